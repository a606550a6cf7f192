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


def run_mode(staleness: int, seconds: float, model: str, workdir: Path, groups_per_step: int = 4,
             lr: float = 1e-4, temperature: float = 0.7) -> dict:
    import ray

    from agentrl.config import load_config
    from agentrl.trainer import Trainer

    run_dir = workdir / f"staleness{staleness}"
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        f"run_dir={run_dir}", f"model.path={model}", "sft.enabled=false",
        "env.id=bench.slow_envs:SlowCalculator-v0", f"replay.max_staleness={staleness}",
        "replay.capacity=32", "rollout.max_concurrent_groups=8", "train.num_steps=100000",
        # pinned here (flags) so that tuning the quickstart does not move this benchmark
        f"replay.groups_per_step={groups_per_step}", f"rollout.temperature={temperature}", f"learner.lr={lr}",
        f"train.time_limit_s={seconds}", "eval.num_episodes=0", "train.checkpoint_interval=0",
    ])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO),
                                       **{k: v for k, v in os.environ.items() if k.startswith("VLLM_")}}})
    trainer = Trainer(cfg, progress=False)
    try:
        trainer.start()
        t0 = time.perf_counter()
        trainer.run()
        wall = time.perf_counter() - t0
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
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150.0, help="training wall time per mode")
    parser.add_argument("--groups-per-step", type=int, default=4, help="replay.groups_per_step of both modes")
    # lr 5e-4 at T 1.0 (the pin until 2026-11-23) made the async run (staleness 4) collapse once the
    # SFT model used the tool well: see bench/RESULTS.md
    parser.add_argument("--lr", type=float, default=1e-4, help="learner.lr of both modes")
    parser.add_argument("--temperature", type=float, default=0.7, help="rollout.temperature of both modes")
    args = parser.parse_args()

    from agentrl.config import load_config
    from agentrl.sft import run_sft

    qs = load_config(REPO / "configs" / "quickstart.yaml")
    model = str(run_sft(qs))  # cached after the quickstart's first run
    with tempfile.TemporaryDirectory() as tmp:
        sync = run_mode(0, args.seconds, model, Path(tmp), args.groups_per_step, args.lr, args.temperature)
        asyn = run_mode(4, args.seconds, model, Path(tmp), args.groups_per_step, args.lr, args.temperature)

    print(f"\nasync vs sync at equal wall time ({args.seconds:.0f} s of training each; CPU, tool latency 0.1-2 s)")
    print(f"{'':28s}{'sync (staleness 0)':>20s}{'async (staleness 4)':>22s}{'ratio':>8s}")
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
