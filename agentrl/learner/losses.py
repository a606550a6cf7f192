"""Policy losses: clipped PPO objective against a proximal policy, importance-sampling correction of
the proximal/behaviour gap, KL to a reference policy, and aggregation by global counts.

Plain functions on padded ``[B, T]`` tensors (rows are sequences, padding has ``loss_mask == 0``);
they know nothing of packing, Ray or the learner backend. Three policies meet here:

* π_θ, the policy being optimized (``logprobs``, the only input that carries gradient);
* π_prox, the learner's own policy before this optimizer step (``prox_logprobs``), the anchor of the
  PPO trust region;
* μ, the behaviour policy: the engine that sampled the tokens (``behavior_logprobs``), possibly some
  weight versions old and numerically different from the learner.

The per-token loss is ``-w · surrogate(π_θ/π_prox, A) + β · KL(π_θ‖π_ref)``, where ``w`` (detached)
corrects the π_prox/μ gap. Masked positions are removed with ``torch.where`` before any arithmetic,
so NaN or inf in padding can reach neither the loss nor the gradient.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from agentrl.config import ConfigError, ImportanceSamplingConfig, LossConfig
from agentrl.config.registry import LOSSES, register_loss

__all__ = [
    "IS_CORRECTIONS",
    "KL_ESTIMATORS",
    "LOSSES",
    "ISWeights",
    "aggregate_token_losses",
    "build_is_correction",
    "compute_policy_loss",
    "count_tokens_and_sequences",
    "kl_estimate",
    "register_loss",
]


class ISWeights(NamedTuple):
    """Importance weights of one batch, all ``[B, T]`` and detached.

    Attributes:
        weights: Weight of every token; 0 off the loss mask and on dropped tokens.
        kept: Loss tokens that keep a weight (False where a band type dropped them).
        truncated: Loss tokens whose weight was cut down to the cap.
    """

    weights: torch.Tensor
    kept: torch.Tensor
    truncated: torch.Tensor


ISCorrection = Callable[[torch.Tensor, torch.Tensor, ImportanceSamplingConfig], ISWeights]
"""``(log_ratio [B, T] = log π_prox - log μ (0 off-mask), mask [B, T] bool, cfg) -> ISWeights``."""


def _seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, 0.0).sum(-1, keepdim=True)  # [B, 1]


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _seq_sum(x, mask) / mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]


def _truncated(log_w: torch.Tensor, mask: torch.Tensor, cap: float) -> ISWeights:
    # min(exp(log_w), cap) taken in log space: a long sequence's product of ratios cannot overflow.
    log_cap = math.log(cap)
    log_w = log_w.expand_as(mask)
    weights = torch.where(mask, torch.exp(torch.clamp(log_w, max=log_cap)), 0.0)
    return ISWeights(weights, mask.clone(), mask & (log_w > log_cap))


def _banded(log_w: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> ISWeights:
    log_low = math.log(low) if low > 0 else -math.inf
    log_w = log_w.expand_as(mask)
    kept = mask & (log_w >= log_low) & (log_w <= math.log(high))
    return ISWeights(kept.to(log_w.dtype), kept, torch.zeros_like(mask))


def _banded_ratio(
    band_log_w: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, cfg: ImportanceSamplingConfig
) -> ISWeights:
    # IcePop: the band decides what is kept; a kept token's weight is its own ratio, truncated.
    kept = _banded(band_log_w, mask, cfg.low, cfg.high).kept
    log_cap = math.log(cfg.cap)
    weights = torch.where(kept, torch.exp(torch.clamp(log_ratio, max=log_cap)), 0.0)
    return ISWeights(weights, kept, kept & (log_ratio > log_cap))


def _no_correction(
    log_ratio: torch.Tensor, mask: torch.Tensor, cfg: ImportanceSamplingConfig
) -> ISWeights:
    return ISWeights(mask.to(log_ratio.dtype), mask.clone(), torch.zeros_like(mask))


def _token_tis(
    log_ratio: torch.Tensor, mask: torch.Tensor, cfg: ImportanceSamplingConfig
) -> ISWeights:
    return _truncated(log_ratio, mask, cfg.cap)


def _seq_tis(
    log_ratio: torch.Tensor, mask: torch.Tensor, cfg: ImportanceSamplingConfig
) -> ISWeights:
    return _truncated(_seq_sum(log_ratio, mask), mask, cfg.cap)


def _seq_tis_geo(
    log_ratio: torch.Tensor, mask: torch.Tensor, cfg: ImportanceSamplingConfig
) -> ISWeights:
    return _truncated(_seq_mean(log_ratio, mask), mask, cfg.cap)


def _token_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, cfg: ImportanceSamplingConfig
) -> ISWeights:
    return _banded(log_ratio, mask, cfg.low, cfg.high)


def _seq_mask_geo(
    log_ratio: torch.Tensor, mask: torch.Tensor, cfg: ImportanceSamplingConfig
) -> ISWeights:
    return _banded(_seq_mean(log_ratio, mask), mask, cfg.low, cfg.high)


def _icepop(
    log_ratio: torch.Tensor, mask: torch.Tensor, cfg: ImportanceSamplingConfig
) -> ISWeights:
    return _banded_ratio(log_ratio, log_ratio, mask, cfg)


def _seq_icepop(
    log_ratio: torch.Tensor, mask: torch.Tensor, cfg: ImportanceSamplingConfig
) -> ISWeights:
    return _banded_ratio(_seq_mean(log_ratio, mask), log_ratio, mask, cfg)


IS_CORRECTIONS: dict[str, ISCorrection] = {
    "none": _no_correction,
    "token_tis": _token_tis,
    "seq_tis": _seq_tis,
    "seq_tis_geo": _seq_tis_geo,
    # Rejection sampling: out of the band weight 0, kept tokens weight 1 ...
    "token_mask": _token_mask,
    "seq_mask_geo": _seq_mask_geo,
    # ... IcePop: the same band, kept tokens weighted by their own ratio (truncated at the cap).
    "icepop": _icepop,
    "seq_icepop": _seq_icepop,
    # GSPO's policy ratio is itself sequence-level (see compute_policy_loss); the π_prox/μ gap is
    # corrected with the same sequence-level truncated geometric-mean weight as seq_tis_geo.
    "gspo": _seq_tis_geo,
}
"""``loss.importance_sampling.type`` -> weight function."""


def build_is_correction(type: str) -> ISCorrection:
    """Look up an importance-sampling correction by its ``loss.importance_sampling.type`` name.

    Raises:
        ConfigError: for an unknown name, with the closest known one.

    Example:
        >>> build_is_correction("token_tis") is IS_CORRECTIONS["token_tis"]
        True
    """
    try:
        return IS_CORRECTIONS[type]
    except KeyError:
        raise ConfigError(_unknown("loss.importance_sampling.type", type, IS_CORRECTIONS)) from None


def _unknown(key: str, given: str, known: dict) -> str:
    hint = difflib.get_close_matches(given, list(known), n=1)
    return (
        f"unknown {key} '{given}'"
        + (f"; did you mean '{hint[0]}'?" if hint else "")
        + f" (known: {', '.join(known)})"
    )


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return -log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.expm1(log_ratio) - log_ratio


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}
"""``loss.kl.estimator`` -> estimator of ``log(π_ref/π)`` per sampled token."""


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from tokens sampled from π (Schulman's k1, k2, k3).

    With ``d = log π_ref(x) - log π(x)``: k1 = -d (unbiased, can be negative), k2 = d²/2 (biased,
    non-negative), k3 = e^d - 1 - d (unbiased and non-negative). Gradient flows through both inputs.

    Args:
        logp: ``[...]`` log-probabilities of the sampled tokens under π.
        ref_logp: ``[...]`` the same tokens under the reference policy.
        kind: ``"k1"``, ``"k2"`` or ``"k3"``.

    Example:
        >>> kl_estimate(torch.tensor([-1.0]), torch.tensor([-1.0]), "k3")
        tensor([0.])
    """
    try:
        estimator = KL_ESTIMATORS[kind]
    except KeyError:
        raise ConfigError(_unknown("loss.kl.estimator", kind, KL_ESTIMATORS)) from None
    return estimator(ref_logp - logp)


