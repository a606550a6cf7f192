"""The config sections of how it learns: replay, loss, advantages, packing, refit, colocation, distillation, watchdogs.

Part of the run configuration (:mod:`agentrl.config` re-exports everything here).
"""

from __future__ import annotations

import warnings
from typing import Literal

from pydantic import Field, field_validator, model_validator

from agentrl.config.base import Section
from agentrl.config.registry import ADVANTAGE_ESTIMATORS, LOSSES

__all__ = ["AdvantageConfig", "ColocateConfig", "DistillConfig", "ImportanceSamplingConfig", "KLConfig", "LossConfig", "PackingConfig", "RefitConfig", "ReplayConfig", "WatchdogConfig"]


class ReplayConfig(Section):
    capacity: int = Field(32, ge=1)
    """Groups the queue holds; rollouts block (backpressure) when it is full."""
    max_staleness: int = Field(1, ge=0)
    """A consumed token was produced by weights at most this many learner steps old. 0 = on-policy."""
    groups_per_step: int = Field(4, ge=1)
    """Groups in one learner batch."""
    wait_for_stragglers: bool = True
    """The learner waits for an in-flight group that its next step would push over max_staleness
    (long episodes finish late), instead of dropping it later; false drops it (bias toward short
    episodes)."""
    dynamic_sampling: bool = False
    """Dynamic sampling (DAPO): a finished group whose raw env rewards (before rollout.overlong's
    zeroing) all tie carries no group-relative signal; it is dropped as it arrives and gives its
    admission slot back, so rollouts keep producing until every batch holds groups_per_step groups
    with a reward spread. Metrics: replay/dynamic_dropped (groups), replay/dynamic_dropped_frac
    (their share of finished groups), replay/dynamic_extra_trajectories (episodes they cost)."""
    dynamic_sampling_max_dropped: int = Field(512, ge=1)
    """With dynamic_sampling: groups dropped in a row (since the learner's last batch) after which
    the run stops with an error instead of waiting forever (the policy then solves, or fails,
    every task: the env is too easy or too hard for dynamic sampling)."""


class ImportanceSamplingConfig(Section):
    type: Literal[
        "none", "token_tis", "seq_tis", "seq_tis_geo", "token_mask", "seq_mask_geo", "icepop", "seq_icepop", "gspo"
    ] = "token_tis"
    """Correction of the gap between the proximal policy and the behaviour policy (engine), with
    ratio = pi_prox / mu per token. token_tis: per-token weight min(ratio, cap); seq_tis: product of
    the sequence's token ratios, truncated; seq_tis_geo: their geometric mean, truncated;
    token_mask: rejection sampling: a token whose ratio is outside [low, high] gets weight 0, a kept
    one weight 1; seq_mask_geo: the same per sequence, by the geometric-mean ratio; icepop (IcePop,
    NeMo-RL's icepop): tokens outside [low, high] get 0, a kept token its own ratio, truncated at cap;
    seq_icepop (NeMo-RL's seq-mask-tis): sequences whose geometric-mean ratio is outside [low, high]
    get 0, each token of a kept one its own ratio, truncated at cap; gspo: GSPO's sequence-level
    (geometric-mean) policy ratio, corrected like seq_tis_geo."""
    cap: float = Field(2.0, gt=0)
    """Truncation cap C of the *_tis, icepop and seq_icepop weights (gspo's too). With cap >= high,
    icepop and seq_icepop weight kept tokens by their untruncated ratio, as NeMo-RL does."""
    low: float = Field(0.5, ge=0)
    """Lower bound of the kept band of token_mask, seq_mask_geo, icepop and seq_icepop."""
    high: float = Field(2.0, gt=0)
    """Upper bound of the kept band of token_mask, seq_mask_geo, icepop and seq_icepop."""

    @model_validator(mode="after")
    def _band(self) -> ImportanceSamplingConfig:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


