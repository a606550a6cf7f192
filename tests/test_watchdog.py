"""The watchdog: deadlines from a run's own timings, the diagnosis (pings from a thread of their
own, stacks of a frozen process read from outside) and no false alarm on a healthy slow run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.config import ConfigError, WatchdogConfig, load_config
from agentrl.driver.watchdog import ActorReport, Deadlines, format_report, py_spy_dump, thread_stacks


@given(st.lists(st.floats(0.0, 1e4), max_size=80), st.floats(0.1, 100), st.floats(1, 20))
@settings(max_examples=200, deadline=None)
def test_a_deadline_is_never_below_its_floor_nor_below_factor_times_a_recent_duration(xs, floor, factor):
    cfg = WatchdogConfig(floor_s=floor, first_s=floor * 3, factor=factor, quantile=1.0, window=50, min_samples=3)
    d = Deadlines(cfg)
    for x in xs:
        d.record("batch", x)
    recent = xs[-50:]
    deadline = d.deadline("batch")
    assert deadline >= floor
    if len(recent) >= 3:
        assert deadline == pytest.approx(max(floor, factor * max(recent)))
    else:
        assert deadline == floor * 3


def test_fixed_deadlines_override_and_unknown_kinds_are_refused():
    d = Deadlines(WatchdogConfig(deadlines={"learner_step": 7200}))
    for _ in range(10):
        d.record("learner_step", 1.0)
    assert d.deadline("learner_step") == 7200 and d.deadline("batch") == 900
    with pytest.raises(ConfigError, match="watchdog.deadlines"):
        load_config(None, ["watchdog.deadlines={learner: 3}"])


def test_the_report_names_the_wait_the_states_and_the_stacks():
    reports = [ActorReport("engine0", "unresponsive", 123, stacks="Thread 1 (idle)\n  f (a.py:1)\n" * 50,
                           action="killed"),
               ActorReport("learner0", "busy", 7, status={"call": "train_step", "for_s": 3.2})]
    text = format_report("a batch of 2 groups", 61.0, 40.0, reports, history="recent batch q0.9 = 8.0s")
    assert "no progress waiting for a batch of 2 groups for 61s (deadline 40s; recent batch q0.9 = 8.0s)" in text
    assert "engine0" in text and "unresponsive" in text and "-> killed" in text
    assert "call=train_step" in text and "stacks of engine0 (pid 123)" in text and "more lines" in text


def test_thread_stacks_show_every_other_thread():
    import threading

    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="waiter", daemon=True)
    t.start()
    try:
        text = thread_stacks()
    finally:
        stop.set()
    assert '"waiter"' in text and "wait" in text and '"MainThread"' not in text.split("Thread")[0]


def test_py_spy_reads_a_frozen_process_from_outside():
    proc = subprocess.Popen([sys.executable, "-c", "import time\ndef parked():\n    time.sleep(60)\nparked()"])
    try:
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGSTOP)
        dump = py_spy_dump(proc.pid)
        if dump is None:
            pytest.fail("py-spy could not read the process (ray[default] installs it; ptrace must be allowed)")
        assert "parked" in dump
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


# -- against real Ray actors -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_diagnosis_tells_busy_idle_frozen_and_dead_apart(ray_local, tmp_path):
    ray = ray_local
    from tests.watchdog_actors import BlockingLoop, Worker

    from agentrl.actors.watchdog import Watchdog

    actors = {"loop": BlockingLoop.remote(), "worker": Worker.remote(), "frozen": BlockingLoop.remote(),
              "dead": Worker.remote()}
    ray.get([a.ping.remote() for a in actors.values()])
    wd = Watchdog(WatchdogConfig(ping_timeout_s=3), lambda: actors, tmp_path)
    wd.learn_pids()
    actors["loop"].hog.remote(30)  # blocks its event loop: the ping answers from its own thread
    actors["worker"].work.remote(30)
    ray.kill(actors["dead"])
    time.sleep(1.0)
    os.kill(wd.pids["frozen"], signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        reports = {r.name: r for r in wd.diagnose(focus=("worker",))}
        took = time.perf_counter() - t0
    finally:
        os.kill(wd.pids["frozen"], signal.SIGKILL)
    assert reports["loop"].state == "idle" and reports["worker"].state == "busy"
    assert reports["frozen"].state == "unresponsive" and reports["dead"].state == "dead"
    assert "Worker.work" in reports["worker"].stacks or "work" in reports["worker"].stacks
    assert "Thread" in reports["frozen"].stacks  # py-spy, from outside the stopped process
    assert took < 3 + 2 * 20


@pytest.mark.slow
def test_a_stall_recovers_or_stops_with_the_report(ray_local, tmp_path):
    ray = ray_local
    from tests.watchdog_actors import Worker

    from agentrl.actors.watchdog import Watchdog
    from agentrl.driver.watchdog import RunStalled

    w = Worker.remote()
    ray.get(w.ping.remote())
    cfg = WatchdogConfig(floor_s=1, first_s=1, ping_timeout_s=2, max_recoveries=10)
    wd = Watchdog(cfg, lambda: {"worker": w}, tmp_path, out=lambda msg: None)
    calls = []
    assert wd.get("learner_step", w.work.remote(2.5), what="work", recover=lambda r: calls.append(r) or True) == 2
    assert len(calls) >= 1 and wd.num_recoveries == len(calls)
    with pytest.raises(RunStalled, match="waiting for more work.*\n.*worker +busy"):
        wd.get("learner_step", w.work.remote(30), what="more work", focus=("worker",))
    assert sorted(p.name for p in tmp_path.glob("watchdog-*.txt"))
    # progress that keeps changing is slow, not stuck: no alarm
    fresh = Worker.remote()
    ray.get(fresh.ping.remote())
    n = iter(range(10**6))
    before = wd.num_alarms
    assert wd.get("batch", fresh.work.remote(3), what="x", progress=lambda: next(n)) == 2 and wd.num_alarms == before


@pytest.mark.slow
def test_a_long_evaluation_that_samples_is_not_a_stall(ray_local, tmp_path):
    """The held-out evaluation's wait reads the engines' sampled-token counts as progress: an
    evaluation far past its deadline on a slow machine raises no alarm while tokens keep coming;
    the same wait with an engine that samples nothing is diagnosed (and with no recovery, stops).
    Before, a slow evaluation counted a "recovery" per deadline and stopped a healthy run after
    watchdog.max_recoveries of them (a starved soak's eval: 600 s deadline, 1 of 3 used)."""
    ray = ray_local
    from tests.watchdog_actors import Sampler

    from agentrl.actors.watchdog import Watchdog
    from agentrl.driver.state import RunActors
    from agentrl.driver.supervision import Supervisor
    from agentrl.driver.watchdog import RunStalled

    class Driver(Supervisor):  # the supervisor of a run whose eval wait is watched
        def recover(self, reports):
            return False  # nothing to restart: an alarm stops the wait

    engine = Sampler.remote()
    ray.get(engine.ping.remote())
    cfg = WatchdogConfig(floor_s=1, first_s=1, ping_timeout_s=5, max_recoveries=0)
    actors = RunActors(engines=[engine],
                       watchdog=Watchdog(cfg, lambda: {"engine0": engine}, tmp_path, out=lambda msg: None))
    driver = Driver(load_config(None, ["watchdog.ping_timeout_s=5"]), actors, make_rollout=None, ckpt_dir=tmp_path,
                    overlap=False)
    assert driver.get("eval", engine.work.remote(5, 200), "the evaluation", progress=driver.sampling_progress) == 3
    assert driver.watchdog.num_alarms == 0
    with pytest.raises(RunStalled, match="the evaluation"):
        driver.get("eval", engine.work.remote(60, 0), "the evaluation", progress=driver.sampling_progress)
    assert driver.watchdog.num_alarms == 1


@pytest.mark.slow
@pytest.mark.full  # the watchdog in a run: the chaos run
def test_a_healthy_slow_run_raises_no_alarm(tiny_model_dir, tmp_path):
    """Slow tools (0.5-1.5 s a call), long trajectories (a slow learner step) and tight watchdog
    settings (floor 5 s, 4x the recent 0.9 quantile): deadlines follow the run, none fires."""
    import ray

    from agentrl.driver.trainer import Trainer
    from tests.test_pipeline_e2e import e2e_overrides, read_rows, start_ray

    run_dir = tmp_path / "run"
    cfg = load_config(None, e2e_overrides(
        tiny_model_dir, run_dir, "env.id=tests.e2e_envs:Chaos-v0", "env.kwargs={delay_s: 1.0}",
        "rollout.max_new_tokens=96", "rollout.max_turns=3", "train.num_steps=8",
        "watchdog.floor_s=5", "watchdog.factor=4", "watchdog.min_samples=2", "watchdog.first_s=300"))
    start_ray()
    trainer = Trainer(cfg, progress=False)
    try:
        trainer.run()
        wd = trainer.watchdog
        alarms, seen = wd.num_alarms, {k: list(v) for k, v in wd.deadlines.recent.items()}
    finally:
        trainer.shutdown()
        ray.shutdown()
    rows = [r for r in read_rows(run_dir) if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert alarms == 0, (wd.last_report, seen)
    assert not (run_dir / "watchdog").exists()
    # it was slow: steps took seconds, so the deadlines came from the run's timings, not the floor.
    # The slow part is the batch (1 s tool calls); the learner step itself takes ~0.01 s on a quiet
    # machine and is not asserted on.
    assert max(seen["batch"]) > 0.5 and max(r["timing/step"] for r in rows) > 2, seen


def test_only_warm_up_kinds_drop_their_first_wait(tmp_path):
    """The first batch (vLLM's first requests) is a warm-up and is not recorded; the first refit is
    an ordinary refit and is: three refits before a freeze leave a history, so its deadline is derived
    from them (not `first_s`)."""
    from actors.watchdog import WARMUP_KINDS, Watchdog
    from agentrl.config import WatchdogConfig

    wd = Watchdog(WatchdogConfig(min_samples=2), lambda: {}, tmp_path)
    for _ in range(2):
        wd.wait("refit", lambda timeout: True, what="a refit")
        wd.wait("batch", lambda timeout: True, what="a batch")
    assert "batch" in WARMUP_KINDS and "refit" not in WARMUP_KINDS
    assert wd.deadlines.quantile("refit") is not None  # both refits recorded
    assert wd.deadlines.quantile("batch") is None  # the first batch was not: one of two


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped interrupt
def test_a_sigterm_dropped_inside_a_finalizer_still_stops_the_loop():
    # Python drops an exception raised in a finalizer ("Exception ignored in ..."): a SIGTERM whose
    # handler runs there loses its KeyboardInterrupt. The driver keeps the signal and its loop raises
    # it at the next step (a SIGTERM test of a whole run once trained on to the end this way).
    import gc

    from agentrl.driver.supervision import SigtermAsInterrupt, stop_if_signalled

    sig = SigtermAsInterrupt()
    sig.take()
    try:
        class Dropper:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the handler runs here, inside the finalizer
                    pass

        d = Dropper()
        del d
        gc.collect()
        with pytest.raises(KeyboardInterrupt, match="stopped by signal SIGTERM"):
            stop_if_signalled()
    finally:
        sig.give_back()
    stop_if_signalled()  # given back: nothing pending
