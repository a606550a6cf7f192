"""Training progress for a person watching: a rich bar on a terminal, plain lines everywhere else.

Plain lines (``agentrl train --no-progress``, or output to a file, a pipe or a CI log, where a
bar would show nothing until the run ends) carry step, reward, success, tokens/s, staleness,
loss, elapsed time and ETA, one per step but at most one every ``every_s`` seconds (the first and
the last step always), so a slow run reads differently from a stuck one::

    step 3/30  reward 0.41  success 0.38  tool 0.72  tok/s 812  stale 1  loss +0.0123  elapsed 0:00:12  eta 0:01:48
"""

from __future__ import annotations

import sys
import time
from typing import Any, Literal, TextIO

__all__ = ["TrainProgress", "format_duration", "parse_progress_line"]


def format_duration(seconds: float) -> str:
    """``H:MM:SS``.

    >>> format_duration(3725.4)
    '1:02:05'
    """
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def parse_progress_line(line: str) -> dict[str, Any] | None:
    """The fields of one plain progress line, or None when ``line`` is not one.

    >>> parse_progress_line("step 3/30  reward 0.41  tok/s 812  stale 1  elapsed 0:00:12  eta 0:01:48")
    {'step': 3, 'total': 30, 'reward': 0.41, 'tok/s': 812.0, 'stale': 1.0, 'elapsed': '0:00:12', 'eta': '0:01:48'}
    """
    parts = line.strip().split()
    if len(parts) < 2 or parts[0] != "step" or "/" not in parts[1] or len(parts) % 2:
        return None
    try:
        step, total = (int(x) for x in parts[1].split("/"))
        out: dict[str, Any] = {"step": step, "total": total}
        for key, value in zip(parts[2::2], parts[3::2]):
            out[key] = value if key in ("elapsed", "eta") else float(value)
    except ValueError:
        return None
    return out


class TrainProgress:
    """Progress of ``total`` steps, from ``start`` (a resumed run).

    Args:
        mode: ``"auto"``: a bar on a terminal, plain lines otherwise; ``"bar"``; ``"lines"``.
        every_s: plain lines: at most one per this many seconds (the first and last step always).
        stream: where plain lines go (default: standard output).
    """

    def __init__(self, total: int, *, start: int = 0, mode: Literal["auto", "bar", "lines"] = "auto",
                 every_s: float = 5.0, stream: TextIO | None = None) -> None:
        self.total = total
        self.start = start
        self.stream = stream
        if mode == "auto":
            out = stream or sys.stdout
            mode = "bar" if hasattr(out, "isatty") and out.isatty() else "lines"
        self.mode = mode
        self.every_s = every_s
        self._progress = None
        self._t0 = time.perf_counter()
        self._last_print = -float("inf")

    def __enter__(self) -> TrainProgress:
        self._t0 = time.perf_counter()
        if self.mode == "bar":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.description}"),
            )
            self._progress.start()
            self._task = self._progress.add_task("", total=self.total, completed=self.start)
        return self

    @staticmethod
    def describe(m: dict[str, Any]) -> str:
        return (
            f"reward {m.get('rollout/reward', 0):.2f}  success {m.get('rollout/success', 0):.2f}  "
            f"tool {m.get('rollout/tool_use_rate', 0):.2f}  tok/s {m.get('rollout/tokens_per_s', 0):.0f}  "
            f"stale {m.get('replay/staleness_max', 0):.0f}  loss {m.get('train/loss', 0):+.4f}"
        )

    def update(self, step: int, m: dict[str, Any]) -> None:
        line = self.describe(m)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, description=line)
            return
        now = time.perf_counter()
        first, last = step == self.start + 1, step >= self.total
        if not (first or last or now - self._last_print >= self.every_s):
            return
        self._last_print = now
        elapsed = now - self._t0
        done = step - self.start
        eta = elapsed / done * max(self.total - step, 0) if done > 0 else 0.0
        print(f"step {step}/{self.total}  {line}  elapsed {format_duration(elapsed)}  eta {format_duration(eta)}",
              file=self.stream or sys.stdout, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
