"""Faults on the GPU loop: the engine killed and restarted under colocation with sleep mode, and a
refit that times out (the engine freezes while it loads the new weights); each must be recovered.

One run of ``configs/gpu_1x.yaml`` (tiny Qwen2, vLLM engine sleeping while the Megatron learner
steps on the same GPU, CUDA-IPC refits), SFT off, a tight watchdog floor. After step 3 the engine
process is SIGKILLed (Ray restarts it; it must come up beside the learner and go on sleeping and
waking); two steps after the run is moving again the engine is SIGSTOPped just as a refit starts
loading weights (the refit's wait passes its deadline; the watchdog must find the engine
unresponsive, dump its stacks, kill it, and the run must go on). Writes per fault: seconds to
detect and to the next step, GPU memory used before and after (NVML), the run's fault counters,
and leftover vLLM processes; then whether the run finished its steps.

    python bench/device_chaos.py --out $OUT/device_chaos.json          # bash bench/device_chaos.sh
    python bench/device_chaos.py --cpu --out /tmp/chaos.json           # the same logic on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]


def gpu_used_gib() -> float | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**30
    except Exception:  # noqa: BLE001 (no GPU: the CPU check of this script)
        return None


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return max((r["step"] for r in rows if "train/loss" in r), default=0)


def wait_for(cond, timeout: float) -> float | None:
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout:
            return None
        time.sleep(0.2)
    return time.perf_counter() - t0


def vllm_orphans(known: set[int]) -> list[str]:
    """vLLM engine-core processes not in the run's process tree (a killed engine's child left behind)."""
    out = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            text = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
        except psutil.Error:
            continue
        if "EngineCore" in text and p.info["pid"] not in known:
            out.append(f"{p.info['pid']} {text[:120]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cpu", action="store_true", help="check the logic on CPU (quickstart model, no colocation)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import ray

    from agentrl.config import load_config
    from agentrl.trainer import Trainer

    run_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"device_chaos_{os.getpid()}"
    common = [f"run_dir={run_dir}", "sft.enabled=false", f"train.num_steps={args.steps}", "train.checkpoint_interval=0",
              "eval.num_episodes=0", "watchdog.floor_s=20", "watchdog.first_s=600", "watchdog.ping_timeout_s=5",
              "watchdog.min_samples=2"]
    if args.cpu:
        cfg = load_config(str(REPO / "configs" / "quickstart.yaml"), [
            *common, "rollout.group_size=4", "replay.groups_per_step=2", "replay.capacity=8", *args.overrides])
    else:
        cfg = load_config(str(REPO / "configs" / "gpu_1x.yaml"), [*common, *args.overrides])
    result: dict[str, Any] = {"config": "quickstart (CPU)" if args.cpu else "gpu_1x (colocated, engine sleep)",
                              "steps": args.steps, "faults": {}, "errors": []}
    trainer = Trainer(cfg, progress=False)

    # The refit fault: SIGSTOP the engine just before it loads the new weights.
    load_engines = trainer._load_engines
    freeze = threading.Event()

    def freezing(payload, version):
        if freeze.is_set():
            freeze.clear()
            pid = trainer.watchdog.pids["engine0"]
            os.kill(pid, signal.SIGSTOP)
            result["faults"]["refit_timeout"]["engine_pid"] = pid
            result["faults"]["refit_timeout"]["t_stop"] = time.perf_counter()
        return load_engines(payload, version)

    trainer._load_engines = freezing

    def inject() -> None:
        # The refit freeze first: it is found by a deadline, and no restart grace is running yet
        # (a restart's grace, twice the engines' start time, would hold the deadline back); the
        # kill then needs no deadline (Ray restarts the engine; the calls on it fail and are
        # asked again), so the grace of the first restart costs nothing.
        try:
            if wait_for(lambda: steps_done(run_dir) >= 3, 900) is None:
                raise TimeoutError("step 3 never came")
            f = result["faults"]["refit_timeout"] = {"at_step": steps_done(run_dir)}
            freeze.set()
            at = f["at_step"]
            got = wait_for(lambda: trainer.num_engine_restarts >= 1, 600)
            f["detected_s"] = None if got is None else time.perf_counter() - f.get("t_stop", time.perf_counter())
            f["next_step_s"] = wait_for(lambda: steps_done(run_dir) > at + 1, 600)
            f["gpu_used_after_gib"] = gpu_used_gib()
            f["watchdog_report"] = trainer.watchdog.last_report[:4000]
            at = steps_done(run_dir)
            f = result["faults"]["engine_kill"] = {"at_step": at, "gpu_used_before_gib": gpu_used_gib()}
            pid = ray.get(trainer.engines[0].pid.remote(), timeout=120)  # the restarted engine's
            f["engine_pid"] = pid
            os.kill(pid, signal.SIGKILL)
            t0 = time.perf_counter()
            f["next_step_s"] = wait_for(lambda: steps_done(run_dir) > at, 600)
            f["two_steps_s"] = wait_for(lambda: steps_done(run_dir) > at + 1, 600)
            f["restarted"] = ray.get(trainer.engines[0].pid.remote(), timeout=120) != pid
            f["gpu_used_after_gib"] = gpu_used_gib()
            f["recovered_s"] = time.perf_counter() - t0
        except Exception:  # noqa: BLE001 (reported in the JSON)
            result["errors"].append(traceback.format_exc())

    t0 = time.perf_counter()
    try:
        trainer.start()
        result["start_s"] = time.perf_counter() - t0
        result["engine_start_s"] = trainer.engine_start_s  # a restart's grace is twice this
        result["gpu_used_started_gib"] = gpu_used_gib()
        thread = threading.Thread(target=inject, daemon=True)
        thread.start()
        try:
            trainer.run()
            result["finished"] = True
        except Exception as exc:  # noqa: BLE001
            result["finished"] = False
            result["errors"].append(f"{type(exc).__name__}: {str(exc)[:4000]}")
        thread.join(timeout=60)
        result["steps_done"] = steps_done(run_dir)
        result["engine_version"] = ray.get(trainer.engines[0].version.remote(), timeout=120)
        result["trainer_version"] = trainer.version
        result["fault_metrics"] = trainer._fault_metrics()
        known = {p.pid for p in psutil.Process().children(recursive=True)}
        result["vllm_orphans"] = vllm_orphans(known | {os.getpid()})
    finally:
        result["wall_s"] = time.perf_counter() - t0
        trainer.shutdown()
        ray.shutdown()
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps(result, indent=1, default=str))
    ok = result.get("finished") and not result["errors"] and result["engine_version"] == args.steps
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
