"""Megatron GPTModel under context parallelism (CP=2) on two gloo CPU ranks: the learner's own
input path (zigzag shards of ids/positions/labels, packed params with the CP group, the project's
core attention with ``attention=sdpa``, logprobs all-gathered back) matches a per-document HF
forward, and the CP-summed gradient matches HF's."""

from __future__ import annotations

from typing import Any

import torch

from tests.gloo_case import run_on_gloo_ranks

WORLD = 2
LENS = [12, 8, 20]  # multiples of 2 * cp


def _tiny_hf():
    try:
        from tests.test_megatron_convert import tiny_hf
    except ImportError:
        from test_megatron_convert import tiny_hf
    return tiny_hf


def _case() -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from agentrl.config import MegatronConfig
    from agentrl.learner.megatron.attention import make_packed_params
    from agentrl.learner.megatron.convert import ModelShape
    from agentrl.learner.megatron.cp_attention import all_gather_zigzag, zigzag_indices
    from agentrl.learner.megatron.model import build_model
    from agentrl.learner.megatron.weights import load_hf_weights

    cfg, hf = _tiny_hf()("qwen2", tied=True)
    shape = ModelShape.from_hf_config(cfg)
    mcfg = MegatronConfig(context_parallel_size=WORLD, attention="sdpa")
    model = build_model(shape, cfg, mcfg, dtype=torch.float32, use_cpu_initialization=True)
    load_hf_weights(model, hf, shape)
    model.chunk_size = 5
    # What MegatronLearner._microbatch does under CP.
    g = torch.Generator().manual_seed(2)
    T = sum(LENS)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENS])
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    labels = torch.roll(ids, -1)
    group = ps.get_context_parallel_group()
    idx = zigzag_indices(cu, WORLD, ps.get_context_parallel_rank())
    params = make_packed_params(cu, max(LENS))
    params.cache["cu_seqlens_cpu"] = cu
    params.cp_group = group
    out = model(ids[idx][None], pos[idx][None], None, labels=labels[idx][None], packed_seq_params=params)
    full = all_gather_zigzag(out, cu, group)  # [T] next-token logprobs in global order
    mine = torch.cat([full[s:e - 1] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    ref_model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    ref_model.load_state_dict(hf, strict=False)
    refs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        logits = ref_model(ids[None, s:e]).logits[0].float()
        refs.append(torch.log_softmax(logits[:-1], -1).gather(1, ids[s + 1:e, None])[:, 0])
    ref = torch.cat(refs)
    mine.sum().backward()
    ref.sum().backward()
    # Every rank's loss is the whole sum, so the all-gather's adjoint hands each rank cp x its
    # tokens' gradient; the sum over the CP group (DDP's reduction) divided by cp is the gradient.
    grads = {}
    for name, hf_param in (("final_norm", ref_model.model.norm.weight),
                           ("embedding", ref_model.model.embed_tokens.weight)):
        p = model.decoder.final_layernorm.weight if name == "final_norm" else model.embedding.word_embeddings.weight
        gsum = p.grad.clone()
        dist.all_reduce(gsum, group=group)
        gsum = gsum[: hf_param.shape[0]] / WORLD
        grads[name] = float((gsum - hf_param.grad).abs().max() / hf_param.grad.abs().max())
    dist.barrier()
    return {"fwd_err": float((mine - ref).abs().max()), "grad_err": grads, "local_tokens": int(out.shape[0])}


def test_cp2_model_forward_and_grad_match_hf(tmp_path: Any) -> None:
    got = run_on_gloo_ranks(_case, tmp_path, WORLD, context_parallel_size=WORLD)
    for r in got:
        assert r["local_tokens"] == sum(LENS) // WORLD
        assert r["fwd_err"] < 2e-4, r  # CP=2 Megatron forward == HF per-document forward (fp32)
        assert all(e < 1e-4 for e in r["grad_err"].values()), r
