"""Watchdog logic: deadlines from a run's own timings, stack dumps and the diagnosis report.

A run that stops making progress must say so, and why. Every wait of the driver has a kind
(``batch``, ``learner_step``, ``refit``, ...); :class:`Deadlines` keeps the recent durations of
each kind and gives the next wait of that kind ``max(floor, factor x quantile)`` seconds, so a run
whose learner is slow gets long deadlines and a fast run catches a freeze quickly. When one
passes, the driver asks every actor for a ping; :func:`format_report` turns the answers (and the
Python stacks of the actors that are busy or do not answer) into the message the user reads.

Knows nothing of Ray: the probing is in ``agentrl.actors.watchdog``, the recovery in the trainer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from agentrl.config import WatchdogConfig

__all__ = ["ActorReport", "Deadlines", "RunStalled", "RunStopped", "format_report", "py_spy_dump", "thread_stacks"]

ActorState = Literal["idle", "busy", "stalled", "unresponsive", "dead"]


class RunStopped(RuntimeError):
    """The run stopped on a fault it could not recover from (an actor whose state is lost, a
    stall); the message names the cause and what ``--resume`` continues from."""


class RunStalled(RunStopped):
    """A wait of the driver passed its deadline and the run could not recover; the message holds
    the diagnosis (what was awaited, every actor's state, the stuck actors' stacks)."""


class Deadlines:
    """Deadlines per kind of wait, from the recent durations of that kind.

    Example:
        >>> d = Deadlines(WatchdogConfig(floor_s=10, first_s=60, factor=4, min_samples=2))
        >>> d.deadline("learner_step")  # no history yet
        60.0
        >>> for s in (3.0, 5.0, 4.0): d.record("learner_step", s)
        >>> d.deadline("learner_step")  # 4 x the 0.9 quantile of (3, 4, 5), above the floor
        20.0
    """

    def __init__(self, cfg: WatchdogConfig) -> None:
        self.cfg = cfg
        self.recent: dict[str, deque[float]] = {}

    def record(self, kind: str, seconds: float) -> None:
        self.recent.setdefault(kind, deque(maxlen=self.cfg.window)).append(float(seconds))

    def quantile(self, kind: str) -> float | None:
        xs = sorted(self.recent.get(kind, ()))
        if len(xs) < self.cfg.min_samples:
            return None
        return xs[min(len(xs) - 1, int(self.cfg.quantile * len(xs)))]

    def deadline(self, kind: str, *, judged: bool = False) -> float:
        """``judged``: the wait has a progress signal that tells slow from stuck (groups queued,
        tokens sampled, a CPU learner's CPU time), so a passed deadline only makes the watchdog
        look: its floor is ``progress_floor_s``, not ``floor_s``."""
        if kind in self.cfg.deadlines:
            return float(self.cfg.deadlines[kind])  # type: ignore[index]
        floor = self.cfg.progress_floor_s if judged else self.cfg.floor_s
        q = self.quantile(kind)
        if q is None:
            return max(self.cfg.first_s, floor)
        return max(floor, self.cfg.factor * q)


@dataclass
class ActorReport:
    """What the diagnosis learned about one actor."""

    name: str
    state: ActorState
    pid: int | None = None
    status: dict = field(default_factory=dict)  # the actor's own account (in-flight work, current call)
    error: str = ""
    stacks: str = ""  # its Python threads' stacks (py-spy from outside, or its own dump)
    action: str = ""  # what the watchdog did about it (restarted, ...)
    core: list = field(default_factory=list)  # an engine's child processes as /proc told (pid, name, state, wchan)


def thread_stacks(skip_current: bool = True) -> str:
    """Every Python thread's stack in this process, innermost call last (as tracebacks print).

    Runs inside an actor, on a thread of its own (a Ray concurrency group), so it answers while
    the actor's main thread or event loop is stuck."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if skip_current and ident == me:
            continue
        out.append(f'Thread {ident} "{names.get(ident, "?")}":\n' + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


def py_spy_dump(pid: int, timeout_s: float = 20.0) -> str | None:
    """``py-spy dump`` of another process (a frozen one too: it reads memory without stopping
    it); None where py-spy is missing or may not read the process (ptrace not permitted)."""
    exe = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
                             timeout=timeout_s)
    except (subprocess.TimeoutExpired, OSError):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None


def format_report(waited_for: str, elapsed_s: float, deadline_s: float, actors: list[ActorReport], *,
                  history: str = "", max_stack_lines: int = 60) -> str:
    """The message printed when a deadline passes."""
    lines = [f"watchdog: no progress waiting for {waited_for} for {elapsed_s:.0f}s "
             f"(deadline {deadline_s:.0f}s{'; ' + history if history else ''}), at {time.strftime('%H:%M:%S')}"]
    for a in actors:
        extra = ", ".join(f"{k}={v}" for k, v in a.status.items())
        lines.append(f"  {a.name:<14} {a.state:<12} pid={a.pid}" + (f"  {extra}" if extra else "")
                     + (f"  error: {a.error}" if a.error else "") + (f"  -> {a.action}" if a.action else ""))
    for a in actors:
        if a.stacks:
            stack = a.stacks.rstrip().splitlines()
            if len(stack) > max_stack_lines:
                stack = stack[:max_stack_lines] + [f"... ({len(stack) - max_stack_lines} more lines)"]
            lines.append(f"  stacks of {a.name} (pid {a.pid}):")
            lines.extend("    " + s for s in stack)
    return "\n".join(lines)
