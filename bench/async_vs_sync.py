"""Async vs sync, side by side in one run, at equal wall time.

The same pipeline and config run twice on CPU: once strictly on-policy (replay.max_staleness=0:
one batch generated per weight version, the learner waits for it and the engines wait for the
learner) and once asynchronously (max_staleness=4: rollouts keep generating while the learner
trains). The env is Calculator with a long-tailed simulated tool latency (lognormal, clipped to
0.1-2 s), starting from the quickstart's SFT model so that episodes do call tools and vary in
length (a direct guess is one turn; a tool call is two).

    python bench/async_vs_sync.py [--seconds 150]

Prints trajectories/s, learner steps per hour and reward at equal wall time for both, the ratios,
and the length distribution of generated vs consumed trajectories in the async run.

    python bench/async_vs_sync.py --fixed-lag [--no-sft]

compares the deterministic modes instead: replay.lag=0 (on-policy) vs replay.lag=1 (the batch of
step k + 1 is generated with version k while step k trains), both with train.deterministic, so
each trains on data that depends on the seed alone. --no-sft starts from the quickstart's tiny
model instead of its SFT model (no 15-minute SFT first; few tool calls, so the tools' latency
matters less).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process and its descendants (Ray's workers,
    vLLM's processes), by process title, e.g. "ray::LearnerActor"."""
    import psutil

    me = psutil.Process()
    out: dict[str, float] = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            name = " ".join(p.cmdline()[:1]) or p.name()
        except psutil.Error:
            continue
        name = "driver" if p.pid == me.pid else name.split(".")[0].split(" ")[0].split("/")[-1]
        out[name] = out.get(name, 0.0) + t.user + t.system + t.children_user + t.children_system
    return out