class KLConfig(Section):
    coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference policy; 0 disables it (no reference pass)."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """k1: log-ratio; k2: half squared log-ratio; k3: the unbiased, non-negative exp(-x) - 1 + x."""


class LossConfig(Section):
    type: str = "ppo"
    """The policy loss. ppo: the clipped PPO objective against the proximal policy with the
    importance-sampling correction and KL penalty below (agentrl.learner.losses.compute_policy_loss). One
    of your own: `<module>:<name>`, a function with compute_policy_loss's arguments that the module
    registers (`@register_loss("name")`, agentrl.learner.losses) or defines; the other fields of this
    section are passed to it (docs/guides/custom-loss.md)."""
    clip_low: float = Field(0.2, ge=0)
    """PPO ratio lower clip: ratio >= 1 - clip_low."""
    clip_high: float = Field(0.28, ge=0)
    """PPO ratio upper clip (clip-higher): ratio <= 1 + clip_high."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip bound c > 1 for negative advantages; None disables it."""
    proximal: Literal["recompute", "bypass"] = "recompute"
    """recompute: ratio against the learner's own logprobs before the step (one optimizer step per
    batch: the training pass's own logprobs, detached; no extra pass); bypass: against the
    behaviour logprobs (IS correction is then the identity)."""
    importance_sampling: ImportanceSamplingConfig = Field(default_factory=ImportanceSamplingConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    """How per-token losses become one number, normalized by global counts."""

    @field_validator("type")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        return LOSSES.check(value)


class AdvantageConfig(Section):
    estimator: str = "grpo"
    """grpo: reward minus group mean (over std if normalize_std); rloo: leave-one-out mean
    baseline; dr_grpo: group mean only, no std (pair with seq_mean_token_sum). One of your own:
    `<module>:<name>`, a function `(returns, normalize_std, eps, std) -> (baseline, scale)` that
    the module registers (`@register_advantage_estimator("name")`, agentrl.learner.advantages) or defines."""
    normalize_std: bool = True
    """GRPO only: divide by the group's reward standard deviation (see std)."""
    std: Literal["population", "sample"] = "population"
    """Which standard deviation GRPO divides by (with normalize_std): population (divide the
    squared deviations by G) or sample (by G - 1, Bessel-corrected, as verl and NeMo-RL do).
    Rewards [1, 0] give advantages +-1.0 with population and +-0.707 with sample. No effect on
    rloo, dr_grpo or without normalize_std."""
    turn_discount: float = Field(1.0, ge=0, le=1)
    """Discount of later turns' rewards for turn-level credit; 1.0 = whole-episode return."""
    eps: float = Field(1e-6, gt=0)
    """Added to the std before dividing."""

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        return ADVANTAGE_ESTIMATORS.check(value)

    @model_validator(mode="after")
    def _std_has_effect(self) -> AdvantageConfig:
        if "std" in self.model_fields_set and (self.estimator != "grpo" or not self.normalize_std):
            warnings.warn(
                f"advantage.std={self.std} has no effect with estimator={self.estimator}, "
                f"normalize_std={self.normalize_std} (only grpo with normalize_std divides by a std)",
                stacklevel=2,
            )
        return self


class PackingConfig(Section):
    algorithm: Literal["mffd", "ffd"] = "mffd"
    """Bin packing of sequences into token-budget micro-batches."""
    max_tokens_per_microbatch: int = Field(4096, ge=16)
    """Token capacity of one packed micro-batch (padding included)."""
    pad_multiple: int = Field(1, ge=1)
    """Pad every sequence to a multiple of this (2*cp for context parallelism)."""
    logprob_chunk_size: int = Field(1024, ge=1)
    """Tokens per chunk when computing logprobs, so no full [T, vocab] float32 tensor exists."""


class RefitConfig(Section):
    interval: int = Field(1, ge=1)
    """Learner steps between weight pushes to the engines."""
    transport: Literal["auto", "object_store", "cuda_ipc", "nccl"] = "auto"
    """How weights reach the engines. object_store: CPU tensors through Ray's object store (CPU
    engines, any placement); cuda_ipc: a CUDA IPC handle of one flat GPU buffer (engines and
    learner on the same GPU, colocate.enabled); nccl: a broadcast from the learner's rank 0 to the
    engines' workers in a process group of its own (engines on other GPUs or nodes; gloo on CPU).
    auto: cuda_ipc when colocated on a GPU, nccl for GPU engines elsewhere, object_store on CPU."""
    mode: Literal["drain", "continue"] = "continue"
    """drain: wait for in-flight requests before swapping weights; continue: pause, swap, and
    resume them on the new weights (each token records the version that made it)."""
    zero_copy: bool = False
    """cuda_ipc with the Megatron learner: the engines read the learner's parameters where they lie
    (the distributed optimizer's contiguous parameter buffer, or one buffer they are gathered into
    at start-up without it) instead of a flat copy made for each refit: no model-sized export
    buffer (2.9 GB at 1.5B in bf16, the learner's memory peak when the engine is resident) and no
    copy. The learner's optimizer step waits until every engine has loaded. Needs
    tensor_parallel_size and pipeline_parallel_size 1 and full fine-tuning (no LoRA)."""


class ColocateConfig(Section):
    enabled: bool = False
    """Engines and learner share the GPU(s): Ray places the learner's rank i and the engines in
    shared GPU bundles (one GPU machine: both on the one GPU)."""
    engine_sleep: bool = True
    """While the learner steps, the engines drain their requests and release their weights and KV
    cache (vLLM sleep mode), then wake with the new weights: the most memory for both, no overlap
    of generation and training. false: both stay resident in a static split
    (engine.gpu_memory_utilization for the engine), so generation and training overlap."""
    learner_gpu_fraction: float = Field(0.5, gt=0, lt=1)
    """The share of a GPU Ray books for each learner rank; engines book engine.num_gpus. The two
    must fit on one GPU (Ray's bookkeeping only: real memory is set by gpu_memory_utilization)."""


class DistillConfig(Section):
    teacher: str | None = None
    """Hugging Face model directory of the teacher for on-policy distillation; None: off. The
    teacher is served by engine actors of its own and scores the student's sampled tokens (vLLM
    prompt logprobs on the student's exact token ids, no retokenization): it must share the
    student's tokenizer. Each policy token t gets the advantage
    coef * (log pi_teacher(y_t) - log mu(y_t)) (the per-token reverse KL, negated; mu is the
    engine that sampled it) plus reward_weight times its task-reward advantage."""
    coef: float = Field(1.0, gt=0)
    """Weight of the distillation term: the per-token reverse-KL advantage, or with top_k > 0
    the dense top-k loss."""
    top_k: int = Field(0, ge=0, le=20)
    """0: the sampled estimate above (the teacher's logprob of the student's own token only).
    k > 0: dense distillation: the teacher returns its k most likely tokens at every policy
    position (vLLM top-k prompt logprobs), and the loss adds, per policy token,
    coef * KL(q_k || pi_student), q_k the teacher's top-k renormalised (zero elsewhere), against
    the student's full softmax (at rollout.temperature): it names the teacher's tokens instead of
    only scoring the student's. The sampled-estimate advantage is then off (only
    reward_weight's task advantage stays in the policy-gradient term). At most 20 (vLLM's
    max_logprobs); torch learner only."""
    top_k_direction: Literal["forward", "reverse"] = "forward"
    """With top_k > 0: forward: KL(q_k || pi_student) as above (mass-covering: a student sharper
    than its teacher is made as uncertain as the teacher). reverse: KL(pi_student || pi_teacher)
    over k + 1 outcomes, the teacher's k tokens and one bucket for every other token (the
    teacher's leftover mass 1 - sum of its top-k probabilities; the student's likewise):
    mode-seeking, and the student's mass outside the teacher's top k is penalised."""
    reward_weight: float = Field(0.0, ge=0)
    """Weight of the task-reward (group-relative) advantage added to the distillation one;
    0: pure distillation, the env's rewards are not trained on."""
    num_engines: int = Field(1, ge=1)
    """Teacher engine actors (round-robin over trajectories)."""
    num_cpus: float = Field(1.0, ge=0)
    """Ray CPUs reserved per teacher engine actor."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per teacher engine actor (0 on CPU)."""
    kv_cache_gib: float | None = Field(None, gt=0)
    """KV-cache size per teacher engine on CPU; None: engine.kv_cache_gib."""

    @property
    def enabled(self) -> bool:
        return self.teacher is not None


class WatchdogConfig(Section):
    """Deadlines on every wait of the driver (a batch, a learner step, a refit, engine sleep/wake,
    a checkpoint), derived from the run's own recent durations of that wait."""

    enabled: bool = True
    """Watch the driver's waits. When a deadline passes the run prints what it waited for, which
    actors answer a ping, and the Python stacks of those that do not (py-spy) or are busy, then
    recovers (restarts a frozen engine or a lost rollout actor) or stops with a message."""
    floor_s: float = Field(300.0, gt=0)
    """No deadline is shorter than this. The first waits of a kind (engine start-up, the first
    step, compilation) have no history and get `first_s`."""
    first_s: float = Field(900.0, gt=0)
    """Deadline of a wait of a kind seen fewer than `min_samples` times."""
    progress_floor_s: float = Field(30.0, gt=0)
    """Floor of the deadline of a wait whose progress is watched (a batch: groups queued; an
    evaluation: tokens sampled; a CPU learner step: its CPU time), in place of `floor_s`: such a
    deadline only makes the watchdog look, and a slow wait that moves raises nothing. Also the
    least time an engine with requests in flight may go without sampling a token before it is
    judged stalled (its actor answering or not) and restarted: between deadlines of a batch or an
    evaluation the watchdog looks for such an engine every max(`progress_floor_s`, `factor` x
    the recent `quantile` of that wait) seconds."""
    factor: float = Field(5.0, ge=1)
    """Deadline = max(floor_s, factor x the `quantile` of the last `window` durations of that kind)."""
    quantile: float = Field(0.9, gt=0, le=1)
    """Which quantile of recent durations the factor multiplies."""
    window: int = Field(50, ge=1)
    """Recent durations kept per kind of wait."""
    min_samples: int = Field(3, ge=1)
    """Durations of a kind needed before it gets a deadline from them."""
    ping_timeout_s: float = Field(10.0, gt=0)
    """How long an actor has to answer the diagnosis ping before it is judged unresponsive."""
    max_recoveries: int = Field(3, ge=0)
    """Recoveries (an actor restarted, its work resubmitted) in one wait before the run stops."""
    deadlines: dict[Literal["batch", "learner_step", "refit", "engine_sleep", "engine_wake", "checkpoint",
                            "eval"], float] = Field(default_factory=dict)
    """Fixed deadlines (seconds) by kind of wait, replacing the derived ones, e.g.
    `{learner_step: 3600}` for a learner known to take long."""
