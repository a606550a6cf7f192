"""Optimizers and learning-rate schedules of the torch code paths (the RL learner on CPU or one
GPU, SFT, the tiny model's induction stage). The Megatron learner builds Megatron-Core's own
optimizer (:mod:`agentrl.learner.megatron.parallel`) and switches it to the fused kernel with
:func:`fuse_adamw`. Knows nothing of configs or models.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["adamw", "fuse_adamw", "plateau_schedule", "torch_optimizers"]


def adamw(params: Iterable["torch.nn.Parameter"], lr: float, *, weight_decay: float = 0.0,
          betas: tuple[float, float] = (0.9, 0.98)) -> "torch.optim.AdamW":
    """AdamW over ``params`` (the defaults are those of SFT and the induction stage)."""
    import torch

    params = list(params)
    # on a GPU, torch's fused kernel (fuse_adamw says why); elsewhere torch's default
    fused = True if params and all(p.is_cuda for p in params) else None
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), fused=fused)


def torch_optimizers(opt: object) -> list["torch.optim.Optimizer"]:
    """The torch optimizers in ``opt``: itself, or those Megatron's wrappers hold
    (``.optimizer``, ``.chained_optimizers``)."""
    import torch

    if opt is None:
        return []
    if isinstance(opt, torch.optim.Optimizer):
        return [opt]
    inner = list(getattr(opt, "chained_optimizers", None) or []) or [getattr(opt, "optimizer", None)]
    return [o for x in inner if x is not opt for o in torch_optimizers(x)]


def fuse_adamw(opt: object, device_types: tuple[str, ...] = ("cuda",)) -> int:
    """Switch the Adam(W) groups in ``opt`` whose parameters all live on ``device_types`` to
    torch's fused kernel; returns how many groups it switched (0: nothing to do).

    torch's default multi-tensor step takes the square root of every second moment of a group
    into one new list before it divides: a transient copy the size of the parameters (5.75 GiB
    of fp32 master weights at the 1.5B shape), on top of weights, gradients and both moments.
    The fused kernel updates each parameter in place from the same inputs with the same
    arithmetic. Megatron-Core builds a plain ``torch.optim.AdamW`` when neither Transformer
    Engine nor Apex is installed; this is applied to it after it is built, and again after a
    checkpoint's optimizer state is loaded (loading brings the saved groups' flags and may leave
    ``step`` counters on the host, where the fused kernel cannot read them).
    """
    import torch

    switched = 0
    for inner in torch_optimizers(opt):
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            params = group["params"]
            if not params or any(p.device.type not in device_types for p in params) or group.get("amsgrad") \
                    or group.get("differentiable") or group.get("capturable"):
                continue
            if not group.get("fused"):
                group["fused"], group["foreach"] = True, False
                switched += 1
            for p in params:
                state = inner.state.get(p)
                step = state.get("step") if state else None
                if torch.is_tensor(step) and (step.device != p.device or step.dtype != torch.float32):
                    state["step"] = step.to(device=p.device, dtype=torch.float32)
    return switched


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
