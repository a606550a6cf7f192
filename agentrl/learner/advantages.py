"""Group-relative advantages (GRPO, RLOO, Dr. GRPO) and turn-level credit for multi-turn episodes.

Every estimator is a baseline and a scale computed from the returns of the G episodes of one task:
``A_i = (x_i - baseline_i) / scale_i``. For plain episode advantages ``x_i`` is the episode's
return; for turn-level credit, the tokens of turn k get ``x = `` turn k's return-to-go, measured
against the same group baseline. With discount 1 and a reward only at the end both coincide.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

import torch

from agentrl.config import AdvantageConfig, ConfigError
from agentrl.config.registry import ADVANTAGE_ESTIMATORS, register_advantage_estimator
from agentrl.rollout.trajectory import TrajectoryGroup

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "STD_CORRECTIONS",
    "build_advantage_estimator",
    "group_advantages",
    "group_baseline",
    "register_advantage_estimator",
    "trajectory_token_advantages",
    "turn_returns",
]

Estimator = Callable[[torch.Tensor, bool, float, str], tuple[torch.Tensor, torch.Tensor]]
"""``(returns [G], normalize_std, eps, std) -> (baseline [G], scale [G])``."""

STD_CORRECTIONS: dict[str, int] = {"population": 0, "sample": 1}
"""``advantage.std`` -> Bessel correction of the group's standard deviation (divide by G - c)."""


def _grpo(
    returns: torch.Tensor, normalize_std: bool, eps: float, std: str = "population"
) -> tuple[torch.Tensor, torch.Tensor]:
    baseline = returns.mean().expand_as(returns)
    if not normalize_std:
        return baseline, returns.new_ones(()).expand_as(returns)
    if std not in STD_CORRECTIONS:
        hint = difflib.get_close_matches(std, list(STD_CORRECTIONS), n=1)
        raise ConfigError(
            f"unknown advantage.std '{std}'" + (f"; did you mean '{hint[0]}'?" if hint else "")
            + f" (known: {', '.join(STD_CORRECTIONS)})"
        )
    # A group of one has no sample std (0/0); it ties with itself and never reaches here.
    scale = returns.std(correction=STD_CORRECTIONS[std]) + eps
    return baseline, scale.expand_as(returns)


def _rloo(
    returns: torch.Tensor, normalize_std: bool, eps: float, std: str = "population"
) -> tuple[torch.Tensor, torch.Tensor]:
    # Leave-one-out: each episode against the mean of the others (an unbiased baseline).
    num = returns.numel()
    if num < 2:
        return returns.clone(), torch.ones_like(returns)
    return (returns.sum() - returns) / (num - 1), torch.ones_like(returns)


def _dr_grpo(
    returns: torch.Tensor, normalize_std: bool, eps: float, std: str = "population"
) -> tuple[torch.Tensor, torch.Tensor]:
    # Dr. GRPO drops the std division (it biases towards easy/hard groups); pair it with
    # loss.aggregation = seq_mean_token_sum, not a per-sequence length normalization.
    return returns.mean().expand_as(returns), torch.ones_like(returns)


def build_advantage_estimator(name: str) -> Estimator:
    """Look up an advantage estimator by its ``advantage.estimator`` name: a built-in one
    (``grpo``, ``rloo``, ``dr_grpo``) or ``module:name`` (:data:`ADVANTAGE_ESTIMATORS`).

    Raises:
        ConfigError: for an unknown name, with the closest known one; a module that does not
            import or lacks the name.
    """
    return ADVANTAGE_ESTIMATORS.resolve(name)


