"""Question: where does a whole learner step go, at the GPU loop's batch shape (wall time vs GPU time)?

`bench/gpu_e2e.py` measures the loop; this looks inside one of its learner steps. A
Qwen2.5-1.5B-shaped model (random weights), the learner built from configs/gpu_1x.yaml as the split
placement runs it (``learner.megatron.cuda_graphs`` off beside a resident engine), and batches of
``--groups`` groups of ``--group-size`` synthetic trajectories shaped like the bench env's (a
prompt, ``--turns`` sampled turns, tool outputs between them). It times ``train_step`` back to back
(as the overlapped loop runs it) and profiles a few steps with the torch profiler, then prints:

* step wall time and learner tokens/s;
* GPU busy: the union of the CUDA kernels' intervals over the steps' wall time;
* the host-side waits for the GPU (synchronizations, blocking copies) and their total;
* the project's ranges (micro-batch building, loss, forward/backward, optimizer, metrics) and the
  GPU idle time under each: where the GPU waits for the host.

    torchrun --nproc-per-node 1 tools/learner_step.py --out learner_step.json   # device machine

The ``torch_full`` and ``torch_lora`` variants build the torch learner instead (a random
Qwen2.5-1.5B-shaped checkpoint written to ``--workdir``; LoRA rank ``--rank`` on every projection,
PEFT, as ``learner.lora`` trains it), to see where a LoRA step's time goes against full fine-tuning's
(the LoRA learner once processed 13 % fewer tokens/s than full fine-tuning at 1.5B);
``torch_lora_peft`` is LoRA through PEFT's own layer forward instead of agentrl's fused one
(``agentrl.learner.lora.fuse_adapters``), ``torch_lora_autograd`` the fused forward with autograd's backward
instead of the fused one (``agentrl.learner.lora.FUSED_BACKWARD``). Every variant also lists its longest GPU
kernels (total time per step):

    python tools/learner_step.py --variants torch_full,torch_lora_peft,torch_lora --out learner_step_lora.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ",
            "cudaMemcpy(", "cudaMemcpyAsync")
VARIANTS = {"eager8k": (8192, "false"), "graphs4k": (4096, "true"), "graphs8k": (8192, "true"),  # tokens/micro-batch, graphs
            "torch_full": (8192, None), "torch_lora": (8192, None),  # the torch learner (no graphs)
            "torch_lora_peft": (8192, None),  # LoRA through PEFT's own layer forward (not the fused one)
            "torch_lora_autograd": (8192, None)}  # the fused forward with autograd's backward (before 2026-11-28)
RANGES = ("agentrl.microbatch", "agentrl.loss", "agentrl.forward_backward", "agentrl.optimizer", "agentrl.metrics")


def make_groups(rng: random.Random, args: argparse.Namespace, version: int) -> list:
    from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

    groups = []
    for g in range(args.groups):
        trajs = []
        for _ in range(args.group_size):
            ids, mask, lps, vers, spans = [], [], [], [], []

            def add(n: int, sampled: bool) -> None:
                start = len(ids)
                ids.extend(rng.randrange(10, 150_000) for _ in range(n))
                mask.extend([int(sampled)] * n)
                lps.extend([-rng.random() * 3 if sampled else 0.0 for _ in range(n)])
                vers.extend([version if sampled else -1] * n)
                if sampled:
                    spans.append((start, len(ids)))

            add(args.prompt_tokens, False)
            for t in range(args.turns):
                add(args.new_tokens, True)
                if t < args.turns - 1:
                    add(args.obs_tokens, False)
            rewards = [0.0] * (len(spans) - 1) + [float(rng.random() < 0.5)]
            trajs.append(Trajectory(token_ids=ids, loss_mask=mask, behavior_logprobs=lps, policy_versions=vers,
                                    turn_spans=spans, turn_rewards=rewards))
        groups.append(TrajectoryGroup(task_id=f"t{g}", trajectories=trajs, group_id=g))
    return groups


def torch_model(workdir: Path, config) -> str:
    """A random checkpoint of ``config`` in HF format with the tiny tokenizer (bench/gpu_e2e.py's)."""
    import sys

    sys.path.insert(0, str(REPO))
    from bench.gpu_e2e import make_model

    return make_model(workdir / "qwen2.5-1.5b-shape", config)


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def idle_gaps(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """[lo, hi) minus the union of ``intervals``."""
    gaps, cur = [], lo
    for s, e in sorted(intervals):
        if s > cur:
            gaps.append((cur, min(s, hi)))
        cur = max(cur, e)
        if cur >= hi:
            break
    if cur < hi:
        gaps.append((cur, hi))
    return [(s, e) for s, e in gaps if e > s]


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="learner_step.json")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=80)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--obs-tokens", type=int, default=270)
    p.add_argument("--steps", type=int, default=4, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--variants", default="eager8k,graphs4k", help=f"of {sorted(VARIANTS)}: micro-batch tokens and "
                   "learner CUDA graphs (the split placement runs eager8k by default; graphs4k fits beside the engine)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--rank", type=int, default=16, help="torch_lora: LoRA rank (alpha = 2 * rank)")
    p.add_argument("--workdir", default="/tmp/learner_step", help="torch_*: where the random checkpoint is written")
    p.add_argument("--top-kernels", type=int, default=15, help="GPU kernels listed per variant, longest first")
    args = p.parse_args()

    from transformers import Qwen2Config

    import agentrl.learner.lora
    from agentrl.config import load_config
    from agentrl.learner.megatron.learner import MegatronLearner
    from agentrl.learner.torch_learner import TorchLearner

    rng = random.Random(0)
    batches = [make_groups(rng, args, 0) for _ in range(3)]
    tokens = sum(len(t.token_ids) for g in batches[0] for t in g.trajectories)
    results = []
    for variant in args.variants.split(","):
        tokens_mb, graphs = VARIANTS[variant]
        common = ["learner.lr=1e-6", f"packing.max_tokens_per_microbatch={tokens_mb}",
                  "rollout.max_total_tokens=4096", "engine.max_model_len=4096"]
        if variant.startswith("torch_"):
            lora = [f"learner.lora.rank={args.rank}", f"learner.lora.alpha={2 * args.rank}"] if "lora" in variant else []
            cfg = load_config(REPO / "configs" / "gpu_1x.yaml", [
                *common, "learner.backend=torch", "model.dtype=bfloat16", *lora, *args.set])
            learner = TorchLearner(cfg, model_path=torch_model(Path(args.workdir), Qwen2Config(**QWEN25_15B)), device="cuda")
            agentrl.learner.lora.FUSED_BACKWARD = variant != "torch_lora_autograd"
            if variant == "torch_lora_peft":  # undo agentrl.learner.lora.fuse_adapters: PEFT's class again
                for module in learner.model.modules():
                    if type(module).__name__ == "FusedLoraLinear":
                        module.__class__ = type(module).__mro__[1]
        else:
            cfg = load_config(REPO / "configs" / "gpu_1x.yaml", [
                *common, f"learner.megatron.cuda_graphs={graphs}", *args.set])
            learner = MegatronLearner(cfg, hf_config=Qwen2Config(**QWEN25_15B))
        res = measure(learner, batches, tokens, args)
        res["variant"] = variant
        results.append(res)
        print(json.dumps(res, indent=2), flush=True)
        del learner
        gc.collect()
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps({"variants": results, "args": vars(args)}, indent=2))
    for r in results:
        print(f"\n{r['variant']}: longest GPU kernels, ms per step")
        for name, ms in r["top_kernels_ms_per_step"]:
            print(f"  {ms:9.2f}  {name}")
    print(f"\n{'variant':10s} {'step s':>7s} {'tok/s':>8s} {'GPU kernels s':>13s} {'GPU busy in step':>16s} {'host waits ms':>13s}")
    for r in results:
        print(f"{r['variant']:10s} {r['step_wall_s']:7.3f} {r['learner_tokens_per_s']:8,.0f} {r['gpu_kernel_s_per_step']:13.3f} "
              f"{r['gpu_busy_in_step']:16.3f} {sum(r['profiled']['host_waits_ms_per_step'].values()):13.1f}")
    if len(results) > 1:
        a = results[0]
        for b in results[1:]:
            print(f"{b['variant']} / {a['variant']}: tokens/s {b['learner_tokens_per_s'] / a['learner_tokens_per_s']:.2f}x, "
                  f"GPU busy in the step {b['gpu_busy_in_step']:.3f} vs {a['gpu_busy_in_step']:.3f}")


