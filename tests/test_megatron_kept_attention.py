"""learner.megatron.recompute_keeps_attention: a recomputed layer keeps its core attention's output
(and the kernel's saved inputs and statistics) from the forward, so its recompute in backward runs
every part of the layer but the attention kernel, with the same gradients. The model runs on CPU
(one gloo rank, as tests/test_megatron_recompute.py: Megatron's checkpoint's CUDA RNG calls stood
in for) with SDPA, whose calls are counted."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from agentrl.config import load_config
from tests.gloo_case import run_on_one_gloo_rank
from tests.test_megatron_recompute import shape_1p5b


def _case() -> dict[str, Any]:
    import megatron.core.tensor_parallel.random as rng
    import torch.nn.functional as F

    rng._get_cuda_rng_state = lambda *a, **k: None
    rng._set_cuda_rng_state = lambda *a, **k: None
    try:
        from tests.test_megatron_convert import tiny_hf
    except ImportError:
        from test_megatron_convert import tiny_hf
    from agentrl.config import MegatronConfig
    from agentrl.learner.megatron.attention import make_packed_params
    from agentrl.learner.megatron.convert import ModelShape
    from agentrl.learner.megatron.model import build_model
    from agentrl.learner.megatron.weights import load_hf_weights

    cfg, hf = tiny_hf("qwen2")
    shape = ModelShape.from_hf_config(cfg)
    sdpa_calls = [0]
    sdpa = F.scaled_dot_product_attention

    def counted(*a: Any, **k: Any) -> torch.Tensor:
        sdpa_calls[0] += 1
        return sdpa(*a, **k)

    F.scaled_dot_product_attention = counted  # attention.py calls it through torch.nn.functional
    g = torch.Generator().manual_seed(5)
    lens = [13, 9]
    ids = torch.randint(0, cfg.vocab_size, (1, sum(lens)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 13, 22], dtype=torch.int32)

    def make(**mcfg: Any):
        model = build_model(shape, cfg, MegatronConfig(**mcfg), dtype=torch.float32, use_cpu_initialization=True)
        load_hf_weights(model, hf, shape)
        model.chunk_size = 7
        model.recompute_above_tokens = mcfg.get("recompute_above_tokens", 0)  # as the learner sets them
        return model

    def run(model: Any, keep: bool) -> dict[str, Any]:
        model.keep_attention = keep
        model.zero_grad(set_to_none=True)
        params = make_packed_params(cu, max(lens))
        sdpa_calls[0] = 0
        out = model(ids, pos, None, labels=torch.roll(ids, -1), packed_seq_params=params)
        forward_calls = sdpa_calls[0]
        (out * torch.linspace(0.5, 1.5, out.numel())).sum().backward()
        return {"grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                "out": out.detach().clone(), "forward_calls": forward_calls, "calls": sdpa_calls[0],
                "left": [k for k in params.cache if isinstance(k, tuple)],
                "kept_set": sorted(params.cache.get("keep_attention", ())), "recomputing": model.recomputing}

    def err(a: dict, b: dict) -> float:
        return max(float((a[n] - b[n]).abs().max() / (b[n].abs().max() + 1e-12)) for n in b)

    res: dict[str, Any] = {"layers": len(cfg.layer_types) if hasattr(cfg, "layer_types") else cfg.num_hidden_layers,
                           "docs": len(lens)}
    model = make(recompute_above_tokens=16)  # 22 tokens: every layer recomputes
    recompute = run(model, keep=False)
    kept = run(model, keep=True)
    model.recompute_above_tokens = 10**9
    whole = run(model, keep=True)  # nothing recomputes: nothing is kept either
    checkpointing = run(make(activation_checkpointing=True), keep=True)
    for name, r in (("recompute", recompute), ("kept", kept), ("whole", whole), ("checkpointing", checkpointing)):
        res[name] = {k: v for k, v in r.items() if k not in ("grads", "out")}
        res[name]["grad_err"] = err(r["grads"], whole["grads"])
        res[name]["out_err"] = float((r["out"] - whole["out"]).abs().max())
        res[name]["same_params"] = sorted(r["grads"]) == sorted(whole["grads"])
    res["kept_vs_recompute"] = err(kept["grads"], recompute["grads"])
    return res


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_on_one_gloo_rank(_case, tmp_path_factory.mktemp("gloo_kept"))


def test_a_recomputed_layer_that_keeps_its_attention_runs_the_kernel_once_with_the_same_gradients(result) -> None:
    layers, docs = result["layers"], result["docs"]
    once = layers * docs  # one SDPA call a document a layer
    # plain recompute: the kernel in the forward and again in every layer's recompute
    assert result["recompute"]["recomputing"] and result["recompute"]["calls"] == 2 * once
    assert result["recompute"]["kept_set"] == []
    # kept: the forward's calls only, for every layer; nothing left in the micro-batch's cache
    kept = result["kept"]
    assert kept["recomputing"] and kept["forward_calls"] == once and kept["calls"] == once, kept
    assert len(kept["kept_set"]) == layers and kept["left"] == []
    # fp32 on CPU: the gradients of whole activations, within the recompute's own rounding
    for name in ("recompute", "kept", "checkpointing"):
        r = result[name]
        assert r["same_params"] and r["out_err"] == 0.0 and r["grad_err"] < 1e-5, (name, r)
    assert result["kept_vs_recompute"] < 1e-6
    # activation_checkpointing (every layer, every micro-batch) keeps them too
    assert result["checkpointing"]["calls"] == once and len(result["checkpointing"]["kept_set"]) == layers
    # a micro-batch that does not recompute keeps nothing and runs the kernel once, with autograd's own graph
    assert result["whole"]["calls"] == once and result["whole"]["kept_set"] == [] and not result["whole"]["recomputing"]


def test_the_plan_recomputes_more_layers_to_keep_every_recomputed_attention() -> None:
    from agentrl.learner.megatron.model import (
        AUTO_RECOMPUTE_SHARE,
        activation_bytes_per_token,
        attention_bytes_per_token,
        layers_to_recompute,
        recompute_plan,
    )

    shape = shape_1p5b()
    att, whole = attention_bytes_per_token(shape), activation_bytes_per_token(shape, layers=1, head=False)
    assert 7000 < att < 7500 and whole > 11 * att  # q, k, v, output, log-sum-exp vs a whole layer
    assert attention_bytes_per_token(shape, tp=2) == att // 2
    free = 110 * 2**30  # one H200 with the engine asleep

    def plan(tokens: int, keep: bool, limit: int | str = "auto") -> tuple[int, int]:
        return recompute_plan(tokens, limit, shape=shape, layers=28, available=free, keep_attention=keep)

    for tokens in (33_279, 66_048, 262_157, 393_225):
        n = layers_to_recompute(tokens, "auto", shape=shape, layers=28, available=free)
        assert plan(tokens, False) == (n, 0)  # without it: the plan as it was
    assert plan(33_279, True) == (0, 0)  # fits whole: nothing recomputes, nothing to keep
    # 256k (the H200 recomputed 26 of 28 layers): all 28 recompute and all keep their attention
    assert plan(262_157, True) == (28, 28)
    n, m = plan(66_048, True)
    assert m == n and layers_to_recompute(66_048, "auto", shape=shape, layers=28, available=free) <= n < 28
    # the chosen plan fits the share of the free memory its estimate allows
    kept_input = shape.hidden_size * 2
    rest = activation_bytes_per_token(shape, layers=0)
    assert 66_048 * ((28 - n) * whole + n * (kept_input + att) + whole + rest) <= AUTO_RECOMPUTE_SHARE * free
    # 384k: all 28 recompute, only some can keep theirs
    n, m = plan(393_225, True)
    assert n == 28 and 0 < m < 28
    assert 393_225 * (28 * kept_input + m * att + whole + rest) <= AUTO_RECOMPUTE_SHARE * free
    assert 393_225 * (28 * kept_input + (m + 1) * att + whole + rest) > AUTO_RECOMPUTE_SHARE * free
    assert plan(40_000, True, limit=16_384) == (28, 28) and plan(8_000, True, limit=16_384) == (0, 0)


def test_keeping_attention_without_recompute_or_under_context_parallelism_says_it_does_nothing() -> None:
    def warned(*extra: str) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_config(None, ["learner.backend=megatron", "learner.num_gpus=2", "model.dtype=bfloat16", *extra])
        return [str(w.message) for w in caught if "recompute_keeps_attention" in str(w.message)]

    assert warned("learner.megatron.recompute_keeps_attention=true")
    assert warned("learner.megatron.recompute_keeps_attention=true", "learner.megatron.recompute_above_tokens=auto",
                  "learner.megatron.context_parallel_size=2", "packing.pad_multiple=4")
    assert not warned("learner.megatron.recompute_keeps_attention=true", "learner.megatron.recompute_above_tokens=auto")
    assert not warned("learner.megatron.recompute_keeps_attention=true", "learner.megatron.activation_checkpointing=true")
