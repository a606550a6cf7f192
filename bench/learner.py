"""Learner throughput, side by side in one run: Megatron backend vs torch backend (HF).

Qwen2.5-1.5B shape with random weights (built from the config below; nothing is downloaded),
bf16, one GPU. Each row times forward + backward of the logprob objective (the learner's hot loop;
the optimizer step is amortized over many micro-batches and left out) on a packed micro-batch:

* ``4k``: one 4096-token document; ``16k``: 4 documents of 4096 tokens packed into one row.
* ``torch/hf-sdpa``: HF transformers with SDPA on the documents as a [n_docs, 4096] batch (the
  reference figure's setup); ``torch/packed``: the torch learner's own path
  (``hf_forward.packed_token_logprobs``, FlexAttention document mask).
* ``megatron/flex`` and ``megatron/sdpa``: the Megatron learner's model with the project's core
  attention, fed by the learner's own micro-batch builder.

MFU counts 6*N + 6*L*h*s FLOPs per token (N all parameters, tied embedding once; s the document
length) against 796 TFLOP/s, the measured bf16 matmul peak of the H100.

Usage: ``torchrun --nproc-per-node 1 bench/learner.py [--out results.json]``
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

__all__ = ["QWEN25_15B", "flops_per_token"]

QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
PEAK = 796e12
DOC = 4096
CASES = {"4k": 1, "16k": 4}


def flops_per_token(num_params: int, cfg: dict, seq: int) -> float:
    return 6 * num_params + 6 * cfg["num_hidden_layers"] * cfg["hidden_size"] * seq


def _time(step, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _docs(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, QWEN25_15B["vocab_size"], (DOC,), generator=g).tolist() for _ in range(n)]


def bench_torch(rows: list[dict], iters: int) -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentrl.learners.hf_forward import chunked_logprobs, packed_token_logprobs
    from agentrl.packing import pack_sequences

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_15B, attn_implementation="sdpa")).to("cuda", torch.bfloat16)
    model.train()
    num_params = sum(p.numel() for p in model.parameters())
    for case, n in CASES.items():
        docs = _docs(n, 1)
        ids = torch.tensor(docs, device="cuda")

        def sdpa_step(model=model, ids=ids) -> None:
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # [n, DOC, H]
            lp = chunked_logprobs(hidden[:, :-1].reshape(-1, hidden.shape[-1]), model.lm_head.weight,
                                  ids[:, 1:].reshape(-1), temperature=1.0, chunk_size=1024)
            lp.sum().backward()

        rows.append({"backend": "torch/hf-sdpa", "case": case, "tokens": n * DOC, "s": _time(sdpa_step, iters)})
        model.zero_grad(set_to_none=True)
        packed = pack_sequences(docs)

        def packed_step(model=model, packed=packed) -> None:
            packed_token_logprobs(model, packed, chunk_size=1024).sum().backward()

        rows.append({"backend": "torch/packed-flex", "case": case, "tokens": n * DOC, "s": _time(packed_step, iters)})
        model.zero_grad(set_to_none=True)
        print(rows[-2:], flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return num_params


def _profile(step, path: str | None) -> None:
    """Top CUDA kernels and the CPU/GPU time of 3 steps (where the fixed per-step cost goes)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 3
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 3 / 1e6
    table = events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60)
    print(f"profile: wall {wall * 1e3:.1f} ms/step, GPU busy {gpu * 1e3:.1f} ms/step", flush=True)
    print("\n".join(table.splitlines()[:22]), flush=True)
    if path:
        with open(path, "w") as f:
            f.write(table)


def bench_megatron(rows: list[dict], iters: int, attentions: list[str], profile_path: str | None = None) -> None:
    from transformers import Qwen2Config

    from agentrl.config import load_config
    from agentrl.learners.megatron.learner import MegatronLearner
    from agentrl.packing import pack_sequences

    cfg = load_config(None, ["learner.backend=megatron", "learner.num_gpus=1", "model.dtype=bfloat16",
                             "packing.max_tokens_per_microbatch=16384", "rollout.max_total_tokens=4096",
                             "engine.max_model_len=4096"])
    learner = MegatronLearner(cfg, hf_config=Qwen2Config(**QWEN25_15B))
    layers = learner.model.decoder.layers
    for variant in attentions:
        attention, _, option = variant.partition("+")
        learner.model.keep_grad_logits = option == "keep"
        for layer in layers:
            layer.self_attention.core_attention.backend = attention
        for case, n in CASES.items():
            packed = pack_sequences(_docs(n, 1))

            def step(packed=packed) -> None:
                mb = learner._microbatch(packed)
                out = learner.ddp(mb.input_ids, mb.position_ids, None, labels=mb.labels, packed_seq_params=mb.params)
                learner._token_logprobs(mb, out).sum().backward()

            rows.append({"backend": f"megatron/{variant}", "case": case, "tokens": n * DOC, "s": _time(step, iters)})
            if profile_path and case == "4k" and variant == attentions[0]:
                _profile(step, profile_path)
            learner.ddp.zero_grad_buffer()
            print(rows[-1], flush=True)
    print("peak memory GiB", torch.cuda.max_memory_allocated() / 2**30, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--attention", default="flex,sdpa,flex+keep",
                    help="Megatron variants: core attention, '+keep' keeps d logp/d logits (no recompute)")
    ap.add_argument("--profile", default=None, help="write a kernel table of the first variant at 4k here")
    ap.add_argument("--skip-torch", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    rows: list[dict] = []
    num_params = 1543714304  # Qwen2.5-1.5B shape, tied embedding counted once (what bench_torch counts)
    if not args.skip_torch:
        num_params = bench_torch(rows, args.iters)
    bench_megatron(rows, args.iters, args.attention.split(","), args.profile)
    base = {r["case"]: r for r in rows if r["backend"] == "torch/hf-sdpa"}
    print(f"\n{torch.cuda.get_device_name()}  N={num_params/1e9:.3f}B  ({time.time() - t0:.0f} s)")
    print(f"{'backend':20s} {'case':5s} {'ms':>8s} {'tok/s':>9s} {'MFU':>6s} {'vs hf-sdpa':>10s}")
    for r in rows:
        r["tok_s"] = r["tokens"] / r["s"]
        r["mfu"] = r["tok_s"] * flops_per_token(num_params, QWEN25_15B, DOC) / PEAK
        ratio = r["tok_s"] / base[r["case"]]["tok_s"] if r["case"] in base else float("nan")
        r["speedup_vs_hf_sdpa"] = ratio
        print(f"{r['backend']:20s} {r['case']:5s} {r['s']*1e3:8.1f} {r['tok_s']:9.0f} {r['mfu']*100:5.1f}% {ratio:9.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "num_params": num_params, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