def group_baseline(
    returns: torch.Tensor,
    estimator: str,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    std: str = "population",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Baseline and scale of each episode of a group: ``A_i = (x_i - baseline_i) / scale_i``.

    A group whose returns all tie carries no relative signal: its baseline is the common return
    (exactly, so episode advantages are exactly 0) and its scale 1 (not ``eps``, which would blow up
    turn-level differences).

    Args:
        returns: ``[G]`` episode returns of one group.
        estimator: ``"grpo"``, ``"rloo"``, ``"dr_grpo"`` or ``module:name`` (one of your own).
        normalize_std: GRPO only: divide by the group's std plus ``eps``.
        eps: added to the standard deviation.
        std: GRPO's standard deviation: ``"population"`` (over G) or ``"sample"`` (over G - 1).
    """
    fn = build_advantage_estimator(estimator)
    if returns.numel() == 0 or bool((returns == returns.reshape(-1)[0]).all()):
        return returns.clone(), torch.ones_like(returns)
    return fn(returns, normalize_std, eps, std)


def group_advantages(
    rewards: torch.Tensor,
    estimator: str,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    std: str = "population",
) -> torch.Tensor:
    """Advantages of the G episodes of one task from their rewards.

    * ``grpo``: ``(r - mean) / (std + eps)``, with the population std (``std="population"``,
      over G) or the Bessel-corrected one (``"sample"``, over G - 1, verl's and NeMo-RL's), or
      ``r - mean`` without ``normalize_std``;
    * ``rloo``: ``r_i - mean_{j≠i} r_j``;
    * ``dr_grpo``: ``r - mean``.

    Args:
        rewards: ``[G]`` episode rewards.
        estimator: a name of :data:`ADVANTAGE_ESTIMATORS`, or ``module:name``.
        normalize_std: GRPO only (ignored by the others).
        eps: added to the standard deviation.
        std: GRPO only: ``"population"`` or ``"sample"`` standard deviation.

    Returns:
        ``[G]`` advantages; all zeros when the rewards tie.

    Example:
        >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), "rloo")
        tensor([ 0.6667, -0.6667, -0.6667,  0.6667])
        >>> group_advantages(torch.tensor([1.0, 0.0]), "grpo", eps=0.0, std="sample")
        tensor([ 0.7071, -0.7071])
    """
    baseline, scale = group_baseline(
        rewards, estimator, normalize_std=normalize_std, eps=eps, std=std
    )
    return (rewards - baseline) / scale


def turn_returns(turn_rewards: list[float], discount: float) -> list[float]:
    """Return-to-go after each turn: ``G_k = Σ_{j ≥ k} discount^(j-k) · r_j``.

    Example:
        >>> turn_returns([0.0, 1.0, 2.0], 0.5)
        [1.0, 2.0, 2.0]
    """
    returns = [0.0] * len(turn_rewards)
    acc = 0.0
    for k in range(len(turn_rewards) - 1, -1, -1):
        acc = float(turn_rewards[k]) + discount * acc
        returns[k] = acc
    return returns


def trajectory_token_advantages(group: TrajectoryGroup, cfg: AdvantageConfig) -> list[list[float]]:
    """Per-token advantages of every trajectory of a group, with turn-level credit.

    Each trajectory's return is ``G_0`` (its discounted return from the first turn); the group
    baseline and scale come from the returns of the trainable trajectories (the segments of one agent
    episode, which share ``info["episode"]``, as one). Every sampled token
    (``loss_mask == 1``) of turn k (``turn_spans[k]``) gets ``(G_k - baseline) / scale``, where
    ``G_k`` is turn k's return-to-go (:func:`turn_returns`; a turn without a reward of its own has
    the return-to-go of the rewards after it, 0 past the last one). Prompt and observation tokens
    get 0. A trajectory without ``turn_spans`` is one turn. Failed trajectories take no part in the
    baseline and get all zeros, as do those ``rollout.overlong = mask`` leaves out.

    Args:
        group: the G episodes of one task.
        cfg: the ``advantage`` section of the config.

    Returns:
        One list per trajectory (in ``group.trajectories`` order), as long as its ``token_ids``.
    """
    out = [[0.0] * len(t) for t in group.trajectories]
    live = [i for i, t in enumerate(group.trajectories) if t.trainable]
    if not live:
        return out
    per_turn = [turn_returns(group.trajectories[i].turn_rewards, cfg.turn_discount) for i in live]
    # The segments of one agent episode (info["episode"], agentrl.rollout.agent.recorder) count once in the
    # baseline: their mean return stands for the episode.
    keys = [group.trajectories[i].info.get("episode", f"#{i}") for i in live]
    episodes = list(dict.fromkeys(keys))
    sums = dict.fromkeys(episodes, 0.0)
    counts = dict.fromkeys(episodes, 0)
    for key, g in zip(keys, per_turn):
        sums[key] += g[0] if g else 0.0
        counts[key] += 1
    returns = torch.tensor([sums[e] / counts[e] for e in episodes], dtype=torch.float64)
    ep_baseline, ep_scale = group_baseline(
        returns, cfg.estimator, normalize_std=cfg.normalize_std, eps=cfg.eps, std=cfg.std
    )
    index = {e: k for k, e in enumerate(episodes)}
    baseline = [ep_baseline[index[key]] for key in keys]
    scale = [ep_scale[index[key]] for key in keys]
    for j, i in enumerate(live):
        traj = group.trajectories[i]
        spans = traj.turn_spans or [(0, len(traj))]
        for k, (start, end) in enumerate(spans):
            g_k = per_turn[j][k] if k < len(per_turn[j]) else 0.0
            adv = (g_k - float(baseline[j])) / float(scale[j])
            for pos in range(start, end):
                if traj.loss_mask[pos]:
                    out[i][pos] = adv
    return out
