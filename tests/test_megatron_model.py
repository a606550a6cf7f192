"""Megatron GPTModel construction on CPU under TP=2 on two gloo ranks: parameter shapes
match the converted checkpoint, HF weights load into the shards and gather back bit-exactly, and
vocab-parallel logprobs over the TP group equal a full log-softmax."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gloo_case import run_on_gloo_ranks

WORLD = 2


def _tiny_hf():  # the tiny HF models of test_megatron_convert, however pytest imported tests/
    try:
        from tests.test_megatron_convert import tiny_hf
    except ImportError:
        from test_megatron_convert import tiny_hf
    return tiny_hf


def _case(family: str, tp: int) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    tiny_hf = _tiny_hf()

    from agentrl.config import MegatronConfig
    from agentrl.learner.megatron.convert import ModelShape
    from agentrl.learner.megatron.logprobs import vocab_parallel_logprobs
    from agentrl.learner.megatron.model import build_model
    from agentrl.learner.megatron.weights import gather_hf_weights, load_hf_weights

    cfg, hf = tiny_hf(family, tied=family != "llama")
    shape = ModelShape.from_hf_config(cfg)
    mcfg = MegatronConfig(tensor_parallel_size=tp)
    model = build_model(shape, cfg, mcfg, dtype=torch.float32, use_cpu_initialization=True)
    load_hf_weights(model, hf, shape)  # raises on any name or shape mismatch
    back = gather_hf_weights(model, shape)
    exact = sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    # Vocab-parallel logprobs: the local shard of the output weight, reduced over the TP group.
    weight = model.shared_embedding_or_output_weight() if shape.tied_embeddings else model.output_layer.weight
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(13, shape.hidden_size, generator=g, dtype=torch.float64)
    labels = torch.randint(0, shape.vocab_size, (13,), generator=g)
    group = ps.get_tensor_model_parallel_group()
    lp = vocab_parallel_logprobs(hidden, weight.detach().double(), labels, group=group if tp > 1 else None,
                                 vocab_start=ps.get_tensor_model_parallel_rank() * weight.shape[0],
                                 real_vocab=shape.vocab_size, temperature=0.8, chunk_size=5)
    full_w = back["model.embed_tokens.weight"] if shape.tied_embeddings else back["lm_head.weight"]
    ref = torch.log_softmax(hidden @ full_w.double().T / 0.8, -1)[torch.arange(13), labels]
    fwd_err, grad_err = _forward_matches_hf(model, cfg, hf)
    dist.barrier()
    return {"exact": exact, "qkv_rows": qkv.shape[0], "lp_err": float((lp - ref).abs().max()),
            "fwd_err": fwd_err, "grad_err": grad_err}


def _forward_matches_hf(model: Any, cfg: Any, hf: dict) -> tuple[float, float]:
    """Packed forward (2 documents, SDPA core attention on CPU) and one gradient against HF."""
    from transformers import AutoModelForCausalLM

    from agentrl.learner.megatron.attention import make_packed_params

    ref_model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    ref_model.load_state_dict(hf, strict=False)  # tied models have no lm_head.weight entry
    g = torch.Generator().manual_seed(2)
    lens = [13, 9]
    ids = torch.randint(0, cfg.vocab_size, (1, sum(lens)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    params = make_packed_params(torch.tensor([0, 13, 22], dtype=torch.int32), 13)
    model.chunk_size = 5
    out = model(ids, pos, None, labels=torch.roll(ids, -1), packed_seq_params=params)  # next-token logprobs
    mine = torch.cat([out[0:12], out[13:21]])
    refs = []
    for s, e in ((0, 13), (13, 22)):
        logits = ref_model(ids[:, s:e]).logits[0].float()
        refs.append(torch.log_softmax(logits[:-1], -1).gather(1, ids[0, s + 1:e, None])[:, 0])
    ref = torch.cat(refs)
    mine.sum().backward()
    ref.sum().backward()
    grad_err = (model.decoder.final_layernorm.weight.grad - ref_model.model.norm.weight.grad).abs().max()
    return float((mine - ref).abs().max()), float(grad_err / ref_model.model.norm.weight.grad.abs().max())


def _all_cases() -> dict[tuple[str, int], Any]:  # on each TP=2 rank (run_on_gloo_ranks)
    return {(family, 2): _case(family, 2) for family in ("qwen2", "llama", "qwen3")}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_on_gloo_ranks(_all_cases, tmp_path_factory.mktemp("gloo_megatron"), WORLD, tensor_model_parallel_size=2)


@pytest.mark.parametrize("family,tp", [("qwen2", 2), ("llama", 2), ("qwen3", 2)])
def test_megatron_model_shards_load_and_gather_bit_exact(results: list[dict], family: str, tp: int) -> None:
    from agentrl.learner.megatron.convert import ModelShape

    tiny_hf = _tiny_hf()

    shape = ModelShape.from_hf_config(tiny_hf(family, tied=family != "llama")[0])
    for rank_results in results:
        r = rank_results[(family, tp)]
        assert r["exact"]
        assert r["qkv_rows"] == (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim // tp
        assert r["lp_err"] < 1e-4  # float32 logits against a float64 reference
        assert r["fwd_err"] < 1e-4, r  # packed Megatron forward == HF per-document forward (fp32)
        assert r["grad_err"] < 1e-4, r


def test_layer_spec_passes_flex_expand_kv() -> None:
    from agentrl.config import MegatronConfig
    from agentrl.learner.megatron.convert import ModelShape
    from agentrl.learner.megatron.model import layer_spec

    shape = ModelShape.from_hf_config(_tiny_hf()("qwen2", tied=True)[0])
    for expand in (False, True):
        mcfg = MegatronConfig(flex_expand_kv=expand)
        spec = layer_spec(shape, mcfg.attention, expand_kv=mcfg.flex_expand_kv)
        assert spec.submodules.self_attention.submodules.core_attention.params == {"backend": "auto", "expand_kv": expand}


def test_auto_attention_is_flex_under_cuda_graphs() -> None:
    from agentrl.config import MegatronConfig
    from agentrl.learner.megatron.model import core_attention

    # a graph replays the kernel it captured: auto's per-micro-batch choice cannot run there
    assert core_attention(MegatronConfig(cuda_graphs=True)) == "flex"
    assert core_attention(MegatronConfig(cuda_graphs=False)) == "auto"
    assert core_attention(MegatronConfig(activation_checkpointing=True)) == "auto"  # no graphs: auto resolved off
    assert core_attention(MegatronConfig(attention="sdpa")) == "sdpa"