def run_mode(staleness: int, seconds: float, model: str, workdir: Path, groups_per_step: int = 4,
             lr: float = 1e-4, temperature: float = 0.7, overrides: list[str] = (), lag: int | None = None) -> dict:
    import ray

    from agentrl.config import load_config
    from agentrl.driver.trainer import Trainer

    run_dir = workdir / (f"staleness{staleness}" if lag is None else f"lag{lag}")
    # replay.lag: deterministic at that lag (the staleness is the lag)
    mode = ["train.deterministic=false"] if lag is None else ["train.deterministic=true", f"replay.lag={lag}"]
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        f"run_dir={run_dir}", f"model.path={model}", "sft.enabled=false",
        "env.id=tools.slow_envs:SlowCalculator-v0", f"replay.max_staleness={staleness}",
        # one rollout actor whose concurrency is bounded only by admission ((4 + 1) x groups_per_step
        # groups ahead of the learner): a second actor process cost CPU the engine needed
        "replay.capacity=32", "rollout.num_actors=1", f"rollout.max_concurrent_groups={5 * groups_per_step}",
        "train.num_steps=100000",
        # pinned here (flags) so that tuning the quickstart does not move this benchmark
        f"replay.groups_per_step={groups_per_step}", f"rollout.temperature={temperature}", f"learner.lr={lr}",
        f"train.time_limit_s={seconds}", "eval.num_episodes=0", "train.checkpoint_interval=0",
        # the quickstart's default is deterministic (on-policy); this compares staleness, or fixed lags
        *mode,
        *overrides,
    ])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO),
                                       **{k: v for k, v in os.environ.items() if k.startswith("VLLM_")}}})
    trainer = Trainer(cfg, progress=False)
    try:
        trainer.start()
        cpu0 = cpu_seconds()
        t0 = time.perf_counter()
        trainer.run()
        wall = time.perf_counter() - t0
        cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu_seconds().items()}
        hist = ray.get(trainer.replay.length_histograms.remote())
        replay = ray.get(trainer.replay.metrics.remote())
    finally:
        trainer.shutdown()
        ray.shutdown()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    elapsed = steps[-1]["timing/elapsed"] if steps else wall
    trajs = sum(r["rollout/trajectories"] for r in steps)  # consumed, trained on or not (tied groups)
    last = steps[-max(1, len(steps) // 4):]
    return {
        "staleness": staleness,
        "lag": lag,
        "steps": len(steps),
        "elapsed_s": elapsed,
        "traj_per_s": trajs / elapsed,
        "steps_per_hour": len(steps) / elapsed * 3600,
        "reward_last_quarter": statistics.mean(r["rollout/reward"] for r in last) if steps else 0.0,
        "tool_use_last_quarter": statistics.mean(r["rollout/tool_use_rate"] for r in last) if steps else 0.0,
        "staleness_max": max((r["replay/staleness_max"] for r in steps), default=0),
        "waiting_s_per_step": statistics.mean(r["timing/waiting"] for r in steps) if steps else 0.0,
        "learner_s_per_step": statistics.mean(r["timing/learner_step"] for r in steps) if steps else 0.0,
        # tied groups (all-equal rewards) are consumed but not trained on (exactly zero gradient)
        "trained_frac": (sum(r["train/num_sequences_trained"] for r in steps) / trajs) if trajs else 0.0,
        "generated_groups": replay["replay/admitted"],
        "dropped_stale": replay["replay/dropped_stale"],
        "hist": hist,
        "cpu_s": {k: v for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v >= 0.5},
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150.0, help="training wall time per mode")
    parser.add_argument("--groups-per-step", type=int, default=4, help="replay.groups_per_step of both modes")
    # lr 5e-4 at T 1.0 (the pin until 2026-11-23) made the async run (staleness 4) collapse once the
    # SFT model used the tool well: see bench/history/async_vs_sync.md
    parser.add_argument("--lr", type=float, default=1e-4, help="learner.lr of both modes")
    parser.add_argument("--temperature", type=float, default=0.7, help="rollout.temperature of both modes")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override applied to both modes (repeatable)")
    parser.add_argument("--workdir", type=Path, help="keep the runs' directories (metrics.jsonl) here")
    parser.add_argument("--only", choices=["sync", "async"], help="run one mode (exploring; no ratio)")
    parser.add_argument("--fixed-lag", action="store_true",
                        help="compare replay.lag=0 (sync) with replay.lag=1 (async), both deterministic")
    parser.add_argument("--no-sft", action="store_true", help="start from the quickstart's tiny model, not its SFT model")
    args = parser.parse_args()

    from agentrl.config import load_config
    from agentrl.driver.sft import run_sft

    qs = load_config(REPO / "configs" / "quickstart.yaml", ["sft.enabled=false", *args.overrides] if args.no_sft else [])
    if args.no_sft:
        from agentrl.model.loading import resolve_model_path

        model = resolve_model_path(qs)  # made once, cached
    else:
        model = str(run_sft(qs))  # cached after the quickstart's first run
    modes = [("sync", 0, 0), ("async", 1, 1)] if args.fixed_lag else [("sync", 0, None), ("async", 4, None)]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.workdir:
            tmp = args.workdir
        for name, staleness, lag in modes:
            if args.only in (None, name):
                runs[name] = run_mode(staleness, args.seconds, model, Path(tmp), args.groups_per_step, args.lr,
                                      args.temperature, args.overrides, lag)
    for name, r in runs.items():
        share = ", ".join(f"{k} {v / r['wall_s']:.2f}" for k, v in r["cpu_s"].items())
        print(f"{name}: CPU cores used by process ({r['wall_s']:.0f} s): {share}")
    if args.only:
        print(json.dumps({k: v for k, v in runs[args.only].items() if k != "hist"}, indent=1))
        return
    sync, asyn = runs["sync"], runs["async"]

    print(f"\nasync vs sync at equal wall time ({args.seconds:.0f} s of training each; CPU, tool latency 0.1-2 s)")
    if args.overrides:
        print("overrides (both modes): " + " ".join(args.overrides))
    names = ("sync (lag 0)", "async (lag 1)") if args.fixed_lag else ("sync (staleness 0)", "async (staleness 4)")
    print(f"{'':28s}{names[0]:>20s}{names[1]:>22s}{'ratio':>8s}")
    for key, label in [("traj_per_s", "trajectories / s"), ("steps_per_hour", "learner steps / hour"),
                       ("reward_last_quarter", "reward (last quarter)"),
                       ("tool_use_last_quarter", "tool use (last quarter)"),
                       ("waiting_s_per_step", "learner waiting s / step"),
                       ("learner_s_per_step", "learner train s / step"),
                       ("trained_frac", "trajectories trained on"), ("steps", "learner steps"),
                       ("staleness_max", "max staleness consumed"), ("dropped_stale", "groups dropped stale")]:
        a, b = sync[key], asyn[key]
        ratio = f"{b / a:7.2f}x" if a else "      -"
        print(f"{label:28s}{a:20.3f}{b:22.3f}{ratio:>8s}")
    gen, con = asyn["hist"]["generated"], asyn["hist"]["consumed"]
    print("\nasync run: trajectory lengths (tokens, buckets of 256), generated vs consumed")
    for bucket in sorted(set(gen) | set(con), key=int):
        g, c = gen.get(bucket, 0), con.get(bucket, 0)
        print(f"  {int(bucket):5d}-{int(bucket) + 255:<5d} generated {g:6d}  consumed {c:6d}  ({c / g if g else 0:.0%})")


if __name__ == "__main__":
    main()
