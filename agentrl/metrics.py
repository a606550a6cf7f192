"""Run metrics: JSONL (one object per step) and TensorBoard events in the run directory."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

__all__ = ["MetricsLogger", "read_metrics"]


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional at run time
                self._tb = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}; is it an agentrl run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
