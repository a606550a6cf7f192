"""Hypothesis strategies and invariant checks for policy losses, public so users test their own.

A loss with the signature of :func:`agentrl.learner.losses.compute_policy_loss` runs through the same
property tests as the built-in one, in a few lines::

    from agentrl.testing import check_masked_tokens_ignored, check_microbatch_invariance
    from agentrl.testing import check_on_policy_gradient

    def test_my_loss():
        check_on_policy_gradient(my_loss)
        check_masked_tokens_ignored(my_loss)
        check_microbatch_invariance(my_loss)

Each ``check_*`` runs a hypothesis search (``cfg`` may be a :class:`LossConfig` or a strategy of
them, e.g. :func:`loss_configs`) and fails with AssertionError on the shrunk counterexample. Each
``assert_*`` checks one batch, for use inside your own ``@given`` test. ``check_*`` must not be
called from inside a ``@given`` test: hypothesis does not nest.
"""

from __future__ import annotations

import dataclasses
import math

import hypothesis
import torch
from hypothesis import HealthCheck, assume, given
from hypothesis import strategies as st

from agentrl.config import ImportanceSamplingConfig, LossConfig
from agentrl.strategies import (  # public through this module too
    AGGREGATIONS,
    BAND_TYPES,
    IS_TYPES,
    LossBatch,
    LossFn,
    loss_batches,
    loss_configs,
    reward_groups,
    sequence_lengths,
    trajectories,
    trajectory_groups,
)

__all__ = [
    "AGGREGATIONS",
    "BAND_TYPES",
    "IS_TYPES",
    "LossBatch",
    "LossFn",
    "assert_clipping",
    "assert_importance_weights",
    "assert_masked_tokens_ignored",
    "assert_microbatch_invariance",
    "assert_on_policy_gradient",
    "check_clipping",
    "check_importance_weights",
    "check_masked_tokens_ignored",
    "check_microbatch_invariance",
    "check_on_policy_gradient",
    "check_policy_loss",
    "expected_normalizer",
    "loss_batches",
    "loss_configs",
    "reference_is_weights",
    "reward_groups",
    "sequence_lengths",
    "trajectories",
    "trajectory_groups",
]


# ------------------------------------------------------------------------------- reference formulas


