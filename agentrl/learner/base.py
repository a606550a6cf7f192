"""The learner contract and the backend registry (:data:`LEARNERS`, :func:`register_learner`).

Every backend (the torch learner on CPU or small GPUs, the Megatron-Core learner on GPUs) exposes
the same five operations, so the trainer, the actors and the tests never know which one runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from agentrl.config.registry import LEARNERS, register_learner

if TYPE_CHECKING:
    import torch

    from agentrl.config import Config
    from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

__all__ = ["LEARNERS", "Learner", "build_learner", "learner_traits", "register_learner"]


@runtime_checkable
class Learner(Protocol):
    """What a learner backend provides.

    ``version`` counts optimizer steps taken; it is the weight version the engines report after a
    refit and the unit of the staleness bound.
    """

    version: int

    def train_step(self, groups: list["TrajectoryGroup"]) -> dict[str, float]:
        """One optimizer step on a batch of groups; returns namespaced metrics (``train/...``)."""
        ...

    def logprobs(self, trajectories: list["Trajectory"]) -> list[list[float]]:
        """Per-token logprobs of each trajectory under the current weights (0.0 at position 0)."""
        ...

    def export_weights(self, device: str = "cpu") -> dict[str, "torch.Tensor"]:
        """Full (gathered) weights with Hugging Face parameter names, on CPU (or on the learner's
        GPU with ``device="cuda"``, for a CUDA IPC or NCCL refit)."""
        ...

    def save(self, path: str | Path) -> None:
        """Model (Hugging Face format), optimizer, RNG and step counter."""
        ...

    def load(self, path: str | Path) -> None: ...


def build_learner(cfg: "Config", **kwargs: Any) -> Learner:
    """Construct the learner backend named by ``cfg.learner.backend``: a registered name
    (:data:`LEARNERS`; built-ins are imported only when selected, so core never imports Megatron)
    or ``module:name``.

    Raises:
        ConfigError: an unknown name (with a did-you-mean), a module that does not import or
            lacks the name.
    """
    return LEARNERS.resolve(cfg.learner.backend)(cfg, **kwargs)


def learner_traits(cfg: "Config") -> dict[str, Any]:
    """What ``cfg.learner.backend`` was registered with (:func:`register_learner`): ``distributed``
    (one actor per GPU in a torch.distributed group), ``lora``, ``dense_distill``. A built-in's
    traits are read without importing it."""
    return LEARNERS.meta(cfg.learner.backend)
