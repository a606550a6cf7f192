"""Run metrics: JSONL (one object per step) and TensorBoard events in the run directory, and
Weights & Biases when ``metrics.wandb.enabled`` (the same rows, the config, the summary)."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.config import WandbConfig

__all__ = ["MetricsLogger", "read_metrics", "require_wandb"]

WANDB_ID_FILE = "wandb_run_id"  # in the run directory: --resume continues the same W&B run


def require_wandb(key: str = "metrics.wandb.enabled") -> None:
    """Raise ConfigError unless the ``wandb`` package can be imported (checked before a run starts)."""
    from agentrl.config import ConfigError

    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"{key}: true, but the wandb package is not installed: pip install 'agentrl[wandb]' "
                          "(or set it to false)")


class MetricsLogger:
    """Writes each step's metrics to every sink of the run.

    Args:
        run_dir: the run directory (``metrics.jsonl``, ``tensorboard/``, ``wandb/``).
        tensorboard: write TensorBoard events.
        wandb: the ``metrics.wandb`` section; logs to W&B when enabled.
        config: the resolved run config, recorded as the W&B run's config.
        resume: continue the W&B run this run directory started (its id is kept in the directory).
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, wandb: "WandbConfig | None" = None,
                 config: dict[str, Any] | None = None, resume: bool = False) -> None:
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
        self._wandb = self._start_wandb(wandb, config, resume) if wandb is not None and wandb.enabled else None

    def _start_wandb(self, wc: "WandbConfig", config: dict[str, Any] | None, resume: bool) -> Any:
        require_wandb()
        import wandb

        id_file = self.run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        run = wandb.init(
            project=wc.project, entity=wc.entity, name=wc.name or self.run_dir.resolve().name, tags=list(wc.tags),
            config=config, dir=str(self.run_dir), mode=wc.mode, id=run_id, resume="allow" if run_id else None,
        )
        id_file.write_text(run.id)
        return run

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        """The run's final numbers (summary.json): the W&B run summary."""
        if self._wandb is not None:
            self._wandb.summary.update({k: _plain(v) for k, v in values.items()})

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}; is it an agentrl run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
