"""HF <-> Megatron conversion: bit-exact round trips, TP sharding, layouts (pure torch, no process group)."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from agentrl.learner.megatron.convert import (
    ModelShape,
    gather_tp,
    globalize_layers,
    hf_to_megatron,
    localize_layers,
    megatron_to_hf,
    shard_tp,
)

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=256)


@functools.cache
def tiny_hf(family: str, tied: bool = True, vocab: int = 101):
    torch.manual_seed(0)
    if family == "qwen2":
        cfg = Qwen2Config(vocab_size=vocab, tie_word_embeddings=tied, **COMMON)
        model = Qwen2ForCausalLM(cfg)
    elif family == "llama":
        cfg = LlamaConfig(vocab_size=vocab, tie_word_embeddings=tied,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64}, **COMMON)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen3Config(vocab_size=vocab, tie_word_embeddings=tied, head_dim=16, **COMMON)
        model = Qwen3ForCausalLM(cfg)
    # Random norms and biases, so a swapped or dropped tensor cannot go unnoticed.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    return cfg, state


@pytest.mark.parametrize("family,tied", [("qwen2", True), ("qwen2", False), ("llama", False), ("qwen3", True)])
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_bit_exact(family: str, tied: bool, tp: int) -> None:
    cfg, hf = tiny_hf(family, tied)
    shape = ModelShape.from_hf_config(cfg)
    full = hf_to_megatron(hf, shape, tp_size=tp)
    assert full["embedding.word_embeddings.weight"].shape[0] == shape.padded_vocab_size(tp)
    shards = [shard_tp(full, tp, r) for r in range(tp)]
    back = megatron_to_hf(gather_tp(shards), shape)
    assert sorted(back) == sorted(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_family_features() -> None:
    q2, q3 = (ModelShape.from_hf_config(tiny_hf(f)[0]) for f in ("qwen2", "qwen3"))
    ll = ModelShape.from_hf_config(tiny_hf("llama", tied=False)[0])
    assert q2.qkv_bias and not q2.qk_norm
    assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 16
    assert not ll.qkv_bias and not ll.qk_norm and not ll.tied_embeddings


def test_fused_qkv_layout_groups_query_heads_with_their_kv_head() -> None:
    cfg, hf = tiny_hf("qwen2")
    shape = ModelShape.from_hf_config(cfg)
    qkv = hf_to_megatron(hf, shape)["decoder.layers.0.self_attention.linear_qkv.weight"]
    hd, hpg = shape.head_dim, shape.heads_per_group
    block = (hpg + 2) * hd
    for g in range(shape.num_kv_heads):
        rows = qkv[g * block:(g + 1) * block]
        q = hf["model.layers.0.self_attn.q_proj.weight"][g * hpg * hd:(g + 1) * hpg * hd]
        k = hf["model.layers.0.self_attn.k_proj.weight"][g * hd:(g + 1) * hd]
        v = hf["model.layers.0.self_attn.v_proj.weight"][g * hd:(g + 1) * hd]
        assert torch.equal(rows, torch.cat([q, k, v]))


def test_tp_shards_hold_matching_gate_and_up_rows() -> None:
    cfg, hf = tiny_hf("llama", tied=False)
    shape = ModelShape.from_hf_config(cfg)
    full = hf_to_megatron(hf, shape, tp_size=2)
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    for r in range(2):
        fc1 = shard_tp(full, 2, r)["decoder.layers.1.mlp.linear_fc1.weight"]
        assert torch.equal(fc1, torch.cat([gate.chunk(2)[r], up.chunk(2)[r]]))
        proj = shard_tp(full, 2, r)["decoder.layers.1.self_attention.linear_proj.weight"]
        assert torch.equal(proj, hf["model.layers.1.self_attn.o_proj.weight"].chunk(2, dim=1)[r])


def test_vocab_padding_rows_are_zero_and_dropped_on_export() -> None:
    cfg, hf = tiny_hf("qwen2", tied=False, vocab=101)
    shape = ModelShape.from_hf_config(cfg)
    full = hf_to_megatron(hf, shape, tp_size=4)
    assert full["output_layer.weight"].shape[0] == 104
    assert not full["output_layer.weight"][101:].any()
    assert megatron_to_hf(full, shape)["lm_head.weight"].shape[0] == 101


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_stages_split_and_rejoin(tied: bool) -> None:
    cfg, hf = tiny_hf("qwen2", tied)
    shape = ModelShape.from_hf_config(cfg)
    full = hf_to_megatron(hf, shape)
    first = localize_layers(full, 0, 2, pre_process=True, post_process=False, tied=tied)
    last = localize_layers(full, 2, 1, pre_process=False, post_process=True, tied=tied)
    assert "decoder.layers.0.input_layernorm.weight" in last and "decoder.final_layernorm.weight" in last
    assert ("output_layer.weight" in last) and "embedding.word_embeddings.weight" not in last
    joined = {**globalize_layers(first, 0), **globalize_layers(last, 2, drop_tied_copy=tied)}
    assert sorted(joined) == sorted(full)
    assert all(torch.equal(joined[k], full[k]) for k in full)


def test_unsupported_options_are_refused() -> None:
    with pytest.raises(ValueError, match="attention_bias"):
        ModelShape.from_hf_config(LlamaConfig(attention_bias=True, **COMMON))
    with pytest.raises(ValueError, match="not supported"):
        ModelShape.from_hf_config(type("C", (), {"model_type": "gpt2"})())


@pytest.mark.parametrize("family,tied", [("qwen2", True), ("qwen2", False), ("llama", False), ("qwen3", True)])
def test_zero_copy_views_give_the_exported_weights(family: str, tied: bool) -> None:
    """refit.zero_copy: the parameters gathered into one buffer (gather_parameters), described as
    strided views (megatron_to_hf(lazy=True) + describe_views) and rebuilt on the engine's side
    (unflatten_weights) equal the copying export, tensor for tensor, without a copy in the learner."""
    from agentrl.weights.transports import LazyReshape, describe_views, gather_parameters, unflatten_weights

    cfg, hf = tiny_hf(family, tied)
    shape = ModelShape.from_hf_config(cfg)
    mc = hf_to_megatron(hf, shape)
    holder = torch.nn.ParameterDict({k.replace(".", "/"): torch.nn.Parameter(v.to(torch.bfloat16).clone())
                                     for k, v in mc.items()})
    buf = gather_parameters(holder)
    params = {k.replace("/", "."): p.data for k, p in holder.items()}
    assert all(p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for p in params.values())
    eager = megatron_to_hf(params, shape)
    lazy = megatron_to_hf(params, shape, lazy=True)
    assert sorted(eager) == sorted(lazy)
    assert any(isinstance(v, LazyReshape) for v in lazy.values())  # q, k, v stay views
    spec = describe_views(buf, lazy)
    rebuilt = dict(unflatten_weights(buf.clone(), spec))  # another process's copy of the memory
    assert sorted(rebuilt) == sorted(eager)
    for name, t in eager.items():
        assert rebuilt[name].shape == t.shape and torch.equal(rebuilt[name], t), name
    # the views follow the parameters: an optimizer's write shows in the next refit's tensors
    eager = {n: t.clone() for n, t in eager.items()}
    with torch.no_grad():
        for p in holder.values():
            p.add_(1)
    again = dict(unflatten_weights(buf, spec))
    assert all(torch.equal(again[n], t + 1) for n, t in eager.items())


def test_gather_parameters_keeps_values_ties_and_training() -> None:
    from agentrl.weights.transports import describe_views, gather_parameters

    torch.manual_seed(0)
    emb = torch.nn.Embedding(11, 6)
    head = torch.nn.Linear(6, 11, bias=False)
    head.weight = emb.weight  # tied
    model = torch.nn.Sequential(emb, torch.nn.Linear(6, 6), torch.nn.LayerNorm(6), head)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    buf = gather_parameters(model)
    assert model[0].weight is model[3].weight
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
        assert v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), k
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    loss = model(torch.tensor([[1, 2, 3]])).logsumexp(-1).sum()
    loss.backward()
    opt.step()
    assert not torch.equal(model[1].weight, before["1.weight"])  # trained in place, inside the buffer
    assert model[1].weight.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="not inside"):
        describe_views(buf, {"stray": torch.zeros(3)})
