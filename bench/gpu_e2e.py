"""The whole GPU loop at a real size, sync vs async, colocated vs split, side by side in one run.

A Qwen2.5-1.5B-shaped model with random weights (no checkpoint can be downloaded on the device;
the tiny tokenizer is enough: the env reads no text), a multi-turn tool env whose tool answers
after ``--tool-latency`` seconds with a ~``--obs-tokens`` observation, vLLM + the Megatron learner
on one GPU. For each placement (colocated: the engine sleeps while the learner steps; split: both
resident, static memory split) it trains ``--seconds`` on-policy (sync, max_staleness 0) and then
async (max_staleness ``--staleness``), and prints, per run: trajectories/s, rollout tokens/s,
learner tokens/s, refit seconds, the step's time split (waiting for data / engine sleep / learner
step / refit, as fractions of the wall time) and the GPU busy fraction (NVML utilization sampled
every 0.1 s); then the async/sync ratios. Writes everything to ``--out`` as JSON.

    python bench/gpu_e2e.py --out gpu_e2e.json                      # device: bench/device_e2e.sh bench
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import gymnasium
from agentrl.envs.base import TextEnv, Turn

ENV_ID = "bench.gpu_e2e:ToolLatency-v0"


class ToolLatencyEnv(TextEnv):
    """Every reply is a tool call: the tool answers after ``latency_s`` with ``obs_words`` words;
    after ``num_turns`` replies the episode ends with a reward drawn from the reply (so GRPO's
    advantages are non-zero and every learner step trains the whole batch)."""

    def __init__(self, *, latency_s: float = 0.5, obs_words: int = 200, num_turns: int = 4, max_turns: int = 8) -> None:
        super().__init__(max_turns=max_turns)
        self.latency_s, self.obs_words, self.num_turns_per_episode = latency_s, obs_words, num_turns

    def new_task(self, rng: random.Random, options: dict[str, Any]) -> list[dict[str, str]]:
        self._rng = rng
        return [{"role": "user", "content": "Use the tool until it says stop. " + " ".join(
            rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(40))}]

    def respond(self, action: str) -> Turn:
        time.sleep(self.latency_s)  # a slow tool (step runs in a worker thread)
        if self.num_turns >= self.num_turns_per_episode:
            return Turn([], reward=float(len(action) % 2), terminated=True, success=True)
        words = " ".join(self._rng.choice(["red", "green", "blue", "seven", "eight"]) for _ in range(self.obs_words))
        return Turn([{"role": "tool", "content": words}], reward=0.0)


gymnasium.register(id="ToolLatency-v0", entry_point=ToolLatencyEnv)


def make_model(out: Path, config: Any = None, *, init_dtype: str = "float32") -> str:
    """Random weights (bf16) with the tiny tokenizer, in HF format: Qwen2.5-1.5B-shaped, or of
    ``config`` (a ``Qwen2Config``, e.g. bench/lora.py's 7B shape). ``init_dtype``: the dtype the
    weights are drawn in before the cast to bf16 (float32: the 1.5B weights of the runs in
    bench/history/gpu_loop.md; bfloat16 builds a large shape without a float32 copy on the GPU)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentrl.model.tiny import bootstrap_tiny

    if (out / "config.json").is_file():
        return str(out)
    bootstrap_tiny(out)  # tokenizer + chat template; the model files are replaced below
    if config is None:
        config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                             num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                             rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
                             bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    torch.set_default_dtype(getattr(torch, init_dtype))
    try:
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(torch.float32)
    for f in out.glob("model*.safetensors"):
        f.unlink()
    model.save_pretrained(out, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return str(out)


class GpuBusy:
    """NVML utilization (percent of time a kernel ran) sampled every 0.1 s in a thread."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        self.samples: list[tuple[float, float]] = []  # (perf_counter, utilization)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.samples.append((time.perf_counter(), self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu / 100.0))

    def __enter__(self) -> GpuBusy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def fraction(self, since: float = 0.0) -> float:
        """Mean utilization over the samples taken after ``since`` (a perf_counter time)."""
        kept = [u for t, u in self.samples if t >= since]
        return statistics.fmean(kept) if kept else 0.0


def run_one(model: str, args: argparse.Namespace, *, placement: str, staleness: int) -> dict[str, Any]:
    import ray

    from agentrl.config import load_config
    from agentrl.driver.trainer import Trainer

    colocated = placement == "colocated"
    overrides = [
        f"model.path={model}", f"run_dir={args.workdir}/run-{placement}-s{staleness}", "sft.enabled=false",
        f"env.id={ENV_ID}", f"env.kwargs={{latency_s: {args.tool_latency}, obs_words: {args.obs_words}, num_turns: {args.turns}}}",
        "rollout.num_actors=2", f"rollout.group_size={args.group_size}", f"rollout.max_concurrent_groups={args.concurrent_groups}",
        "rollout.temperature=1.0", "rollout.top_p=1.0", f"rollout.max_new_tokens={args.new_tokens}", f"rollout.max_turns={args.turns + 1}",
        "rollout.max_total_tokens=4096", "engine.max_model_len=4096", f"engine.max_num_seqs={args.max_num_seqs}",
        f"engine.enforce_eager={'true' if args.engine_eager else 'auto'}",
        f"engine.gpu_memory_utilization={args.engine_mem_colocated if colocated else args.engine_mem_split}",
        f"replay.max_staleness={staleness}", f"replay.groups_per_step={args.groups_per_step}", "replay.capacity=256",
        "learner.lr=1e-6", "packing.max_tokens_per_microbatch=8192", f"colocate.engine_sleep={colocated}",
        "train.num_steps=100000", f"train.time_limit_s={args.seconds}", "train.checkpoint_interval=0",
        "eval.num_episodes=0", "cluster.num_cpus=14", *args.set,
    ]
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "gpu_1x.yaml", overrides)
    trainer = Trainer(cfg, progress=False)
    trainer.save_checkpoint = lambda: None  # a benchmark keeps no checkpoint (3 GB at this size)
    try:
        trainer.start()
        rows: list[dict[str, Any]] = []
        logged: list[float] = []  # when each step's metrics arrived
        logger = type("L", (), {"log": lambda self, step, m: (rows.append(dict(m)), logged.append(time.perf_counter())),
                                "close": lambda self: None})()
        runs = [r.run.remote() for r in trainer.rollouts]
        t0 = time.perf_counter()
        with GpuBusy() as busy:
            trainer._loop(logger)
        wall = time.perf_counter() - t0
        for r in trainer.rollouts:
            r.stop.remote()
        del runs
    finally:
        trainer.shutdown()
        ray.shutdown()
    steps = rows[1:] or rows  # the first step includes the pipeline's fill-up
    span = sum(r["timing/step"] for r in steps) or 1e-9
    trajs = sum(r.get("rollout/trajectories", 0.0) for r in steps)
    sampled = sum(r.get("rollout/tokens_per_s", 0.0) * r["timing/step"] for r in steps)
    return {
        "placement": placement, "max_staleness": staleness, "steps": len(rows), "wall_s": wall,
        "trajectories_per_s": trajs / span, "rollout_tokens_per_s": sampled / span,
        "learner_tokens_per_s": sum(r.get("train/num_tokens", 0.0) for r in steps) / span,
        "refit_s_mean": statistics.fmean(r.get("timing/refit", 0.0) for r in steps),
        "split": {k: sum(r.get(f"timing/{k}", 0.0) for r in steps) / span
                  for k in ("waiting", "engine_sleep", "learner_step", "refit", "refit_wait")},
        "gpu_busy": busy.fraction(logged[0] if len(logged) > 1 else 0.0),  # after the first step's fill-up
        "gpu_busy_all": busy.fraction(),
        "learner_memory_gib": {k: max((r.get(f"memory/learner_{k}_gib", 0.0) for r in rows), default=0.0)
                               for k in ("allocated", "reserved", "peak")},
        "reward_mean": statistics.fmean(r.get("rollout/reward", 0.0) for r in steps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_e2e.json")
    p.add_argument("--workdir", default="/tmp/gpu_e2e")
    p.add_argument("--seconds", type=float, default=90.0, help="timed training per run")
    p.add_argument("--placements", default="colocated,split")
    p.add_argument("--staleness", type=int, default=2, help="max_staleness of the async runs")
    p.add_argument("--modes", default="sync,async", help="which of sync (max_staleness 0) and async to run")
    p.add_argument("--tool-latency", type=float, default=0.5)
    p.add_argument("--obs-words", type=int, default=150)
    p.add_argument("--turns", type=int, default=3, help="tool calls per episode")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--concurrent-groups", type=int, default=32, help="per rollout actor (there are 2)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the engine's batch")
    p.add_argument("--engine-eager", action="store_true", help="vLLM without CUDA graphs (default: graphs, as on any GPU)")
    p.add_argument("--engine-mem-colocated", type=float, default=0.3)
    p.add_argument("--engine-mem-split", type=float, default=0.2,
                   help="0.25 left the engine short of memory for a refit beside the 1.5B learner's step on an H100")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every run")
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # as agentrl.driver.pipeline does: no warning at ray.init
    model = make_model(Path(args.workdir) / "qwen2.5-1.5b-shape")
    results: list[dict[str, Any]] = []
    for placement in args.placements.split(","):
        for staleness in [{"sync": 0, "async": args.staleness}[m] for m in args.modes.split(",")]:
            res = run_one(model, args, placement=placement, staleness=staleness)
            results.append(res)
            print(json.dumps(res), flush=True)
            Path(args.out).write_text(json.dumps({"runs": results}, indent=2))
    print(f"\n{'placement':10s} {'stale':>5s} {'traj/s':>7s} {'roll tok/s':>10s} {'learn tok/s':>11s} "
          f"{'refit s':>7s} {'wait':>5s} {'sleep':>5s} {'train':>5s} {'refit':>5s} {'GPU busy':>8s}")
    for r in results:
        s = r["split"]
        print(f"{r['placement']:10s} {r['max_staleness']:5d} {r['trajectories_per_s']:7.2f} {r['rollout_tokens_per_s']:10.0f} "
              f"{r['learner_tokens_per_s']:11.0f} {r['refit_s_mean']:7.2f} {s['waiting']:5.2f} {s['engine_sleep']:5.2f} "
              f"{s['learner_step']:5.2f} {s['refit']:5.2f} {r['gpu_busy']:8.2f}")
    ratios = {}
    for placement in args.placements.split(","):
        sync = next((r for r in results if r["placement"] == placement and r["max_staleness"] == 0), None)
        asyn = next((r for r in results if r["placement"] == placement and r["max_staleness"] > 0), None)
        if sync is None or asyn is None:
            continue
        ratios[placement] = asyn["trajectories_per_s"] / max(sync["trajectories_per_s"], 1e-9)
        print(f"async/sync trajectories/s ({placement}): {ratios[placement]:.2f}x")
    Path(args.out).write_text(json.dumps({"runs": results, "async_over_sync": ratios, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
