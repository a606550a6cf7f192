"""Core attention of one long document: the learner's FlexAttention vs SDPA's kernels, side by side.

The long-context workloads train one episode a micro-batch, and at such lengths attention is most
of a layer's work: at 64k tokens and the Qwen2.5-1.5B shape its forward+backward FLOPs are ~2x those
of the layer's matmuls. The Megatron learner's core attention (`PackedCoreAttention`) runs it as
compiled FlexAttention with a document-causal block mask (`learner.megatron.attention=flex`, the
default) or as one causal SDPA call per document (`attention=sdpa`), where torch picks the kernel.
This script times both paths of that module on one document of each length, with SDPA's kernels
forced one at a time, in one process on one GPU:

- ``flex``: the learner's FlexAttention path (GQA inside the kernel); ``flex+kvrep``: K/V repeated
  to the query heads first (``learner.megatron.flex_expand_kv``);
- ``sdpa-default``: the learner's SDPA path as torch chooses; ``sdpa-flash``, ``sdpa-cudnn``,
  ``sdpa-efficient``: the same under ``torch.nn.attention.sdpa_kernel`` of that one kernel (GQA
  inside the call, ``enable_gqa``), and each ``+kvrep``: K/V repeated to the query heads first;
- ``auto``: the learner's default (``attention=auto``), which picks one of the two per micro-batch
  (`agentrl.learner.megatron.attention.auto_backend`; the row says which in ``auto_ran``).

``--docs 1,4,16`` packs each length as that many equal documents in turn (document-causal, as the
learner packs short episodes), where FlexAttention's one block-sparse call meets SDPA's one call a
document.

For each length and backend: forward ms, forward+backward ms, TFLOP/s of forward+backward (causal:
forward 2·L²·heads·dim, backward 2.5× that), the agreement with the first backend that ran, ``flex`` on a GPU (max |out − flex| / max |flex|,
the same for dq), and its forward+backward time over this one's (> 1: faster than flex). A backend that
refuses the inputs (a kernel without GQA, say) gets its error instead of figures.

Usage (one GPU): ``PYTHONPATH=. python bench/attention.py --lengths 16384,32768,65536,131072 --json attention.json``
CPU dry run of the script's logic (float32, small; SDPA's math kernel stands in for flex, which has
no CPU backward): ``PYTHONPATH=. python bench/attention.py --cpu``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BACKENDS", "attention_tflops", "main", "make_attention"]

BACKENDS = ("flex", "flex+kvrep", "sdpa-default", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient",
            "sdpa-flash+kvrep", "sdpa-cudnn+kvrep", "sdpa-efficient+kvrep", "auto", "auto+kvrep")


def attention_tflops(length: int, heads: int, head_dim: int, seconds: float, docs: int = 1) -> float:
    """TFLOP/s of one causal forward+backward over ``length`` tokens packed as ``docs`` equal
    documents (document-causal: each attends within its own) in ``seconds``."""
    doc = length / docs
    forward = 2.0 * doc * doc * heads * head_dim * docs  # QK^T and PV, each 2·L·L·d a head, halved by causality
    return forward * 3.5 / seconds / 1e12


def make_attention(backend: str, heads: int, kv_heads: int, head_dim: int) -> tuple[Any, Callable[[], Any]]:
    """The learner's core attention module for ``backend`` and the context to run it in."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from agentrl.learner.megatron.attention import PackedCoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                            num_query_groups=kv_heads, kv_channels=head_dim, attention_dropout=0.0,
                            hidden_dropout=0.0)
    module_backend = backend.split("+")[0] if backend.startswith(("flex", "auto")) else "sdpa"
    module = PackedCoreAttention(cfg, 1, AttnMaskType.causal, "self", backend=module_backend,
                                 expand_kv=backend.endswith("+kvrep"))
    kernel = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION",
              "sdpa-math": "MATH"}.get(backend.removesuffix("+kvrep"))
    if kernel is None:
        return module, contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return module, lambda: sdpa_kernel([getattr(SDPBackend, kernel)])


