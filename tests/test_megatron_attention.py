"""The Megatron learner's core attention (`PackedCoreAttention`): what ``attention=auto`` runs.

``auto`` picks, per packed micro-batch, one causal SDPA call a document (long documents) or one
block-sparse FlexAttention call (many short ones). On CPU both paths are SDPA (FlexAttention has no
CPU backward); the CUDA test checks that auto's SDPA and FlexAttention micro-batches equal the
``flex`` backend's forward and gradients.
"""

from __future__ import annotations

import pytest
import torch

from agentrl.learner.megatron import attention as att
from agentrl.learner.megatron.attention import (
    AUTO_SDPA_MEAN_DOC_TOKENS,
    PackedCoreAttention,
    auto_backend,
    make_packed_params,
)

HEADS, KV_HEADS, DIM = 4, 2, 16


def _params(lengths: list[int], device: str = "cpu", host_bounds: bool = True):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = make_packed_params(cu.to(device), max(lengths))
    if host_bounds:
        params.cache["cu_seqlens_cpu"] = cu
    return params


def _module(backend: str, expand_kv: bool = False, dim: int = DIM) -> PackedCoreAttention:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=HEADS * dim, num_attention_heads=HEADS,
                            num_query_groups=KV_HEADS, kv_channels=dim, attention_dropout=0.0,
                            hidden_dropout=0.0)
    return PackedCoreAttention(cfg, 1, AttnMaskType.causal, "self", backend=backend, expand_kv=expand_kv)


def test_auto_runs_sdpa_where_documents_are_long_and_flex_where_they_are_many_and_short() -> None:
    n = AUTO_SDPA_MEAN_DOC_TOKENS
    assert auto_backend(_params([131_072])) == "sdpa"  # one long episode a micro-batch
    assert auto_backend(_params([n, n])) == "sdpa"
    assert auto_backend(_params([n - 1])) == "flex"
    assert auto_backend(_params([256] * 64)) == "flex"  # a 16k micro-batch of short episodes
    assert auto_backend(_params([3 * n, 100, 100])) == "sdpa"  # the mean: 3n + 200 over 3 documents
    assert auto_backend(_params([2 * n, 100, 100, 100])) == "flex"


def test_auto_decides_once_a_micro_batch_from_the_host_boundaries() -> None:
    params = _params([8192, 8192])
    # the learner's host copy is what is read: the device tensor is never touched (no sync)
    params.cu_seqlens_q = torch.empty(3, dtype=torch.int32, device="meta")
    assert auto_backend(params) == "sdpa"
    params.cache["cu_seqlens_cpu"] = torch.tensor([0, 16, 32], dtype=torch.int32)
    assert auto_backend(params) == "sdpa"  # every layer (and a recomputed forward) runs the same kernel
    fallback = _params([16, 16], host_bounds=False)  # without the host copy: read from cu_seqlens_q
    assert auto_backend(fallback) == "flex" and fallback.cache["bounds"] == [0, 16, 32]


def test_unknown_core_attention_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown core attention 'dense'"):
        _module("dense")


def test_auto_sdpa_keeps_grouped_kv_heads_unrepeated(monkeypatch: pytest.MonkeyPatch) -> None:
    """flex_expand_kv is the FlexAttention path's: auto's SDPA calls get the KV heads as they are
    (cuDNN takes GQA; repeated K/V would be saved for backward, ng/np more memory for no speed),
    while attention=sdpa with a forced expand still repeats them; both give the same attention."""
    seen: list[int] = []
    sdpa = att.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append(k.shape[1])
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(att.F, "scaled_dot_product_attention", spy)
    gen = torch.Generator().manual_seed(0)
    lengths = [40, 24]
    q, k, v = (torch.randn(sum(lengths), h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    out_auto = _module("auto", expand_kv=True)(q, k, v, None, packed_seq_params=_params(lengths))
    assert seen == [KV_HEADS] * len(lengths)
    seen.clear()
    out_sdpa = _module("sdpa", expand_kv=True)(q, k, v, None, packed_seq_params=_params(lengths))
    assert seen == [HEADS] * len(lengths)
    torch.testing.assert_close(out_auto, out_sdpa)
    # document-causal: the second document's first token attends to itself only
    first = v[lengths[0]].repeat_interleave(HEADS // KV_HEADS, dim=0).reshape(-1)
    torch.testing.assert_close(out_auto[lengths[0]], first)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("lengths", "ran"), [([4096, 6144], "sdpa"), ([256] * 24 + [100], "flex")],
                         ids=["long-docs-sdpa", "short-docs-flex"])
def test_auto_on_cuda_equals_flex_forward_and_gradients(lengths: list[int], ran: str) -> None:
    dim = 128  # the head size of the models trained (FlexAttention's compiled kernel at its real shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    grad = torch.randn(t, HEADS * dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    results = {}
    for backend in ("flex", "auto"):
        params = _params(lengths, device="cuda")
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        out = _module(backend, dim=dim)(qq, kk, vv, None, packed_seq_params=params)
        out.backward(grad)
        results[backend] = [x.float() for x in (out, qq.grad, kk.grad, vv.grad)]
        if backend == "auto":
            assert params.cache["auto_backend"] == ran
    for got, ref in zip(results["auto"], results["flex"], strict=True):
        assert float((got - ref).abs().max() / ref.abs().max()) < 2e-2  # bf16: two kernels, one attention
