"""Qwen3-MoE in the Megatron learner: HF <-> Megatron conversion of routers and experts (bit-exact
round trips, TP sharding, transformers' fused in-memory experts), and Megatron's own MoELayer on a
CPU gloo rank giving transformers' Qwen3MoeForCausalLM logprobs and gradients."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.gloo_case import run_on_gloo_ranks


@functools.cache
def tiny_moe(norm_topk: bool = True, mlp_only_layers: tuple[int, ...] = (1,), tied: bool = False):
    """A tiny random Qwen3-MoE (3 layers, the second dense unless ``mlp_only_layers`` says
    otherwise): its config, its in-memory state dict, and the checkpoint's (save_pretrained) names."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from agentrl.learner.megatron.convert import experts_to_checkpoint_names

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                         num_experts=6, num_experts_per_tok=2, norm_topk_prob=norm_topk,
                         mlp_only_layers=list(mlp_only_layers), max_position_embeddings=256,
                         tie_word_embeddings=tied, router_aux_loss_coef=0.01)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # random norms too, so a swapped or dropped tensor cannot go unnoticed
        for p in model.parameters():
            p.normal_()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    return cfg, state, {k: v.clone() for k, v in experts_to_checkpoint_names(state).items()}


def test_shape_reads_the_moe_config() -> None:
    from agentrl.learner.megatron.convert import ModelShape

    cfg, _, _ = tiny_moe()
    shape = ModelShape.from_hf_config(cfg)
    assert (shape.num_experts, shape.moe_topk, shape.moe_ffn_hidden_size) == (6, 2, 32)
    assert shape.moe_layers == (True, False, True) and shape.moe_norm_topk and shape.qk_norm
    assert shape.router_aux_loss_coef == 0.01
    cfg.decoder_sparse_step = 2  # every second layer (1, 3, ...) sparse, less the dense list
    assert ModelShape.from_hf_config(cfg).moe_layers == (False, False, False)
    cfg.decoder_sparse_step = 1