def _events_ms(fn: Callable[[], None], iters: int, device: torch.device) -> float:
    """Median ms of ``fn`` over ``iters`` runs (CUDA events on a GPU, wall clock on CPU)."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def measure(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
            args: argparse.Namespace, device: torch.device, docs: int = 1) -> tuple[dict[str, Any], tuple[torch.Tensor, ...]]:
    """One backend on ``docs`` packed documents: its timings, and its output and dq for the agreement."""
    from agentrl.learner.megatron.attention import make_packed_params

    length = q.shape[0]
    module, ctx = make_attention(backend, args.heads, args.kv_heads, args.head_dim)
    cu = torch.linspace(0, length, docs + 1).round().to(torch.int32)  # ``docs`` (near-)equal documents
    params = make_packed_params(cu.to(device), int((cu[1:] - cu[:-1]).max()))
    params.cache["cu_seqlens_cpu"] = cu  # as the learner gives it: boundaries read on the host
    qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))  # no rope tables: attention alone

    def forward() -> torch.Tensor:
        with ctx():
            return module(qq, kk, vv, None, packed_seq_params=params)

    def forward_backward() -> None:
        qq.grad = kk.grad = vv.grad = None
        forward().backward(grad)

    row: dict[str, Any] = {"length": length, "docs": docs, "backend": backend}
    t0 = time.perf_counter()
    forward_backward()  # the first call compiles FlexAttention
    if device.type == "cuda":
        torch.cuda.synchronize()
    row["first_call_s"] = round(time.perf_counter() - t0, 3)
    for _ in range(args.warmup):
        forward_backward()
    with torch.no_grad():
        row["forward_ms"] = round(_events_ms(forward, args.iters, device), 3)
    row["forward_backward_ms"] = round(_events_ms(forward_backward, args.iters, device), 3)
    row["tflops"] = attention_tflops(length, args.heads, args.head_dim, row["forward_backward_ms"] / 1e3, docs)
    if "auto_backend" in params.cache:
        row["auto_ran"] = params.cache["auto_backend"]  # what attention=auto chose for this micro-batch
    qq.grad = None
    out = forward()
    out.backward(grad)
    return row, (out.detach().float(), qq.grad.float())


def run_length(length: int, backends: list[str], args: argparse.Namespace, device: torch.device,
               dtype: torch.dtype, docs: int = 1) -> list[dict[str, Any]]:
    """Every backend on ``length`` tokens of ``docs`` documents (same q, k, v and upstream gradient)."""
    gen = torch.Generator(device=device).manual_seed(length)
    q, k, v = (torch.randn(length, h, args.head_dim, device=device, dtype=dtype, generator=gen)
               for h in (args.heads, args.kv_heads, args.kv_heads))
    grad = torch.randn(length, args.heads * args.head_dim, device=device, dtype=dtype, generator=gen)
    rows, ref = [], None
    for backend in backends:
        try:
            row, got = measure(backend, q, k, v, grad, args, device, docs)
            if ref is None:
                ref, row["reference"] = got, True  # the first backend that ran (flex on a GPU)
            else:
                row["out_rel_err"] = float((got[0] - ref[0]).abs().max() / ref[0].abs().max())
                row["dq_rel_err"] = float((got[1] - ref[1]).abs().max() / ref[1].abs().max())
            del got
        except Exception as exc:  # noqa: BLE001 - a kernel that refuses the inputs is a result
            row = {"length": length, "docs": docs, "backend": backend,
                   "error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"}
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = next((r for r in rows if "forward_backward_ms" in r), None)
    for r in rows:
        if base is not None and "forward_backward_ms" in r:
            r["reference_backend"] = base["backend"]
            r["speedup_vs_reference"] = round(base["forward_backward_ms"] / r["forward_backward_ms"], 3)
    return rows


def _err(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.1e}" if key in row else "ref"


def print_table(rows: list[dict[str, Any]]) -> None:
    ref = next((r["reference_backend"] for r in rows if "reference_backend" in r), "-")
    print(f"{'length':>7} {'docs':>5}  {'backend':<15} {'fwd ms':>9} {'fwd+bwd ms':>11} {'TFLOP/s':>8} "
          f"{'vs ' + ref:>12} {'out err':>9} {'dq err':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['length']:>7} {r['docs']:>5}  {r['backend']:<15} {r['error']}")
            continue
        print(f"{r['length']:>7} {r['docs']:>5}  {r['backend']:<15} {r['forward_ms']:>9.2f} {r['forward_backward_ms']:>11.2f} "
              f"{r['tflops']:>8.1f} {r['speedup_vs_reference']:>11.2f}x {_err(r, 'out_rel_err'):>9} {_err(r, 'dq_rel_err'):>9}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[16384, 32768, 65536])
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"any of {', '.join(BACKENDS)}")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--docs", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                    help="each length packed as this many equal documents (document-causal), each in turn")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--cpu", action="store_true",
                    help="dry run: float32, small; sdpa-math (the reference), sdpa-default, sdpa-math+kvrep")
    args = ap.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS) - {"sdpa-math", "sdpa-math+kvrep"})
    if unknown:
        ap.error(f"unknown backends {unknown}: any of {', '.join(BACKENDS)}")
    if args.cpu:
        device, dtype = torch.device("cpu"), torch.float32
        # the kernels that run on a CPU, and auto (SDPA there: FlexAttention has no CPU backward)
        backends = ["sdpa-math", "sdpa-default", "sdpa-math+kvrep", "auto"]
        if args.lengths == ap.get_default("lengths"):
            args.lengths = [256, 512]
    else:
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU (or --cpu for a dry run)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        print(torch.cuda.get_device_name(), f"torch {torch.__version__}", flush=True)
    rows: list[dict[str, Any]] = []
    if min(args.docs) < 1 or max(args.docs) > min(args.lengths):
        ap.error(f"--docs {args.docs}: at least 1, and at most each length")
    for length in args.lengths:
        for docs in args.docs:
            rows += run_length(length, backends, args, device, dtype, docs)
            print_table([r for r in rows if r["length"] == length and r["docs"] == docs])
        if args.json:  # after every length: a later OOM or timeout keeps what ran
            with open(args.json, "w") as f:
                json.dump({"device": str(torch.cuda.get_device_name()) if device.type == "cuda" else "cpu",
                           "torch": torch.__version__, "heads": args.heads, "kv_heads": args.kv_heads,
                           "head_dim": args.head_dim, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
