"""Properties of the group advantage estimators and of turn-level credit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agentrl.learner.advantages import (
    ADVANTAGE_ESTIMATORS,
    group_advantages,
    trajectory_token_advantages,
    turn_returns,
)
from agentrl.config import AdvantageConfig, ConfigError
from agentrl.testing import reward_groups, trajectories, trajectory_groups
from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

FAST = settings(max_examples=80, deadline=None)
ESTIMATORS = tuple(ADVANTAGE_ESTIMATORS)


def test_registry_matches_config() -> None:
    assert set(ESTIMATORS) == {"grpo", "rloo", "dr_grpo"}
    for name in ESTIMATORS:
        assert AdvantageConfig(estimator=name).estimator == name
    with pytest.raises(ValueError, match="did you mean 'rloo'"):
        AdvantageConfig(estimator="rlo")
    with pytest.raises(ConfigError, match="did you mean 'rloo'"):
        group_advantages(torch.zeros(2), "rlo")


@FAST
@given(
    rewards=reward_groups(),
    normalize_std=st.booleans(),
    std_kind=st.sampled_from(["population", "sample"]),
)
def test_grpo_zero_mean_and_unit_std(rewards: torch.Tensor, normalize_std: bool, std_kind: str) -> None:
    adv = group_advantages(rewards, "grpo", normalize_std=normalize_std, std=std_kind)
    assert abs(float(adv.mean())) <= 1e-9 * max(1.0, float(adv.abs().max()))
    # Each convention makes the advantages' own std of that convention 1 (up to eps).
    correction = {"population": 0, "sample": 1}[std_kind]
    std = float(rewards.std(correction=correction)) if rewards.numel() > correction else 0.0
    if normalize_std and std > 1e-3:
        assert float(adv.std(correction=correction)) == pytest.approx(std / (std + 1e-6), rel=1e-9)
    if not normalize_std:
        torch.testing.assert_close(adv, rewards - rewards.mean(), rtol=0, atol=1e-12)


def _one_token_trajectory(reward: float) -> Trajectory:
    return Trajectory(token_ids=[1, 2], loss_mask=[0, 1], behavior_logprobs=[0.0, -1.0],
                      policy_versions=[-1, 0], turn_spans=[(1, 2)], turn_rewards=[reward])


@pytest.mark.parametrize(("std_kind", "expected"), [("population", 1.0), ("sample", 0.5**0.5)])
def test_grpo_std_conventions_on_two_rewards(std_kind: str, expected: float) -> None:
    # Rewards [1, 0]: population std 0.5 gives +-1.0 (agentrl's default); the Bessel-corrected
    # sample std 0.707 gives +-0.707 (verl, NeMo-RL).
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    adv = group_advantages(rewards, "grpo", eps=1e-12, std=std_kind)
    assert adv.tolist() == pytest.approx([expected, -expected], rel=1e-9)
    cfg = AdvantageConfig(std=std_kind, eps=1e-12)
    group = TrajectoryGroup("t", [_one_token_trajectory(1.0), _one_token_trajectory(0.0)])
    out = trajectory_token_advantages(group, cfg)
    assert [row[-1] for row in out] == pytest.approx([expected, -expected], rel=1e-9)


def test_std_convention_matters_only_for_normalized_grpo() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0], dtype=torch.float64)
    for estimator, normalize_std in [("grpo", False), ("rloo", True), ("dr_grpo", True)]:
        a, b = (group_advantages(rewards, estimator, normalize_std=normalize_std, std=k)
                for k in ("population", "sample"))
        assert torch.equal(a, b), estimator
    a, b = (group_advantages(rewards, "grpo", std=k) for k in ("population", "sample"))
    assert not torch.equal(a, b)
    with pytest.raises(ConfigError, match="did you mean 'sample'"):
        group_advantages(rewards, "grpo", std="sampel")
    with pytest.warns(UserWarning, match="advantage.std.*no effect"):
        AdvantageConfig(estimator="rloo", std="sample")


@FAST
@given(
    value=st.floats(-10, 10),
    size=st.integers(1, 8),
    estimator=st.sampled_from(ESTIMATORS),
    normalize_std=st.booleans(),
)
def test_equal_rewards_give_exactly_zero(
    value: float, size: int, estimator: str, normalize_std: bool
) -> None:
    adv = group_advantages(
        torch.full((size,), value, dtype=torch.float64), estimator, normalize_std=normalize_std
    )
    assert adv.tolist() == [0.0] * size


@FAST
@given(rewards=reward_groups())
def test_rloo_matches_its_definition(rewards: torch.Tensor) -> None:
    values = rewards.tolist()
    size = len(values)
    naive = [
        v - sum(values[:i] + values[i + 1 :]) / (size - 1) if size > 1 else 0.0
        for i, v in enumerate(values)
    ]
    torch.testing.assert_close(
        group_advantages(rewards, "rloo"),
        torch.tensor(naive, dtype=torch.float64),
        rtol=1e-12,
        atol=1e-12,
    )


@FAST
@given(rewards=reward_groups())
def test_dr_grpo_is_mean_centering_without_std(rewards: torch.Tensor) -> None:
    for normalize_std in (True, False):
        adv = group_advantages(rewards, "dr_grpo", normalize_std=normalize_std)
        torch.testing.assert_close(adv, rewards - rewards.mean(), rtol=0, atol=1e-12)


@FAST
@given(rewards=reward_groups(min_size=2), scale=st.floats(0.1, 10), shift=st.floats(-10, 10))
def test_grpo_invariant_to_affine_rewards(
    rewards: torch.Tensor, scale: float, shift: float
) -> None:
    assume(float(rewards.std(correction=0)) > 0.1)
    a = group_advantages(rewards, "grpo", eps=1e-12)
    b = group_advantages(rewards * scale + shift, "grpo", eps=1e-12)
    torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)


@FAST
@given(rewards=st.lists(st.floats(-5, 5), max_size=6), discount=st.floats(0, 1))
def test_turn_returns_closed_form(rewards: list[float], discount: float) -> None:
    got = turn_returns(rewards, discount)
    expected = [
        sum(discount ** (j - k) * rewards[j] for j in range(k, len(rewards)))
        for k in range(len(rewards))
    ]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert turn_returns(rewards, 0.0) == rewards


def _check_shape(group: TrajectoryGroup, out: list[list[float]]) -> None:
    assert len(out) == len(group.trajectories)
    for traj, adv in zip(group.trajectories, out):
        assert len(adv) == len(traj.token_ids)
        assert all(a == 0.0 for a, m in zip(adv, traj.loss_mask) if not m)
        if traj.status == "failed":
            assert all(a == 0.0 for a in adv)


@FAST
@given(
    group=trajectory_groups(final_reward_only=True),
    estimator=st.sampled_from(ESTIMATORS),
    normalize_std=st.booleans(),
)
def test_final_reward_discount_one_equals_episode_advantage(
    group, estimator: str, normalize_std: bool
) -> None:
    cfg = AdvantageConfig(estimator=estimator, normalize_std=normalize_std, turn_discount=1.0)
    out = trajectory_token_advantages(group, cfg)
    _check_shape(group, out)
    live = [i for i, t in enumerate(group.trajectories) if t.status != "failed"]
    assume(live)
    rewards = torch.tensor([group.trajectories[i].reward for i in live], dtype=torch.float64)
    episode = group_advantages(rewards, estimator, normalize_std=normalize_std).tolist()
    for j, i in enumerate(live):
        traj = group.trajectories[i]
        assert [a for a, m in zip(out[i], traj.loss_mask) if m] == [
            episode[j]
        ] * traj.num_sampled_tokens


@pytest.mark.filterwarnings("ignore:advantage.std=")
@FAST
@given(
    group=trajectory_groups(),
    cfg=st.builds(
        AdvantageConfig,
        estimator=st.just("grpo") | st.sampled_from(ESTIMATORS),
        normalize_std=st.booleans(),
        turn_discount=st.floats(0, 1),
        std=st.sampled_from(["population", "sample"]),
    ),
)
def test_turn_tokens_get_their_turns_return_to_go(group, cfg: AdvantageConfig) -> None:
    out = trajectory_token_advantages(group, cfg)
    _check_shape(group, out)
    live = [t for t in group.trajectories if t.status != "failed"]
    assume(live)
    # Naive recomputation: G_k per turn, the group's baseline/scale from the G_0 of live episodes.
    returns = [
        [
            sum(
                cfg.turn_discount ** (j - k) * t.turn_rewards[j]
                for j in range(k, len(t.turn_rewards))
            )
            for k in range(len(t.turn_rewards))
        ]
        for t in live
    ]
    g0 = [r[0] for r in returns]
    mean = sum(g0) / len(g0)
    for idx, traj in enumerate(live):
        if len(set(g0)) == 1:
            baseline, scale = g0[idx], 1.0
        elif cfg.estimator == "rloo":
            baseline, scale = (sum(g0) - g0[idx]) / (len(g0) - 1), 1.0
        elif cfg.estimator == "grpo" and cfg.normalize_std:
            dof = len(g0) - (cfg.std == "sample")
            std = (sum((x - mean) ** 2 for x in g0) / dof) ** 0.5
            baseline, scale = mean, std + cfg.eps
        else:
            baseline, scale = mean, 1.0
        adv = out[group.trajectories.index(traj)]
        for k, (start, end) in enumerate(traj.turn_spans):
            expected = (returns[idx][k] - baseline) / scale
            assert adv[start:end] == pytest.approx([expected] * (end - start), rel=1e-9, abs=1e-9)


@FAST
@given(
    group=trajectory_groups(statuses=("ok", "truncated")),
    failed=trajectories(statuses=("failed",)),
    estimator=st.sampled_from(ESTIMATORS),
    wild=st.floats(-100, 100),
)
def test_failed_trajectories_excluded_from_baseline(
    group, failed, estimator: str, wild: float
) -> None:
    cfg = AdvantageConfig(estimator=estimator, turn_discount=0.9)
    before = trajectory_token_advantages(group, cfg)
    failed.turn_rewards = [wild] * len(failed.turn_rewards)
    with_failed = TrajectoryGroup(task_id=group.task_id, trajectories=[failed, *group.trajectories])
    after = trajectory_token_advantages(with_failed, cfg)
    assert after[0] == [0.0] * len(failed)
    assert after[1:] == before


def test_all_failed_and_unspanned_trajectories() -> None:
    from agentrl.rollout.trajectory import Trajectory

    def traj(reward: float, status: str = "ok") -> Trajectory:
        # No turn_spans: the whole trajectory is one turn.
        return Trajectory(
            token_ids=[1, 2, 3],
            loss_mask=[0, 1, 1],
            behavior_logprobs=[0.0, -1.0, -1.0],
            policy_versions=[-1, 0, 0],
            turn_rewards=[reward],
            status=status,
        )

    cfg = AdvantageConfig(estimator="dr_grpo")
    assert trajectory_token_advantages(TrajectoryGroup("t", [traj(1.0, "failed")]), cfg) == [
        [0.0] * 3
    ]
    out = trajectory_token_advantages(TrajectoryGroup("t", [traj(1.0), traj(0.0)]), cfg)
    assert out == [[0.0, 0.5, 0.5], [0.0, -0.5, -0.5]]
