"""Learner throughput, side by side in one run: Megatron backend vs torch backend (HF).

Qwen2.5-1.5B shape with random weights (built from the config below; nothing is downloaded),
bf16, one GPU. Each row times forward + backward of the logprob objective (the learner's hot loop;
the optimizer step is amortized over many micro-batches and left out) on a packed micro-batch:

* ``4k``: one 4096-token document; ``16k``: 4 documents of 4096 tokens packed into one row.
* ``torch/hf-sdpa``: HF transformers with SDPA on the documents as a [n_docs, 4096] batch (the
  reference figure's setup); ``torch/packed``: the torch learner's own path
  (``hf_forward.packed_token_logprobs``, FlexAttention document mask).
* ``megatron/<attention>+<options>``: the Megatron learner's model with the project's core
  attention, fed by the learner's own micro-batch builder; options ``keep`` (kept d logp/d logits),
  ``graphs`` (the decoder replayed as CUDA graphs, `DecoderGraphs`), ``bf16grad``
  (``learner.megatron.grad_reduce_in_fp32=false``: bf16 main grads), ``kvrep`` (K/V repeated to the
  query heads before FlexAttention, ``PackedCoreAttention.expand_kv``), ``fhead`` (the logprob head's
  softmax work as compiled one-pass kernels, ``vocab_parallel_logprobs(fused=True)``). For each variant the run also
  records the logprob sum, the max logprob difference to the first variant and the gradient norm
  of one pass from zero gradients (same weights in every learner).

MFU counts 6*N + 6*L*h*s FLOPs per token (N all parameters, tied embedding once; s the document
length) against 796 TFLOP/s, the measured bf16 matmul peak of the H100.

``megatron/default`` (``--variants default``) is a learner built from the default config at each
case's micro-batch size, so it measures what the ``auto`` fast options resolve to (all four on one
GPU): the figure a user gets without setting anything.

Usage: ``torchrun --nproc-per-node 1 bench/learner.py [--out results.json] [--variants default,...]``
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

    from agentrl.learner.hf_forward import chunked_logprobs, packed_token_logprobs
    from agentrl.learner.packing import pack_sequences

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


def _grad_norm(learner) -> float:
    return float(torch.sqrt(sum(b.grad_data.float().pow(2).sum() for b in learner.ddp.buffers)))


def default_config(tokens: int):
    """The run config of ``megatron/default``: everything at its default but what a 1-GPU
    Megatron run at this micro-batch size must set (the fast options stay ``auto``)."""
    from agentrl.config import load_config

    return load_config(None, ["learner.backend=megatron", "learner.num_gpus=1", f"packing.max_tokens_per_microbatch={tokens}",
                              "rollout.max_total_tokens=4096", "engine.max_model_len=4096"])


def _build_megatron(grad_fp32: bool, state: dict | None):
    from transformers import Qwen2Config

    from agentrl.config import FAST_OPTIONS, load_config
    from agentrl.learner.megatron.learner import MegatronLearner

    # The named variants switch the fast options on the built model themselves: build with all off.
    cfg = load_config(None, ["learner.backend=megatron", "learner.num_gpus=1", "model.dtype=bfloat16",
                             "packing.max_tokens_per_microbatch=16384", "rollout.max_total_tokens=4096",
                             "engine.max_model_len=4096", f"learner.megatron.grad_reduce_in_fp32={grad_fp32}",
                             *(f"learner.megatron.{k}=false" for k in FAST_OPTIONS)])
    learner = MegatronLearner(cfg, hf_config=Qwen2Config(**QWEN25_15B))
    if state is not None:  # the same weights in every learner of the run
        learner.model.load_state_dict(state)
    return learner


def _set_options(learner, keep: bool, kvrep: bool, fhead: bool) -> None:
    """The model-side settings of learner.megatron.keep_grad_logits, flex_expand_kv, fused_logprobs."""
    learner.model.keep_grad_logits, learner.model.fused_logprobs = keep, fhead
    for layer in learner.model.decoder.layers:
        layer.self_attention.core_attention.expand_kv = kvrep


def _train_check(learner, rows: list[dict]) -> None:
    """train_step (recompute pass + fwd/bwd + Adam) on 15k tokens in 2 micro-batches of <= 8192, same
    weights each time: eager with the defaults, eager with keep+kvrep+fhead, then cuda_graphs with
    them (capture, replay) -- the recommended config against the defaults (a 16k-token graph and
    Adam's state do not fit together in 80 GB)."""
    from agentrl.learner.megatron.graphs import DecoderGraphs
    from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

    g = torch.Generator().manual_seed(2)
    trajs = []
    learner.cfg.packing.max_tokens_per_microbatch = 8192
    for i, n in enumerate((4096, 4096, 3072, 2048, 2048)):  # 8192 + 7168 tokens: both 8192 under graphs
        p = n // 5
        trajs.append(Trajectory(token_ids=torch.randint(0, QWEN25_15B["vocab_size"], (n,), generator=g).tolist(),
                                loss_mask=[0] * p + [1] * (n - p),
                                behavior_logprobs=[0.0] * p + (-8 - 4 * torch.rand(n - p, generator=g)).tolist(),
                                policy_versions=[-1] * p + [0] * (n - p), turn_spans=[(p, n)],
                                turn_rewards=[float(i % 2)]))
    groups = [TrajectoryGroup(task_id="t0", trajectories=trajs, group_id=0)]
    state = {k: v.detach().clone() for k, v in learner.model.state_dict().items() if torch.is_tensor(v)}
    mcfg = learner.cfg.learner.megatron
    for graphs, opts in ((False, False), (False, True), (True, True), (True, True)):
        learner.model.load_state_dict(state, strict=False)
        _set_options(learner, opts, opts, opts)
        mcfg.cuda_graphs = graphs
        if graphs and learner.graphs is None:
            learner.graphs = DecoderGraphs(learner.model)
        if learner.graphs is not None:
            learner.graphs.enabled = graphs
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = learner.train_step(groups)
        torch.cuda.synchronize()
        rows.append({"check": "train_step", "cuda_graphs": graphs, "keep+kvrep+fhead": opts,
                     "grad_reduce_in_fp32": mcfg.grad_reduce_in_fp32, "loss": m["train/loss"],
                     "grad_norm": m["train/grad_norm"], "s": time.perf_counter() - t0,
                     "peak_GiB": torch.cuda.max_memory_allocated() / 2**30})
        print(_stamp(), rows[-1], flush=True)
    mcfg.cuda_graphs = False


def _compiled_graphs(checks: list[dict]) -> None:
    """How many graphs dynamo holds for each of the learner's compiled functions (bounded by design)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from agentrl.learner.megatron import compiled

    counts = {fn.__name__: len(_debug_get_cache_entry_list(fn.__code__)) for fn in compiled._COMPILED}
    checks.append({"check": "compiled_graphs", **counts})
    print(_stamp(), checks[-1], flush=True)


def bench_megatron(rows: list[dict], checks: list[dict], iters: int, variants: list[str],
                   profile_path: str | None = None, write=lambda: None, train_check: bool = False) -> None:
    from agentrl.learner.megatron.graphs import use_capture_stream

    use_capture_stream()  # every variant on the same side stream, built before DDP (what cuda_graphs does)
    box: dict = {"learner": None, "state": None}  # the learner lives here only: a rebuild frees it
    ref: dict = {}
    for variant in variants:
        try:
            if variant == "default":
                _bench_default(box, ref, rows, checks, iters, write)
                continue
            _bench_variant(box, ref, rows, checks, iters, variant,
                           profile_path if variant == variants[-1] else None, write)
        except Exception as e:  # noqa: BLE001 -- record it, go on with the next variant
            import traceback

            traceback.print_exc()
            checks.append({"backend": f"megatron/{variant}", "error": repr(e)[:2000]})
            if box["learner"] is not None and box["learner"].graphs is not None:
                box["learner"].graphs.enabled = False
            torch.cuda.empty_cache()
            write()
    print("peak memory GiB", torch.cuda.max_memory_allocated() / 2**30, flush=True)
    if train_check and box["learner"] is not None:
        if box["learner"].graphs is not None:
            box["learner"].graphs.reset()
        try:
            _train_check(box["learner"], checks)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            checks.append({"check": "train_step", "error": repr(e)[:2000]})
        write()
    try:
        _compiled_graphs(checks)
    except Exception as e:  # noqa: BLE001
        checks.append({"check": "compiled_graphs", "error": repr(e)[:500]})


def _free(box: dict) -> None:
    learner = box["learner"]
    if learner is not None and learner.graphs is not None:
        learner.graphs.reset()
    box["learner"] = None
    gc.collect()
    torch.cuda.empty_cache()


def _time_case(learner, ref, rows, checks, iters, backend, case, n, write):
    """Time forward + backward of the logprob objective on one packed case; record agreement.
    Returns the timed step (for the profiler)."""
    from agentrl.learner.packing import pack_sequences

    packed = pack_sequences(_docs(n, 1))

    def step(packed=packed, learner=learner) -> torch.Tensor:
        mb = learner._microbatch(packed)
        out = learner.ddp(mb.input_ids, mb.position_ids, None, labels=mb.labels, packed_seq_params=mb.params)
        lp = learner._token_logprobs(mb, out)
        lp.sum().backward()
        return lp

    step()  # first call: compiles, and captures graphs (whose warm-up passes may add to main_grad)
    learner.ddp.zero_grad_buffer()  # agreement: logprobs and grad norm of one pass from zero grads
    lp = step().detach()
    check = {"backend": backend, "case": case, "lp_sum": float(lp.sum()), "grad_norm": _grad_norm(learner)}
    if case in ref:
        check["lp_max_diff_vs_first"] = float((lp - ref[case]).abs().max())
    else:
        ref[case] = lp
    checks.append(check)
    rows.append({"backend": backend, "case": case, "tokens": n * DOC, "s": _time(step, iters)})
    learner.ddp.zero_grad_buffer()
    print(_stamp(), rows[-1], check, flush=True)
    write()
    return step


def _bench_default(box, ref, rows, checks, iters, write) -> None:
    """``megatron/default``: a learner built from the default config per case (micro-batch budget
    = the case's tokens, as under CUDA graphs every micro-batch is padded to the budget), so the
    row measures whatever the ``auto`` options resolve to, as a user gets it."""
    from transformers import Qwen2Config

    from agentrl.config import FAST_OPTIONS
    from agentrl.learner.megatron.learner import MegatronLearner

    _free(box)
    for case, n in CASES.items():
        cfg = default_config(n * DOC)
        options = {k: getattr(cfg.learner.megatron, k) for k in FAST_OPTIONS}
        learner = MegatronLearner(cfg, hf_config=Qwen2Config(**QWEN25_15B))
        if box["state"] is not None:  # the same weights as the other variants
            learner.model.load_state_dict(box["state"])
        print(_stamp(), "built megatron learner from the default config:", options, flush=True)
        checks.append({"backend": "megatron/default", "case": case, "resolved": options})
        _time_case(learner, ref, rows, checks, iters, "megatron/default", case, n, write)
        box["learner"] = learner
        del learner
        _free(box)  # before the next case's learner is built


def _bench_variant(box, ref, rows, checks, iters, variant, profile_path, write) -> None:
    from agentrl.learner.megatron.graphs import DecoderGraphs

    attention, *options = variant.split("+")
    grad_fp32 = "bf16grad" not in options
    learner = box["learner"]
    if learner is None or learner.cfg.learner.megatron.grad_reduce_in_fp32 != grad_fp32:
        if learner is not None:
            if learner.graphs is not None:
                learner.graphs.reset()
            box["learner"] = learner = None
            gc.collect()
            torch.cuda.empty_cache()
        learner = box["learner"] = _build_megatron(grad_fp32, box["state"])
        print(_stamp(), "built megatron learner, grad_reduce_in_fp32 =", grad_fp32,
              f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated", flush=True)
        if box["state"] is None:
            box["state"] = {k: v.detach().cpu() for k, v in learner.model.state_dict().items() if torch.is_tensor(v)}
    learner.model.keep_grad_logits = "keep" in options
    learner.model.fused_logprobs = "fhead" in options
    kvrep = "kvrep" in options
    if getattr(learner, "_bench_kvrep", False) != kvrep:
        for layer in learner.model.decoder.layers:
            layer.self_attention.core_attention.expand_kv = kvrep
        learner._bench_kvrep = kvrep
        if learner.graphs is not None:
            learner.graphs.reset()
    if "graphs" in options and learner.graphs is None:
        learner.graphs = DecoderGraphs(learner.model)
    if learner.graphs is not None:
        learner.graphs.enabled = "graphs" in options
    for layer in learner.model.decoder.layers:
        layer.self_attention.core_attention.backend = attention
    for case, n in CASES.items():
        step = _time_case(learner, ref, rows, checks, iters, f"megatron/{variant}", case, n, write)
        if profile_path and case == "4k":
            _profile(step, profile_path)


def _stamp() -> str:
    return time.strftime("%H:%M:%S")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--variants", default="flex+keep,flex+keep+fhead,flex+keep+graphs+bf16grad+kvrep,"
                    "flex+keep+graphs+bf16grad+kvrep+fhead,flex+keep+graphs+kvrep,flex+keep+graphs+kvrep+fhead",
                    help="Megatron variants: 'default' (a learner from the default config, fast options auto, one "
                         "per case), or core attention (flex, sdpa) and options: '+keep' keeps d logp/d logits "
                         "(no recompute), '+graphs' replays the decoder as CUDA graphs, '+bf16grad' "
                         "learner.megatron.grad_reduce_in_fp32=false, "
                         "'+kvrep' K/V repeated to the query heads before FlexAttention, '+fhead' fused (compiled) "
                         "logprob head")
    ap.add_argument("--profile", default=None, help="write a kernel table of the last variant at 4k here")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--train-check", action="store_true", help="then train_step eager vs cuda_graphs (loss, grad norm)")
    ap.add_argument("--cases", default=",".join(CASES), help="which of 4k,16k")
    ap.add_argument("--static-compile", action="store_true",
                    help="A/B: the learner's kernels compiled with dynamic=False (a graph per length, as before 3a7ec0b)")
    args = ap.parse_args()
    for case in set(CASES) - set(args.cases.split(",")):
        del CASES[case]
    if args.static_compile:
        from agentrl.learner.megatron import compiled

        compiled.DYNAMIC = False
    t0 = time.time()
    rows: list[dict] = []
    checks: list[dict] = []
    num_params = 1543714304  # Qwen2.5-1.5B shape, tied embedding counted once (what bench_torch counts)

    def finish(final: bool = False) -> None:
        base = {r["case"]: r for r in rows if r["backend"] == "torch/hf-sdpa"}
        for r in rows:
            r["tok_s"] = r["tokens"] / r["s"]
            r["mfu"] = r["tok_s"] * flops_per_token(num_params, QWEN25_15B, DOC) / PEAK
            r["speedup_vs_hf_sdpa"] = r["tok_s"] / base[r["case"]]["tok_s"] if r["case"] in base else float("nan")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "num_params": num_params, "rows": rows,
                           "checks": checks, "complete": final}, f, indent=1)

    print(_stamp(), torch.cuda.get_device_name(), flush=True)
    if not args.skip_torch:
        num_params = bench_torch(rows, args.iters)
        finish()
    bench_megatron(rows, checks, args.iters, args.variants.split(","), args.profile, finish, args.train_check)
    finish(final=True)
    print(f"\n{torch.cuda.get_device_name()}  N={num_params/1e9:.3f}B  ({time.time() - t0:.0f} s)")
    print(f"{'backend':28s} {'case':5s} {'ms':>8s} {'tok/s':>9s} {'MFU':>6s} {'vs hf-sdpa':>10s}")
    for r in rows:
        print(f"{r['backend']:28s} {r['case']:5s} {r['s']*1e3:8.1f} {r['tok_s']:9.0f} {r['mfu']*100:5.1f}% "
              f"{r['speedup_vs_hf_sdpa']:9.2f}x")
    for c in checks:
        print(c)


if __name__ == "__main__":
    main()
