"""Progress for a person watching: one line format for every stage of a run, with the time left.

Each stage prints ``STAGE step S/T  key value ...  elapsed H:MM:SS  eta H:MM:SS`` as it goes: the
tiny model's induction pre-stage (``bootstrap``), the SFT warm start (``sft``) and the RL steps
(``rl``), at most one line every ``every_s`` seconds (the first and the last step always), so a
slow run reads differently from a stuck one and the ETA tells how long the stage has left. The RL
stage shows a rich bar instead on a terminal; plain lines go to standard output everywhere else
(``agentrl train --no-progress``, a file, a pipe, a CI log). Every line also goes to
``RUN_DIR/progress.log`` (``tail -f`` it from another terminal), the bar's stage included::

    bootstrap step 300/500  loss 6.447  P(copy) 0.002  elapsed 0:00:36  eta 0:00:24
    sft step 120/694  epoch 1  loss 0.5083  elapsed 0:00:25  eta 0:02:00
    rl step 3/30  reward 0.41  success 0.38  tool 0.72  tok/s 812  stale 1  loss +0.0123  elapsed 0:00:12  eta 0:01:48
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Literal, TextIO

__all__ = ["StageProgress", "TrainProgress", "format_duration", "parse_progress_line", "progress_line"]


def format_duration(seconds: float) -> str:
    """``H:MM:SS``.

    >>> format_duration(3725.4)
    '1:02:05'
    """
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def progress_line(stage: str, step: int, total: int, fields: dict[str, Any], elapsed: float, eta: float | None) -> str:
    """One progress line; ``fields`` are shown as given (format numbers before); an ``eta`` of
    None (no pace known yet) shows as ``-``.

    >>> progress_line("sft", 120, 694, {"epoch": 1, "loss": "0.5083"}, 25.2, 119.6)
    'sft step 120/694  epoch 1  loss 0.5083  elapsed 0:00:25  eta 0:02:00'
    """
    parts = [f"{stage} step {step}/{total}", *(f"{key} {value}" for key, value in fields.items()),
             f"elapsed {format_duration(elapsed)}", f"eta {'-' if eta is None else format_duration(eta)}"]
    return "  ".join(parts)


def eta_seconds(elapsed: float, done: int, left: int) -> float:
    """The time ``left`` steps take at the pace of the ``done`` ones (0 before the first).

    >>> eta_seconds(20.0, 2, 10)
    100.0
    """
    return elapsed / done * max(left, 0) if done > 0 else 0.0


def parse_progress_line(line: str) -> dict[str, Any] | None:
    """The fields of one plain progress line, or None when ``line`` is not one.

    >>> parse_progress_line("rl step 3/30  reward 0.41  tok/s 812  stale 1  elapsed 0:00:12  eta 0:01:48")
    {'stage': 'rl', 'step': 3, 'total': 30, 'reward': 0.41, 'tok/s': 812.0, 'stale': 1.0, 'elapsed': '0:00:12', 'eta': '0:01:48'}
    """
    parts = line.strip().split()
    stage = None
    if len(parts) > 2 and parts[0] != "step" and parts[1] == "step":  # the stage's name first
        stage, parts = parts[0], parts[1:]
    if len(parts) < 2 or parts[0] != "step" or "/" not in parts[1] or len(parts) % 2:
        return None
    try:
        step, total = (int(x) for x in parts[1].split("/"))
        out: dict[str, Any] = ({"stage": stage} if stage else {}) | {"step": step, "total": total}
        for key, value in zip(parts[2::2], parts[3::2]):
            out[key] = value if key in ("elapsed", "eta") else float(value)
    except ValueError:
        return None
    return out


class StageProgress:
    """Plain progress lines of one stage (``bootstrap``, ``sft``): ``update(step, total, fields)``
    after each step writes one through ``log`` and to ``log_file`` when the first or last step is
    done or ``every_s`` have passed since the last line. ``elapsed`` counts from when the object is
    made; the ETA is the steps left at the pace since the first update (``-`` on the first line:
    what comes before the first step, such as building the data, is not a step's pace)."""

    def __init__(self, stage: str, *, every_s: float = 5.0, log: Callable[[str], Any] = print,
                 log_file: str | Path | None = None) -> None:
        self.stage = stage
        self.every_s = every_s
        self.log = log
        self.log_file = Path(log_file) if log_file else None
        self._t0 = time.perf_counter()
        self._first: tuple[float, int] | None = None  # (time, step) of the first update
        self._last_print = -float("inf")

    def update(self, step: int, total: int, fields: dict[str, Any]) -> str | None:
        """The line written, or None when this step is not shown."""
        now = time.perf_counter()
        if self._first is None:
            self._first = (now, step)
        if not (step == 1 or step >= total or now - self._last_print >= self.every_s):
            return None
        self._last_print = now
        elapsed = now - self._t0
        t1, s1 = self._first
        eta = eta_seconds(now - t1, step - s1, total - step) if step > s1 else (0.0 if step >= total else None)
        line = progress_line(self.stage, step, total, fields, elapsed, eta)
        self.log(line)
        append_line(self.log_file, line)
        return line


def append_line(path: Path | None, line: str) -> None:
    """Append ``line`` to ``path`` (none: nothing); the folder is made if missing."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(line + "\n")


class TrainProgress:
    """Progress of ``total`` steps, from ``start`` (a resumed run).

    Args:
        mode: ``"auto"``: a bar on a terminal, plain lines otherwise; ``"bar"``; ``"lines"``.
        every_s: plain lines: at most one per this many seconds (the first and last step always).
        stream: where plain lines go (default: standard output).
        log_file: every plain line is appended here too, also while the bar shows.
    """

    def __init__(self, total: int, *, start: int = 0, mode: Literal["auto", "bar", "lines"] = "auto",
                 every_s: float = 5.0, stream: TextIO | None = None, log_file: str | Path | None = None) -> None:
        self.total = total
        self.log_file = Path(log_file) if log_file else None
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
                TextColumn("[bold]rl"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.description}"),
            )
            self._progress.start()
            self._task = self._progress.add_task("", total=self.total, completed=self.start)
        return self

    @staticmethod
    def fields(m: dict[str, Any]) -> dict[str, str]:
        """What a line shows of a step's metrics."""
        return {"reward": f"{m.get('rollout/reward', 0):.2f}", "success": f"{m.get('rollout/success', 0):.2f}",
                "tool": f"{m.get('rollout/tool_use_rate', 0):.2f}", "tok/s": f"{m.get('rollout/tokens_per_s', 0):.0f}",
                "stale": f"{m.get('replay/staleness_max', 0):.0f}", "loss": f"{m.get('train/loss', 0):+.4f}"}

    @classmethod
    def describe(cls, m: dict[str, Any]) -> str:
        return "  ".join(f"{key} {value}" for key, value in cls.fields(m).items())

    def update(self, step: int, m: dict[str, Any]) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, description=self.describe(m))
        now = time.perf_counter()
        first, last = step == self.start + 1, step >= self.total
        if not (first or last or now - self._last_print >= self.every_s):
            return
        self._last_print = now
        elapsed = now - self._t0
        text = progress_line("rl", step, self.total, self.fields(m), elapsed,
                             eta_seconds(elapsed, step - self.start, self.total - step))
        append_line(self.log_file, text)
        if self._progress is None:
            print(text, file=self.stream or sys.stdout, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
