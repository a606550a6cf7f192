"""Properties of the built-in policy loss, proven with the public checks of agentrl.testing."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.config import ConfigError, ImportanceSamplingConfig, KLConfig, LossConfig
from agentrl.learner.losses import (
    IS_CORRECTIONS,
    KL_ESTIMATORS,
    aggregate_token_losses,
    build_is_correction,
    compute_policy_loss,
    count_tokens_and_sequences,
    kl_estimate,
)
from agentrl.testing import (
    AGGREGATIONS,
    BAND_TYPES,
    IS_TYPES,
    check_clipping,
    check_importance_weights,
    check_masked_tokens_ignored,
    check_microbatch_invariance,
    check_on_policy_gradient,
    expected_normalizer,
    loss_batches,
    loss_configs,
    reference_is_weights,
)

FAST = settings(max_examples=60, deadline=None)


def test_registry_matches_config_types() -> None:
    assert set(IS_CORRECTIONS) == set(IS_TYPES)
    literal = ImportanceSamplingConfig.model_fields["type"].annotation.__args__
    assert set(literal) == set(IS_CORRECTIONS)
    assert set(LossConfig.model_fields["aggregation"].annotation.__args__) == set(AGGREGATIONS)
    assert set(KLConfig.model_fields["estimator"].annotation.__args__) == set(KL_ESTIMATORS)


@pytest.mark.parametrize("is_type", IS_TYPES)
def test_on_policy_gradient_is_plain_policy_gradient(is_type: str) -> None:
    check_on_policy_gradient(compute_policy_loss, loss_configs(types=(is_type,)), max_examples=25)


def test_masked_tokens_never_matter() -> None:
    check_masked_tokens_ignored(compute_policy_loss, loss_configs(), max_examples=80)


def test_microbatch_invariance() -> None:
    check_microbatch_invariance(compute_policy_loss, loss_configs(), max_examples=80)


def test_clipping_pessimistic_and_zero_gradient_where_active() -> None:
    check_clipping(compute_policy_loss, loss_configs(), max_examples=80)


@pytest.mark.parametrize("is_type", IS_TYPES)
def test_importance_weights_match_definitions(is_type: str) -> None:
    check_importance_weights(compute_policy_loss, loss_configs(types=(is_type,)), max_examples=25)


@FAST
@given(batch=loss_batches(max_log_ratio=2.0), cfg=loss_configs(proximal=("recompute",)))
def test_is_weights_truncated_and_masks_exact(batch, cfg: LossConfig) -> None:
    is_cfg = cfg.importance_sampling
    mask = batch.loss_mask
    log_ratio = torch.where(mask, batch.prox_logprobs - batch.behavior_logprobs, 0.0)
    out = IS_CORRECTIONS[is_cfg.type](log_ratio, mask, is_cfg)
    assert not out.weights.requires_grad
    assert bool((out.weights[~mask] == 0).all()) and not bool(out.kept[~mask].any())
    expected = reference_is_weights(batch.prox_logprobs, batch.behavior_logprobs, mask, is_cfg)
    if is_cfg.type in BAND_TYPES:
        # Exactly the out-of-band tokens (sequences) are dropped (weight 0). Kept ones keep weight 1
        # (rejection sampling) or their own ratio truncated at the cap (IcePop).
        assert bool((out.weights[~out.kept] == 0).all())
        if is_cfg.type in ("token_mask", "seq_mask_geo"):
            assert bool((out.weights[out.kept] == 1).all())
        else:
            ratio = log_ratio.exp()
            torch.testing.assert_close(
                out.weights[out.kept], ratio.clamp(max=is_cfg.cap)[out.kept], rtol=1e-9, atol=0
            )
            assert torch.equal(out.truncated, out.kept & (log_ratio > math.log(is_cfg.cap)))
        wide = is_cfg.model_copy(
            update={"low": is_cfg.low * (1 - 1e-9), "high": is_cfg.high * (1 + 1e-9)}
        )
        narrow = is_cfg.model_copy(
            update={"low": is_cfg.low * (1 + 1e-9), "high": is_cfg.high * (1 - 1e-9)}
        )
        inside = (
            reference_is_weights(batch.prox_logprobs, batch.behavior_logprobs, mask, narrow) > 0
        )
        outside = (
            reference_is_weights(batch.prox_logprobs, batch.behavior_logprobs, mask, wide) == 0
        )
        assert not bool((out.kept & outside).any()) and bool(out.kept[inside].all())
    else:
        assert bool((out.weights <= is_cfg.cap * (1 + 1e-12)).all())
        torch.testing.assert_close(out.weights, expected, rtol=1e-9, atol=0)
        assert torch.equal(out.kept, mask)
        uncapped = reference_is_weights(
            batch.prox_logprobs,
            batch.behavior_logprobs,
            mask,
            is_cfg.model_copy(update={"cap": math.inf}),
        )
        edge = (uncapped - is_cfg.cap).abs() <= 1e-9 * is_cfg.cap
        truncated = mask & (uncapped > is_cfg.cap) & (is_cfg.type != "none")
        assert torch.equal(out.truncated | edge, truncated | edge)


@pytest.mark.parametrize(
    ("is_type", "expected"),
    [("token_mask", -1.0), ("seq_mask_geo", -1.0), ("icepop", -1.5), ("seq_icepop", -1.5)],
)
def test_rejection_sampling_vs_icepop_worked_example(is_type: str, expected: float) -> None:
    # One token, rho = pi_prox / mu = 1.5, A = 1, pi = pi_prox, band [0.5, 2]: rejection sampling
    # keeps the token at weight 1 (loss -1.0), IcePop at weight rho (loss -1.5, NeMo-RL's icepop).
    prox = torch.tensor([[-1.0]], dtype=torch.float64)
    behavior = prox - math.log(1.5)
    logprobs = prox.clone().requires_grad_(True)
    cfg = LossConfig(importance_sampling=ImportanceSamplingConfig(type=is_type, low=0.5, high=2.0, cap=2.0))
    loss, m = compute_policy_loss(logprobs, prox, behavior, torch.ones(1, 1), torch.ones(1, 1), cfg)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    assert float(m["train/is_weight_mean"]) == pytest.approx(-expected, rel=1e-12)
    # Out of the band (rho = 3 > 2) every one of them drops the token.
    loss, m = compute_policy_loss(logprobs, prox, prox - math.log(3.0), torch.ones(1, 1), torch.ones(1, 1), cfg)
    assert float(loss.detach()) == 0.0 and float(m["train/is_masked_token_frac"]) == 1.0


@FAST
@given(
    batch=loss_batches(max_log_ratio=2.0),
    cap=st.floats(0.5, 4.0),
    low=st.floats(0.0, 0.95),
    high=st.floats(1.05, 5.0),
)
def test_icepop_is_the_rejection_mask_times_the_truncated_ratio(batch, cap, low, high) -> None:
    mask = batch.loss_mask
    log_ratio = torch.where(mask, batch.prox_logprobs - batch.behavior_logprobs, 0.0)
    ratio = torch.where(mask, log_ratio.exp().clamp(max=cap), 0.0)
    for icepop, rejection in (("icepop", "token_mask"), ("seq_icepop", "seq_mask_geo")):
        ice = build_is_correction(icepop)(log_ratio, mask, ImportanceSamplingConfig(type=icepop, cap=cap, low=low, high=high))
        rej = build_is_correction(rejection)(log_ratio, mask, ImportanceSamplingConfig(type=rejection, low=low, high=high))
        assert torch.equal(ice.kept, rej.kept)
        torch.testing.assert_close(ice.weights, rej.weights * ratio, rtol=1e-12, atol=0)
    # A band that keeps everything makes icepop token_tis.
    wide = ImportanceSamplingConfig(type="icepop", cap=cap, low=0.0, high=1e9)
    tis = build_is_correction("token_tis")(log_ratio, mask, wide)
    ice = build_is_correction("icepop")(log_ratio, mask, wide)
    assert torch.equal(ice.weights, tis.weights) and torch.equal(ice.truncated, tis.truncated)


def test_ratio_on_a_clip_bound_takes_the_unclipped_branch() -> None:
    # With a zero clip range every on-policy ratio sits on both bounds: that is not clipped.
    cfgs = [
        LossConfig(
            clip_low=0.0,
            clip_high=0.0,
            aggregation=agg,
            importance_sampling=ImportanceSamplingConfig(type=t),
        )
        for t in IS_TYPES
        for agg in AGGREGATIONS
    ]
    check_on_policy_gradient(compute_policy_loss, st.sampled_from(cfgs), max_examples=30)


def test_dual_clip_touches_only_negative_advantages() -> None:
    # Ratio 1.25 for all: above the dual bound 1.2 but under 1 + clip_high = 1.28.
    prox = torch.full((1, 2), -1.0, dtype=torch.float64)
    logprobs = (prox + math.log(1.25)).requires_grad_(True)
    adv = torch.tensor([[2.0, -2.0]], dtype=torch.float64)
    cfg = LossConfig(
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=1.2,
        importance_sampling=ImportanceSamplingConfig(type="none"),
    )
    loss, metrics = compute_policy_loss(logprobs, prox, prox, adv, torch.ones(1, 2), cfg)
    loss.backward()
    assert logprobs.grad.tolist() == [[pytest.approx(-1.25 * 2 / 2), 0.0]]
    assert float(loss.detach()) == pytest.approx(-(1.25 * 2 - 1.2 * 2) / 2)
    assert float(metrics["train/dual_clip_frac"]) == 0.5


def test_seq_tis_in_log_space_does_not_overflow() -> None:
    # 2000 tokens of ratio e^0.5: the product e^1000 overflows any float; the weight is the cap.
    length = 2000
    behavior = torch.full((1, length), -3.0)
    prox = behavior + 0.5
    logprobs = prox.clone().requires_grad_(True)
    cfg = LossConfig(importance_sampling=ImportanceSamplingConfig(type="seq_tis", cap=2.0))
    adv = torch.ones(1, length)
    loss, metrics = compute_policy_loss(logprobs, prox, behavior, adv, torch.ones(1, length), cfg)
    loss.backward()
    assert math.isfinite(float(loss.detach())) and bool(torch.isfinite(logprobs.grad).all())
    assert float(metrics["train/is_weight_max"]) == pytest.approx(2.0)
    assert float(metrics["train/is_truncated_frac"]) == 1.0


def test_huge_ratios_on_clipped_tokens_keep_gradients_finite() -> None:
    # float32 exp(200) is inf; a clipped token must still contribute a zero, finite gradient.
    prox = torch.tensor([[-250.0, -250.0, -1.0]])
    logprobs = torch.tensor([[-50.0, -50.0, -1.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 0.0, -1.0]])
    cfg = LossConfig(dual_clip=3.0, importance_sampling=ImportanceSamplingConfig(type="none"))
    loss, _ = compute_policy_loss(logprobs, prox, prox, adv, torch.ones(1, 3), cfg)
    loss.backward()
    assert math.isfinite(float(loss.detach()))
    assert logprobs.grad.tolist() == [[0.0, 0.0, pytest.approx(1 / 3)]]


def test_bypass_uses_behavior_as_proximal() -> None:
    g = torch.Generator().manual_seed(0)
    behavior = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    logprobs = behavior + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=g) < 0.7
    for is_type in IS_TYPES:
        cfg = LossConfig(
            proximal="bypass", importance_sampling=ImportanceSamplingConfig(type=is_type)
        )
        reference = LossConfig(
            importance_sampling=ImportanceSamplingConfig(
                type="gspo" if is_type == "gspo" else "none"
            )
        )
        expected, _ = compute_policy_loss(logprobs, behavior, behavior, adv, mask, reference)
        garbage = torch.full_like(behavior, math.nan)
        for prox in (None, garbage):
            loss, metrics = compute_policy_loss(logprobs, prox, behavior, adv, mask, cfg)
            assert float(loss) == pytest.approx(float(expected), rel=1e-12)
            assert float(metrics["train/is_weight_mean"]) == 1.0


def test_no_gradient_through_proximal_behavior_or_weights() -> None:
    g = torch.Generator().manual_seed(1)
    behavior = (-torch.rand(2, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    prox = (behavior.detach() + 0.2).requires_grad_(True)
    logprobs = (prox.detach() + 0.1).requires_grad_(True)
    adv = torch.randn(2, 4, generator=g, dtype=torch.float64)
    for is_type in IS_TYPES:
        cfg = LossConfig(importance_sampling=ImportanceSamplingConfig(type=is_type))
        loss, metrics = compute_policy_loss(logprobs, prox, behavior, adv, torch.ones(2, 4), cfg)
        loss.backward()
        assert behavior.grad is None and prox.grad is None and logprobs.grad is not None
        assert all(not v.requires_grad and v.ndim == 0 for v in metrics.values())


def test_metrics_on_a_handmade_batch() -> None:
    log = math.log
    # π_θ/π_prox: 2 (A>0: clipped high), 0.5 (A<0: clipped low), 2 (A<0: inside), 4 (A<0: dual).
    prox = torch.full((1, 4), log(0.2), dtype=torch.float64)
    logprobs = prox + torch.tensor([[log(2), log(0.5), log(2), log(4)]], dtype=torch.float64)
    # π_prox/μ: 1, 1, 1/4, 4 -> token_tis weights with cap 2: 1, 1, 1/4, 2.
    behavior = prox - torch.tensor([[0.0, 0.0, -log(4), log(4)]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    loss, m = compute_policy_loss(logprobs, prox, behavior, adv, mask, cfg)
    assert (
        float(m["train/clip_frac_high"]),
        float(m["train/clip_frac_low"]),
        float(m["train/dual_clip_frac"]),
    ) == (0.25, 0.25, 0.25)
    assert float(m["train/is_weight_mean"]) == pytest.approx((1 + 1 + 0.25 + 2) / 4)
    assert float(m["train/is_weight_max"]) == pytest.approx(2.0)
    assert float(m["train/is_truncated_frac"]) == 0.25
    assert float(m["train/ratio_mean"]) == pytest.approx((2 + 0.5 + 2 + 4) / 4)
    # Surrogates: 1.28·1, 0.8·(-1), 2·(-1), 3·(-1); weighted by 1, 1, 1/4, 2; loss = -mean.
    assert float(loss) == pytest.approx(-(1.28 - 0.8 - 0.5 - 6) / 4)
    d = [0.0, 0.0, -log(4), log(4)]  # log π_prox/μ
    assert float(m["train/kl_behavior_prox"]) == pytest.approx(
        sum(math.exp(x) - 1 - x for x in d) / 4
    )
    probs_mu = [0.2, 0.2, 0.8, 0.05]
    assert float(m["train/mismatch_prob_diff"]) == pytest.approx(
        sum(abs(p - 0.2) for p in probs_mu) / 4
    )
    assert float(m["train/mismatch_logprob_diff_max"]) == pytest.approx(log(4))
    assert "train/kl_ref" not in m
    # Metrics are this batch's own means, whatever global counts the loss is normalized by.
    loss_global, m_global = compute_policy_loss(
        logprobs, prox, behavior, adv, mask, cfg, num_tokens=40.0
    )
    assert float(loss_global) == pytest.approx(float(loss) / 10)
    assert (
        float(m_global["train/policy_loss"])
        == float(m["train/policy_loss"])
        == pytest.approx(float(loss))
    )
    masked_cfg = LossConfig(
        importance_sampling=ImportanceSamplingConfig(type="token_mask", low=0.5, high=2.0)
    )
    _, m = compute_policy_loss(logprobs, prox, behavior, adv, mask, masked_cfg)
    assert (
        float(m["train/is_masked_token_frac"]) == 0.5
        and float(m["train/is_masked_seq_frac"]) == 0.0
    )
    seq_cfg = LossConfig(
        importance_sampling=ImportanceSamplingConfig(type="seq_mask_geo", low=1.5, high=2.0)
    )
    _, m = compute_policy_loss(logprobs, prox, behavior, adv, mask, seq_cfg)
    assert (
        float(m["train/is_masked_token_frac"]) == 1.0
        and float(m["train/is_masked_seq_frac"]) == 1.0
    )


def test_empty_batch_gives_zero_loss_and_metrics() -> None:
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = compute_policy_loss(
        logprobs,
        logprobs.detach(),
        logprobs.detach(),
        torch.ones(2, 3),
        torch.zeros(2, 3),
        LossConfig(),
    )
    loss.backward()
    assert float(loss.detach()) == 0.0 and bool((logprobs.grad == 0).all())
    assert all(float(v) == 0.0 for k, v in metrics.items() if k != "train/ratio_mean")


# ---------------------------------------------------------------------------------------------- KL


def test_kl_estimators_expectations_on_a_categorical() -> None:
    # E_{x~π}[k1] = E_{x~π}[k3] = KL(π‖π_ref) exactly; k2 and k3 are never negative.
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        logp = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
        ref = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
        kl = float((logp.exp() * (logp - ref)).sum())
        for kind in ("k1", "k3"):
            assert float((logp.exp() * kl_estimate(logp, ref, kind)).sum()) == pytest.approx(
                kl, rel=1e-10
            )
        assert bool((kl_estimate(logp, ref, "k2") >= 0).all()) and bool(
            (kl_estimate(logp, ref, "k3") >= 0).all()
        )
        assert float(kl_estimate(logp, logp, "k3").abs().max()) == 0.0


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimate_gradcheck(kind: str) -> None:
    g = torch.Generator().manual_seed(3)
    logp = (-torch.rand(6, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    ref = (logp.detach() + 0.5 * torch.randn(6, generator=g, dtype=torch.float64)).requires_grad_(
        True
    )
    assert torch.autograd.gradcheck(lambda a, b: kl_estimate(a, b, kind), (logp, ref))


@FAST
@given(
    batch=loss_batches(),
    cfg=loss_configs(kl=False),
    coef=st.floats(0.01, 2.0),
    kind=st.sampled_from(["k1", "k2", "k3"]),
)
def test_kl_term_adds_coef_times_aggregated_estimate(
    batch, cfg: LossConfig, coef: float, kind: str
) -> None:
    args = (
        batch.logprobs,
        batch.prox_logprobs,
        batch.behavior_logprobs,
        batch.advantages,
        batch.loss_mask,
    )
    without, _ = compute_policy_loss(*args, cfg)
    cfg_kl = cfg.model_copy(update={"kl": KLConfig(coef=coef, estimator=kind)})
    with_kl, metrics = compute_policy_loss(*args, cfg_kl, ref_logprobs=batch.ref_logprobs)
    kl = kl_estimate(batch.logprobs, batch.ref_logprobs, kind)
    expected = without + coef * aggregate_token_losses(kl, batch.loss_mask, cfg.aggregation)
    torch.testing.assert_close(with_kl, expected, rtol=1e-10, atol=1e-12)
    mean_kl = kl[batch.loss_mask].mean()
    torch.testing.assert_close(metrics["train/kl_ref"], mean_kl, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------- gradcheck


def _gradcheck_case(is_type: str, seed: int, cfg: LossConfig):
    """Inputs with every ratio at least 1e-3 away from a clip bound, some of them clipped."""
    g = torch.Generator().manual_seed(seed)
    rows, length = 3, 5
    bounds = torch.tensor([1 - cfg.clip_low, 1 + cfg.clip_high, cfg.dual_clip], dtype=torch.float64)
    for _ in range(1000):
        mask = torch.rand(rows, length, generator=g) < 0.75
        mask[:, 0] = True
        behavior = -torch.rand(rows, length, generator=g, dtype=torch.float64) * 3 - 0.1
        prox = behavior + torch.empty(rows, length, dtype=torch.float64).uniform_(
            -0.8, 0.8, generator=g
        )
        log_ratio = torch.empty(rows, length, dtype=torch.float64).uniform_(-0.7, 1.4, generator=g)
        if is_type == "gspo":  # GSPO's token form is the exact gradient for per-sequence advantages
            adv = (
                torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, length).clone()
            )
            ratio = (torch.where(mask, log_ratio, 0.0).sum(-1) / mask.sum(-1)).exp()[:, None]
        else:
            adv = torch.randn(rows, length, generator=g, dtype=torch.float64)
            ratio = log_ratio.exp()
        if float((ratio[..., None] - bounds).abs().min()) > 1e-3:
            ref = (
                prox + log_ratio + 0.3 * torch.randn(rows, length, generator=g, dtype=torch.float64)
            )
            return prox + log_ratio, prox, behavior, adv, mask, ref
    raise AssertionError("no case found")


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("is_type", IS_TYPES)
def test_gradcheck_every_variant(is_type: str, aggregation: str) -> None:
    seed = IS_TYPES.index(is_type) * 3 + AGGREGATIONS.index(aggregation)
    cfg = LossConfig(
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
        aggregation=aggregation,
        importance_sampling=ImportanceSamplingConfig(type=is_type, cap=1.5, low=0.7, high=1.5),
        kl=KLConfig(coef=0.1, estimator=("k1", "k2", "k3")[seed % 3]),
    )
    logprobs, prox, behavior, adv, mask, ref = _gradcheck_case(is_type, seed, cfg)
    _, metrics = compute_policy_loss(logprobs, prox, behavior, adv, mask, cfg, ref_logprobs=ref)
    if is_type != "gspo":  # the check covers clipped tokens too
        assert float(metrics["train/clip_frac_low"] + metrics["train/clip_frac_high"]) > 0

    def loss(lp: torch.Tensor) -> torch.Tensor:
        return compute_policy_loss(
            lp, prox, behavior, adv, mask, cfg, ref_logprobs=ref, num_tokens=20.0, num_sequences=4.0
        )[0]

    assert torch.autograd.gradcheck(loss, (logprobs.clone().requires_grad_(True),))


# ------------------------------------------------------------------------------------- aggregation


@FAST
@given(batch=loss_batches(allow_empty=True), aggregation=st.sampled_from(AGGREGATIONS))
def test_aggregation_matches_normalizer(batch, aggregation: str) -> None:
    per_token = batch.advantages
    got = aggregate_token_losses(per_token, batch.loss_mask, aggregation)
    norm = expected_normalizer(batch.loss_mask, aggregation)
    expected = torch.where(batch.loss_mask, per_token / norm, 0.0).sum()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    num_tokens, num_sequences = count_tokens_and_sequences(batch.loss_mask)
    global_counts = aggregate_token_losses(
        per_token, batch.loss_mask, aggregation, num_tokens=num_tokens, num_sequences=num_sequences
    )
    torch.testing.assert_close(global_counts, got, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------ errors


def test_user_errors_are_clear() -> None:
    with pytest.raises(ConfigError, match="did you mean 'token_tis'"):
        build_is_correction("token_ts")
    with pytest.raises(ConfigError, match="did you mean 'k3'"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "kl3")
    with pytest.raises(ConfigError, match="loss.aggregation"):
        aggregate_token_losses(torch.zeros(1, 1), torch.ones(1, 1), "seq_mean")
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_policy_loss(x, x, x, x, x, LossConfig(kl=KLConfig(coef=0.1)))
    with pytest.raises(ValueError, match="advantages has shape"):
        compute_policy_loss(x, x, x, torch.zeros(2, 4), x, LossConfig())
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        compute_policy_loss(
            torch.zeros(3),
            torch.zeros(3),
            torch.zeros(3),
            torch.zeros(3),
            torch.ones(3),
            LossConfig(),
        )
    with pytest.raises(ValueError, match="prox_logprobs is None"):
        compute_policy_loss(x, None, x, x, x, LossConfig())
