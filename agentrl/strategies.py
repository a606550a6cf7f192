"""Hypothesis strategies for losses, advantages and trajectories (re-exported by
:mod:`agentrl.testing`, which adds the invariant checks built on them)."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from hypothesis import strategies as st

from agentrl.config import ImportanceSamplingConfig, KLConfig, LossConfig
from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

__all__ = [
    "AGGREGATIONS",
    "BAND_TYPES",
    "IS_TYPES",
    "LossBatch",
    "LossFn",
    "loss_batches",
    "loss_configs",
    "reward_groups",
    "sequence_lengths",
    "trajectories",
    "trajectory_groups",
]

IS_TYPES = (
    "none", "token_tis", "seq_tis", "seq_tis_geo", "token_mask", "seq_mask_geo", "icepop", "seq_icepop", "gspo",
)
BAND_TYPES = ("token_mask", "seq_mask_geo", "icepop", "seq_icepop")
"""IS types that drop what lies outside ``[low, high]`` (per token, or per sequence by its geometric mean)."""
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


class LossFn(Protocol):
    """The signature of :func:`agentrl.learner.losses.compute_policy_loss`."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        prox_logprobs: torch.Tensor,
        behavior_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        cfg: LossConfig,
        *,
        ref_logprobs: torch.Tensor | None = None,
        num_tokens: float | None = None,
        num_sequences: float | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@dataclasses.dataclass(frozen=True)
class LossBatch:
    """The inputs of a policy loss, all ``[B, T]``; ``loss_mask`` is bool."""

    logprobs: torch.Tensor
    prox_logprobs: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    ref_logprobs: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.logprobs.shape

    def replace(self, **changes: torch.Tensor) -> LossBatch:
        """A copy with some tensors replaced."""
        return dataclasses.replace(self, **changes)

    def rows(self, index: list[int]) -> LossBatch:
        """The sub-batch of the given rows (sequences)."""
        return LossBatch(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))


# -------------------------------------------------------------------------------------- strategies


def _floats(draw: st.DrawFn, n: int, lo: float, hi: float) -> list[float]:
    return draw(
        st.lists(st.floats(lo, hi, allow_nan=False, allow_infinity=False), min_size=n, max_size=n)
    )


@st.composite
def loss_batches(
    draw: st.DrawFn,
    *,
    max_rows: int = 5,
    max_len: int = 8,
    max_log_ratio: float = 1.0,
    dtype: torch.dtype = torch.float64,
    sequence_advantages: bool = False,
    allow_empty: bool = False,
) -> LossBatch:
    """Padded token batches: random masks (gaps, empty rows), logprobs, advantages.

    ``log π_prox - log μ``, ``log π_θ - log π_prox`` and ``log π_ref - log π_θ`` are each within
    ``±max_log_ratio``. ``sequence_advantages`` gives every token of a row the same advantage.
    At least one token is masked in unless ``allow_empty``.
    """
    num_rows, length = draw(st.integers(1, max_rows)), draw(st.integers(1, max_len))
    n = num_rows * length
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    if not allow_empty and not any(mask):
        mask[draw(st.integers(0, n - 1))] = True
    if sequence_advantages:
        adv = [a for a in _floats(draw, num_rows, -3.0, 3.0) for _ in range(length)]
    else:
        adv = _floats(draw, n, -3.0, 3.0)
    behavior = torch.tensor(_floats(draw, n, -6.0, 0.0), dtype=dtype)
    prox = behavior + torch.tensor(_floats(draw, n, -max_log_ratio, max_log_ratio), dtype=dtype)
    logprobs = prox + torch.tensor(_floats(draw, n, -max_log_ratio, max_log_ratio), dtype=dtype)
    ref = logprobs + torch.tensor(_floats(draw, n, -max_log_ratio, max_log_ratio), dtype=dtype)
    shape = (num_rows, length)
    return LossBatch(
        logprobs=logprobs.reshape(shape),
        prox_logprobs=prox.reshape(shape),
        behavior_logprobs=behavior.reshape(shape),
        advantages=torch.tensor(adv, dtype=dtype).reshape(shape),
        loss_mask=torch.tensor(mask).reshape(shape),
        ref_logprobs=ref.reshape(shape),
    )


