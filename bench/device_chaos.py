"""Faults on the GPU loop: a refit that times out (the engine freezes while it loads the new
weights), then the engine killed and restarted under colocation with sleep mode; each must be
recovered, or the run must stop with a diagnosis, within bounded time.

One run of ``configs/gpu_1x.yaml`` (tiny Qwen2, vLLM engine sleeping while the Megatron learner
steps on the same GPU, CUDA-IPC refits), SFT off, a tight watchdog floor. After step 3 the engine
is SIGSTOPped just as a refit starts loading weights (the refit's wait passes its deadline; the
watchdog must find the engine unresponsive, dump its stacks, kill it, and the run must go on). Two
steps after the run moves again, the (restarted) engine process is SIGKILLed while the driver waits
for a batch: Ray restarts it, and since CUDA-IPC refits stage no weights it comes up with its start
weights; the driver must load the current ones into it (``faults/engine_catch_ups``) or the run
must stop naming the cause. Writes per fault: seconds to detect and to the next steps, GPU memory
used (NVML), the run's fault counters, every watchdog report, leftover vLLM processes; then
whether the run finished its steps.

The JSON is written after each phase and on SIGTERM, and every wait is bounded by ``--budget-s``
(default 440 s, under the 540 s of ``bench/device_chaos.sh``): a run that hangs still ends with a
JSON that says where (``hung``: the driver's stacks, the last watchdog report).

``--cpu`` runs the same faults in the same order on CPU (quickstart model, no colocation,
object-store refits, strictly on-policy so that groups queued before the kill cannot make the next
batch). An object-store refit is staged in the replay actor, where a restarted engine finds it; to
mirror the GPU transports the staged weights are dropped before the kill (``--keep-staged`` keeps
them).

    python bench/device_chaos.py --out $OUT/device_chaos.json          # bash bench/device_chaos.sh
    python bench/device_chaos.py --cpu --out /tmp/chaos.json           # the same logic on CPU

``--core-freeze`` adds a third fault once the second is recovered: the engine's vLLM core process
(the child of the engine actor that samples) is SIGSTOPped while its actor keeps answering; the
watchdog must find it by its sampled tokens standing still (``faults.core_freeze.detected_s``,
against ``stall_threshold_s``), kill the core and the actor, and the run must go on
(``CHAOS_ARGS=--core-freeze bash bench/device_chaos.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
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
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return max((r["step"] for r in rows if "train/loss" in r), default=0)


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


def driver_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f'Thread "{names.get(ident, ident)}":\n' + "".join(traceback.format_stack(frame)[-12:])
                     for ident, frame in sys._current_frames().items() if ident != threading.get_ident())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=440.0,
                    help="every wait ends by then; a run still going is reported as hung (its stacks in the JSON)")
    ap.add_argument("--cpu", action="store_true", help="check the logic on CPU (quickstart model, no colocation)")
    ap.add_argument("--core-freeze", action="store_true",
                    help="a third fault: SIGSTOP the engine's vLLM core process (its actor still answers) while "
                         "the driver waits for a batch; the watchdog must find it by its progress and restart it")
    ap.add_argument("--keep-staged", action="store_true",
                    help="--cpu: leave the staged weights in place for the restarted engine (GPU transports stage none)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    t_begin = time.perf_counter()
    end = t_begin + args.budget_s
    out_path = Path(args.out)
    result: dict[str, Any] = {"config": "quickstart (CPU)" if args.cpu else "gpu_1x (colocated, engine sleep)",
                              "steps": args.steps, "budget_s": args.budget_s, "phase": "starting", "faults": {},
                              "errors": [], "watchdog_reports": [], "log": []}
    write_lock = threading.Lock()

    def note(msg: str) -> None:
        line = f"{time.perf_counter() - t_begin:7.1f}s {msg}"
        result["log"].append(line)
        print(f"device_chaos: {line}", file=sys.stderr, flush=True)

    def write() -> None:
        with write_lock:
            result["wall_s"] = time.perf_counter() - t_begin
            tmp = out_path.with_name(out_path.name + ".tmp")
            tmp.write_text(json.dumps(result, indent=1, default=str))
            tmp.replace(out_path)

    def on_term(signum, frame) -> None:  # the call's timeout: say how far it got, then go
        result["sigterm"] = {"phase": result["phase"], "at_s": time.perf_counter() - t_begin,
                             "driver_stacks": driver_stacks()}
        note(f"SIGTERM in phase: {result['phase']}")
        write()
        import ray

        closer = threading.Thread(target=ray.shutdown, daemon=True)  # no vLLM process left on the GPU
        closer.start()
        closer.join(timeout=20)
        os._exit(124)

    signal.signal(signal.SIGTERM, on_term)

    def wait_for(cond, what: str, limit: float = 600.0) -> float | None:
        """Seconds until ``cond()``, or None (noted) past ``limit`` or the budget."""
        t0 = time.perf_counter()
        stop = min(t0 + limit, end)
        while not cond():
            if time.perf_counter() > stop:
                note(f"gave up waiting for {what} after {time.perf_counter() - t0:.0f}s")
                return None
            time.sleep(0.2)
        return time.perf_counter() - t0

    import ray

    from agentrl.config import load_config
    from agentrl.driver.trainer import Trainer

    run_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"device_chaos_{os.getpid()}"
    result["run_dir"] = str(run_dir)
    common = [f"run_dir={run_dir}", "sft.enabled=false", f"train.num_steps={args.steps}", "train.checkpoint_interval=0",
              "eval.num_episodes=0", "watchdog.floor_s=20", "watchdog.first_s=600", "watchdog.ping_timeout_s=5",
              "watchdog.min_samples=2"]
    if args.cpu:
        # strictly on-policy: no group queued before the kill can make the next batch, only ones the
        # restarted engine samples (on the GPU run none queued sufficed either: no step came after it)
        cfg = load_config(str(REPO / "configs" / "quickstart.yaml"), [
            *common, "rollout.group_size=4", "replay.groups_per_step=2", "replay.capacity=8", "replay.max_staleness=0",
            *args.overrides])
    else:
        cfg = load_config(str(REPO / "configs" / "gpu_1x.yaml"), [*common, *args.overrides])
    trainer = Trainer(cfg, progress=False)
    write()

    # The refit fault: SIGSTOP the engine just before it loads the new weights.
    freeze = threading.Event()

    def freezing(payload, version):
        if freeze.is_set():
            freeze.clear()
            pid = trainer.watchdog.pids["engine0"]
            os.kill(pid, signal.SIGSTOP)
            result["faults"]["refit_timeout"].update(engine_pid=pid, t_stop=time.perf_counter(), version=version)
            note(f"SIGSTOP engine0 (pid {pid}) as the refit to version {version} loads")
        return load_engines(payload, version)

    def freeze_core() -> None:
        """The engine's vLLM core (the actor's child process that samples) frozen while the actor
        answers its pings: found by its tokens standing still, killed with its actor, restarted."""
        at, restarts = steps_done(run_dir), trainer.supervisor.engine_restarts
        engine_pid = ray.get(trainer.engines[0].pid.remote(), timeout=120)
        cores = [p for p in psutil.Process(engine_pid).children(recursive=True) if "EngineCore" in " ".join(p.cmdline())]
        f = result["faults"]["core_freeze"] = {"at_step": at, "engine_pid": engine_pid, "core_pids": [p.pid for p in cores]}
        if not cores:
            result["errors"].append(f"core_freeze: no EngineCore child of engine0 (pid {engine_pid})")
            return
        for p in cores:
            p.send_signal(signal.SIGSTOP)
        t0 = time.perf_counter()
        note(f"SIGSTOP engine0's core {f['core_pids']} (its actor, pid {engine_pid}, still answers) after step {at}")
        result["phase"] = "fault 3 (core freeze): waiting for the stall's restart"
        write()
        got = wait_for(lambda: trainer.supervisor.engine_restarts > restarts, "the stalled engine's restart")
        f["detected_s"] = got
        f["stall_threshold_s"] = trainer.watchdog.stall_after("batch")
        result["phase"] = "fault 3 (core freeze): waiting for two more steps"
        write()
        f["two_steps_s"] = wait_for(lambda: steps_done(run_dir) > at + 1, "two steps after the core freeze")
        f["recovered_s"] = None if f["two_steps_s"] is None else time.perf_counter() - t0
        f["cores_left"] = [p.pid for p in cores if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        f["fault_metrics"] = trainer.supervisor.fault_metrics()

    def inject() -> None:
        # The refit freeze first: it is found by a deadline, and no restart grace is running yet
        # (a restart's grace, twice the engines' start time, would hold the deadline back); the
        # kill then is found by the engine's restart.
        try:
            result["phase"] = "fault 1 (refit freeze): waiting for step 3"
            if wait_for(lambda: steps_done(run_dir) >= 3, "step 3", 900) is None:
                return
            f = result["faults"]["refit_timeout"] = {"at_step": steps_done(run_dir)}
            freeze.set()
            at = f["at_step"]
            result["phase"] = "fault 1 (refit freeze): waiting for the watchdog's kill"
            write()
            got = wait_for(lambda: trainer.supervisor.engine_restarts >= 1, "the frozen engine's kill")
            f["detected_s"] = None if got is None else time.perf_counter() - f.get("t_stop", time.perf_counter())
            result["phase"] = "fault 1 (refit freeze): waiting for two more steps"
            write()
            f["next_step_s"] = wait_for(lambda: steps_done(run_dir) > at + 1, "two steps after the freeze")
            f["gpu_used_after_gib"] = gpu_used_gib()
            f["fault_metrics"] = trainer.supervisor.fault_metrics()
            if f["next_step_s"] is None:
                return
            at = steps_done(run_dir)
            f = result["faults"]["engine_kill"] = {"at_step": at, "gpu_used_before_gib": gpu_used_gib()}
            pid = ray.get(trainer.engines[0].pid.remote(), timeout=120)  # the restarted engine's
            f["engine_pid"] = pid
            if args.cpu and not args.keep_staged:
                # as under CUDA IPC or NCCL: nothing staged for the restarted engine to load
                wait_for(lambda: not trainer.weights.refit_in_flight(), "the refit in flight", 120)
                ray.get(trainer.actors.weight_store.stage_weights.remote(trainer.weights.engines_version, []), timeout=60)
                f["staged_weights_dropped"] = True
            os.kill(pid, signal.SIGKILL)
            t0 = time.perf_counter()
            note(f"SIGKILL engine0 (pid {pid}) after step {at}")
            result["phase"] = "fault 2 (engine kill): waiting for the next step"
            write()
            f["next_step_s"] = wait_for(lambda: steps_done(run_dir) > at, "a step after the kill")
            f["catch_ups"] = trainer.weights.engine_catch_ups
            result["phase"] = "fault 2 (engine kill): waiting for two more steps"
            write()
            if f["next_step_s"] is not None:
                f["two_steps_s"] = wait_for(lambda: steps_done(run_dir) > at + 1, "two steps after the kill")
            new_pid = ray.get(trainer.engines[0].pid.remote(), timeout=60)
            f["restarted"] = new_pid != pid
            f["gpu_used_after_gib"] = gpu_used_gib()
            f["recovered_s"] = time.perf_counter() - t0 if f.get("two_steps_s") is not None else None
            f["fault_metrics"] = trainer.supervisor.fault_metrics()
            if args.core_freeze and f.get("two_steps_s") is not None:
                freeze_core()
            result["phase"] = "faults done: waiting for the run to end"
            write()
        except Exception:  # noqa: BLE001 (reported in the JSON)
            result["errors"].append(traceback.format_exc())
            write()

    def run() -> None:
        try:
            trainer.run()
            result["finished"] = True
        except Exception as exc:  # noqa: BLE001
            result["finished"] = False
            result["errors"].append(f"{type(exc).__name__}: {str(exc)[:6000]}")
        note(f"the run ended (finished={result['finished']})")

    code = 1
    try:
        trainer.start()
        load_engines, trainer.weights.load_engines = trainer.weights.load_engines, freezing  # start() built it
        signal.signal(signal.SIGTERM, on_term)  # again: ray.init installs its own
        result["start_s"] = time.perf_counter() - t_begin
        result["engine_start_s"] = trainer.engine_start_s  # a restart's grace is twice this
        result["gpu_used_started_gib"] = gpu_used_gib()
        shown = trainer.watchdog.out

        def keep(report: str) -> None:
            result["watchdog_reports"].append(f"at {time.perf_counter() - t_begin:.0f}s: {report[:6000]}")
            shown(report)
            write()

        trainer.watchdog.out = keep
        note("started; the run begins")
        write()
        injector = threading.Thread(target=inject, daemon=True, name="inject")
        injector.start()
        runner = threading.Thread(target=run, daemon=True, name="run")
        runner.start()
        runner.join(timeout=max(1.0, end - time.perf_counter()))
        injector.join(timeout=max(1.0, min(60.0, end + 30 - time.perf_counter())))
        result["steps_done"] = steps_done(run_dir)
        result["trainer_version"] = trainer.version
        result["engines_version"] = trainer.weights.engines_version
        result["fault_metrics"] = trainer.supervisor.fault_metrics()
        result["phase_at_end"] = result["phase"]
        if runner.is_alive():
            result["hung"] = {"phase": result["phase"], "driver_stacks": driver_stacks(),
                              "last_watchdog_report": trainer.watchdog.last_report[:6000]}
            result["finished"] = False
            note(f"the run is still going at the budget ({args.budget_s:.0f}s): reported as hung")
        else:
            try:
                result["engine_version"] = ray.get(trainer.engines[0].version.remote(), timeout=60)
            except Exception as exc:  # noqa: BLE001
                result["errors"].append(f"engine version: {type(exc).__name__}: {exc}")
        known = {p.pid for p in psutil.Process().children(recursive=True)}
        result["vllm_orphans"] = vllm_orphans(known | {os.getpid()})
        ok = (result.get("finished") and not result["errors"] and result.get("engine_version") == args.steps
              and "engine_kill" in result["faults"]
              and (not args.core_freeze or (result["faults"].get("core_freeze", {}).get("recovered_s") is not None
                                            and not result["faults"]["core_freeze"].get("cores_left"))))
        code = 0 if ok else 1
    except Exception:  # noqa: BLE001
        result["errors"].append(traceback.format_exc())
    finally:
        result["phase"] = "shutting down"
        write()
        closer = threading.Thread(target=lambda: (trainer.shutdown(), ray.shutdown()), daemon=True)
        closer.start()
        closer.join(timeout=45)
        result["phase"] = "done" if not closer.is_alive() else "done (shutdown still going after 45s)"
        write()
        print(json.dumps({k: v for k, v in result.items() if k not in ("hung",)}, indent=1, default=str))
    sys.stdout.flush()
    os._exit(code)  # not waiting on threads a hung run left behind


if __name__ == "__main__":
    main()
