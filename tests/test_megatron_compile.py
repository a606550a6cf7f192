"""agentrl.learner.megatron.compiled on CPU, dynamo only (a counting backend runs the traced graphs
eagerly): every micro-batch length and both grad modes fit in a fixed number of graphs per function,
the tiled FlexAttention equals the plain one, and a hit recompile limit raises instead of running
eagerly (the silent eager FlexAttention that OOMed the H100)."""

from __future__ import annotations

import pytest
import sympy
import torch
from torch._dynamo.testing import CompileCounter
from torch.nn.attention.flex_attention import flex_attention as eager_flex

from agentrl.learner.megatron import compiled as C
from agentrl.learner.megatron.attention import apply_rope
from agentrl.learner.megatron.cp_attention import document_causal_block_mask
from agentrl.learner.megatron.logprobs import _fused_dlogits, _fused_stats
from agentrl.learner.megatron.model import _rms_norm

LENGTHS = (256, 384, 640, 1024)  # every one a multiple of 128, as the learner pads them


class _Counter(CompileCounter):
    """Counts graphs and records each FlexAttention query length (a sympy expression if symbolic)."""

    def __init__(self) -> None:
        super().__init__()
        self.flex_lengths: list = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        for node in gm.graph.nodes:
            if node.op == "call_function" and "flex_attention" in str(node.target):
                n = node.args[0].meta["example_value"].shape[2]
                self.flex_lengths.append(n.node.expr if isinstance(n, torch.SymInt) else n)
        return super().__call__(gm, example_inputs)


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> _Counter:
    cnt = _Counter()
    monkeypatch.setattr(C, "BACKEND", cnt)
    C.reset()
    yield cnt
    C.reset()


def _packed_mask(t: int):
    cu = torch.tensor([0, t // 4, t // 2 + 5, t])
    pos = torch.arange(t)
    return document_causal_block_mask(cu[torch.searchsorted(cu, pos, right=True) - 1], pos, t)


@pytest.mark.parametrize("kv_heads", [2, 4])  # GQA, and K/V repeated to the query heads
def test_flex_attention_any_length_two_graphs_per_grad_mode(counter: _Counter, kv_heads: int) -> None:
    g = torch.Generator().manual_seed(kv_heads)
    for t in LENGTHS:
        q = torch.randn(1, 4, t, 16, generator=g)
        k, v = (torch.randn(1, kv_heads, t, 16, generator=g) for _ in range(2))
        mask = _packed_mask(t)
        for grad in (False, True):  # no backward on CPU: the grad mode alone is a guard
            with torch.set_grad_enabled(grad):
                out = C.flex_attention(q, k, v, mask, 0.25)
        want = eager_flex(q, k, v, block_mask=mask, scale=0.25, enable_gqa=kv_heads != 4)
        assert torch.allclose(out, want, atol=1e-5)
    # first length static, the second recompiles with the length symbolic, which serves the rest
    assert counter.frame_count == 4
    static, symbolic = counter.flex_lengths[:2], counter.flex_lengths[2:]
    assert static == [LENGTHS[0]] * 2 and all(isinstance(n, sympy.Expr) for n in symbolic)
    # ... and the symbolic length is known to be a multiple of 128 (IS_DIVISIBLE kernels)
    assert all(sympy.Mod(n, 128) == 0 for n in symbolic)


def _norm_rope_head(fn: str) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, generator=g, requires_grad=True)
    for t in LENGTHS:
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                if fn == "norm":
                    x = torch.randn(t, 1, 32, generator=g, requires_grad=True)
                    assert torch.allclose(C.compiled(_rms_norm)(x, w, 1e-6), _rms_norm(x, w, 1e-6))
                if fn == "rope":
                    cos, sin = torch.randn(t, 8, generator=g), torch.randn(t, 8, generator=g)
                    for heads in (4, 2):  # q, then k
                        h = torch.randn(t, heads, 8, generator=g, requires_grad=True)
                        assert torch.equal(C.compiled(apply_rope)(h, cos, sin), apply_rope(h, cos, sin))
        if fn == "head":  # inside the autograd Function: no grad
            logits = torch.randn(t, 40, generator=g).bfloat16()
            local, inside = torch.randint(0, 40, (t,), generator=g), torch.rand(t, generator=g) < 0.9
            with torch.no_grad():
                got = C.compiled(_fused_stats)(logits, local, inside, 0.7, 36)
                for a, b in zip(got, _fused_stats(logits, local, inside, 0.7, 36)):
                    assert torch.allclose(a, b)
                lse, scale = got[1], torch.rand(t, generator=g)
                d = C.compiled(_fused_dlogits)(logits, lse, local, inside, scale, 0.7, 36)
                assert torch.allclose(d.float(), _fused_dlogits(logits, lse, local, inside, scale, 0.7, 36).float())


@pytest.mark.parametrize("fn,graphs", [("norm", 4), ("rope", 8), ("head", 4)])
def test_rms_norm_rope_and_fused_head_any_length(counter: _Counter, fn: str, graphs: int) -> None:
    _norm_rope_head(fn)
    # at most 2 per grad mode and input layout (rope: q and k heads), whatever the lengths
    assert counter.frame_count <= graphs


def test_recompile_limit_raises_instead_of_running_eagerly(counter: _Counter) -> None:
    norm = C.compiled(_rms_norm)
    assert torch._dynamo.config.recompile_limit >= C.RECOMPILE_LIMIT
    x, w = torch.randn(128, 1, 8), torch.randn(8)
    with torch._dynamo.config.patch(recompile_limit=1):
        norm(x, w, 1e-6)
        with torch.enable_grad(), pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            norm(x.requires_grad_(), w, 1e-6)
