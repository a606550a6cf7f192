"""Progress decides, not liveness: telling a stalled actor from a slow one.

An actor answers the watchdog's ping from a thread of its own, so an engine actor answers while
the vLLM core process under it is frozen (SIGSTOP, a hung kernel, a stuck collective) and samples
nothing: "busy and answering" says nothing about whether its work moves. What does is a counter
of the work itself (an engine's sampled tokens and finished requests). Here:

- :class:`ProgressClock` lives in an actor: how much work is pending, how much progress it made,
  and for how long it has had work pending and made none (its own clock: no clock skew);
- :class:`ProgressLedger` lives in the driver: the counters it read from each actor's pings and
  since when each has not moved (catches an actor whose own clock is missing or wrong);
- :func:`stall_reason` is the decision: work pending and no progress for a threshold;
- :func:`describe_processes` reads what the OS says of a process and its children (state, wchan)
  from ``/proc``: the diagnosis of a frozen core, whose Python stacks nothing can read when py-spy
  is missing.

Knows nothing of Ray; the probing is in ``agentrl.actors.watchdog``, the recovery in
``agentrl.driver.supervision``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["ProgressClock", "ProgressLedger", "describe_processes", "format_processes", "stall_reason"]


class ProgressClock:
    """An actor's account of its own progress: ``begin``/``end`` around each unit of work (a
    request, a weight load), ``advance`` whenever it moves (tokens sampled).

    The no-progress time starts when work arrives at an idle actor and restarts at every advance
    and every end; it is 0 while nothing is pending (an idle engine is not a stalled one).

    Example:
        >>> t = [0.0]
        >>> c = ProgressClock(clock=lambda: t[0])
        >>> c.begin(); t[0] = 5.0; c.advance(3); t[0] = 40.0
        >>> c.status()
        {'pending': 1, 'progress': 3, 'no_progress_s': 35.0}
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.pending = 0
        self.count = 0  # progress events so far (tokens, finished calls): what the driver's ledger reads
        self._since = clock()

    def begin(self) -> None:
        if self.pending == 0:
            self._since = self._clock()  # the time idle before this work is no stall
        self.pending += 1

    def advance(self, n: int = 1) -> None:
        if n > 0:
            self.count += n
            self._since = self._clock()

    def end(self) -> None:
        self.pending = max(0, self.pending - 1)
        self.count += 1  # a finished (or failed, or cancelled) call is progress: the work moved on
        self._since = self._clock()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        self.begin()
        try:
            yield
        finally:
            self.end()

    def no_progress_s(self) -> float:
        return round(self._clock() - self._since, 1) if self.pending else 0.0

    def status(self) -> dict[str, Any]:
        return {"pending": self.pending, "progress": self.count, "no_progress_s": self.no_progress_s()}


@dataclass
class _Seen:
    value: Any
    since: float  # when the driver first read this value
    pid: Any


class ProgressLedger:
    """The driver's record of each actor's ``progress`` counter: since when it has not moved.

    A value read the first time starts its clock at the moment it was read (a late read only
    makes the stall look shorter, never longer); a new process (another pid) starts afresh.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: dict[str, _Seen] = {}

    def observe(self, name: str, status: dict[str, Any], pid: Any = None) -> float | None:
        """Record a ping's status; returns seconds the actor's counter has stood still (None if
        the actor reports no counter)."""
        value = status.get("progress")
        if value is None:
            return None
        now = self._clock()
        seen = self._seen.get(name)
        if seen is None or seen.value != value or seen.pid != pid:
            self._seen[name] = seen = _Seen(value, now, pid)
        return round(now - seen.since, 1)

    def still_for(self, name: str) -> float | None:
        seen = self._seen.get(name)
        return None if seen is None else round(self._clock() - seen.since, 1)

    def forget(self, name: str) -> None:
        self._seen.pop(name, None)


def stall_reason(status: dict[str, Any], threshold_s: float, still_s: float | None = None) -> str | None:
    """Why an actor that answered is stalled, or None: work pending (``pending`` > 0) and no
    progress for ``threshold_s`` by its own clock (``no_progress_s``) or by the driver's
    (``still_s``: its counter unchanged in the pings read that long)."""
    pending = int(status.get("pending") or 0)
    if pending <= 0:
        return None
    own = status.get("no_progress_s")
    ages = [a for a in (own, still_s) if a is not None]
    if not ages or max(ages) < threshold_s:
        return None
    requests = int(status.get("requests_in_flight") or 0)
    what = (f"{requests} request(s) in flight" if requests
            else f"{pending} call(s) pending" + (" (a weight load, sleep or wake)" if "requests_in_flight" in status else ""))
    return (f"stalled: answers its ping but made no progress for {max(ages):.0f}s with {what} "
            f"(progress={status.get('progress')}; threshold {threshold_s:.0f}s)")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def describe_processes(pid: int) -> list[dict[str, Any]]:
    """What ``/proc`` says of the descendants of ``pid`` (an engine actor's vLLM core, its
    workers): pid, name, state (``T (stopped)``, ``S (sleeping)`` ...), the kernel function it
    waits in (wchan) and how many of its threads are in each state. Empty where ``pid`` is not a
    process of this host."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for p in children:
        status = _read(f"/proc/{p.pid}/status")
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        try:
            name = " ".join(p.cmdline()[:1]) or p.name()
        except psutil.Error:
            name = fields.get("Name", "?").strip()
        threads: dict[str, int] = {}
        for task in _tasks(p.pid):
            st = _read(f"/proc/{p.pid}/task/{task}/stat").rsplit(")", 1)[-1].split()
            if st:
                threads[st[0]] = threads.get(st[0], 0) + 1
        out.append({"pid": p.pid, "name": name.strip(), "state": fields.get("State", "?").strip(),
                    "wchan": _read(f"/proc/{p.pid}/wchan").strip() or "?", "threads": threads})
    return out


def _tasks(pid: int) -> list[str]:
    import os

    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def format_processes(procs: list[dict[str, Any]]) -> str:
    """One line per process of :func:`describe_processes`."""
    return "\n".join(
        f"process {p['pid']} {p['name']}: state {p['state']}, wchan {p['wchan']}, threads "
        + ", ".join(f"{n} {s}" for s, n in sorted(p.get("threads", {}).items()))
        for p in procs)
