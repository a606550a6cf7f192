"""Chaos suite: faults injected into a real run (tiny model, vLLM engine, Ray actors, CPU).

One run takes every fault that it can survive, one after another: an engine frozen with SIGSTOP
(the watchdog finds it unresponsive, dumps its stacks with py-spy, kills it; Ray restarts it), a
rollout actor killed with SIGKILL (replaced; its groups in flight are counted as abandoned), the
weights object of a refit dropped (exported again), a tool that hangs forever and an env that
raises in ``reset`` (episodes fail, counted), a put past the replay queue's capacity (refused,
nothing lost). The run must finish its steps, and every admitted group must be accounted for,
none trained twice. A second run has its learner killed mid-step: it stops with a message naming
the cause, and ``--resume`` continues from its last checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from agentrl.config import load_config
from tests.test_pipeline_e2e import _agentrl, e2e_overrides, read_rows, start_ray

pytestmark = pytest.mark.slow

CHAOS_ENV = "tests.e2e_envs:Chaos-v0"
MAX_STEPS = 30  # a step takes ~0.5 s on a quiet machine: faults land while work is left; the run
# is cut to two steps past the last fault once they are all in


def _steps(run_dir) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    return max((r.get("step", 0) for r in read_rows(run_dir) if "train/loss" in r), default=0)


def _wait_for(cond, timeout: float, what: str, poll_s: float = 0.2) -> float:
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"chaos: {what} did not happen within {timeout:.0f}s")
        time.sleep(poll_s)
    return time.perf_counter() - t0


@pytest.fixture(scope="module")
def chaos(tiny_model_dir, tmp_path_factory):
    import ray

    from agentrl.driver.trainer import Trainer
    from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

    run_dir = tmp_path_factory.mktemp("chaos") / "run"
    cfg = load_config(None, e2e_overrides(
        tiny_model_dir, run_dir, f"env.id={CHAOS_ENV}", "env.kwargs={raise_reset_every: 5, hang_prob: 0.02}",
        "env.step_timeout_s=3", f"train.num_steps={MAX_STEPS}", "train.checkpoint_interval=4",
        "watchdog.floor_s=20", "watchdog.first_s=300", "watchdog.ping_timeout_s=5", "watchdog.min_samples=2"))
    start_ray()
    trainer = Trainer(cfg, progress=False)
    out: dict = {"cfg": cfg, "run_dir": run_dir, "trained": [], "errors": []}

    # -- instrumentation: which groups each step trained on; a refit whose weights object is dropped
    drop = threading.Event()

    def instrument() -> None:  # once start() has built the supervisor and the weights service
        learner_step, load_engines = trainer.supervisor.learner_step, trainer.weights.load_engines

        def record(ref, groups, **kw):
            metrics = learner_step(ref, groups, **kw)
            out["trained"].append([g.group_id for g in groups])
            return metrics

        def dropping(payload, version):
            if drop.is_set():  # the weights' object is lost: its owner dies before the engines read it
                from tests.watchdog_actors import Holder

                drop.clear()
                holder = Holder.remote()
                [payload] = ray.get(holder.hold.remote(payload))
                ray.kill(holder)
                time.sleep(1.0)
                out["dropped_version"] = version
            return load_engines(payload, version)

        trainer.supervisor.learner_step, trainer.weights.load_engines = record, dropping

    def inject():
        try:
            wd = trainer.watchdog
            _wait_for(lambda: _steps(run_dir) >= 3, 600, "step 3")
            pid = wd.pids["engine0"]
            os.kill(pid, signal.SIGSTOP)
            out["engine_stopped"] = (pid, time.perf_counter(), _steps(run_dir))
            out["engine_detect_s"] = _wait_for(lambda: trainer.supervisor.engine_restarts >= 1, 300, "the frozen engine's restart")
            out["engine_recover_s"] = _wait_for(lambda: _steps(run_dir) > out["engine_stopped"][2], 600,
                                                "a step after the engine's restart") + out["engine_detect_s"]
            at = _steps(run_dir)
            _wait_for(lambda: _steps(run_dir) >= at + 1, 600, "one more step")
            pid = wd.pids["rollout0"]
            os.kill(pid, signal.SIGKILL)
            out["rollout_killed"] = (pid, _steps(run_dir))
            out["rollout_detect_s"] = _wait_for(lambda: trainer.supervisor.rollout_restarts >= 1, 300, "the rollout's replacement")
            at = _steps(run_dir)
            drop.set()
            _wait_for(lambda: trainer.weights.refit_retries >= 1, 300, "the refit's retry")
            out["refit_retry_step"] = at
            # a put past capacity (no admission ticket): refused, the queue unchanged
            before = ray.get(trainer.replay.metrics.remote())
            bogus = TrajectoryGroup("bogus#0", [Trajectory([1, 2], [0, 1], [0.0, -1.0], [-1, 0], turn_rewards=[1.0])],
                                    group_id=-999)
            try:
                ray.get(trainer.replay.put.remote(bogus, 10**6))
                out["overfill"] = "accepted"
            except Exception as exc:  # noqa: BLE001
                out["overfill"] = str(exc)
            out["overfill_counts"] = (before, ray.get(trainer.replay.metrics.remote()))
            trainer.cfg.train.num_steps = min(MAX_STEPS, trainer.step + 2)  # every fault is in: finish soon
        except Exception as exc:  # noqa: BLE001 (reported by the tests)
            out["errors"].append(repr(exc))
        finally:
            drop.clear()

    try:
        trainer.start()
        instrument()
        t0 = time.perf_counter()
        thread = threading.Thread(target=inject, daemon=True)
        thread.start()
        out["summary"] = trainer.run()
        out["run_s"] = time.perf_counter() - t0
        thread.join(timeout=30)
        out["counts"] = ray.get(trainer.replay.metrics.remote(), timeout=120)
        out["engine_version"] = ray.get(trainer.engines[0].version.remote(), timeout=120)
        out["version"] = trainer.version
        out["rollout_stats"] = ray.get([r.stats.remote() for r in trainer.rollouts], timeout=120)
        out["faults"] = trainer.supervisor.fault_metrics()
        out["pids"] = {"engine0": ray.get(trainer.engines[0].pid.remote(), timeout=120),
                       "rollout0": ray.get(trainer.rollouts[0].ping.remote(), timeout=120)["pid"]}
        out["num_steps"] = trainer.cfg.train.num_steps
    finally:
        trainer.shutdown()
        ray.shutdown()
    out["rows"] = [r for r in read_rows(run_dir) if "train/loss" in r]
    out["reports"] = sorted((Path(run_dir) / "watchdog").glob("watchdog-*.txt"))
    print(json.dumps({k: v for k, v in out.items() if k in (
        "run_s", "engine_detect_s", "engine_recover_s", "rollout_detect_s", "faults", "errors", "counts")},
        indent=1, default=str))
    return out


def test_chaos_run_completes_its_steps(chaos):
    assert not chaos["errors"], chaos["errors"]
    n = chaos["num_steps"]
    assert [r["step"] for r in chaos["rows"]] == list(range(1, n + 1))
    assert chaos["version"] == chaos["engine_version"] == n


def test_frozen_engine_is_diagnosed_and_restarted(chaos):
    pid = chaos["engine_stopped"][0]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert chaos["pids"]["engine0"] != pid, "the engine was not restarted"
    text = "\n".join(p.read_text() for p in chaos["reports"])
    assert "engine0" in text and "unresponsive" in text and "killed; Ray restarts it" in text
    # its stacks read from outside the frozen process (py-spy), the other actors' states listed
    assert f"stacks of engine0 (pid {pid})" in text and "Thread" in text
    assert all(f"{name} " in text for name in ("replay", "learner0", "rollout0", "rollout1"))
    assert chaos["engine_detect_s"] < 180  # deadline (floor 20 s, 5x recent waits) + ping + dumps, on a loaded machine


def test_killed_rollout_actor_is_replaced_and_its_groups_counted(chaos):
    assert chaos["faults"]["faults/rollout_restarts"] >= 1
    assert chaos["pids"]["rollout0"] != chaos["rollout_killed"][0]
    assert chaos["rollout_detect_s"] < 30  # noticed by its run() call's end, not by a deadline
    assert chaos["counts"]["replay/abandoned"] <= chaos["counts"]["replay/released"]


def test_dropped_refit_object_is_exported_again(chaos):
    assert chaos["faults"]["faults/refit_retries"] == 1
    assert chaos["engine_version"] == chaos["num_steps"]  # later refits went on


def test_hanging_tool_and_raising_reset_fail_episodes_not_the_run(chaos):
    failed = sum(s["rollout/failed_groups"] for s in chaos["rollout_stats"])
    frac = max(r.get("rollout/failed_frac", 0.0) for r in chaos["rows"])
    assert failed >= 1, "no group failed: reset never raised"  # every 5th seed's reset raises
    assert frac > 0 or failed >= 1


def test_put_past_capacity_is_refused_and_loses_nothing(chaos):
    assert "without a matching admit" in chaos["overfill"]
    before, after = chaos["overfill_counts"]
    assert after["replay/size"] <= chaos["cfg"].replay.capacity
    for r in chaos["rows"]:
        assert r["replay/size"] + r["replay/in_flight"] <= chaos["cfg"].replay.capacity


def test_every_group_is_accounted_for_and_none_trained_twice(chaos):
    c = chaos["counts"]
    assert c["replay/admitted"] == (c["replay/consumed"] + c["replay/dropped_stale"] + c["replay/released"]
                                    + c["replay/size"] + c["replay/in_flight"])
    ids = [g for step in chaos["trained"] for g in step]
    assert len(ids) == chaos["num_steps"] * chaos["cfg"].replay.groups_per_step == c["replay/consumed"]
    assert len(set(ids)) == len(ids), "a group was trained twice"


def _children(proc: psutil.Process, name: str) -> list[psutil.Process]:
    out = []
    for p in proc.children(recursive=True):
        try:
            if name in " ".join(p.cmdline()[:1]) or p.name().startswith(name):
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.full  # resume: test_resume_continues_a_run_from_its_last_checkpoint
def test_learner_killed_mid_step_stops_with_its_cause_and_resume_continues(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    steps = 8  # the kill lands at step 3 or 4, past the step-2 checkpoint (0.5 s a step on a quiet machine)
    overrides = e2e_overrides(tiny_model_dir, run_dir, f"train.num_steps={steps}", "train.checkpoint_interval=2",
                              "--no-progress")
    log = tmp_path / "first.log"
    proc = _agentrl("train", *_config(tmp_path), *overrides, log=log)
    try:
        _wait_for(lambda: _steps(run_dir) >= 3 or proc.poll() is not None, 600, "step 3", poll_s=0.05)
        assert proc.poll() is None, log.read_text()[-3000:]
        [learner] = _children(psutil.Process(proc.pid), "ray::LearnerActor")
        learner.kill()
        t_kill = time.perf_counter()
        rc = proc.wait(timeout=300)
        stop_s = time.perf_counter() - t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 3, text[-3000:]
    # mid-step, or between steps (its refit export, its checkpoint save): the cause is named either way
    assert "the learner died" in text and "--resume" in text, text[-3000:]
    assert stop_s < 120
    done = _steps(run_dir)
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    k = int(latest.split("_")[1])
    assert k <= done < steps
    n_first = len([r for r in read_rows(run_dir) if "train/loss" in r])
    proc = _agentrl("train", *_config(tmp_path), *overrides, "--resume", log=tmp_path / "second.log")
    assert proc.wait(timeout=900) == 0, (tmp_path / "second.log").read_text()[-3000:]
    rows = [r for r in read_rows(run_dir) if "train/loss" in r]
    assert [r["step"] for r in rows[n_first:]] == list(range(k + 1, steps + 1))  # continued from the checkpoint


def _config(tmp_path) -> list[str]:
    cfg = tmp_path / "chaos.yaml"
    cfg.write_text("")
    return [str(cfg)]


@pytest.mark.full  # engine death: the chaos run's frozen engine
def test_engine_killed_without_staged_weights_gets_the_current_ones(tiny_model_dir, tmp_path):
    """The GPU chaos run's second fault on CPU: the engine SIGKILLed while the driver
    waits for a batch, restarted by Ray with nothing staged for it (as under CUDA IPC or NCCL,
    which stage no weights), so it comes up with its start weights. Strictly on-policy
    (``max_staleness=0``): only groups it samples can make the next batch. The driver must load
    the current weights into it and the run must finish its steps; before the fix every group it
    made was dropped as stale and the run waited forever, the watchdog silent (the stale drops
    counted as progress)."""
    import ray

    from agentrl.driver.trainer import Trainer

    run_dir = tmp_path / "run"
    steps = 5
    cfg = load_config(None, e2e_overrides(
        tiny_model_dir, run_dir, f"train.num_steps={steps}", "replay.max_staleness=0", "watchdog.floor_s=20",
        "watchdog.first_s=300", "watchdog.ping_timeout_s=5", "watchdog.min_samples=2"))
    start_ray()
    trainer = Trainer(cfg, progress=False)
    out: dict = {}
    def killing(payload, version):
        load_engines(payload, version)
        if version == 2:  # the engines serve version 2 now; take it from them as a GPU transport would
            ray.get(trainer.actors.weight_store.stage_weights.remote(version, []))
            pid = ray.get(trainer.engines[0].pid.remote())
            os.kill(pid, signal.SIGKILL)
            out["killed"] = (pid, time.perf_counter())

    def run():
        try:
            out["summary"] = trainer.run()
        except Exception as exc:  # noqa: BLE001 (asserted on below)
            out["error"] = f"{type(exc).__name__}: {exc}"

    runner = threading.Thread(target=run, daemon=True)
    try:
        trainer.start()
        load_engines, trainer.weights.load_engines = trainer.weights.load_engines, killing
        runner.start()
        runner.join(timeout=900)  # the engine's restart is a vLLM start (a minute, several on a loaded machine)
        assert not runner.is_alive(), (f"no step since the kill: steps done {_steps(run_dir)}, "
                                       f"faults {trainer.supervisor.fault_metrics()}, last report:\n{trainer.watchdog.last_report}")
        faults = trainer.supervisor.fault_metrics()
        pid = ray.get(trainer.engines[0].pid.remote(), timeout=120)
        engine_version = ray.get(trainer.engines[0].version.remote(), timeout=120)
    finally:
        if not runner.is_alive():
            trainer.shutdown()
        ray.shutdown()
    assert "error" not in out, out["error"][-4000:]
    rows = [r for r in read_rows(run_dir) if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert "killed" in out and pid != out["killed"][0]  # restarted, in a new process
    assert faults["faults/engine_catch_ups"] == 1  # the restarted engine only (a ping read late is no restart)
    assert engine_version == trainer.version == steps
    # trained on fresh groups only: the restarted engine's stale ones were dropped, never consumed
    assert all(r["replay/staleness_max"] == 0 for r in rows)
