"""A rich progress bar for training: step, reward, success, tokens/s, staleness, ETA."""

from __future__ import annotations

from typing import Any

__all__ = ["TrainProgress"]


class TrainProgress:
    def __init__(self, total: int, *, start: int = 0, enabled: bool = True) -> None:
        self.total = total
        self.start = start
        self.enabled = enabled
        self._progress = None

    def __enter__(self) -> "TrainProgress":
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.description}"),
            )
            self._progress.start()
            self._task = self._progress.add_task("", total=self.total, completed=self.start)
        return self

    def update(self, step: int, m: dict[str, Any]) -> None:
        line = (
            f"reward {m.get('rollout/reward', 0):.2f}  success {m.get('rollout/success', 0):.2f}  "
            f"tools {m.get('rollout/tool_use_rate', 0):.2f}  tok/s {m.get('rollout/tokens_per_s', 0):.0f}  "
            f"stale {m.get('replay/staleness_max', 0):.0f}  loss {m.get('train/loss', 0):+.4f}"
        )
        if self._progress is not None:
            self._progress.update(self._task, completed=step, description=line)
        elif self.enabled:
            print(f"step {step}/{self.total}  {line}", flush=True)

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
