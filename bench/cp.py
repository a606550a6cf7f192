"""Context-parallel attention at 16k tokens: CP=2 vs. CP=1, side by side in one run.

For each packing layout, every rank builds the same random q, k, v (Qwen2.5-1.5B attention
shape: 12 query heads, 2 KV heads, head dim 128) and an upstream gradient, then measures:

- agreement: outputs and q/k/v gradients of CP=1 and CP=2 (bf16, FlexAttention) against a
  float32 SDPA reference with an explicit mask, as max|err| / max|ref| over both ranks;
- time per GPU of one attention forward+backward: CP=1 (the whole sequence on one GPU) vs. CP=2
  (half the queries per GPU, including the K/V all-gather and dK/dV reduce-scatter), the time
  of those two collectives alone, the first call on a new packing, and the mask build.

Run (2 GPUs):
    PYTHONPATH=. python -m torch.distributed.run --standalone --nproc_per_node 2 bench/cp.py
CPU dry run of the script's logic (gloo, SDPA, small):
    PYTHONPATH=. python -m torch.distributed.run --standalone --nproc_per_node 2 bench/cp.py --cpu

One GPU (``--emulate-cp 2``, no process group): every CP rank's attention runs in turn in one
process, local zigzag queries against the whole K/V (what the all-gather would deliver), with
dK/dV summed over the emulated ranks (what the reduce-scatter would deliver). It checks the
FlexAttention block mask's forward and backward against a float32 reference on CUDA and times the
per-rank attention of CP=2 (FlexAttention, and the explicit-mask SDPA path) against CP=1, without
the collectives:
    PYTHONPATH=. python bench/cp.py --emulate-cp 2 --json cp_emulated.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from agentrl.learner.megatron import cp_attention
from agentrl.learner.megatron.cp_attention import (
    all_gather_zigzag,
    cp_document_attention,
    document_causal_attention,
    zigzag_indices,
)

__all__ = ["main"]


def _layouts(tokens: int) -> dict[str, list[int]]:
    q = tokens // 4
    uneven = [
        3 * q // 2,
        q // 2 + 4,
        q,
        tokens - 3 * q - 4,
    ]  # all multiples of 4 when tokens % 16 == 0
    return {"1 doc": [tokens], "4 equal docs": [q] * 4, "4 uneven docs": uneven}


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max())


def _max_over_ranks(x: float, device: torch.device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _fwd_bwd(
    fn: Callable[..., torch.Tensor], leaves: list[torch.Tensor], grad: torch.Tensor
) -> list[torch.Tensor]:
    for t in leaves:
        t.grad = None
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def _time_ms(step: Callable[[], Any], iters: int, device: torch.device) -> float:
    """Mean wall time of ``step`` per call on this rank, all ranks starting together."""
    dist.barrier()
    if device.type == "cuda":
        return _cuda_ms(step, iters, warmup=False)
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) * 1e3 / iters


_START = time.perf_counter()


def _log(msg: str) -> None:
    """Progress on rank 0 with seconds since start, so a run cut off by a time limit says where."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[{time.perf_counter() - _START:7.1f}s] {msg}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_mib(step: Callable[[], Any], iters: int, device: torch.device) -> tuple[float, float]:
    """(mean ms per call, peak memory above the starting allocation in MiB) of a warmed-up step."""
    step()
    if device.type != "cuda":
        return _time_ms(step, iters, device), 0.0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ms = _time_ms(step, iters, device)
    return ms, (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _bench_layout(
    lengths: list[int],
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    backend: str,
    group: dist.ProcessGroup,
) -> dict[str, Any]:
    cp_size, rank = dist.get_world_size(group), dist.get_rank(group)
    T, H, Hkv, D = args.tokens, args.heads, args.kv_heads, args.head_dim
    cu = _cu(lengths)
    g = torch.Generator(device=device).manual_seed(1234)
    full32 = [torch.randn((T, h, D), generator=g, device=device) for h in (H, Hkv, Hkv, H)]
    q, k, v, dout = (t.to(dtype) for t in full32)
    idx = zigzag_indices(cu, cp_size, rank).to(device)

    def ref_fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return document_causal_attention(a, b, c, cu, backend="sdpa")

    def cp1_fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return document_causal_attention(a, b, c, cu, backend=backend)

    def cp2_fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return cp_document_attention(a, b, c, cu, group, backend=backend)

    # float32 reference with an explicit boolean mask (an independent attention kernel).
    ref = _fwd_bwd(ref_fn, [t.clone().requires_grad_() for t in full32[:3]], full32[3])
    ref_local = [r[idx] for r in ref]
    _log(f"{lengths}: float32 SDPA reference done")
    del ref, full32

    cp1_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cp2_leaves = [t[idx].clone().requires_grad_() for t in (q, k, v)]
    dout_local = dout[idx].contiguous()
    first_s = {}
    for key, fn, leaves, grad in (
        ("cp1", cp1_fn, cp1_leaves, dout),
        ("cp2", cp2_fn, cp2_leaves, dout_local),
    ):
        dist.barrier()
        t0 = time.perf_counter()
        got = _fwd_bwd(fn, leaves, grad)  # the first call compiles when needed
        _sync(device)
        first_s[key] = _max_over_ranks(time.perf_counter() - t0, device)
        _log(f"{lengths}: first {key} call (mask build, compile if needed) {first_s[key]:.1f}s")
        if key == "cp1":
            got1 = [x[idx] for x in got]
        else:
            got2 = got

    errors: dict[str, dict[str, float]] = {}
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        errors[what] = {
            "cp1_vs_fp32": _max_over_ranks(_rel_err(got1[i], ref_local[i]), device),
            "cp2_vs_fp32": _max_over_ranks(_rel_err(got2[i], ref_local[i]), device),
            "cp2_vs_cp1": _max_over_ranks(_rel_err(got2[i], got1[i].float()), device),
        }
    del got1, got2, ref_local

    cp1_ms, cp1_mib = _peak_mib(lambda: _fwd_bwd(cp1_fn, cp1_leaves, dout), args.iters, device)
    cp2_ms, cp2_mib = _peak_mib(
        lambda: _fwd_bwd(cp2_fn, cp2_leaves, dout_local), args.iters, device
    )

    _log(f"{lengths}: timed cp1 {cp1_ms:.2f} ms, cp2 {cp2_ms:.2f} ms")

    # The collectives alone: what CP attention gathers (K and V stacked), and its gradient.
    kv_local = torch.stack((k[idx], v[idx]), dim=1).requires_grad_()
    kv_grad = torch.randn((T, 2, Hkv, D), device=device, dtype=dtype)
    comm_ms, _ = _peak_mib(
        lambda: all_gather_zigzag(kv_local, cu, group).backward(kv_grad), args.iters, device
    )

    _sync(device)
    cp_attention._plan.cache_clear()
    t0 = time.perf_counter()
    cp_attention._get_plan(cu, cp_size, rank, device, backend)
    _sync(device)
    plan_ms = (time.perf_counter() - t0) * 1e3

    return {
        "doc_lengths": lengths,
        "errors": errors,
        "fwd_bwd_ms": {
            "cp1": _max_over_ranks(cp1_ms, device),
            "cp2_per_gpu": _max_over_ranks(cp2_ms, device),
            "speedup": _max_over_ranks(cp1_ms, device) / _max_over_ranks(cp2_ms, device),
        },
        "kv_allgather_plus_grad_reducescatter_ms": _max_over_ranks(comm_ms, device),
        "first_call_s": first_s,
        "mask_build_ms": _max_over_ranks(plan_ms, device),
        "peak_extra_mem_mib": {
            "cp1": _max_over_ranks(cp1_mib, device),
            "cp2": _max_over_ranks(cp2_mib, device),
        },
    }


def _cuda_ms(step: Callable[[], Any], iters: int, warmup: bool = True) -> float:
    """Mean CUDA-event time of ``step`` per call, after one warm-up call (compiles) if ``warmup``."""
    if warmup:
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _emulate_layout(lengths: list[int], args: argparse.Namespace, cp_size: int) -> dict[str, Any]:
    """CP=1 vs. every emulated CP rank's attention on one GPU (see the module docstring)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    T, H, Hkv, D = sum(lengths), args.heads, args.kv_heads, args.head_dim
    scale = D**-0.5
    cu = _cu(lengths)
    g = torch.Generator(device=device).manual_seed(1234)
    full32 = [torch.randn((T, h, D), generator=g, device=device) for h in (H, Hkv, Hkv, H)]
    q, k, v, dout = (t.to(dtype) for t in full32)
    res: dict[str, Any] = {"doc_lengths": lengths, "first_call_s": {}, "fwd_bwd_ms": {}, "errors": {}}

    ref = _fwd_bwd(lambda a, b, c: document_causal_attention(a, b, c, cu, backend="sdpa"),
                   [t.clone().requires_grad_() for t in full32[:3]], full32[3])
    del full32

    def run_cp(backend: str, time_it: bool) -> tuple[list[torch.Tensor], list[float]]:
        """Forward+backward of every emulated rank; outputs/dq scattered back, dk/dv summed."""
        out, dq = torch.empty_like(q), torch.empty_like(q)
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        times = []
        for r in range(cp_size):
            idx = zigzag_indices(cu, cp_size, r).to(device)
            plan = cp_attention._get_plan(cu, cp_size, r, device, backend)
            leaves = [q[idx].clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()]
            grad = dout[idx].contiguous()

            def step(leaves: list = leaves, plan: Any = plan, grad: torch.Tensor = grad) -> list[torch.Tensor]:
                return _fwd_bwd(lambda a, b, c: cp_attention._attend(a, b, c, plan, scale, backend), leaves, grad)

            t0 = time.perf_counter()
            got = step()
            torch.cuda.synchronize()
            res["first_call_s"][f"cp{cp_size}_{backend}_rank{r}"] = time.perf_counter() - t0
            out[idx], dq[idx] = got[0], got[1]
            dk += got[2].float()
            dv += got[3].float()
            if time_it:
                times.append(_cuda_ms(step, args.iters))
        return [out, dq, dk, dv], times

    t0 = time.perf_counter()
    cp1_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cp1 = _fwd_bwd(lambda a, b, c: document_causal_attention(a, b, c, cu, backend="flex"), cp1_leaves, dout)
    torch.cuda.synchronize()
    res["first_call_s"]["cp1_flex"] = time.perf_counter() - t0
    res["fwd_bwd_ms"]["cp1_flex"] = _cuda_ms(
        lambda: _fwd_bwd(lambda a, b, c: document_causal_attention(a, b, c, cu, backend="flex"), cp1_leaves, dout),
        args.iters)
    _log(f"{lengths}: CP=1 flex {res['fwd_bwd_ms']['cp1_flex']:.2f} ms (first call {res['first_call_s']['cp1_flex']:.1f}s)")
    got, times = run_cp("flex", True)
    res["fwd_bwd_ms"][f"cp{cp_size}_flex_per_rank"] = times
    _log(f"{lengths}: CP={cp_size} flex per rank {times} ms")
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        res["errors"][what] = {"cp1_flex_vs_fp32": _rel_err(cp1[i], ref[i]),
                               f"cp{cp_size}_flex_vs_fp32": _rel_err(got[i], ref[i])}
    del got, cp1
    if T <= args.sdpa_max_tokens:  # the explicit [t, T] mask path, for comparison
        _, times = run_cp("sdpa", True)
        res["fwd_bwd_ms"][f"cp{cp_size}_sdpa_per_rank"] = times
        _log(f"{lengths}: CP={cp_size} sdpa (explicit mask) per rank {times} ms")
    cp_attention._plan.cache_clear()
    t0 = time.perf_counter()
    cp_attention._get_plan(cu, cp_size, 0, device, "flex")
    torch.cuda.synchronize()
    res["mask_build_ms"] = (time.perf_counter() - t0) * 1e3
    res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return res


def emulate(args: argparse.Namespace) -> None:
    """``--emulate-cp N`` on one GPU: CP=N attention per rank vs. CP=1, written to ``--json``."""
    torch.cuda.set_device(0)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "emulated_cp": args.emulate_cp,
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "bfloat16"},
        "layouts": {},
    }
    layouts = {f"{n} {name}": lens for n in args.emulate_tokens for name, lens in _layouts(n).items()
               if n == args.emulate_tokens[0] or name == "1 doc"}
    for name, lengths in layouts.items():
        try:
            results["layouts"][name] = _emulate_layout(lengths, args, args.emulate_cp)
        except Exception as e:  # noqa: BLE001 - keep the other layouts' figures
            results["layouts"][name] = {"error": repr(e)[:500]}
            _log(f"{name}: FAILED {e!r}")
        print(f"[{name}] {json.dumps(results['layouts'][name])}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)


def main() -> None:
    """Run the benchmark on every rank; rank 0 prints a table and writes ``--json``."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None, help="write the results here (rank 0)")
    ap.add_argument("--cpu", action="store_true", help="gloo + SDPA in float32, for a dry run")
    ap.add_argument("--emulate-cp", type=int, default=0, help="one GPU, no process group: emulate this CP degree")
    ap.add_argument("--emulate-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[16384],
                    help="packed lengths for --emulate-cp (all layouts for the first, '1 doc' for the rest)")
    ap.add_argument("--sdpa-max-tokens", type=int, default=16384, help="--emulate-cp: SDPA path up to this length")
    args = ap.parse_args()
    if args.emulate_cp:
        emulate(args)
        return

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if args.cpu:
        device, dtype, backend = torch.device("cpu"), torch.float32, "sdpa"
        dist.init_process_group("gloo")
    else:
        device, dtype, backend = torch.device("cuda", local_rank), torch.bfloat16, "flex"
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    _log(f"process group up: {dist.get_backend()} x {dist.get_world_size()}")

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cp_size": dist.get_world_size(),
        "shape": {
            "tokens": args.tokens,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "dtype": str(dtype),
        },
        "layouts": {},
    }
    for name, lengths in _layouts(args.tokens).items():
        results["layouts"][name] = _bench_layout(lengths, args, device, dtype, backend, group)
        if rank == 0:
            print(f"[{name}] {json.dumps(results['layouts'][name])}", flush=True)
            if args.json:  # after every layout, so a run cut short still leaves its figures
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=2)

    if rank == 0:
        _print_table(results)
    dist.destroy_process_group()


def _print_table(results: dict[str, Any]) -> None:
    s = results["shape"]
    print(
        f"\n{results['device']}, torch {results['torch']}, CP={results['cp_size']}, {s['tokens']} tokens, "
        f"{s['heads']}/{s['kv_heads']} heads x {s['head_dim']}, {s['dtype']}"
    )
    print(
        "| layout | CP=1 fwd+bwd ms | CP=2 fwd+bwd ms/GPU | speed-up | comm ms | mask build ms "
        "| max rel err out/dq/dk/dv CP=1 vs fp32 | same, CP=2 | CP=2 vs CP=1 |"
    )
    print("|" + " --- |" * 9)
    for name, r in results["layouts"].items():
        t, e = r["fwd_bwd_ms"], r["errors"]
        errs = ["/".join(f"{e[w][key]:.1e}" for w in ("out", "dq", "dk", "dv")) for key in e["out"]]
        print(
            f"| {name} | {t['cp1']:.2f} | {t['cp2_per_gpu']:.2f} | {t['speedup']:.2f}x "
            f"| {r['kv_allgather_plus_grad_reducescatter_ms']:.2f} | {r['mask_build_ms']:.1f} | "
            + " | ".join(errs)
            + " |"
        )


if __name__ == "__main__":
    main()
