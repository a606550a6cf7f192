"""The Megatron learner with context parallelism on GPUs: CP=2 vs CP=1 on one packed batch.

One process per GPU (``torchrun``, or plain ``python3`` with RANK/WORLD_SIZE/... for one GPU).
``--tp``/``--pp`` add tensor/pipeline parallel degrees (DP = world / (tp*pp*cp); bench/device_megatron.sh
matrix4 runs TP1·CP1, TP2·CP2 and PP2·CP2 on 4 GPUs). The model is a random Qwen2-shape checkpoint (``SHAPE``, bf16) written once to ``--workdir`` by
``--make-model``, so every run loads the same initial weights. The batch is one group of 3
trajectories (lengths ``[1/2, 3/8, 1/8] * --tokens``, a 20 % prompt then sampled tokens, rewards
1/0/0.5) packed into one micro-batch (``packing.pad_multiple=4``). Phases, each followed by a
rewrite of ``--out`` (JSON), so a run cut short still leaves what it measured:

1. build the learner (``learner.megatron.context_parallel_size = --cp``, DP = world / cp);
2. ``logprobs`` of the batch under the initial weights (saved to ``--workdir/lp_cp{cp}_{tokens}.pt``;
   compared with the file of ``--ref-cp`` when it exists);
3. the first ``train_step`` (loss, grad norm; compared with ``--ref`` JSON when given);
4. ``--steps`` timed ``train_step`` calls: tokens/s per GPU, peak ``torch.cuda.max_memory_allocated``.

``--dry-run`` stops before the learner (config, batch, packing and zigzag shards only; CPU, any
world size, gloo); ``--fake`` replaces the learner by a stub (CPU checks of the phase logic).

Example (bench/device_megatron.sh cp2):
    python3 bench/megatron_cp.py --make-model --workdir /tmp/mcp
    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_PORT=29611 python3 bench/megatron_cp.py --cp 1 --out cp1.json
    torchrun --standalone --nproc-per-node 2 bench/megatron_cp.py --cp 2 --ref cp1.json --out cp2.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

SHAPE = dict(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
             tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)
FRACTIONS = (4, 3, 1)  # trajectory lengths in eighths of --tokens
T0 = time.time()


def log(msg: str) -> None:
    rank = os.environ.get("RANK", "0")
    print(f"[{time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s r{rank}] {msg}", flush=True)


def lengths_for(tokens: int) -> list[int]:
    unit = tokens // 8
    out = [f * unit for f in FRACTIONS]
    out[0] += tokens - sum(out)
    return [n - n % 4 for n in out]  # multiples of 2 * cp (cp <= 2): no per-sequence padding


def make_groups(tokens: int, seed: int = 0) -> list:
    from agentrl.trajectory import Trajectory, TrajectoryGroup

    rng = random.Random(seed)
    trajs = []
    for n, reward in zip(lengths_for(tokens), (1.0, 0.0, 0.5)):
        p = n // 5
        trajs.append(Trajectory(
            token_ids=[rng.randrange(SHAPE["vocab_size"]) for _ in range(n)],
            loss_mask=[0] * p + [1] * (n - p),
            behavior_logprobs=[0.0] * p + [-rng.uniform(8.0, 12.0) for _ in range(n - p)],
            policy_versions=[-1] * p + [0] * (n - p),
            turn_spans=[(p, n)], turn_rewards=[reward],
        ))
    return [TrajectoryGroup(task_id="t0", trajectories=trajs, group_id=0)]


def make_config(model_dir: Path, cp: int, world: int, tokens: int, attention: str, tp: int = 1, pp: int = 1):
    from agentrl.config import load_config

    longest = max(lengths_for(tokens))
    return load_config(None, [
        f"model.path={model_dir}", "model.dtype=bfloat16", "learner.backend=megatron", f"learner.num_gpus={world}",
        f"learner.megatron.context_parallel_size={cp}", f"learner.megatron.attention={attention}",
        f"learner.megatron.tensor_parallel_size={tp}", f"learner.megatron.pipeline_parallel_size={pp}",
        "packing.pad_multiple=4", f"packing.max_tokens_per_microbatch={max(tokens, 16384)}",
        f"rollout.max_total_tokens={longest}", "engine.max_model_len=32768",
        "rollout.temperature=1.0", "learner.lr=1e-5",
    ])


def make_model_dir(path: Path) -> Path:
    """Random Qwen2-shape HF checkpoint (bf16 safetensors), made once."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE)).to(torch.bfloat16)
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    log(f"model written to {path}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    return path


def dry_checks(cfg, groups: list, cp: int, model_parallel: int = 1) -> dict:
    """What the learner does to the batch before the model: samples, plan, packing, shards."""
    from agentrl.learners.common import build_samples, pack_samples, plan_microbatches
    from agentrl.learners.megatron.cp_attention import zigzag_indices

    samples = build_samples(groups, cfg.advantage)
    dp = max(cfg.learner.num_gpus, 1) // (cp * model_parallel)
    plan = plan_microbatches(samples, cfg.packing, num_ranks=dp)
    packed = [pack_samples(samples, ix, pad_multiple=cfg.packing.pad_multiple) for ix in plan[0]]
    res = {"num_samples": len(samples), "plan": plan,
           "packed_tokens": [int(p.input_ids.shape[1]) for p in packed],
           "advantages": [float(s.advantages[-1]) for s in samples]}
    if cp > 1:
        cu = packed[0].cu_seqlens.to(torch.int32)
        shards = [zigzag_indices(cu, cp, r) for r in range(cp)]
        res["shard_tokens"] = [int(s.numel()) for s in shards]
        assert sorted(torch.cat(shards).tolist()) == list(range(int(cu[-1]))), "zigzag shards must cover the batch"
    return res


class FakeLearner:
    """CPU stand-in with the learner's surface the phases use (script checks only)."""

    def __init__(self, cfg, cp: int, tp: int = 1, pp: int = 1) -> None:
        from agentrl.learners.megatron.parallel import ParallelLayout

        world, rank = dist.get_world_size(), dist.get_rank()
        dp = world // (tp * pp * cp)  # Megatron's rank order: tp fastest, then cp, dp, pp
        self.layout = ParallelLayout(world, rank, tp, pp, cp, dp, rank % tp, rank // (tp * cp * dp),
                                     rank // tp % cp, rank // (tp * cp) % dp)

    def logprobs(self, trajs: list) -> list[list[float]]:
        return [[0.0] + [-10.0] * (len(t.token_ids) - 1) for t in trajs]

    def train_step(self, groups: list) -> dict:
        time.sleep(0.01)
        return {"train/loss": 0.123, "train/grad_norm": 1.5, "timing/training": 0.01, "timing/logprobs": 0.0}


def all_max(x: float) -> float:
    t = torch.tensor([float(x)], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def all_ranks(x: float) -> list[float]:
    t = torch.tensor([float(x)], device="cuda" if torch.cuda.is_available() else "cpu")
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [round(float(o), 3) for o in out]


def mem_gib(kind: str = "max") -> float:
    if not torch.cuda.is_available():
        return 0.0
    fn = torch.cuda.max_memory_allocated if kind == "max" else torch.cuda.memory_allocated
    return fn() / 2**30


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ref-tag", default=None, help="compare logprobs with lp_{ref_tag}_{tokens}.pt (default cp{ref_cp})")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--workdir", default="/tmp/mcp")
    ap.add_argument("--out", default=None)
    ap.add_argument("--ref", default=None, help="JSON of the CP=1 run to compare the first step with")
    ap.add_argument("--ref-cp", type=int, default=1, help="compare logprobs with lp_cp{ref_cp}_{tokens}.pt")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--attention", default="sdpa", choices=["sdpa", "flex"])
    ap.add_argument("--random-init", action="store_true", help="random weights from the config (no checkpoint)")
    ap.add_argument("--make-model", action="store_true", help="only write the checkpoint to --workdir/model")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--fake", action="store_true")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if args.make_model:
        make_model_dir(model_dir)
        return

    cpu = args.dry_run or args.fake
    if cpu:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
    else:
        from agentrl.learners.megatron.parallel import init_distributed

        init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    tag = f"cp{args.cp}" if args.tp == args.pp == 1 else f"tp{args.tp}pp{args.pp}cp{args.cp}"
    ref_tag = args.ref_tag or f"cp{args.ref_cp}"
    res: dict = {"cp": args.cp, "tp": args.tp, "pp": args.pp, "tag": tag, "world": world, "tokens": args.tokens, "attention": args.attention,
                 "shape": SHAPE, "lengths": lengths_for(args.tokens), "phases": {}, "errors": []}
    if torch.cuda.is_available():
        res["device"] = torch.cuda.get_device_name()

    def write() -> None:
        res["elapsed_s"] = time.time() - T0
        if rank == 0 and args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))

    groups = make_groups(args.tokens)
    trajs = [t for g in groups for t in g.trajectories]
    cfg = make_config(model_dir, args.cp, world, args.tokens, args.attention, args.tp, args.pp)
    res["dry"] = dry_checks(cfg, groups, args.cp, args.tp * args.pp)
    log(f"config ok: {tag} world={world} lengths={res['lengths']} dry={res['dry']}")
    write()
    if args.dry_run:
        dist.barrier()
        dist.destroy_process_group()
        return

    # 1. build
    t = time.time()
    if args.fake:
        learner = FakeLearner(cfg, args.cp, args.tp, args.pp)
    else:
        from transformers import Qwen2Config

        from agentrl.learners.megatron.learner import MegatronLearner

        if args.random_init:
            learner = MegatronLearner(cfg, hf_config=Qwen2Config(**SHAPE))
        else:
            learner = MegatronLearner(cfg)
    res["layout"] = learner.layout.describe()
    res["phases"]["build"] = {"s": time.time() - t, "mem_allocated_gib": all_max(mem_gib("now"))}
    log(f"built in {time.time() - t:.1f}s: {res['layout']}; allocated {res['phases']['build']['mem_allocated_gib']:.2f} GiB")
    write()

    # 2. logprobs under the initial weights
    try:
        t = time.time()
        lps = learner.logprobs(trajs)
        sync()
        ph = res["phases"]["logprobs"] = {"s": time.time() - t}
        flat = torch.tensor([x for row in lps for x in row])
        ph["mean"] = float(flat.mean())
        if rank == 0:
            torch.save(flat, work / f"lp_{tag}_{args.tokens}.pt")
        ref_path = work / f"lp_{ref_tag}_{args.tokens}.pt"
        if ref_tag != tag and ref_path.exists():
            ref = torch.load(ref_path)
            d = (flat - ref).abs()
            ph[f"vs_{ref_tag}_max_abs"], ph[f"vs_{ref_tag}_mean_abs"] = float(d.max()), float(d.mean())
        log(f"logprobs: {ph}")
    except Exception as e:  # keep going: the train step is the main figure
        res["errors"].append(f"logprobs: {e!r}\n{traceback.format_exc()}")
        log(f"logprobs FAILED: {e!r}\n{traceback.format_exc()}")
    write()

    # 3. first train step from the initial weights (compared with CP=1)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t = time.time()
    try:
        m = learner.train_step(groups)
        sync()
    except Exception as e:  # record it in the JSON, then fail
        res["errors"].append(f"step1: {e!r}\n{traceback.format_exc()}")
        log(f"step1 FAILED: {e!r}\n{traceback.format_exc()}")
        write()
        raise
    ph = res["phases"]["step1"] = {"s": time.time() - t, "loss": m["train/loss"], "grad_norm": m["train/grad_norm"],
                                   "peak_mem_gib": all_max(mem_gib()), "metrics": m}
    if args.ref and Path(args.ref).exists():
        ref = json.loads(Path(args.ref).read_text()).get("phases", {}).get("step1")
        if ref:
            ph["ref_loss"], ph["ref_grad_norm"] = ref["loss"], ref["grad_norm"]
            ph["loss_rel_diff"] = abs(ph["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
            ph["grad_norm_rel_diff"] = abs(ph["grad_norm"] - ref["grad_norm"]) / max(abs(ref["grad_norm"]), 1e-12)
    log(f"step1 in {ph['s']:.1f}s: loss {ph['loss']:.6g} grad_norm {ph['grad_norm']:.6g} "
        f"peak {ph['peak_mem_gib']:.2f} GiB; vs ref: {ph.get('loss_rel_diff')}, {ph.get('grad_norm_rel_diff')}")
    write()

    # 4. timed steps
    times = []
    for i in range(args.steps):
        sync()
        t = time.perf_counter()
        m = learner.train_step(groups)
        sync()
        times.append(time.perf_counter() - t)
        log(f"step {i + 2}: {times[-1] * 1e3:.0f} ms loss {m['train/loss']:.6g} grad_norm {m['train/grad_norm']:.4g}")
        med = statistics.median(times)
        res["phases"]["timed"] = {
            "step_s": times, "median_s": med, "tokens_per_s_per_gpu": args.tokens / med / world,
            "tokens_per_s": args.tokens / med, "peak_mem_gib_per_gpu": all_max(mem_gib()),
            "peak_mem_gib_ranks": all_ranks(mem_gib()),
            "timing_logprobs_s": m.get("timing/logprobs"), "timing_training_s": m.get("timing/training"),
        }
        write()
    log(f"done: {json.dumps(res['phases'].get('timed'))}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
