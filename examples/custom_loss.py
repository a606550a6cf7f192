"""A policy loss of your own project, selected with `loss.type=examples.custom_loss:cispo`
(docs/guides/custom-loss.md). Below this docstring the file is the guide's block, verbatim
(tests/test_custom_loss.py checks it and runs agentrl.testing's property checks on the loss).
"""

import math

import torch

from agentrl.learner.losses import aggregate_token_losses, kl_estimate, register_loss


@register_loss("cispo", advantage_factor=True)
def cispo(logprobs, prox_logprobs, behavior_logprobs, advantages, loss_mask, cfg, *,
          ref_logprobs=None, num_tokens=None, num_sequences=None):
    """CISPO: every token keeps its gradient; the importance ratio r = pi/pi_old, clipped to
    [1 - clip_low, 1 + clip_high], only scales it. Per token: -sg(clip(r)) * A * log pi."""
    mask = loss_mask.bool()
    logp = torch.where(mask, logprobs, 0.0)  # padding may hold NaN: remove it before any arithmetic
    old = behavior_logprobs if prox_logprobs is None or cfg.proximal == "bypass" else prox_logprobs
    old = torch.where(mask, old.detach(), 0.0)
    adv = torch.where(mask, advantages.detach(), 0.0)
    log_ratio = (logp - old).detach().clamp(max=math.log1p(cfg.clip_high))  # no overflow in exp
    weight = torch.exp(log_ratio).clamp(min=1 - cfg.clip_low)
    # The value is -clip(r) * A (what PPO reports); the gradient is -clip(r) * A * d log pi.
    per_token = -weight * adv * torch.exp(logp - logp.detach())
    if cfg.kl.coef > 0:
        ref = torch.where(mask, ref_logprobs.detach(), 0.0)
        per_token = per_token + cfg.kl.coef * kl_estimate(logp, ref, cfg.kl.estimator)
    loss = aggregate_token_losses(per_token, mask, cfg.aggregation,
                                  num_tokens=num_tokens, num_sequences=num_sequences)
    clipped = mask & ((weight > 1 + cfg.clip_high - 1e-12) | (weight <= 1 - cfg.clip_low))
    n = mask.sum().clamp(min=1)
    metrics = {  # this batch's own means; the learner merges micro-batches by token count
        "train/policy_loss": aggregate_token_losses(per_token.detach(), mask, cfg.aggregation),
        "train/cispo_clip_frac": clipped.sum() / n,
        "train/cispo_weight_mean": torch.where(mask, weight, 0.0).sum() / n,
    }
    return loss, metrics