def test_checkpoint_names_match_save_pretrained(tmp_path) -> None:
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    cfg, state, ckpt = tiny_moe()
    model = Qwen3MoeForCausalLM(cfg)
    model.load_state_dict(state)
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(saved) == sorted(ckpt)
    assert all(torch.equal(saved[k], ckpt[k]) for k in ckpt)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_moe_round_trip_is_bit_exact(tp: int, tied: bool) -> None:
    from agentrl.learner.megatron.convert import ModelShape, gather_tp, hf_to_megatron, megatron_to_hf, shard_tp

    cfg, state, ckpt = tiny_moe(tied=tied)
    shape = ModelShape.from_hf_config(cfg)
    full = hf_to_megatron(ckpt, shape, tp_size=tp)
    assert torch.equal(full["decoder.layers.0.mlp.router.weight"], ckpt["model.layers.0.mlp.gate.weight"])
    fc1 = full["decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert torch.equal(fc1, state["model.layers.2.mlp.experts.gate_up_proj"][5])  # [gate; up], as HF fuses them
    assert "decoder.layers.1.mlp.linear_fc1.weight" in full  # the dense layer stays dense
    assert torch.equal(hf_to_megatron(state, shape, tp_size=tp)[
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"], ckpt["model.layers.0.mlp.experts.3.down_proj.weight"])
    shards = [shard_tp(full, tp, r) for r in range(tp)]
    if tp == 2:  # each rank holds the matching halves of every expert's gate and up
        gate, up = ckpt["model.layers.0.mlp.experts.1.gate_proj.weight"], ckpt["model.layers.0.mlp.experts.1.up_proj.weight"]
        assert torch.equal(shards[1]["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"],
                           torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    back = megatron_to_hf(gather_tp(shards), shape)
    assert sorted(back) == sorted(ckpt)
    for name, t in ckpt.items():
        assert torch.equal(back[name], t), name


def _case(norm_topk: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import Qwen3MoeForCausalLM

    from agentrl.config import MegatronConfig
    from agentrl.learner.megatron.attention import make_packed_params
    from agentrl.learner.megatron.convert import ModelShape
    from agentrl.learner.megatron.model import build_model
    from agentrl.learner.megatron.weights import gather_hf_weights, load_hf_weights

    try:
        from tests.test_megatron_moe import tiny_moe as make
    except ImportError:
        from test_megatron_moe import tiny_moe as make
    cfg, state, ckpt = make(norm_topk)
    shape = ModelShape.from_hf_config(cfg)
    tp = ps.get_tensor_model_parallel_world_size()
    model = build_model(shape, cfg, MegatronConfig(tensor_parallel_size=tp), dtype=torch.float32,
                        use_cpu_initialization=True)
    kinds = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    experts = type(model.decoder.layers[0].mlp.experts).__name__
    load_hf_weights(model, ckpt, shape)  # raises on any name or shape mismatch
    back = gather_hf_weights(model, shape)
    exact = sorted(back) == sorted(ckpt) and all(torch.equal(back[k], ckpt[k]) for k in ckpt)
    fc1_rows = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight.shape[0]
    result = {"kinds": kinds, "experts": experts, "exact": exact, "fc1_rows": fc1_rows}
    if tp > 1:  # Megatron's MoE token dispatch under TP gathers into CUDA memory: no CPU forward
        dist.barrier()
        return result

    ref_model = Qwen3MoeForCausalLM._from_config(cfg, attn_implementation="sdpa")
    ref_model.load_state_dict(state)
    g = torch.Generator().manual_seed(2)
    lens = [13, 9]
    ids = torch.randint(0, cfg.vocab_size, (1, sum(lens)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    params = make_packed_params(torch.tensor([0, 13, 22], dtype=torch.int32), 13)
    model.chunk_size = 5
    out = model(ids, pos, None, labels=torch.roll(ids, -1), packed_seq_params=params)
    mine = torch.cat([out[0:12], out[13:21]])
    refs = []
    for s, e in ((0, 13), (13, 22)):
        logits = ref_model(ids[:, s:e]).logits[0].float()
        refs.append(torch.log_softmax(logits[:-1], -1).gather(1, ids[0, s + 1:e, None])[:, 0])
    ref = torch.cat(refs)
    mine.sum().backward()
    ref.sum().backward()
    ref_router = ref_model.model.layers[0].mlp.gate.weight.grad
    router = model.decoder.layers[0].mlp.router.weight.grad
    fc2 = model.decoder.layers[2].mlp.experts.local_experts[4].linear_fc2.weight.grad
    ref_fc2 = ref_model.model.layers[2].mlp.experts.down_proj.grad[4]
    dist.barrier()
    return {**result, "fwd_err": float((mine - ref).abs().max()),
            "router_grad_err": float((router - ref_router).abs().max() / ref_router.abs().max()),
            "expert_grad_err": float((fc2 - ref_fc2).abs().max() / ref_fc2.abs().max().clamp_min(1e-30)),
            "expert_grad_max": float(ref_fc2.abs().max())}


def _cases() -> dict[bool, Any]:
    return {norm: _case(norm) for norm in (True, False)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict]]:
    return {tp: run_on_gloo_ranks(_cases, tmp_path_factory.mktemp(f"gloo_moe{tp}"), tp, tensor_model_parallel_size=tp)
            for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_moe_shards_load_and_gather_bit_exact(results: dict[int, list[dict]], tp: int) -> None:
    for rank_results in results[tp]:
        for r in rank_results.values():
            assert r["kinds"] == ["MoELayer", "MLP", "MoELayer"], r
            assert r["experts"] == "SequentialMLP"
            assert r["fc1_rows"] == 2 * 32 // tp  # each expert's [gate; up] split over TP
            assert r["exact"]


@pytest.mark.parametrize("norm_topk", [True, False])
def test_megatron_moe_matches_transformers(results: dict[int, list[dict]], norm_topk: bool) -> None:
    for rank_results in results[1]:
        r = rank_results[norm_topk]
        assert r["fwd_err"] < 1e-4, r  # packed Megatron forward == HF per-document forward (fp32)
        assert r["router_grad_err"] < 1e-4, r
        assert r["expert_grad_max"] > 0 and r["expert_grad_err"] < 1e-4, r


def test_moe_config_routes_as_transformers() -> None:
    from agentrl.learner.megatron.convert import ModelShape
    from agentrl.learner.megatron.model import moe_config

    shape = ModelShape.from_hf_config(tiny_moe()[0])
    c = moe_config(shape)
    assert c["moe_router_pre_softmax"] is False  # renormalized top-k == softmax over the top-k logits
    assert c["moe_router_load_balancing_type"] == "none" and c["moe_aux_loss_coeff"] == 0.0
    assert c["moe_layer_freq"] == [1, 0, 1]
    assert moe_config(shape, None)["moe_aux_loss_coeff"] == 0.01  # the checkpoint's
    assert moe_config(shape, 0.1)["moe_router_load_balancing_type"] == "aux_loss"
    assert moe_config(ModelShape.from_hf_config(tiny_moe(norm_topk=False)[0]))["moe_router_pre_softmax"] is True
