"""Progress decides, not liveness: the stall decision, the adaptive deadline, the recovery's choice
and the kill of a frozen process tree. Fast, no Ray: stand-in engines whose actor answers its ping
while their counter stands still."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

from agentrl.config import WatchdogConfig, load_config
from agentrl.progress_watch import ProgressClock, ProgressLedger, describe_processes, stall_reason
from agentrl.driver.watchdog import ActorReport, Deadlines


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_clock_runs_only_while_work_is_pending_and_nothing_moves():
    t = FakeClock()
    c = ProgressClock(clock=t)
    t.t += 100
    assert c.no_progress_s() == 0.0  # idle: no stall, however long
    c.begin()
    t.t += 5
    assert c.no_progress_s() == 5.0  # the idle time before the work is not counted
    c.advance(7)
    t.t += 3
    c.begin()  # more work arriving at a busy engine does not restart the clock
    t.t += 40
    assert c.status() == {"pending": 2, "progress": 7, "no_progress_s": 43.0}
    c.end()  # a request finished: progress
    assert c.status() == {"pending": 1, "progress": 8, "no_progress_s": 0.0}
    c.advance(0)  # no token is no progress
    t.t += 2
    assert c.no_progress_s() == 2.0


def test_an_engine_with_requests_in_flight_and_no_new_token_is_stalled_whatever_its_actor_says():
    # the reported case: the actor answers (busy), 16 requests in flight, 8282 tokens and no more
    status = {"busy": True, "requests_in_flight": 16, "tokens_sampled": 8282, "pending": 16, "progress": 8298,
              "no_progress_s": 31.0}
    why = stall_reason(status, threshold_s=30.0)
    assert why is not None and "16 request(s) in flight" in why and "31s" in why
    assert stall_reason(status, threshold_s=60.0) is None  # not for long enough
    assert stall_reason(status | {"pending": 0, "requests_in_flight": 0}, threshold_s=1.0) is None  # idle
    assert stall_reason(status | {"no_progress_s": 0.5}, threshold_s=30.0) is None  # tokens just came


def test_the_driver_ledger_catches_a_counter_that_does_not_move_without_the_actors_own_clock():
    t = FakeClock()
    ledger = ProgressLedger(clock=t)
    stand_in = {"busy": True, "requests_in_flight": 4, "pending": 4, "progress": 100}  # no no_progress_s
    assert ledger.observe("engine0", stand_in, pid=11) == 0.0
    t.t += 20
    assert ledger.observe("engine0", stand_in, pid=11) == 20.0
    assert stall_reason(stand_in, 30.0, ledger.still_for("engine0")) is None
    t.t += 15
    assert stall_reason(stand_in, 30.0, ledger.observe("engine0", stand_in, pid=11)) is not None
    assert ledger.observe("engine0", stand_in | {"progress": 101}, pid=11) == 0.0  # it moved
    t.t += 50
    assert ledger.observe("engine0", stand_in | {"progress": 101}, pid=12) == 0.0  # a new process
    assert ledger.observe("replay", {"size": 3}) is None  # no counter: nothing judged


def test_a_watched_wait_gets_a_deadline_from_its_own_p90_with_a_30s_floor():
    cfg = WatchdogConfig()  # the defaults
    d = Deadlines(cfg)
    for s in [2.0] * 9 + [2.4]:  # the quickstart's batch waits (p90 2.4 s)
        d.record("batch", s)
    assert d.deadline("batch", judged=True) == 30.0  # was 300 s: a stall is found in tens of seconds
    assert d.deadline("batch") == 300.0  # a wait that nothing but its deadline judges keeps floor_s
    for s in [60.0] * 10:  # a slow healthy workload: the deadline follows it
        d.record("batch", s)
    assert d.deadline("batch", judged=True) == 300.0
    assert Deadlines(cfg).deadline("batch", judged=True) == cfg.first_s  # no history (the warm-up): first_s
    assert load_config(None, ["watchdog.progress_floor_s=5"]).watchdog.progress_floor_s == 5


class StandInEngines:
    """The Ray side of the watchdog without Ray: an engine whose actor always answers, busy with
    ``requests`` in flight, and whose token count moves only while ``sampling`` is set."""

    def __init__(self) -> None:
        self.clock = ProgressClock()
        self.tokens = 0
        self.sampling = False
        self.restarts = 0
        for _ in range(16):
            self.clock.begin()

    def ping_all(self, timeout_s=None, actors=None) -> list[ActorReport]:
        if self.sampling:
            self.tokens += 5
            self.clock.advance(5)
        status = {"requests_in_flight": 16, "tokens_sampled": self.tokens, **self.clock.status()}
        return [ActorReport("engine0", "busy", 4242, status=status), ActorReport("learner0", "idle", 7)]


def _watchdog(tmp_path, engines: StandInEngines, **cfg):
    from agentrl.actors.watchdog import Watchdog

    wd = Watchdog(WatchdogConfig(**cfg), lambda: {"engine0": None, "learner0": None}, tmp_path, out=lambda m: None)
    wd.ping_all = engines.ping_all  # type: ignore[method-assign]
    wd.stacks_of = lambda report, handle: ""  # type: ignore[method-assign]
    for _ in range(4):
        wd.deadlines.record("batch", 0.01)  # a quick workload: the stall threshold is the floor
    return wd


def test_a_batch_wait_finds_an_answering_engine_that_samples_nothing_and_recovers(tmp_path):
    engines = StandInEngines()
    wd = _watchdog(tmp_path, engines, progress_floor_s=0.3, floor_s=60, first_s=60, factor=5)
    seen: list[list[ActorReport]] = []

    def recover(reports):
        seen.append(reports)
        engines.sampling = True  # restarted: it samples again
        engines.restarts += 1
        return True

    def done(timeout: float) -> bool:  # the batch comes once the engine samples again
        end = time.perf_counter() + timeout
        while time.perf_counter() < end and not engines.restarts:
            time.sleep(0.02)
        return engines.restarts > 0

    t0 = time.perf_counter()
    elapsed = wd.wait("batch", done, what="a batch", recover=recover, progress=lambda: 0)
    assert engines.restarts == 1 and len(seen) == 1
    engine = next(r for r in seen[0] if r.name == "engine0")
    assert engine.state == "stalled" and "16 request(s) in flight" in engine.error
    assert elapsed < 5 and time.perf_counter() - t0 < 5  # the 0.3 s threshold, not the 60 s deadline
    assert wd.num_stalls == 1 and "engine0" in wd.last_report and "stalled" in wd.last_report


def test_a_slow_engine_that_keeps_sampling_is_not_stalled(tmp_path):
    engines = StandInEngines()
    engines.sampling = True
    wd = _watchdog(tmp_path, engines, progress_floor_s=0.2, floor_s=60, first_s=60, factor=5, max_recoveries=100)
    end = time.perf_counter() + 1.5  # several thresholds, tokens at every look

    def done(timeout: float) -> bool:
        time.sleep(min(timeout, max(0.0, end - time.perf_counter())))
        return time.perf_counter() >= end

    states = []
    # the batch's own progress stands still (no group queued): its deadlines pass and are diagnosed,
    # but the engine that samples is busy, never stalled, and nothing is restarted
    wd.wait("batch", done, what="a batch", recover=lambda r: states.extend(x.state for x in r) or True,
            progress=lambda: 0)
    assert wd.num_alarms >= 2 and wd.num_stalls == 0 and "stalled" not in states and "busy" in states
    # the wait's progress moving (groups queued): no alarm at all
    before, end = wd.num_alarms, time.perf_counter() + 1.0
    wd.wait("batch", done, what="a batch", recover=lambda r: False, progress=lambda: engines.tokens)
    assert wd.num_alarms == before


def test_the_recovery_restarts_a_stalled_engine_and_waits_on_a_busy_one():
    from agentrl.driver.state import RunActors
    from agentrl.driver.supervision import Supervisor

    class Driver(Supervisor):
        def __init__(self):
            watchdog = SimpleNamespace(ledger=ProgressLedger(), process_alive=lambda name, pid: True,
                                       grace=lambda s: None)
            actors = RunActors(replay="r", learner=SimpleNamespace(actors=["l"]), engines=["handle0", "handle1"],
                               watchdog=watchdog)
            super().__init__(load_config(None, []), actors, make_rollout=None, ckpt_dir=Path("unused"), overlap=False,
                             engine_start_s=10.0)
            self.weights = SimpleNamespace(engines_version=1, transport="object_store")
            self.killed: list[str] = []

        def kill_frozen(self, report, handle):
            self.killed.append(handle)
            return "SIGKILLed pids 99; none left"

    d = Driver()
    stalled = ActorReport("engine0", "stalled", 5, status={"requests_in_flight": 16, "core": "VLLM::EngineCore pid 99 "
                                                           "state T (stopped)"}, error="stalled: ...")
    busy = ActorReport("engine1", "busy", 6, status={"requests_in_flight": 3})
    assert d.recover([stalled, busy, ActorReport("learner0", "idle", 7)])
    assert d.killed == ["handle0"] and d.engine_restarts == 1
    assert stalled.action == "killed; Ray restarts it and it loads the current weights (SIGKILLed pids 99; none left)"
    assert busy.action == ""
    # nothing stalled, every actor answering: waited again (as before), nothing killed
    busy2 = ActorReport("engine1", "busy", 6, status={"requests_in_flight": 3})
    assert d.recover([busy2]) and busy2.action == "busy and answering: waiting again" and d.killed == ["handle0"]


_TREE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(0.1)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_stopped_core_is_described_from_proc_and_killed_with_its_parent_leaving_no_orphan(monkeypatch):
    """An engine actor's process with a child (its vLLM core) frozen with SIGSTOP: /proc names the
    child's state, and the kill ends both (SIGKILL by pid; the parent's death alone ends no child)."""
    import agentrl.driver.supervision
    from agentrl.driver.state import RunActors
    from agentrl.driver.supervision import Supervisor

    asked = []
    monkeypatch.setattr(agentrl.driver.supervision.ray, "kill", lambda handle, no_restart=True: asked.append(handle))
    parent = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True)
    try:
        core = int(parent.stdout.readline())
        os.kill(core, signal.SIGSTOP)
        time.sleep(0.2)
        [proc] = describe_processes(parent.pid)
        assert proc["pid"] == core and proc["state"] == "T (stopped)" and proc["threads"] == {"T": 1}

        sup = Supervisor(load_config(None, []), RunActors(watchdog=SimpleNamespace(is_same_process=lambda name, pid: True)),
                         make_rollout=None, ckpt_dir=Path("unused"), overlap=False)
        text = sup.kill_frozen(ActorReport("engine0", "stalled", parent.pid), handle="actor0")
        assert asked == ["actor0"]  # Ray is told too (it restarts the actor)
        parent.wait(timeout=10)  # reaped here (our child); the core by whoever adopted it
        assert f"SIGKILLed pids {core}, {parent.pid}" in text and "none left" in text, text
        assert not psutil.pid_exists(core) or psutil.Process(core).status() == psutil.STATUS_ZOMBIE
    finally:
        if parent.poll() is None:
            parent.kill()
        try:
            os.kill(core, signal.SIGKILL)  # only where the test failed before its kill
        except (ProcessLookupError, NameError):
            pass
