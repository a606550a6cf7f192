"""Ray side of the watchdog: waits with deadlines, pings and stack dumps of actors.

Every actor class mixes in :class:`AsyncDiag` or :class:`SyncDiag`: ``ping`` and ``stacks``
run in a concurrency group of their own (their own thread), so an actor whose event loop or main
thread is stuck still answers them. A frozen process (SIGSTOP, a deadlock holding the GIL)
answers nothing: it is judged unresponsive and its stacks are read from outside with py-spy.
The deadlines and the report are :mod:`agentrl.driver.watchdog`'s; what to do about a stuck actor is
the trainer's (the ``recover`` callback of :meth:`Watchdog.wait`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import ray

from agentrl.config import WatchdogConfig
from agentrl.driver.watchdog import ActorReport, Deadlines, RunStalled, format_report, py_spy_dump, thread_stacks

__all__ = ["DIAG_GROUPS", "WARMUP_KINDS", "AsyncDiag", "SyncDiag", "Watchdog"]

DIAG_GROUPS = {"diag": 1}  # ray.remote(concurrency_groups=DIAG_GROUPS) on every actor class
WARMUP_KINDS = frozenset({"batch", "learner_step", "engine_sleep", "engine_wake"})
"""Waits whose first one is a warm-up (vLLM's first requests, compiles) and is not recorded; a first
refit is an ordinary one, and without it a run that refits three times before a fault has too few."""


class AsyncDiag:
    """Diagnosis methods of an async actor (their own event loop, on their own thread)."""

    def diag_status(self) -> dict[str, Any]:
        return {}

    @ray.method(concurrency_group="diag")
    async def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), **self.diag_status()}

    @ray.method(concurrency_group="diag")
    async def stacks(self) -> str:
        return thread_stacks()


class SyncDiag:
    """Diagnosis methods of a threaded actor (a thread of their own beside the one that works)."""

    def diag_status(self) -> dict[str, Any]:
        return {}

    @ray.method(concurrency_group="diag")
    def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), **self.diag_status()}

    @ray.method(concurrency_group="diag")
    def stacks(self) -> str:
        return thread_stacks()


Recover = Callable[[list[ActorReport]], bool]


class Watchdog:
    """Deadlines on the driver's waits, a diagnosis when one passes, and recovery through the
    caller's ``recover`` callback.

    Args:
        cfg: the run's ``watchdog`` section.
        actors: returns the run's actors now, by name (actors get replaced during a run).
        log_dir: where each diagnosis is written too (``watchdog-<n>.txt``).
        out: where the diagnosis is printed.
    """

    def __init__(self, cfg: WatchdogConfig, actors: Callable[[], dict[str, Any]], log_dir: Path,
                 out: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.deadlines = Deadlines(cfg)
        self.actors = actors
        self.log_dir = Path(log_dir)
        self.out = out or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.pids: dict[str, int] = {}
        self.pid_started: dict[str, float] = {}  # the process's start time: a reused pid is not it
        self._pings: dict[str, Any] = {}  # refresh_pids: pings sent, not yet read
        self.num_alarms = 0
        self.num_recoveries = 0
        self.last_report = ""
        self._grace_until = 0.0
        self._waited: set[str] = set()  # kinds waited for at least once

    def grace(self, seconds: float) -> None:
        """No deadline passes in the next ``seconds`` (an actor restarted by a recovery, or by Ray,
        is starting: a vLLM engine takes as long as at the run's start)."""
        self._grace_until = max(self._grace_until, time.perf_counter() + seconds)

    # -- waiting ----------------------------------------------------------------------------------
    def get(self, kind: str, refs: Any, *, what: str, recover: Recover | None = None,
            focus: tuple[str, ...] = (), progress: Callable[[], Hashable] | None = None) -> Any:
        """``ray.get(refs)`` under a deadline for ``kind`` (see :meth:`wait`)."""
        many = isinstance(refs, list)
        lst = list(refs) if many else [refs]
        if lst:
            self.wait(kind, lambda t: not ray.wait(lst, num_returns=len(lst), timeout=t)[1], what=what,
                      recover=recover, focus=focus, progress=progress)
        return ray.get(lst) if many else ray.get(lst[0])

    def result(self, kind: str, future: Future, *, what: str, recover: Recover | None = None,
               focus: tuple[str, ...] = ()) -> Any:
        """``future.result()`` under a deadline for ``kind``."""
        def done(t: float) -> bool:
            try:
                future.result(timeout=t)
            except FutureTimeout:
                return False
            except BaseException:
                return True  # raised below, to the caller
            return True
        self.wait(kind, done, what=what, recover=recover, focus=focus)
        return future.result()

    def wait(self, kind: str, done: Callable[[float], bool], *, what: str, recover: Recover | None = None,
             focus: tuple[str, ...] = (), progress: Callable[[], Hashable] | None = None) -> float:
        """Wait until ``done(timeout)`` is true. Each time the deadline of ``kind`` passes: if
        ``progress()`` changed since the last look (work is still arriving) wait on; otherwise
        diagnose, print the report, and let ``recover`` act on it. ``recover`` returning False (or
        ``watchdog.max_recoveries`` passing) stops the run with :class:`RunStalled`.
        ``focus``: actors whose stacks are dumped even when they answer (busy on this wait)."""
        t0 = time.perf_counter()
        if not self.cfg.enabled:
            while not done(3600.0):
                pass
            return time.perf_counter() - t0
        recoveries = 0
        alarmed = False
        mark = progress() if progress is not None else None
        while True:
            deadline = max(self.deadlines.deadline(kind), self._grace_until - time.perf_counter())
            if done(deadline):
                break
            if progress is not None:
                now = progress()
                if now != mark and now is not None:
                    mark = now
                    continue  # slow, not stuck
            alarmed = True
            self.num_alarms += 1
            reports = self.diagnose(focus)
            recovered = recover(reports) if recover is not None else False
            elapsed = time.perf_counter() - t0
            q = self.deadlines.quantile(kind)
            history = f"recent {kind} q{self.cfg.quantile:g} = {q:.1f}s" if q is not None else f"no {kind} history yet"
            report = format_report(what, elapsed, deadline, reports, history=history)
            if recovered and recoveries < self.cfg.max_recoveries:
                recoveries += 1
                self.num_recoveries += 1
                self._emit(report + f"\nwatchdog: recovered ({recoveries} of at most {self.cfg.max_recoveries} "
                                    "in this wait); waiting again")
                continue
            why = ("nothing the watchdog can restart would unblock it" if not recovered
                   else f"watchdog.max_recoveries ({self.cfg.max_recoveries}) reached")
            self._emit(report)
            raise RunStalled(f"{report}\nstopping the run: {why}")
        elapsed = time.perf_counter() - t0
        # A recovered wait's length says nothing about healthy ones; nor does one that waited out
        # a restart (the restarted engine's start-up, ~a minute on a GPU), nor the first of its
        # kind where the first one warms up (vLLM's first requests, the first batch, the first learner
        # step's compile: WARMUP_KINDS; `first_s` covers it):
        # recorded, they would raise this kind's deadline to factor x that for the rest of the run.
        first = kind not in self._waited and kind in WARMUP_KINDS
        self._waited.add(kind)
        if not alarmed and not first and self._grace_until <= t0:
            self.deadlines.record(kind, elapsed)
        return elapsed

    def _emit(self, report: str) -> None:
        self.last_report = report
        self.out(report)
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            (self.log_dir / f"watchdog-{self.num_alarms:03d}.txt").write_text(report + "\n")
        except OSError:
            pass

    # -- diagnosis --------------------------------------------------------------------------------
    def ping_all(self, timeout_s: float | None = None) -> list[ActorReport]:
        """Every actor's state: idle or busy (it answered), unresponsive (no answer in
        ``watchdog.ping_timeout_s``) or dead."""
        timeout_s = self.cfg.ping_timeout_s if timeout_s is None else timeout_s
        actors = self.actors()
        refs = {}
        reports = {}
        for name, handle in actors.items():
            try:
                refs[name] = handle.ping.remote()
            except Exception as exc:  # noqa: BLE001 (a handle whose actor is gone)
                reports[name] = ActorReport(name, "dead", self.pids.get(name), error=str(exc)[:200])
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        for name, ref in refs.items():
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                reports[name] = ActorReport(name, "unresponsive", self.pids.get(name),
                                            error=self._process_state(name))
                continue
            try:
                status = dict(ray.get(ref))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                reports[name] = ActorReport(name, "dead", self.pids.get(name), error=type(exc).__name__)
                continue
            pid = status.pop("pid", None)
            if pid is not None:
                self._learn(name, pid)
            busy = bool(status.pop("busy", False))
            reports[name] = ActorReport(name, "busy" if busy else "idle", pid, status=status)
        return [reports[n] for n in actors if n in reports]

    def _process_state(self, name: str) -> str:
        """What the OS says of an unresponsive actor's process: stopped (SIGSTOP), gone, ..."""
        pid = self.pids.get(name)
        if pid is None:
            return "pid unknown"
        try:
            import psutil

            if not self.process_alive(name, pid):
                return f"process {pid} is gone (restarting?)"
            return f"process {pid} is {psutil.Process(pid).status()}"
        except Exception:  # noqa: BLE001
            return ""

    def diagnose(self, focus: tuple[str, ...] = ()) -> list[ActorReport]:
        reports = self.ping_all()
        actors = self.actors()
        for r in reports:
            if r.state == "unresponsive" or (r.name in focus and r.state == "busy"):
                r.stacks = self.stacks_of(r, actors.get(r.name))
        return reports

    def stacks_of(self, report: ActorReport, handle: Any) -> str:
        """py-spy from outside where it can read the process; else the actor's own dump (which a
        frozen actor cannot give)."""
        if report.pid is not None:
            dump = py_spy_dump(report.pid, timeout_s=self.cfg.ping_timeout_s * 2)
            if dump:
                return dump
        if report.state == "unresponsive" or handle is None:
            return "(no stacks: the process answers nothing and py-spy could not read it)"
        try:
            return ray.get(handle.stacks.remote(), timeout=self.cfg.ping_timeout_s)
        except Exception as exc:  # noqa: BLE001
            return f"(no stacks: {type(exc).__name__})"

    def _learn(self, name: str, pid: int) -> None:
        if self.pids.get(name) != pid:
            self.pids[name] = pid
            try:
                import psutil

                self.pid_started[name] = psutil.Process(pid).create_time()
            except Exception:  # noqa: BLE001 (another node's process)
                self.pid_started.pop(name, None)

    def is_same_process(self, name: str, pid: int) -> bool:
        """Whether ``pid`` is still the process the actor ``name`` answered from (not a reused pid)."""
        try:
            import psutil

            return self.pid_started.get(name) == psutil.Process(pid).create_time()
        except Exception:  # noqa: BLE001
            return False

    def process_alive(self, name: str, pid: int) -> bool:
        """Whether the process the actor ``name`` last answered from still exists (True where it
        cannot be told: another node's process)."""
        try:
            import psutil

            if not psutil.pid_exists(pid):
                return False
            return self.is_same_process(name, pid) or name not in self.pid_started
        except Exception:  # noqa: BLE001
            return True

    def refresh_pids(self) -> None:
        """Learn the pids of restarted actors without waiting: reads the pings sent last time that
        have answered, and pings again (call it between waits, e.g. once a step)."""
        for name, ref in list(self._pings.items()):
            if ray.wait([ref], timeout=0)[0]:
                del self._pings[name]
                try:
                    self._learn(name, ray.get(ref)["pid"])
                except Exception:  # noqa: BLE001 (dead or restarting: next time)
                    pass
        for name, handle in self.actors().items():
            if name not in self._pings:
                try:
                    self._pings[name] = handle.ping.remote()
                except Exception:  # noqa: BLE001
                    pass

    def learn_pids(self, timeout_s: float = 60.0) -> None:
        """Ping everything once (at start and after a restart): a frozen actor's pid is known.
        An actor still starting gets ``timeout_s`` to answer."""
        self.ping_all(timeout_s)