def expected_normalizer(
    loss_mask: torch.Tensor,
    aggregation: str,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> torch.Tensor:
    """``[B, T]`` float64: what each token's loss is divided by under ``aggregation``."""
    mask = loss_mask.bool()
    n_tok = max(float(mask.sum()) if num_tokens is None else float(num_tokens), 1.0)
    n_seq = max(float(mask.any(-1).sum()) if num_sequences is None else float(num_sequences), 1.0)
    if aggregation == "token_mean":
        return torch.full(mask.shape, n_tok, dtype=torch.float64)
    if aggregation == "seq_mean_token_mean":
        return (
            (n_seq * mask.sum(-1, keepdim=True).clamp(min=1)).to(torch.float64).expand(mask.shape)
        )
    if aggregation == "seq_mean_token_sum":
        return torch.full(mask.shape, n_seq, dtype=torch.float64)
    raise ValueError(f"unknown aggregation {aggregation!r}")


def _exp(x: float) -> float:
    return math.exp(x) if x < 700 else math.inf


def reference_is_weights(
    prox_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: ImportanceSamplingConfig,
) -> torch.Tensor:
    """``[B, T]`` float64 importance weights computed naively, token by token, by definition."""
    out = torch.zeros(loss_mask.shape, dtype=torch.float64)
    cap, low, high = cfg.cap, cfg.low, cfg.high
    for i in range(loss_mask.shape[0]):
        idx = [t for t in range(loss_mask.shape[1]) if bool(loss_mask[i, t])]
        if not idx:
            continue
        d = [float(prox_logprobs[i, t]) - float(behavior_logprobs[i, t]) for t in idx]
        geo = _exp(sum(d) / len(d))
        weights = {
            "none": [1.0] * len(d),
            "token_tis": [min(_exp(x), cap) for x in d],
            "seq_tis": [min(_exp(sum(d)), cap)] * len(d),
            "seq_tis_geo": [min(geo, cap)] * len(d),
            "gspo": [min(geo, cap)] * len(d),
            "token_mask": [1.0 if low <= _exp(x) <= high else 0.0 for x in d],
            "seq_mask_geo": [1.0 if low <= geo <= high else 0.0] * len(d),
            "icepop": [min(_exp(x), cap) if low <= _exp(x) <= high else 0.0 for x in d],
            "seq_icepop": [min(_exp(x), cap) if low <= geo <= high else 0.0 for x in d],
        }[cfg.type]
        for t, w in zip(idx, weights):
            out[i, t] = w
    return out


# ---------------------------------------------------------------------------------------- plumbing


def _with(cfg: LossConfig, **changes: object) -> LossConfig:
    """A deep copy of ``cfg`` with dotted fields changed (``{"kl.coef": 0.0}``)."""
    new = cfg.model_copy(deep=True)
    for dotted, value in changes.items():
        *path, name = dotted.split(".")
        node = new
        for part in path:
            node = getattr(node, part)
        setattr(node, name, value)
    return new


def _run(
    loss_fn: LossFn,
    batch: LossBatch,
    cfg: LossConfig,
    *,
    logprobs: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Call ``loss_fn``; return (loss, d loss / d logprobs, metrics)."""
    lp = (batch.logprobs if logprobs is None else logprobs).detach().clone().requires_grad_(True)
    loss, metrics = loss_fn(
        lp,
        batch.prox_logprobs,
        batch.behavior_logprobs,
        batch.advantages,
        batch.loss_mask if loss_mask is None else loss_mask,
        cfg,
        ref_logprobs=batch.ref_logprobs,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
    )
    if not (isinstance(loss, torch.Tensor) and loss.ndim == 0):
        raise AssertionError(f"the loss must be a scalar tensor, got {loss!r}")
    grad = torch.autograd.grad(loss, lp, allow_unused=True)[0] if loss.requires_grad else None
    return loss.detach(), torch.zeros_like(lp) if grad is None else grad, metrics


def _assert_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 1e-7, atol: float = 1e-10
) -> None:
    actual, expected = actual.to(torch.float64), expected.to(torch.float64)
    if not torch.allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True):
        diff = (actual - expected).abs().nan_to_num(math.inf).max().item()
        raise AssertionError(
            f"{what}: max abs difference {diff:.3g}\n got:      {actual}\n expected: {expected}"
        )


def _settings(max_examples: int, settings: hypothesis.settings | None) -> hypothesis.settings:
    if settings is not None:
        return settings
    return hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        report_multiple_bugs=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.data_too_large,
        ],
    )


def _configs(
    cfg: LossConfig | st.SearchStrategy[LossConfig] | None,
) -> st.SearchStrategy[LossConfig]:
    if cfg is None:
        return st.just(LossConfig())
    return st.just(cfg) if isinstance(cfg, LossConfig) else cfg


# ------------------------------------------------------------------------------------------ checks


def assert_on_policy_gradient(
    loss_fn: LossFn,
    batch: LossBatch,
    cfg: LossConfig,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> None:
    """With π_θ = π_prox = μ (KL off), the loss is ``Σ -A/norm`` and its gradient ``-A/norm`` on
    masked tokens (0 elsewhere), ``norm`` as :func:`expected_normalizer`: every IS weight is 1."""
    cfg = _with(cfg, **{"kl.coef": 0.0})
    on = batch.replace(prox_logprobs=batch.behavior_logprobs, logprobs=batch.behavior_logprobs)
    loss, grad, _ = _run(loss_fn, on, cfg, num_tokens=num_tokens, num_sequences=num_sequences)
    norm = expected_normalizer(batch.loss_mask, cfg.aggregation, num_tokens, num_sequences)
    expected = torch.where(batch.loss_mask, -batch.advantages.to(torch.float64) / norm, 0.0)
    _assert_close(
        grad, expected, f"on-policy gradient ({cfg.aggregation}, {cfg.importance_sampling.type})"
    )
    _assert_close(
        loss, expected.sum(), f"on-policy loss ({cfg.aggregation}, {cfg.importance_sampling.type})"
    )


def assert_masked_tokens_ignored(
    loss_fn: LossFn, batch: LossBatch, cfg: LossConfig, garbage: LossBatch
) -> None:
    """Whatever sits at masked-out positions, the loss, the gradient on masked tokens and the
    metrics are the same, and the gradient at masked-out positions is exactly 0.

    ``garbage`` (NaN and inf welcome) fills the masked-out positions; when it is larger than
    ``batch``, the batch is also padded with its extra columns and rows, all masked out.
    """
    (rows, cols), (num_rows, length) = garbage.shape, batch.shape
    if rows < num_rows or cols < length:
        raise ValueError(
            f"garbage {tuple(garbage.shape)} is smaller than the batch {tuple(batch.shape)}"
        )
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    mask[:num_rows, :length] = batch.loss_mask

    def embed(name: str) -> torch.Tensor:
        out = getattr(garbage, name).clone()
        out[:num_rows, :length] = torch.where(
            batch.loss_mask, getattr(batch, name), out[:num_rows, :length]
        )
        return out

    dirty = LossBatch(
        *(mask if f.name == "loss_mask" else embed(f.name) for f in dataclasses.fields(batch))
    )
    loss, grad, metrics = _run(loss_fn, batch, cfg)
    loss_d, grad_d, metrics_d = _run(loss_fn, dirty, cfg)
    _assert_close(loss_d, loss, "loss with garbage in masked-out positions")
    _assert_close(grad_d[:num_rows, :length], grad, "gradient with garbage in masked-out positions")
    if bool((grad_d[~mask] != 0).any()):
        raise AssertionError(f"nonzero gradient at masked-out positions: {grad_d}")
    for name, value in metrics.items():
        if name not in metrics_d:
            raise AssertionError(f"metric {name} missing with garbage in masked-out positions")
        _assert_close(metrics_d[name], value, f"metric {name} with garbage in masked-out positions")


def assert_microbatch_invariance(
    loss_fn: LossFn, batch: LossBatch, cfg: LossConfig, groups: list[list[int]]
) -> None:
    """Accumulating over micro-batches (``groups`` of rows) given the global counts equals one pass
    over the whole batch; and ``None`` counts mean the batch's own counts."""
    num_tokens = float(batch.loss_mask.sum())
    num_sequences = float(batch.loss_mask.any(-1).sum())
    loss, grad, _ = _run(loss_fn, batch, cfg, num_tokens=num_tokens, num_sequences=num_sequences)
    local, _, _ = _run(loss_fn, batch, cfg)
    _assert_close(local, loss, "loss with num_tokens/num_sequences None vs. the batch's own counts")
    lp = batch.logprobs.detach().clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for rows in groups:
        sub = batch.rows(rows)
        part, _ = loss_fn(
            lp[rows],
            sub.prox_logprobs,
            sub.behavior_logprobs,
            sub.advantages,
            sub.loss_mask,
            cfg,
            ref_logprobs=sub.ref_logprobs,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
        )
        if part.requires_grad:
            part.backward()
        total = total + part.detach().to(torch.float64)
    _assert_close(total, loss, f"summed micro-batch loss over rows {groups}")
    _assert_close(
        torch.zeros_like(lp) if lp.grad is None else lp.grad,
        grad,
        f"accumulated micro-batch gradient over rows {groups}",
    )


def _near(x: torch.Tensor, bound: float) -> torch.Tensor:
    return (x - bound).abs() <= 1e-7 * max(1.0, abs(bound))


def assert_clipping(loss_fn: LossFn, batch: LossBatch, cfg: LossConfig) -> bool:
    """PPO clipping with this config's semantics (IS weights made 1 by setting μ = π_prox, KL off).

    Checks the loss against ``Σ -min(r·A, clip(r)·A)/norm`` (dual clip: ``max(·, c·A)`` for A < 0;
    for gspo ``r`` is the sequence's geometric-mean ratio), that the gradient is ``-r·A/norm``
    where no clip is active and exactly 0 where one is, and pessimism: the loss is never below the
    unclipped ``Σ -r·A/norm``, for the batch and for every token alone (except that the dual clip,
    by design, caps a negative-advantage token's loss at ``-c·A``).

    Returns:
        False (nothing checked) when a ratio lies within 1e-7 of a clip bound, where the side taken
        is a matter of rounding; True otherwise.
    """
    cfg = _with(cfg, **{"kl.coef": 0.0, "proximal": "recompute"})
    batch = batch.replace(behavior_logprobs=batch.prox_logprobs)
    mask, adv = batch.loss_mask, batch.advantages.to(torch.float64)
    log_ratio = torch.where(mask, batch.logprobs - batch.prox_logprobs, 0.0).to(torch.float64)
    if cfg.importance_sampling.type == "gspo":
        log_ratio = (
            log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        ).expand(mask.shape)
    ratio = log_ratio.exp()
    upper, lower, dual = 1 + cfg.clip_high, 1 - cfg.clip_low, cfg.dual_clip
    live = mask & (adv != 0)
    near = _near(ratio, upper) | _near(ratio, lower)
    if dual is not None:
        near = near | _near(ratio, dual)
    if bool((live & near).any()):
        return False
    objective = torch.where(adv > 0, ratio.clamp(max=upper) * adv, ratio.clamp(min=lower) * adv)
    active = (adv > 0) & (ratio > upper) | (adv < 0) & (ratio < lower)
    if dual is not None:
        objective = torch.where(adv < 0, torch.maximum(objective, dual * adv), objective)
        active = active | (adv < 0) & (ratio > dual)
    norm = expected_normalizer(mask, cfg.aggregation)
    loss, grad, _ = _run(loss_fn, batch, cfg)
    what = f"({cfg.aggregation}, {cfg.importance_sampling.type}, dual_clip={dual})"
    _assert_close(loss, torch.where(mask, -objective / norm, 0.0).sum(), f"clipped loss {what}")
    _assert_close(
        grad, torch.where(mask & ~active, -ratio * adv / norm, 0.0), f"clipped gradient {what}"
    )
    if bool((grad[mask & active] != 0).any()):
        raise AssertionError(f"nonzero gradient where the clip is active {what}: {grad}")
    # The dual clip bounds the penalty of A < 0 tokens from above: there c·A replaces r·A.
    dual_active = (adv < 0) & (ratio > dual) if dual is not None else torch.zeros_like(mask)
    unclipped = torch.where(
        mask, -torch.where(dual_active, dual or 0.0, ratio) * adv / norm, 0.0
    ).sum()
    if float(loss) < float(unclipped) - 1e-9 * max(1.0, abs(float(unclipped))):
        raise AssertionError(f"loss {float(loss)} below the unclipped {float(unclipped)} {what}")
    token_ratio = (
        torch.where(mask, batch.logprobs - batch.prox_logprobs, 0.0).to(torch.float64).exp()
    )
    for i, t in mask.nonzero().tolist()[:6]:
        alone = torch.zeros_like(mask)
        alone[i, t] = True
        single, _, _ = _run(loss_fn, batch, cfg, loss_mask=alone)
        r_t = float(token_ratio[i, t])
        if dual is not None and adv[i, t] < 0 and r_t > dual:
            r_t = dual
        bound = -r_t * float(adv[i, t])
        if float(single) < bound - 1e-9 * max(1.0, abs(bound)):
            raise AssertionError(
                f"token ({i}, {t}) alone: loss {float(single)} below the unclipped {bound} {what}"
            )
    return True


def assert_importance_weights(loss_fn: LossFn, batch: LossBatch, cfg: LossConfig) -> bool:
    """With π_θ = π_prox (ratio 1, unclipped), token_mean, KL off, the gradient is ``-w·A/N``: the
    weights it implies must match :func:`reference_is_weights` (truncated at the cap, 0 exactly on
    the out-of-band tokens or sequences of the BAND_TYPES).

    Returns:
        False (nothing checked) when a masked type's ratio lies within 1e-7 of ``low`` or ``high``.
    """
    cfg = _with(cfg, **{"kl.coef": 0.0, "proximal": "recompute", "aggregation": "token_mean"})
    is_cfg = cfg.importance_sampling
    mask = batch.loss_mask
    batch = batch.replace(logprobs=batch.prox_logprobs)
    if is_cfg.type in BAND_TYPES:
        d = torch.where(mask, batch.prox_logprobs - batch.behavior_logprobs, 0.0).to(torch.float64)
        if is_cfg.type in ("seq_mask_geo", "seq_icepop"):
            d = (d.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand(
                mask.shape
            )
        if bool((mask & (_near(d.exp(), is_cfg.low) | _near(d.exp(), is_cfg.high))).any()):
            return False
    expected = reference_is_weights(batch.prox_logprobs, batch.behavior_logprobs, mask, is_cfg)
    loss, grad, _ = _run(loss_fn, batch, cfg)
    num_tokens = max(float(mask.sum()), 1.0)
    adv = batch.advantages.to(torch.float64)
    _assert_close(
        loss,
        torch.where(mask, -expected * adv, 0.0).sum() / num_tokens,
        f"loss at ratio 1 with IS weights ({is_cfg.type})",
    )
    sel = mask & (adv.abs() > 1e-3)
    implied = -grad.to(torch.float64)[sel] * num_tokens / adv[sel]
    _assert_close(implied, expected[sel], f"IS weights implied by the gradient ({is_cfg.type})")
    return True


def check_on_policy_gradient(
    loss_fn: LossFn,
    cfg: LossConfig | st.SearchStrategy[LossConfig] | None = None,
    *,
    max_examples: int = 50,
    settings: hypothesis.settings | None = None,
) -> None:
    """Hypothesis search for a violation of :func:`assert_on_policy_gradient`, with local counts and
    with global counts larger than the batch's (as a micro-batch of a bigger batch sees)."""

    @given(
        batch=loss_batches(),
        cfg=_configs(cfg),
        extra=st.one_of(st.none(), st.tuples(st.integers(0, 20), st.integers(0, 5))),
    )
    def run(batch: LossBatch, cfg: LossConfig, extra: tuple[int, int] | None) -> None:
        counts: dict[str, float] = {}
        if extra is not None:
            counts = {
                "num_tokens": float(batch.loss_mask.sum()) + extra[0],
                "num_sequences": float(batch.loss_mask.any(-1).sum()) + extra[1],
            }
        assert_on_policy_gradient(loss_fn, batch, cfg, **counts)

    _settings(max_examples, settings)(run)()


_GARBAGE = st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30, 0.0, 7.0, -7.0])


@st.composite
def _garbage_like(draw: st.DrawFn, batch: LossBatch) -> LossBatch:
    shape = (batch.shape[0] + draw(st.integers(0, 2)), batch.shape[1] + draw(st.integers(0, 2)))
    n = shape[0] * shape[1]

    def fill() -> torch.Tensor:
        values = draw(st.lists(_GARBAGE, min_size=n, max_size=n))
        return torch.tensor(values, dtype=batch.logprobs.dtype).reshape(shape)

    return LossBatch(fill(), fill(), fill(), fill(), torch.zeros(shape, dtype=torch.bool), fill())


def check_masked_tokens_ignored(
    loss_fn: LossFn,
    cfg: LossConfig | st.SearchStrategy[LossConfig] | None = None,
    *,
    max_examples: int = 50,
    settings: hypothesis.settings | None = None,
) -> None:
    """Hypothesis search for a violation of :func:`assert_masked_tokens_ignored` (NaN/inf garbage,
    extra padding rows and columns)."""

    @given(data=st.data(), batch=loss_batches(allow_empty=True), cfg=_configs(cfg))
    def run(data: st.DataObject, batch: LossBatch, cfg: LossConfig) -> None:
        assert_masked_tokens_ignored(loss_fn, batch, cfg, data.draw(_garbage_like(batch)))

    _settings(max_examples, settings)(run)()


@st.composite
def _row_groups(draw: st.DrawFn, num_rows: int) -> list[list[int]]:
    order = draw(st.permutations(range(num_rows)))
    label = draw(st.lists(st.integers(0, num_rows - 1), min_size=num_rows, max_size=num_rows))
    groups: dict[int, list[int]] = {}
    for row in order:
        groups.setdefault(label[row], []).append(row)
    return list(groups.values())


def check_microbatch_invariance(
    loss_fn: LossFn,
    cfg: LossConfig | st.SearchStrategy[LossConfig] | None = None,
    *,
    max_examples: int = 50,
    settings: hypothesis.settings | None = None,
) -> None:
    """Hypothesis search for a violation of :func:`assert_microbatch_invariance` (random splits)."""

    @given(data=st.data(), batch=loss_batches(max_rows=6), cfg=_configs(cfg))
    def run(data: st.DataObject, batch: LossBatch, cfg: LossConfig) -> None:
        assert_microbatch_invariance(loss_fn, batch, cfg, data.draw(_row_groups(batch.shape[0])))

    _settings(max_examples, settings)(run)()


def check_clipping(
    loss_fn: LossFn,
    cfg: LossConfig | st.SearchStrategy[LossConfig] | None = None,
    *,
    max_examples: int = 50,
    settings: hypothesis.settings | None = None,
) -> None:
    """Hypothesis search for a violation of :func:`assert_clipping` (PPO-style clipped losses)."""

    @given(batch=loss_batches(max_log_ratio=0.6), cfg=_configs(cfg))
    def run(batch: LossBatch, cfg: LossConfig) -> None:
        assume(assert_clipping(loss_fn, batch, cfg))

    _settings(max_examples, settings)(run)()


def check_importance_weights(
    loss_fn: LossFn,
    cfg: LossConfig | st.SearchStrategy[LossConfig] | None = None,
    *,
    max_examples: int = 50,
    settings: hypothesis.settings | None = None,
) -> None:
    """Hypothesis search for a violation of :func:`assert_importance_weights`."""

    @given(batch=loss_batches(), cfg=_configs(cfg))
    def run(batch: LossBatch, cfg: LossConfig) -> None:
        assume(assert_importance_weights(loss_fn, batch, cfg))

    _settings(max_examples, settings)(run)()


def check_policy_loss(
    loss_fn: LossFn,
    cfg: LossConfig | st.SearchStrategy[LossConfig] | None = None,
    *,
    clipping: bool = True,
    importance_weights: bool = True,
    max_examples: int = 50,
    settings: hypothesis.settings | None = None,
) -> None:
    """All the checks above. ``clipping`` and ``importance_weights`` hold only for losses that
    follow this library's PPO clip and ``loss.importance_sampling`` semantics."""
    checks = [check_on_policy_gradient, check_masked_tokens_ignored, check_microbatch_invariance]
    checks += [check_clipping] if clipping else []
    checks += [check_importance_weights] if importance_weights else []
    for check in checks:
        check(loss_fn, cfg, max_examples=max_examples, settings=settings)
