"""Optimizers and learning-rate schedules of the torch code paths (the RL learner on CPU or one
GPU, SFT, the tiny model's induction stage). The Megatron learner builds Megatron-Core's own
optimizer (:mod:`agentrl.learners.megatron.parallel`). Knows nothing of configs or models.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["adamw", "plateau_schedule"]


def adamw(params: Iterable["torch.nn.Parameter"], lr: float, *, weight_decay: float = 0.0,
          betas: tuple[float, float] = (0.9, 0.98)) -> "torch.optim.AdamW":
    """AdamW over ``params`` (the defaults are those of SFT and the induction stage)."""
    import torch

    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas))


def plateau_schedule(opt: "torch.optim.Optimizer", total: int) -> "torch.optim.lr_scheduler.LambdaLR":
    """Learning rate over ``total`` steps: 20 steps of warm-up, a long plateau (a copy skill is
    learned late, in a sudden drop), then a linear decay over the last 30 % to 5 %.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> sched = plateau_schedule(opt, 100)
        >>> lrs = []
        >>> for _ in range(100):
        ...     lrs.append(sched.get_last_lr()[0]); opt.step(); sched.step()
        >>> lrs[0], lrs[19], lrs[50], round(lrs[99], 3)
        (0.05, 1.0, 1.0, 0.05)
    """
    import torch

    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 20, max(0.05, (total - i) / (0.3 * total))))