@st.composite
def loss_configs(
    draw: st.DrawFn,
    *,
    types: tuple[str, ...] = IS_TYPES,
    aggregations: tuple[str, ...] = AGGREGATIONS,
    proximal: tuple[str, ...] = ("recompute", "bypass"),
    dual_clip: bool = True,
    kl: bool = True,
) -> LossConfig:
    """Sensible loss configs: clip ranges > 0, caps >= 1, mask bands around 1, optional KL."""
    coef = draw(st.one_of(st.just(0.0), st.floats(0.01, 1.0))) if kl else 0.0
    return LossConfig(
        clip_low=draw(st.floats(0.05, 0.6)),
        clip_high=draw(st.floats(0.05, 0.6)),
        dual_clip=draw(st.one_of(st.none(), st.floats(1.05, 4.0))) if dual_clip else None,
        proximal=draw(st.sampled_from(proximal)),
        aggregation=draw(st.sampled_from(aggregations)),
        importance_sampling=ImportanceSamplingConfig(
            type=draw(st.sampled_from(types)),
            cap=draw(st.floats(1.0, 4.0)),
            low=draw(st.floats(0.2, 0.95)),
            high=draw(st.floats(1.05, 3.0)),
        ),
        kl=KLConfig(coef=coef, estimator=draw(st.sampled_from(["k1", "k2", "k3"]))),
    )


@st.composite
def reward_groups(draw: st.DrawFn, *, min_size: int = 1, max_size: int = 8) -> torch.Tensor:
    """``[G]`` float64 rewards of one group: binary (ties are common), small integers, or real."""
    size = draw(st.integers(min_size, max_size))
    element = draw(
        st.sampled_from(
            [st.sampled_from([0.0, 1.0]), st.integers(-3, 3).map(float), st.floats(-5.0, 5.0)]
        )
    )
    return torch.tensor(draw(st.lists(element, min_size=size, max_size=size)), dtype=torch.float64)


def sequence_lengths(*, max_count: int = 16, max_len: int = 512) -> st.SearchStrategy[list[int]]:
    """Lists of sequence lengths: uniform, all equal, or long-tailed (many short, a few long)."""
    uniform = st.lists(st.integers(1, max_len), min_size=1, max_size=max_count)
    equal = st.tuples(st.integers(1, max_len), st.integers(1, max_count)).map(
        lambda p: [p[0]] * p[1]
    )
    short = st.integers(1, max(1, max_len // 16))
    tailed = st.tuples(
        st.lists(short, min_size=1, max_size=max_count),
        st.lists(
            st.integers(max(1, max_len // 2), max_len), min_size=1, max_size=max(1, max_count // 8)
        ),
    ).map(lambda p: (p[0] + p[1])[:max_count])
    return st.one_of(uniform, equal, tailed)


@st.composite
def trajectories(
    draw: st.DrawFn,
    *,
    max_turns: int = 4,
    max_segment: int = 4,
    final_reward_only: bool = False,
    statuses: tuple[str, ...] = ("ok", "truncated", "failed"),
) -> Trajectory:
    """Multi-turn trajectories: prompt, then turns of sampled tokens separated by observations."""
    mask = [0] * draw(st.integers(1, 4))
    spans = []
    num_turns = draw(st.integers(1, max_turns))
    for k in range(num_turns):
        if k:
            mask += [0] * draw(st.integers(1, max_segment))
        start = len(mask)
        mask += [1] * draw(st.integers(1, max_segment))
        spans.append((start, len(mask)))
    reward = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-2.0, 2.0))
    if final_reward_only:
        rewards = [0.0] * (num_turns - 1) + [draw(reward)]
    else:
        rewards = draw(st.lists(reward, min_size=num_turns, max_size=num_turns))
    return Trajectory(
        token_ids=list(range(len(mask))),
        loss_mask=mask,
        behavior_logprobs=[-0.5 if m else 0.0 for m in mask],
        policy_versions=[0 if m else -1 for m in mask],
        turn_spans=spans,
        turn_rewards=rewards,
        status=draw(st.sampled_from(statuses)),
    )


@st.composite
def trajectory_groups(
    draw: st.DrawFn, *, min_size: int = 1, max_size: int = 6, **kwargs
) -> TrajectoryGroup:
    """Groups of :func:`trajectories` (keyword arguments are passed on)."""
    trajs = draw(st.lists(trajectories(**kwargs), min_size=min_size, max_size=max_size))
    return TrajectoryGroup(task_id="task", trajectories=trajs)
