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
from agentrl.progress_watch import (
    ProgressLedger,
    describe_processes,
    format_processes,
    stall_reason,
)
from agentrl.driver.watchdog import (
    ActorReport,
    Deadlines,
    RunStalled,
    format_report,
    py_spy_dump,
    thread_stacks,
)

__all__ = ["DIAG_GROUPS", "STALL_KINDS", "WARMUP_KINDS", "AsyncDiag", "SyncDiag", "Watchdog"]

DIAG_GROUPS = {"diag": 1}  # ray.remote(concurrency_groups=DIAG_GROUPS) on every actor class
WARMUP_KINDS = frozenset({"batch", "learner_step", "engine_sleep", "engine_wake"})
"""Waits whose first one is a warm-up (vLLM's first requests, compiles) and is not recorded; a first
refit is an ordinary one, and without it a run that refits three times before a fault has too few."""
STALL_KINDS = frozenset({"batch", "eval"})
"""Waits on the engines' sampling: between their deadlines the watchdog looks for a stalled engine
every `Watchdog.stall_after` seconds (engines with requests in flight and no token since)."""
JUDGED = ("engine", "teacher")
"""Actors judged by their progress and restarted when stalled (the others' counters are shown)."""


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
        self.ledger = ProgressLedger()  # each actor's progress counter, as its pings told it
        self.num_stalls = 0  # actors found stalled (answering, no progress)

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
        judged = progress is not None
        look = t0  # the last look at `progress`: the deadline counts from there
        while True:
            now = time.perf_counter()
            grace_left = self._grace_until - now
            deadline = max(self.deadlines.deadline(kind, judged=judged), grace_left)
            stall_s = self.stall_after(kind)
            left = deadline - (now - look)
            # Engine waits look for a stalled engine between deadlines too (its actor answers, and
            # the wait's own progress may come from the other engines), three times a threshold: a
            # stall is found within 4/3 of it. A look is a ping of each engine.
            timeout = left if stall_s is None else min(left, max(stall_s / 3, grace_left))
            if done(max(timeout, 0.0)):
                break
            stalled = self.stalled(stall_s) if stall_s is not None and self._grace_until <= time.perf_counter() else []
            if not stalled:
                if time.perf_counter() - look < deadline:
                    continue  # a look for stalled engines only; the deadline has not passed
                look = time.perf_counter()
                if progress is not None:
                    now_p = progress()
                    if now_p != mark and now_p is not None:
                        mark = now_p
                        continue  # slow, not stuck
            alarmed = True
            self.num_alarms += 1
            reports = self.diagnose(focus, stall_s=stall_s if stall_s is not None else deadline)
            self.num_stalls += sum(r.state == "stalled" for r in reports)
            recovered = recover(reports) if recover is not None else False
            elapsed = time.perf_counter() - t0
            q = self.deadlines.quantile(kind)
            history = f"recent {kind} q{self.cfg.quantile:g} = {q:.1f}s" if q is not None else f"no {kind} history yet"
            if stall_s is not None:
                history += f"; an engine with requests in flight and no token for {stall_s:.0f}s is stalled"
            report = format_report(what, elapsed, deadline, reports, history=history)
            if recovered and recoveries < self.cfg.max_recoveries:
                recoveries += 1
                self.num_recoveries += 1
                self._emit(report + f"\nwatchdog: recovered ({recoveries} of at most {self.cfg.max_recoveries} "
                                    "in this wait); waiting again")
                look = time.perf_counter()
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

    def stall_after(self, kind: str) -> float | None:
        """Seconds without a token after which an engine with requests in flight is stalled, in
        a wait of ``kind`` (None: no looks between deadlines; the kind is not an engine wait, or
        it has no history yet): ``watchdog.factor`` x the recent quantile of that wait, at least
        ``watchdog.progress_floor_s``. A quick workload finds a frozen engine core in tens of
        seconds; a slow one, whose waits are long, gets a threshold as long."""
        if kind not in STALL_KINDS or self.deadlines.quantile(kind) is None:
            return None
        return self.deadlines.deadline(kind, judged=True)

    def stalled(self, threshold_s: float) -> list[ActorReport]:
        """Ping the engines and return those that answer and are stalled (no progress for
        ``threshold_s`` with work pending) or do not answer at all."""
        engines = {n: h for n, h in self.actors().items() if n.startswith(JUDGED)}
        if not engines:
            return []
        reports = self.ping_all(actors=engines)
        self.judge(reports, threshold_s)
        return [r for r in reports if r.state in ("stalled", "unresponsive")]  # (dead: Ray restarts it)

    def judge(self, reports: list[ActorReport], threshold_s: float) -> None:
        """Mark as ``stalled`` the engines whose work has not moved for ``threshold_s`` (by their
        own clock or by the counters their pings gave the driver), whatever their actor answers."""
        for r in reports:
            if r.state not in ("busy", "idle"):
                continue
            still = self.ledger.still_for(r.name)
            if still is not None:
                r.status["still_s"] = still
            if not r.name.startswith(JUDGED):
                continue
            why = stall_reason(r.status, threshold_s, still)
            if why is not None:
                r.state, r.error = "stalled", why

    def _emit(self, report: str) -> None:
        self.last_report = report
        self.out(report)
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            (self.log_dir / f"watchdog-{self.num_alarms:03d}.txt").write_text(report + "\n")
        except OSError:
            pass

    # -- diagnosis --------------------------------------------------------------------------------
    def ping_all(self, timeout_s: float | None = None, actors: dict[str, Any] | None = None) -> list[ActorReport]:
        """Every actor's state (or that of ``actors``): idle or busy (it answered), unresponsive
        (no answer in ``watchdog.ping_timeout_s``) or dead. Their progress counters go to the ledger."""
        timeout_s = self.cfg.ping_timeout_s if timeout_s is None else timeout_s
        actors = self.actors() if actors is None else actors
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
            self.ledger.observe(name, status, pid)
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

    def diagnose(self, focus: tuple[str, ...] = (), stall_s: float | None = None) -> list[ActorReport]:
        """Every actor's report; with ``stall_s``, engines stalled that long are marked so. A
        stalled or unresponsive engine's report names its core process(es): pid, state from /proc
        (``T (stopped)``), wchan, and stacks where py-spy can read them."""
        reports = self.ping_all()
        if stall_s is not None:
            self.judge(reports, stall_s)
        actors = self.actors()
        for r in reports:
            if r.state in ("unresponsive", "stalled") or (r.name in focus and r.state == "busy"):
                r.stacks = self.stacks_of(r, actors.get(r.name))
            if r.name.startswith(JUDGED) and r.state in ("unresponsive", "stalled"):
                self.describe_core(r, actors.get(r.name))
        return reports

    def describe_core(self, report: ActorReport, handle: Any) -> None:
        """Add the engine's child processes (vLLM's core) to its report: read from /proc here
        when the actor's process is on this host, else asked of the actor."""
        procs: list[dict[str, Any]] = []
        if report.pid is not None and self.is_same_process(report.name, report.pid):
            procs = describe_processes(report.pid)
        elif report.state == "stalled" and handle is not None:
            try:
                procs = ray.get(handle.core_processes.remote(), timeout=self.cfg.ping_timeout_s)
            except Exception:  # noqa: BLE001 (an actor class without it, or gone)
                procs = []
        report.core = procs
        if not procs:
            return
        report.status["core"] = "; ".join(f"{p['name']} pid {p['pid']} state {p['state']}" for p in procs)
        lines = [format_processes(procs)]
        for p in procs:
            dump = py_spy_dump(p["pid"], timeout_s=self.cfg.ping_timeout_s * 2)
            lines.append(f"stacks of process {p['pid']}:\n{dump}" if dump else
                         f"(no Python stacks of process {p['pid']}: py-spy is missing or may not read it; "
                         "its state and wchan above are from /proc)")
        report.stacks = (report.stacks.rstrip() + "\n" if report.stacks else "") + "\n".join(lines)

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
                    status = dict(ray.get(ref))
                    self._learn(name, status["pid"])
                    self.ledger.observe(name, status, status["pid"])
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
