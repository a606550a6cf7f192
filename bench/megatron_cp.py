"""The Megatron learner with context parallelism on GPUs: CP=2 vs CP=1 on one packed batch.

One process per GPU (``torchrun``, or plain ``python3`` with RANK/WORLD_SIZE/... for one GPU).
``--tp``/``--pp`` add tensor/pipeline parallel degrees (DP = world / (tp*pp*cp); bench/device_megatron.sh
matrix4 runs TP1·CP1, TP2·CP2 and PP2·CP2 on 4 GPUs). The model is a random Qwen2-shape checkpoint (``SHAPE``, bf16) written once to ``--workdir`` by
``--make-model``, so every run loads the same initial weights. The batch is one group of 3
trajectories (by default lengths ``[1/2, 3/8, 1/8] * --tokens``, a 20 % prompt then sampled tokens, rewards
1/0/0.5) packed into one micro-batch (``packing.pad_multiple=4``). Phases, each followed by a
rewrite of ``--out`` (JSON), so a run cut short still leaves what it measured:

1. build the learner (``learner.megatron.context_parallel_size = --cp``, DP = world / cp);
2. ``logprobs`` of the batch under the initial weights (saved to ``--workdir/lp_cp{cp}_{tokens}.pt``;
   compared with the file of ``--ref-cp`` when it exists);
3. the first ``train_step`` (loss, grad norm; compared with ``--ref`` JSON when given);
4. ``--steps`` timed ``train_step`` calls: tokens/s per GPU, peak ``torch.cuda.max_memory_allocated``;
5. with ``--probe-tokens N`` or ``--probe-auto``: one ``train_step`` on 2 trajectories of N tokens
   (one per micro-batch), recording a ``torch.cuda.OutOfMemoryError`` instead of failing; ``--probe-auto``
   picks N from a linear memory model of the timed steps (the shortest length predicted not to fit).

``--shape qwen1.5b --random-init`` is the Qwen2.5-1.5B shape with Megatron's seeded random init (its
seed does not depend on the CP rank; the logprob comparison checks that CP degrees start equal); ``--doc-len D`` makes ``--tokens / D`` trajectories of D tokens
(rewards 1, 0, 1, ...) packed into micro-batches of ``--mb-tokens`` (bench/device_megatron.sh cpflex).

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

SHAPES = {
    # 342M parameters: the shape of the first CP and TP x PP x CP figures.
    "small": {"vocab_size": 32000, "hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
              "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    # Qwen2.5-1.5B (1.54B parameters); max_position_embeddings raised for the long-context probe.
    "qwen1.5b": {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                 "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 262144,
                 "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
}
SHAPE = SHAPES["small"]  # the --shape in use (set in main)
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


def doc_lengths(tokens: int, doc_len: int) -> list[int]:
    """``--doc-len 0``: the 3-trajectory layout of ``lengths_for``; else ``tokens // doc_len`` equal ones."""
    if doc_len <= 0:
        return lengths_for(tokens)
    if doc_len % 4 or tokens % doc_len:
        raise SystemExit(f"--doc-len {doc_len} must be a multiple of 4 dividing --tokens {tokens}")
    return [doc_len] * (tokens // doc_len)


def make_groups(tokens: int, seed: int = 0, doc_len: int = 0) -> list:
    """One group; rewards 1, 0, 0.5 (mixed layout) or alternating 1, 0 (equal documents)."""
    from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

    rng = random.Random(seed)
    trajs = []
    lengths = doc_lengths(tokens, doc_len)
    rewards = (1.0, 0.0, 0.5) if doc_len <= 0 else [float(i % 2 == 0) for i in range(len(lengths))]
    for n, reward in zip(lengths, rewards):
        p = n // 5
        trajs.append(Trajectory(
            token_ids=[rng.randrange(SHAPE["vocab_size"]) for _ in range(n)],
            loss_mask=[0] * p + [1] * (n - p),
            behavior_logprobs=[0.0] * p + [-rng.uniform(8.0, 12.0) for _ in range(n - p)],
            policy_versions=[-1] * p + [0] * (n - p),
            turn_spans=[(p, n)], turn_rewards=[reward],
        ))
    return [TrajectoryGroup(task_id="t0", trajectories=trajs, group_id=0)]


def make_config(model_dir: Path, cp: int, world: int, tokens: int, attention: str, tp: int = 1, pp: int = 1,
                doc_len: int = 0, mb_tokens: int = 16384):
    from agentrl.config import load_config

    longest = max(doc_lengths(tokens, doc_len))
    mb = max(mb_tokens, longest) if doc_len > 0 else max(tokens, mb_tokens)
    return load_config(None, [
        f"model.path={model_dir}", "model.dtype=bfloat16", "learner.backend=megatron", f"learner.num_gpus={world}",
        f"learner.megatron.context_parallel_size={cp}", f"learner.megatron.attention={attention}",
        f"learner.megatron.tensor_parallel_size={tp}", f"learner.megatron.pipeline_parallel_size={pp}",
        "packing.pad_multiple=4", f"packing.max_tokens_per_microbatch={mb}",
        f"rollout.max_total_tokens={longest}", f"engine.max_model_len={max(32768, longest)}",
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
    from agentrl.learner.common import build_samples, pack_samples, plan_microbatches
    from agentrl.learner.megatron.cp_attention import zigzag_indices

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
        from agentrl.learner.megatron.parallel import ParallelLayout

        self.cfg = cfg
        world, rank = dist.get_world_size(), dist.get_rank()
        dp = world // (tp * pp * cp)  # Megatron's rank order: tp fastest, then cp, dp, pp
        self.layout = ParallelLayout(world, rank, tp, pp, cp, dp, rank % tp, rank // (tp * cp * dp),
                                     rank // tp % cp, rank // (tp * cp) % dp)

    def logprobs(self, trajs: list) -> list[list[float]]:
        return [[0.0] + [-10.0] * (len(t.token_ids) - 1) for t in trajs]

    def train_step(self, groups: list) -> dict:
        time.sleep(0.01)
        if max(len(t.token_ids) for g in groups for t in g.trajectories) > 40000 * self.layout.cp:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake: over 40000 tokens per GPU)")
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


def compile_report(when: str) -> None:
    """torch.compile's cumulative compile time per function and its frame/recompile counters."""
    from torch._dynamo.utils import compile_times, counters

    log(f"compile times {when}:\n{compile_times(repr='str', aggregate=True)}")
    log(f"dynamo counters {when}: { {k: dict(v) for k, v in counters.items() if k in ('stats', 'frames', 'recompiles')} }")


PROBE_CANDIDATES = (32768, 49152, 65536, 81920, 98304, 131072, 163840, 196608, 262144)


def pick_probe_lengths(static_gib: float, peak_gib: float, tokens_per_gpu: int, cp: int, capacity_gib: float) -> dict:
    """Linear memory model from the timed steps -> probe lengths (shortest predicted not to fit first).

    peak(L) = static + act * L / cp, act = (timed peak - static) / tokens per GPU of one micro-batch:
    activations grow linearly in tokens (FlexAttention keeps no score matrix, logprobs are chunked).
    A length qualifies when its predicted peak exceeds the GPU by 10 %; among those, prefer the ones
    whose CP=2 prediction (same static memory: an upper bound) stays under 80 % of the GPU.
    """
    act = (peak_gib - static_gib) / max(tokens_per_gpu, 1)

    def predict(n: int, c: int) -> float:
        return static_gib + act * n / c

    over = [n for n in PROBE_CANDIDATES if predict(n, cp) > 1.1 * capacity_gib]
    good = [n for n in over if predict(n, 2 * cp) < 0.8 * capacity_gib] or over
    return {"act_gib_per_1k_tokens": act * 1024, "static_gib": static_gib, "capacity_gib": capacity_gib,
            "predicted_peak_gib": {n: round(predict(n, cp), 1) for n in PROBE_CANDIDATES},
            "predicted_peak_gib_cp2": {n: round(predict(n, 2 * cp), 1) for n in PROBE_CANDIDATES},
            "lengths": good[:2] or list(PROBE_CANDIDATES[-1:])}


def probe(learner, args, res: dict, write) -> None:
    """One train_step per probe length on 2 trajectories of that length; records out-of-memory errors."""
    rank = dist.get_rank()
    sync()
    static = all_max(mem_gib("now"))  # weights, fp32 grads, optimizer state; activations freed
    if args.probe_auto:
        timed = res["phases"].get("timed", {})
        capacity = torch.cuda.mem_get_info()[1] / 2**30 if torch.cuda.is_available() else 100.0
        mb_tokens = min(args.mb_tokens, args.tokens)
        pick = pick_probe_lengths(static, timed.get("peak_mem_gib_per_gpu", static), mb_tokens // args.cp,
                                  args.cp, capacity)
        lengths = pick["lengths"]
        res["probe_model"] = pick
        log(f"probe model: {pick}")
    else:
        lengths = [int(x) for x in args.probe_tokens.split(",") if x]
    res["phases"]["probe"] = out = []
    for n in lengths:
        groups = make_groups(2 * n, seed=1, doc_len=n)
        learner.cfg.packing.max_tokens_per_microbatch = n  # one trajectory per micro-batch
        entry: dict = {"tokens": n, "micro_batches": 2, "static_gib": static}
        out.append(entry)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        log(f"probe {n} tokens: train_step on 2 x {n} (CP={args.cp}, {n // args.cp} tokens per GPU) ...")
        t = time.time()
        try:
            m = learner.train_step(groups)
            sync()
        except torch.cuda.OutOfMemoryError as e:
            entry.update(ok=False, oom=True, s=time.time() - t, error=str(e)[:600],
                         peak_mem_gib=mem_gib(), reserved_gib=torch.cuda.memory_reserved() / 2**30)
            log(f"probe {n}: OUT OF MEMORY after {entry['s']:.1f}s (peak allocated {entry['peak_mem_gib']:.1f} GiB on "
                f"rank {rank}): {str(e)[:300]}")
            res.setdefault("oom_tokens", n)
            torch.cuda.empty_cache()
            write()
            break
        loss, gn = float(m["train/loss"]), float(m["train/grad_norm"])
        entry.update(ok=True, oom=False, s=time.time() - t, loss=loss, grad_norm=gn,
                     finite=bool(torch.isfinite(torch.tensor([loss, gn])).all()),
                     peak_mem_gib=all_max(mem_gib()), peak_mem_gib_ranks=all_ranks(mem_gib()),
                     tokens_per_s_per_gpu=2 * n / (time.time() - t) / dist.get_world_size(), metrics=m)
        log(f"probe {n}: ok in {entry['s']:.1f}s (incl. compiles) loss {loss:.6g} grad_norm {gn:.6g} "
            f"peak {entry['peak_mem_gib']:.1f} GiB/GPU")
        write()


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
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES), help="model shape (random weights)")
    ap.add_argument("--doc-len", type=int, default=0,
                    help="trajectories of this many tokens (--tokens / doc-len of them); 0: 1/2+3/8+1/8 of --tokens")
    ap.add_argument("--mb-tokens", type=int, default=16384, help="packing.max_tokens_per_microbatch")
    ap.add_argument("--probe-tokens", default="",
                    help="after the timed steps, one train_step on 2 trajectories of each of these lengths "
                         "(comma-separated, one per micro-batch), recording an out-of-memory error")
    ap.add_argument("--probe-auto", action="store_true",
                    help="pick the probe length from the timed steps' memory: the shortest predicted not to "
                         "fit this GPU (stops at the first out-of-memory error)")
    ap.add_argument("--random-init", action="store_true", help="random weights from the config (no checkpoint)")
    ap.add_argument("--make-model", action="store_true", help="only write the checkpoint to --workdir/model")
    ap.add_argument("--compile-report", action="store_true",
                    help="log torch.compile's time per compiled function after the first logprobs and step")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--fake", action="store_true")
    args = ap.parse_args()
    global SHAPE
    SHAPE = SHAPES[args.shape]
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
        from agentrl.learner.megatron.parallel import init_distributed

        init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    tag = f"cp{args.cp}" if args.tp == args.pp == 1 else f"tp{args.tp}pp{args.pp}cp{args.cp}"
    ref_tag = args.ref_tag or f"cp{args.ref_cp}"
    if args.doc_len:
        tag += f"_d{args.doc_len}"
    res: dict = {"cp": args.cp, "tp": args.tp, "pp": args.pp, "tag": tag, "world": world, "tokens": args.tokens, "attention": args.attention,
                 "shape_name": args.shape, "shape": SHAPE, "lengths": doc_lengths(args.tokens, args.doc_len),
                 "mb_tokens": args.mb_tokens, "phases": {}, "errors": []}
    if torch.cuda.is_available():
        res["device"] = torch.cuda.get_device_name()

    def write() -> None:
        res["elapsed_s"] = time.time() - T0
        if rank == 0 and args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))

    groups = make_groups(args.tokens, doc_len=args.doc_len)
    trajs = [t for g in groups for t in g.trajectories]
    cfg = make_config(model_dir, args.cp, world, args.tokens, args.attention, args.tp, args.pp,
                      doc_len=args.doc_len, mb_tokens=args.mb_tokens)
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

        from agentrl.learner.megatron.learner import MegatronLearner

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
        if args.compile_report:
            compile_report("after logprobs")
    except Exception as e:  # noqa: BLE001 - keep going: the train step is the main figure
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
    if args.compile_report:
        compile_report("after step1")
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
    if args.probe_tokens or args.probe_auto:
        probe(learner, args, res, write)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
