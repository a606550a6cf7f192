"""The public checks of agentrl.testing catch broken losses, and the losses guide's example runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from agentrl.config import ImportanceSamplingConfig, LossConfig
from agentrl.docs import code_blocks
from agentrl.learner.losses import compute_policy_loss
from agentrl.testing import (
    check_clipping,
    check_importance_weights,
    check_masked_tokens_ignored,
    check_microbatch_invariance,
    check_on_policy_gradient,
    check_policy_loss,
    loss_configs,
    sequence_lengths,
    trajectory_groups,
)

# ------------------------------------------------------- the example of docs/guides/losses.md, as written

GUIDE = Path(__file__).resolve().parents[1] / "docs/guides/losses.md"


def test_guide_example_runs():
    """The guide's "Test your own loss" block (marked doc-test for this file), executed as written."""
    (block,) = [b for b in code_blocks(GUIDE) if b.mark == "doc-test" and b.mark_value.endswith("test_testing_helpers.py")]
    namespace: dict = {}
    exec(compile(block.code, block.where, "exec"), namespace)
    namespace["test_reinforce_tis_loss"]()


# ------------------------------------------------------------------------------------ broken losses

QUICK = settings(
    max_examples=100,
    deadline=None,
    phases=[Phase.generate],
    database=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def ignores_mask(logprobs, prox_logprobs, behavior_logprobs, advantages, loss_mask, cfg, **_):
    per_token = -torch.exp(logprobs - prox_logprobs.detach()) * advantages
    return per_token.sum() / loss_mask.sum().clamp(min=1), {}


def multiplies_by_mask(logprobs, prox_logprobs, behavior_logprobs, advantages, loss_mask, cfg, **_):
    mask = loss_mask.to(logprobs.dtype)
    per_token = -torch.exp(logprobs - prox_logprobs.detach()) * advantages * mask
    return per_token.sum() / mask.sum().clamp(min=1), {}


def local_counts(*args, num_tokens=None, num_sequences=None, **kwargs):
    return compute_policy_loss(*args, **kwargs)


def sign_flipped(*args, **kwargs):
    loss, metrics = compute_policy_loss(*args, **kwargs)
    return -loss, metrics


def untruncated(logprobs, prox, behavior, adv, mask, cfg, **kwargs):
    cfg = cfg.model_copy(
        update={"importance_sampling": cfg.importance_sampling.model_copy(update={"cap": 1e9})}
    )
    return compute_policy_loss(logprobs, prox, behavior, adv, mask, cfg, **kwargs)


def optimistic_clip(logprobs, prox_logprobs, behavior_logprobs, advantages, loss_mask, cfg, **_):
    # max instead of min: the clip then lets the ratio run away instead of stopping it.
    mask = loss_mask.bool()
    ratio = torch.exp(torch.where(mask, logprobs - prox_logprobs, 0.0))
    adv = torch.where(mask, advantages, 0.0)
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token = -torch.maximum(ratio * adv, clipped * adv)
    return per_token.sum() / mask.sum().clamp(min=1), {}


def leaky_metric(*args, **kwargs):
    loss, metrics = compute_policy_loss(*args, **kwargs)
    metrics["train/advantage_mean"] = args[3].mean()  # the padding's advantages leak in
    return loss, metrics


TOKEN_MEAN = loss_configs(
    aggregations=("token_mean",), types=("token_tis",), proximal=("recompute",)
)


@pytest.mark.parametrize(
    ("broken", "check", "cfg"),
    [
        (ignores_mask, check_masked_tokens_ignored, TOKEN_MEAN),
        (multiplies_by_mask, check_masked_tokens_ignored, TOKEN_MEAN),
        (leaky_metric, check_masked_tokens_ignored, TOKEN_MEAN),
        (local_counts, check_microbatch_invariance, loss_configs()),
        (sign_flipped, check_on_policy_gradient, loss_configs()),
        (untruncated, check_importance_weights, TOKEN_MEAN),
        (optimistic_clip, check_clipping, TOKEN_MEAN),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_checks_catch_broken_losses(broken, check, cfg) -> None:
    with pytest.raises(AssertionError):
        check(broken, cfg, settings=QUICK)


def test_subtler_bugs_are_caught() -> None:
    # A GSPO with per-token ratios, or a loss without its dual clip, is not this library's loss.
    def token_ratio_gspo(logprobs, prox, behavior, adv, mask, cfg, **kwargs):
        is_cfg = cfg.importance_sampling.model_copy(update={"type": "seq_tis_geo"})
        return compute_policy_loss(
            logprobs,
            prox,
            behavior,
            adv,
            mask,
            cfg.model_copy(update={"importance_sampling": is_cfg}),
            **kwargs,
        )

    with pytest.raises(AssertionError):
        check_clipping(token_ratio_gspo, loss_configs(types=("gspo",)), settings=QUICK)

    def no_dual_clip(logprobs, prox, behavior, adv, mask, cfg, **kwargs):
        return compute_policy_loss(
            logprobs,
            prox,
            behavior,
            adv,
            mask,
            cfg.model_copy(update={"dual_clip": None}),
            **kwargs,
        )

    with pytest.raises(AssertionError):
        check_clipping(no_dual_clip, LossConfig(dual_clip=1.5), settings=QUICK)


def test_check_policy_loss_passes_the_builtin_loss() -> None:
    check_policy_loss(
        compute_policy_loss,
        LossConfig(importance_sampling=ImportanceSamplingConfig(type="seq_tis")),
        max_examples=15,
    )


# -------------------------------------------------------------------------------------- strategies


@settings(max_examples=50, deadline=None)
@given(lengths=sequence_lengths(max_count=8, max_len=64))
def test_sequence_lengths_within_bounds(lengths: list[int]) -> None:
    assert 1 <= len(lengths) <= 8 and all(1 <= n <= 64 for n in lengths)


@settings(max_examples=50, deadline=None)
@given(group=trajectory_groups())
def test_trajectory_groups_are_consistent(group) -> None:
    for traj in group.trajectories:
        in_span = [any(s <= i < e for s, e in traj.turn_spans) for i in range(len(traj))]
        assert [bool(m) for m in traj.loss_mask] == in_span
        assert len(traj.turn_rewards) == len(traj.turn_spans) >= 1


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_loss_configs_respect_requests(data: st.DataObject) -> None:
    cfg = data.draw(
        loss_configs(
            types=("gspo",), aggregations=("seq_mean_token_sum",), dual_clip=False, kl=False
        )
    )
    assert cfg.importance_sampling.type == "gspo" and cfg.aggregation == "seq_mean_token_sum"
    assert cfg.dual_clip is None and cfg.kl.coef == 0
