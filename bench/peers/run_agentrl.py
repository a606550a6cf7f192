"""agentrl on one peer-harness workload (bench/peers/README.md): writes one Result per setting.

Settings:
  recommended  what configs/gpu_1x.yaml and the GPU guide recommend on one GPU: the engine and the
               Megatron learner both resident (static split), async with max_staleness 2, refit
               every step by CUDA IPC; the long workload sleeps the engine while the learner steps
               (colocated), since a 16k-token micro-batch does not fit beside a resident engine; its
               engine share is 0.25 (16 episodes of 16.6k tokens need ~7.4 GB of KV cache): at
               0.5 the waking engine found no room beside the learner's weights and optimizer
               state (an OOM on the H100, 2026-11-25, kept in the results); and its learner
               recomputes the layers of a micro-batch whose activations would not fit
               (learner.megatron.recompute_above_tokens=auto: at 16k none does; without it
               long64k OOMed on the H200, 2026-11-29).
  like         closest to TRL's colocate mode: the same placement, but on-policy (max_staleness 0:
               generate, then train, then refit, one after the other).
  memory       `like` at TRL's recommended memory settings, for the peak-memory comparison: vLLM's
               share of the GPU is TRL's (0.3) and the learner recomputes activations
               (megatron.activation_checkpointing, as TRL's gradient checkpointing does); a refit
               reads the learner's parameters in place (refit.zero_copy), the learner's
               allocator maps expandable segments (learner.expandable_segments) and keeps the fp32
               master weights as int16 remainders (learner.megatron.master_weight_remainders).
Every setting samples and trains over the tokenizer's ids only (`model.tokenizer_vocab_only`), as
verl does (TRL does not): the random model's 151,936-row head has ~0.5 % of its mass on the
tokenizer's 749 ids.

    python bench/peers/run_agentrl.py --workload multi --settings recommended,like --out peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers.common import (
    GpuSampler,
    Result,
    close_result,
    harness_parser,
    make_model,
    mark_cut,
    observation_text,
    pinned_versions,
    prompt_texts,
    run_workload,
    steady_state,
    step_intervals,
    timed_summary,
    write_result,
)

ENV_ID = "bench.peers.peer_env:PeerTool-v0"


def overrides(args: argparse.Namespace, wl, model: str, texts_file: str, setting: str) -> list[str]:
    steps = args.warmup + args.steps
    on_policy = setting in ("like", "memory")
    engine_mem = 0.3 if setting == "memory" else args.engine_mem
    max_len = wl.episode_tokens + 512
    colocated = wl.name.startswith("long") and not args.cpu
    out = [
        # as verl samples (its vLLM server masks the logits past len(tokenizer)): only the tokenizer's
        # ids, trained on the same masked distribution (bench/history/peers.md, 2026-11-27)
        f"model.path={model}", "model.bootstrap_tiny=false", "model.tokenizer_vocab_only=true", f"run_dir={args.workdir}/run-{wl.name}-{setting}", "sft.enabled=false",
        f"env.id={ENV_ID}",
        f"env.kwargs={{texts_file: '{texts_file}', tool_calls: {wl.tool_calls}, latency_s: {wl.tool_latency_s}, "
        f"new_tokens: {wl.new_tokens}, max_turns: {wl.tool_calls + 1}}}",
        "rollout.num_actors=2", f"rollout.group_size={wl.group_size}",
        f"rollout.max_concurrent_groups={max(1, wl.prompts_per_step // 2) if on_policy else wl.prompts_per_step}",
        "rollout.temperature=1.0", "rollout.top_p=1.0", f"rollout.max_new_tokens={wl.new_tokens}",
        f"rollout.min_new_tokens={wl.new_tokens}", f"rollout.max_turns={wl.tool_calls + 1}",
        f"rollout.max_total_tokens={max_len}", f"engine.max_model_len={max_len}",
        f"engine.max_num_seqs={min(256, wl.group_size * wl.prompts_per_step * 2)}", "engine.enforce_eager=auto",
        f"replay.max_staleness={0 if on_policy else 2}", f"replay.groups_per_step={wl.prompts_per_step}",
        f"replay.capacity={4 * wl.prompts_per_step}",
        f"learner.lr={args.lr}", "loss.clip_low=0.2", "loss.clip_high=0.28",
        f"packing.max_tokens_per_microbatch={max(8192, max_len)}",
        f"train.num_steps={steps}", "train.checkpoint_interval=0", "eval.num_episodes=0",
    ]
    if args.cpu:
        out += ["learner.backend=torch", "learner.num_gpus=0", "engine.num_gpus=0", "colocate.enabled=false",
                "model.dtype=float32", "cluster.num_cpus=4", "engine.num_cpus=1", "learner.num_cpus=1",
                "engine.kv_cache_gib=1"]
    else:
        out += [f"colocate.engine_sleep={'true' if colocated else 'false'}",
                f"engine.gpu_memory_utilization={0.25 if colocated else engine_mem}", "cluster.num_cpus=14"]
        if colocated and setting != "memory":  # memory recomputes every micro-batch anyway
            out.append("learner.megatron.recompute_above_tokens=auto")
        if setting == "memory":
            # recompute as TRL's gradient checkpointing; the engines read the learner's parameters
            # in place at each refit (no model-sized export buffer: TRL loads vLLM tensor by tensor);
            # the learner's allocator in expandable segments (2.2 GiB less reserved beyond allocated
            # at the step's peak, H200 2026-11-28)
            # and the fp32 master weights as int16 remainders beside the bf16 weights (2 bytes a
            # parameter less; the same updates bit for bit: tests/test_megatron_gpu.py, H200 2026-11-29)
            out += ["learner.megatron.activation_checkpointing=true", "refit.zero_copy=true",
                    "learner.expandable_segments=true", "learner.megatron.master_weight_remainders=true"]
    blocks = getattr(args, "kv_blocks", 0) or peer_kv_blocks(getattr(args, "kv_blocks_from", None), wl.name)
    if blocks:
        out.append(f"engine.gpu_kv_cache_gib={kv_cache_gib(model, blocks)!r}")
    return out + list(args.set)


def peer_kv_blocks(path: str | None, workload: str) -> int:
    """The KV blocks a peer's vLLM sized for itself in its last result on ``workload`` in ``path``
    (a peers.json: TRL's ``extra.kv_blocks``); 0 without ``path``; an error when none is there."""
    if not path:
        return 0
    rows = [r for r in json.loads(Path(path).read_text()) if r.get("system") != "agentrl"
            and r.get("workload") == workload and (r.get("extra") or {}).get("kv_blocks")]
    if not rows:
        raise SystemExit(f"run_agentrl: no peer result on {workload!r} with extra.kv_blocks in {path}")
    return int(rows[-1]["extra"]["kv_blocks"])


def kv_cache_gib(model: str, blocks: int, block_tokens: int = 16, dtype_bytes: int = 2) -> float:
    """The KV cache of ``blocks`` vLLM blocks of the model at ``model`` (a config.json's shape), in
    GiB: what engine.gpu_kv_cache_gib needs for vLLM to make exactly that many (its default block
    of 16 tokens, bf16 K and V of every layer)."""
    c = json.loads((Path(model) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_block = c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim
    return blocks * per_block * block_tokens * dtype_bytes / 2**30


def run_setting(args: argparse.Namespace, wl, model: str, texts_file: str, setting: str,
                prep_s: dict[str, float] | None = None) -> Result:
    import ray

    from agentrl.config import load_config
    from agentrl.driver.trainer import Trainer

    res = Result(system="agentrl", setting=setting, workload=wl.name, workload_spec=wl.__dict__.copy(),
                 versions=pinned_versions("ray", "megatron-core"))
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "gpu_1x.yaml",
                      overrides(args, wl, model, texts_file, setting))
    res.extra["config"] = {"max_staleness": cfg.replay.max_staleness, "engine_sleep": cfg.colocate.engine_sleep,
                           "learner": cfg.learner.backend, "micro_batch_tokens": cfg.packing.max_tokens_per_microbatch,
                           "engine_batched_tokens": cfg.engine.max_num_batched_tokens,
                           "attention": cfg.learner.megatron.attention,
                           "recompute_keeps_attention": cfg.learner.megatron.recompute_keeps_attention,
                           "set": list(args.set)}
    t_init = time.perf_counter()
    trainer = Trainer(cfg, progress=False)
    trainer.save_checkpoint = lambda: None  # a benchmark keeps no checkpoint (3 GB at this size)
    # where the start-up goes (what a device call must leave room for beside the steps)
    start_s = res.extra["start_s"] = {**(prep_s or {}), "trainer_init": round(time.perf_counter() - t_init, 1)}
    rows: list[dict] = []
    stamps: list[float] = []
    t0 = time.perf_counter()
    cut = False
    sampler = GpuSampler().start()
    try:
        t_start = time.perf_counter()
        trainer.start()  # Ray, the engines (vLLM's start), the learner, the first refit
        start_s["trainer_start"] = round(time.perf_counter() - t_start, 1)
        start_s["engines"] = round(trainer.engine_start_s or 0.0, 1)
        start_s["trainer_parts"] = dict(trainer.start_s)  # ray, engines, engines_sleep, learner, ...
        try:  # the learner's build, from its actor's start (imports, CUDA, model, weights, optimizer)
            start_s["learner_build"] = ray.get(trainer.learner.start_timeline.remote(), timeout=60)
        except Exception as exc:  # noqa: BLE001 - a diagnostic: the run goes on without it
            start_s["learner_build"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        logger = type("L", (), {"log": lambda self, step, m: (rows.append(dict(m)), stamps.append(time.perf_counter())),
                                "close": lambda self: None})()
        # the first (warm-up) step starts with the rollouts, as a peer's first step starts with its first
        # generation; the timed steps start at the last warm-up step's end (summarize)
        t0 = time.perf_counter()
        runs = [r.run.remote() for r in trainer.rollouts]
        trainer._loop(logger)
        for r in trainer.rollouts:
            r.stop.remote()
        del runs
    except KeyboardInterrupt as exc:  # the trainer's SIGTERM (a device call's time limit) or Ctrl-C
        cut = True
        mark_cut(res, exc, len(rows), args.warmup + args.steps)
    except Exception as exc:  # out of memory or any failure: the table says so
        oom = "out of memory" in str(exc).lower() or "OutOfMemory" in type(exc).__name__ or "OOM" in str(exc)
        res.status, res.reason = ("oom" if oom else "error"), f"{type(exc).__name__}: {str(exc)[-600:]}"
        traceback.print_exc()
    finally:
        sampler.stop()
        # a cut run has seconds left (`timeout -k`): its result is written before the slow shutdown
        ask_s = 10 if cut else 120
        try:  # what the learner holds, by holder, and its allocator's peak (the memory goal's profile)
            res.extra["learner_memory_gib"] = {k: round(v, 3) for k, v in ray.get(
                trainer.learner.memory_report.remote(), timeout=ask_s).items()}
        except Exception as exc:  # noqa: BLE001 - a failed run may have no learner left to ask
            res.extra["learner_memory_gib"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        try:  # each vLLM worker's allocator and process (the rest of the split by process)
            res.extra["engine_memory_gib"] = [{k: round(v, 3) for k, v in w.items()} for e in trainer.engines
                                              for w in ray.get(e.memory_stats.remote(), timeout=ask_s)]
        except Exception as exc:  # noqa: BLE001 - a failed run may have no engine left to ask
            res.extra["engine_memory_gib"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        summarize(res, rows, stamps, t0, args.warmup)
        busy_from = stamps[args.warmup - 1] if len(stamps) > args.warmup else 0.0
        write_result(close_result(res, sampler, busy_from, args.steps), Path(args.out))
        trainer.shutdown()
        ray.shutdown()
    if cut:
        raise SystemExit(f"run_agentrl: {res.reason}")
    return res


def summarize(res: Result, rows: list[dict], stamps: list[float], t0: float, warmup: int) -> None:
    """The step metrics the trainer logged (``rows``, ended at ``stamps``) into ``res``'s figures.

    A step's wall is the interval between its end and the previous step's (:func:`step_intervals`),
    as for every peer; the first ``warmup`` steps are not timed. The rollouts run from before the
    first step (agentrl's recommended setting is async: they fill the replay queue while the learner
    makes its first step), so the step after a single warm-up step trains on rollouts made during
    the warm-up and takes about half a steady step: two warm-up steps (the runners' default) drain
    that fill, and ``extra.steady`` says whether the first timed step was a normal one."""
    if not rows:
        return
    walls = step_intervals(t0, stamps)
    gen = [m.get("rollout/tokens_per_s", 0.0) * m.get("timing/step", 0.0) for m in rows]
    summary = timed_summary(walls, [m.get("train/num_tokens", 0.0) for m in rows], gen, warmup)
    for k, v in summary.items():
        setattr(res, k, v)
    timed = rows[warmup:]
    res.weight_sync_s = (sum(m.get("timing/refit", 0.0) for m in timed) / len(timed)) if timed else None
    res.reward_curve = [round(m.get("rollout/reward", 0.0), 4) for m in rows]
    res.episode_tokens = (sum(m.get("train/num_tokens", 0.0) for m in rows)
                          / max(1.0, sum(m.get("train/num_sequences_trained", m.get("rollout/trajectories", 1.0))
                                         for m in rows)))
    res.extra["staleness_max"] = max(m.get("replay/staleness_max", 0.0) for m in rows)
    res.extra["step_walls_s"] = [round(w, 3) for w in walls]
    res.extra["steady"] = steady_state(walls, warmup)
    res.extra["learner_peaks_by_step_gib"] = [{k.removeprefix("memory/peak_").removesuffix("_gib"): round(v, 3)
                                               for k, v in m.items() if k.startswith("memory/peak_")} for m in rows]
    # where each step's time went (the trainer's timing/*: waiting for rollouts, the learner's step,
    # its logprob pass, the refit) and what recomputed (learner.megatron.recompute_above_tokens)
    res.extra["timing_by_step_s"] = [{k.removeprefix("timing/"): round(v, 3) for k, v in m.items()
                                      if k.startswith("timing/")} for m in rows]
    if any("train/recomputed_microbatches" in m for m in rows):
        res.extra["recompute_by_step"] = [{"microbatches": m.get("train/recomputed_microbatches", 0.0),
                                           "layers_mean": round(m.get("train/recomputed_layers", 0.0), 2),
                                           "attention_kept_mean": round(m.get("train/attention_kept_layers", 0.0), 2)}
                                          for m in rows]
    # the engine's sampling logprobs against the learner's for the same tokens, each step: a refit
    # that left the engine other weights than the learner's shows here first
    res.extra["kl_behavior_prox_by_step"] = [round(m["train/kl_behavior_prox"], 6) for m in rows
                                             if "train/kl_behavior_prox" in m]


def main() -> None:
    p = harness_parser(__doc__, settings="recommended,like")
    p.add_argument("--engine-mem", type=float, default=0.2,
                   help="vLLM's share of the GPU when resident (bench/gpu_e2e.py: 0.25 left no room for a refit)")
    p.add_argument("--cpu", action="store_true", help="a CPU check of the harness: tiny shape, scaled workload")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--kv-blocks", type=int, default=0,
                   help="the engine's KV cache in vLLM blocks (engine.gpu_kv_cache_gib), e.g. a peer's kv_blocks, "
                        "for a row at an equal KV cache; 0: sized from the engine's GPU share")
    p.add_argument("--kv-blocks-from", default=None, metavar="PEERS_JSON",
                   help="--kv-blocks from the last peer result on this workload in PEERS_JSON (its extra.kv_blocks)")
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    wl = run_workload(args)
    t0 = time.perf_counter()
    model = make_model(Path(args.workdir) / f"model-{'cpu' if args.cpu else '1.5b'}", "cpu" if args.cpu else "1.5b")
    t1 = time.perf_counter()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts_file = Path(args.workdir) / f"texts-{wl.name}.json"
    texts_file.write_text(json.dumps({"prompts": prompt_texts(tok, wl, 256), "observation": observation_text(tok, wl),
                                      "special_tokens": list(tok.all_special_tokens)}))
    prep_s = {"model": round(t1 - t0, 1), "texts": round(time.perf_counter() - t1, 1)}
    for setting in args.settings.split(","):
        run_setting(args, wl, model, str(texts_file), setting, prep_s)  # writes its result, cut or not


if __name__ == "__main__":
    main()
