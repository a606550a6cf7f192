"""Ray actor around a learner backend (see :mod:`agentrl.learners.base`)."""

from __future__ import annotations

from typing import Any

import ray

from agentrl.config import Config

__all__ = ["LearnerActor"]


@ray.remote
class LearnerActor:
    def __init__(self, cfg: Config, model_path: str, **kwargs: Any) -> None:
        import torch

        from agentrl.learners.base import build_learner

        torch.set_num_threads(max(1, int(cfg.learner.num_cpus)))
        self.learner = build_learner(cfg, model_path=model_path, **kwargs)

    def train_step(self, groups) -> dict[str, float]:
        return self.learner.train_step(groups)

    def logprobs(self, trajectories) -> list[list[float]]:
        return self.learner.logprobs(trajectories)

    def export_weights(self) -> dict:
        return self.learner.export_weights()

    def version(self) -> int:
        return self.learner.version

    def save(self, path: str) -> None:
        self.learner.save(path)

    def load(self, path: str) -> int:
        self.learner.load(path)
        return self.learner.version