def count_tokens_and_sequences(loss_mask: torch.Tensor) -> tuple[int, int]:
    """``(num_tokens, num_sequences)`` of a batch as :func:`compute_policy_loss` counts them.

    Tokens are positions with a true loss mask; sequences are rows with at least one such token.
    Sum these over every micro-batch (and rank) of a step to get the global counts.
    """
    mask = loss_mask.bool()
    return int(mask.sum()), int(mask.any(-1).sum())


def _count(
    value: float | torch.Tensor | None, local: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
    count = local if value is None else torch.as_tensor(value, device=like.device)
    return count.to(like.dtype).clamp(min=1)


def aggregate_token_losses(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    aggregation: str,
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce ``[B, T]`` per-token losses to one number, normalized by (global) counts.

    * ``token_mean``: ``Σ_tokens ℓ / num_tokens``;
    * ``seq_mean_token_mean``: ``Σ_seqs (Σ_t ℓ / n_seq) / num_sequences`` (``n_seq`` is the row's
      own token count, local to the row, so rows split cleanly);
    * ``seq_mean_token_sum``: ``Σ_seqs Σ_t ℓ / num_sequences`` (Dr. GRPO's constant normalization).

    Given the global counts, the sum over micro-batches equals the loss of the whole batch. Counts
    below 1 are taken as 1.

    Args:
        per_token: ``[B, T]`` losses; masked-out positions are ignored, whatever they hold.
        loss_mask: ``[B, T]`` true on tokens that count.
        aggregation: one of the three names above (``loss.aggregation``).
        num_tokens: masked tokens in the whole global batch; None counts this batch.
        num_sequences: sequences in the whole global batch; None counts rows of this batch with at
            least one masked token.
    """
    mask = loss_mask.bool()
    x = torch.where(mask, per_token, 0.0)
    if aggregation == "token_mean":
        return x.sum() / _count(num_tokens, mask.sum(), x)
    if aggregation not in ("seq_mean_token_mean", "seq_mean_token_sum"):
        known = dict.fromkeys(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
        raise ConfigError(_unknown("loss.aggregation", aggregation, known))
    per_seq = x.sum(-1)  # [B]
    if aggregation == "seq_mean_token_mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / _count(num_sequences, mask.any(-1).sum(), x)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of ``x`` over ``mask`` (0 when nothing is masked in), without a host sync."""
    if x.numel() == 0:
        return x.new_zeros(())
    return torch.where(mask.any(), torch.where(mask, x, torch.finfo(x.dtype).min).amax(), x.new_zeros(()))


def _check_inputs(tensors: dict[str, torch.Tensor | None], shape: torch.Size) -> None:
    if len(shape) != 2:
        raise ValueError(f"logprobs must be [B, T] (rows are sequences), got shape {tuple(shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logprobs"
            )


def compute_policy_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor | None,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: LossConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Off-policy-corrected clipped policy loss of one (micro-)batch.

    Per token, with ``r = π_θ/π_prox`` and advantage ``A``:
    ``surrogate = min(r·A, clip(r, 1 - clip_low, 1 + clip_high)·A)``, and for ``A < 0`` with dual
    clip ``c``: ``max(surrogate, c·A)``. A token whose clip is active contributes a constant (zero
    gradient); at a bound exactly the unclipped branch is taken. The loss per token is
    ``-w·surrogate + kl.coef·k(π_θ, π_ref)``, with ``w`` from ``IS_CORRECTIONS[type]`` (detached),
    aggregated by :func:`aggregate_token_losses`.

    ``type: gspo`` makes the ratio sequence-level: ``s_i = exp(mean_t log(π_θ/π_prox))``, clipped
    like ``r`` above, in GSPO's token form ``s_i,t = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)]`` (value ``s_i``,
    gradient through each token's own log-probability); its π_prox/μ weight is the truncated
    geometric mean. GSPO expects much smaller clip ranges (e.g. 3e-4 / 4e-4).

    ``cfg.proximal == "bypass"`` uses ``behavior_logprobs`` as π_prox (``prox_logprobs`` is ignored
    and may be None) and skips the importance weights (they would all be 1).

    Args:
        logprobs: ``[B, T]`` current-policy log-probabilities of the sampled tokens (with grad).
        prox_logprobs: ``[B, T]`` proximal-policy log-probabilities (detached here).
        behavior_logprobs: ``[B, T]`` behaviour-policy (engine) log-probabilities (detached here).
        advantages: ``[B, T]`` per-token advantages.
        loss_mask: ``[B, T]`` true / 1 on tokens that count; everything else is ignored.
        cfg: the ``loss`` section of the config.
        ref_logprobs: ``[B, T]`` reference-policy logprobs; needed when ``cfg.kl.coef > 0``.
        num_tokens: masked tokens in the whole global batch (None: this batch's count).
        num_sequences: sequences in the whole global batch (None: rows of this batch with a
            masked token).

    Returns:
        ``(loss, metrics)``: a scalar loss to backpropagate, and detached scalar metrics named
        ``train/...``: means over this batch's own masked tokens (or sequences), not shares of the
        global batch; merge micro-batches by a token-weighted mean (``max`` for ``*_max`` keys).

    Example:
        >>> lp = torch.zeros(2, 3, requires_grad=True)
        >>> adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0]])
        >>> mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
        >>> old = lp.detach()
        >>> loss, metrics = compute_policy_loss(lp, old, old, adv, mask, LossConfig())
        >>> loss.item(), metrics["train/clip_frac_high"].item()
        (0.0, 0.0)
    """
    bypass = cfg.proximal == "bypass"
    if prox_logprobs is None and not bypass:
        raise ValueError(
            "prox_logprobs is None but loss.proximal is 'recompute'; pass them or set bypass"
        )
    if cfg.kl.coef > 0 and ref_logprobs is None:
        raise ValueError(
            f"loss.kl.coef is {cfg.kl.coef} but no ref_logprobs were given; pass them or set coef 0"
        )
    _check_inputs(
        {
            "prox_logprobs": prox_logprobs,
            "behavior_logprobs": behavior_logprobs,
            "advantages": advantages,
            "loss_mask": loss_mask,
            "ref_logprobs": ref_logprobs,
        },
        logprobs.shape,
    )
    mask = loss_mask.bool()
    dtype = logprobs.dtype

    def clean(x: torch.Tensor) -> torch.Tensor:  # detached, zero off the mask
        return torch.where(mask, x.detach().to(dtype), 0.0)

    logp = torch.where(mask, logprobs, 0.0)
    behavior = clean(behavior_logprobs)
    prox = behavior if bypass else clean(prox_logprobs)
    adv = clean(advantages)
    is_type = cfg.importance_sampling.type
    correction = build_is_correction("none" if bypass else is_type)
    isw = correction(prox - behavior, mask, cfg.importance_sampling)

    log_ratio = logp - prox  # [B, T]
    if is_type == "gspo":
        seq_log_ratio = _seq_mean(log_ratio, mask).detach()  # [B, 1]
        log_ratio = seq_log_ratio + (logp - logp.detach())
    ratio_value = torch.exp(log_ratio.detach())
    clip_high = mask & (adv > 0) & (ratio_value > 1 + cfg.clip_high)
    clip_low = mask & (adv < 0) & (ratio_value < 1 - cfg.clip_low)
    dual = torch.zeros_like(mask)
    if cfg.dual_clip is not None:
        dual = mask & (adv < 0) & (ratio_value > cfg.dual_clip)
    frozen = clip_high | clip_low | dual | ~mask | (adv == 0)
    bound = torch.full_like(adv, cfg.dual_clip or 0.0)
    bound = bound.masked_fill(clip_low, 1 - cfg.clip_low).masked_fill(clip_high, 1 + cfg.clip_high)
    # Frozen tokens take exp(0): their gradient is zero and must stay finite even for huge ratios.
    ratio = torch.exp(torch.where(frozen, 0.0, log_ratio))
    surrogate = torch.where(frozen, bound * adv, ratio * adv)
    pg_per_token = -isw.weights * surrogate

    counts = {"num_tokens": num_tokens, "num_sequences": num_sequences}
    per_token = pg_per_token
    kl_ref = None
    if cfg.kl.coef > 0:
        kl_ref = torch.where(mask, kl_estimate(logp, clean(ref_logprobs), cfg.kl.estimator), 0.0)
        per_token = per_token + cfg.kl.coef * kl_ref
    loss = aggregate_token_losses(per_token, mask, cfg.aggregation, **counts)

    with torch.no_grad():
        has_tokens = mask.any(-1)
        metrics = {
            # This batch's own mean (local counts), like every metric here.
            "train/policy_loss": aggregate_token_losses(pg_per_token, mask, cfg.aggregation),
            "train/ratio_mean": _masked_mean(ratio_value, mask),
            "train/clip_frac_low": _masked_mean(clip_low.to(dtype), mask),
            "train/clip_frac_high": _masked_mean(clip_high.to(dtype), mask),
            "train/dual_clip_frac": _masked_mean(dual.to(dtype), mask),
            "train/is_weight_mean": _masked_mean(isw.weights, mask),
            "train/is_weight_max": _masked_max(isw.weights, mask),
            "train/is_truncated_frac": _masked_mean(isw.truncated.to(dtype), mask),
            "train/is_masked_token_frac": _masked_mean((~isw.kept).to(dtype), mask),
            "train/is_masked_seq_frac": (has_tokens & ~isw.kept.any(-1)).sum().to(dtype)
            / has_tokens.sum().clamp(min=1),
            "train/kl_behavior_prox": _masked_mean(kl_estimate(behavior, prox, "k3"), mask),
            "train/mismatch_prob_diff": _masked_mean((behavior.exp() - prox.exp()).abs(), mask),
            "train/mismatch_logprob_diff_max": _masked_max((behavior - prox).abs(), mask),
        }
        if kl_ref is not None:
            metrics["train/kl_ref"] = _masked_mean(kl_ref, mask)
    return loss, {k: v.detach() for k, v in metrics.items()}