def measure(learner, batches, tokens: int, args: argparse.Namespace) -> dict:
    def step(i: int) -> dict:
        return learner.train_step(batches[i % len(batches)])

    for i in range(2):
        step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    walls = []
    for i in range(args.steps):
        s = time.perf_counter()
        m = step(i)  # metrics come back as floats: the step ends with the GPU done
        walls.append(time.perf_counter() - s)
    wall = (time.perf_counter() - t0) / args.steps

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ps = time.perf_counter()
        for i in range(args.profile_steps):
            step(i)
        torch.cuda.synchronize()
        prof_wall = time.perf_counter() - ps
    events = prof.events()
    # Device-side work only: kernels, copies, memsets (record_function ranges also show up on the
    # GPU timeline, as user annotations spanning whole phases: not work).
    kernels = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False) and not e.name.startswith(("agentrl.", "ProfilerStep"))]
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    lo = min(e.time_range.start for e in cpu)
    hi = max([e.time_range.end for e in cpu] + [k[1] for k in kernels])
    busy = union_length(kernels)
    gaps = idle_gaps(kernels, lo, hi)
    waits: dict[str, list[float]] = {}
    for e in cpu:
        if any(e.name.startswith(op) for op in SYNC_OPS):
            waits.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    ranges: dict[str, dict[str, float]] = {}
    for name in RANGES:
        spans = [(e.time_range.start, e.time_range.end) for e in cpu if e.name == name]
        ranges[name] = {
            "count": len(spans), "host_ms": sum(b - a for a, b in spans) / 1e3 / args.profile_steps,
            "gpu_idle_ms": sum(overlap(g, s) for g in gaps for s in spans) / 1e3 / args.profile_steps,
        }
    per_kernel: dict[str, float] = {}
    for e in events:
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False) \
                and not e.name.startswith(("agentrl.", "ProfilerStep")):
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:args.top_kernels]
    result = {
        "top_kernels_ms_per_step": [(name[:120], ms / 1e3 / args.profile_steps) for name, ms in top],
        "device": torch.cuda.get_device_name(), "tokens_per_step": tokens,
        "microbatches": m.get("train/num_microbatches"),
        "step_wall_s": wall, "step_wall_s_each": walls, "learner_tokens_per_s": tokens / wall,
        "gpu_kernel_s_per_step": busy / 1e6 / args.profile_steps,
        # kernel time (profiled; the profiler slows the host, not the kernels) over the unprofiled step
        "gpu_busy_in_step": busy / 1e6 / args.profile_steps / wall,
        "profiled": {"wall_s_per_step": prof_wall / args.profile_steps,
                     "gpu_busy_fraction": busy / max(hi - lo, 1e-9),
                     "gpu_idle_ms_per_step": (hi - lo - busy) / 1e3 / args.profile_steps,
                     "idle_gaps_over_1ms": sorted((round((b - a) / 1e3, 2) for a, b in gaps if b - a > 1000),
                                                  reverse=True)[:20],
                     "host_waits_ms_per_step": {k: round(sum(v) / 1e3 / args.profile_steps, 2) for k, v in waits.items()},
                     "host_wait_calls_per_step": {k: len(v) / args.profile_steps for k, v in waits.items()},
                     "ranges": ranges},
    }
    return result


if __name__ == "__main__":
    main()
