"""The main job: (bootstrap) -> (SFT warm start, cached) -> async RL -> held-out eval."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from agentrl.config import Config

__all__ = ["train"]


def _explicit_ray_auth_mode(cfg: Config) -> None:
    # Ray (2.5x) turns token authentication on for a new local cluster (the trainer starts one when
    # cluster.address is None) and warns that it did, unless RAY_AUTH_MODE names the mode. Name the
    # same secure mode, before Ray is imported (Ray reads it once, at import); a cluster joined by
    # address keeps its own setting.
    if cfg.cluster.address is None and "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")


@contextlib.contextmanager
def _torch_threads(n: int | None):
    """torch's intra-op threads set to ``n`` inside (None: unchanged)."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train(cfg: Config, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    _explicit_ray_auth_mode(cfg)
    from agentrl.actors.runtime_env import build_runtime_env
    from agentrl.env.ids import check_env
    from agentrl.model.loading import resolve_model_path
    from agentrl.config.registry import check_components
    from agentrl.driver.trainer import Trainer

    # Mistakes in the env or the runtime env fail here, before the model is made, SFT or Ray start.
    if cfg.agent.solve is not None:  # the agent's functions and tasks: imported (and shipped) like env modules
        from agentrl.rollout.agent.user import load_agent

        load_agent(cfg.agent)
    if cfg.agent.solve is None or cfg.sft.enabled:
        check_env(cfg.env.id, cfg.env.kwargs, need_expert=cfg.sft.enabled)
    check_components(cfg)  # a user's loss, advantage estimator or learner backend (module:name)
    build_runtime_env(cfg)
    if cfg.metrics.wandb.enabled:
        from agentrl.driver.metrics import require_wandb

        require_wandb()
    from agentrl.driver.progress import StageProgress

    log_file = Path(cfg.run_dir) / "progress.log"  # every stage's progress lines, beside the terminal's
    with _torch_threads(cfg.sft.num_threads):
        model_path = resolve_model_path(cfg, progress=StageProgress("bootstrap", log_file=log_file).update)
        if cfg.sft.enabled:
            from agentrl.driver.sft import run_sft

            model_path = str(run_sft(cfg, log_file=log_file))
    summary: dict[str, Any] = {}
    trainer = Trainer(cfg, model_path=model_path, resume=resume, progress=progress)
    try:
        summary.update(trainer.run())
    finally:
        trainer.shutdown()
    return summary
