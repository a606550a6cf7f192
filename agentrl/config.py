"""Typed run configuration: pydantic v2 models, YAML files and dotted command-line overrides.

Nothing here imports torch, Ray or vLLM, so parsing (and ``--help``/``--print-config``) is instant.
Every model rejects unknown keys, and every error names the dotted path of the field at fault.
"""

from __future__ import annotations

import difflib
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from agentrl.config_base import ConfigError, Section
from agentrl.config_learner import (
    FAST_OPTIONS,
    LearnerConfig,
    LoRAConfig,
    MegatronConfig,
    resolve_fast_options,
)
from agentrl.tool_calls import tool_parser_error

__all__ = [
    "FAST_OPTIONS",
    "AdvantageConfig",
    "AgentConfig",
    "ClusterConfig",
    "ColocateConfig",
    "Config",
    "ConfigError",
    "DistillConfig",
    "EngineConfig",
    "EnvConfig",
    "EvalConfig",
    "ImportanceSamplingConfig",
    "KLConfig",
    "LearnerConfig",
    "LoRAConfig",
    "LossConfig",
    "MetricsConfig",
    "MegatronConfig",
    "ModelConfig",
    "TinyModelConfig",
    "PackingConfig",
    "RefitConfig",
    "ReplayConfig",
    "RolloutConfig",
    "SFTConfig",
    "TrainConfig",
    "WandbConfig",
    "WatchdogConfig",
    "apply_overrides",
    "load_config",
    "resolve_fast_options",
]




class TinyModelConfig(Section):
    hidden_size: int = Field(128, ge=8)
    """Width of the tiny model that model.bootstrap_tiny creates."""
    num_layers: int = Field(4, ge=1)
    """Decoder layers of the tiny model."""
    num_heads: int = Field(4, ge=1)
    """Attention heads (hidden_size must be a multiple)."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention; num_heads must be a multiple)."""
    intermediate_size: int = Field(384, ge=8)
    """MLP width."""
    max_position_embeddings: int = Field(4096, ge=64)
    """Context the tiny model (and vLLM serving it) accepts; 16384 for the long-context recipe."""
    rope_theta: float = Field(10000.0, gt=0)
    """Rotary base; larger for long contexts, so some rotary dimensions stay nearly still over the
    whole window and attention can match content at any distance."""
    induction_steps: int = Field(0, ge=0)
    """Steps of a pre-stage on repeated random token blocks (2,048 tokens each) that gives the
    random model induction heads, the copy skill every pretrained LM has (the long-context recipe
    needs it: 1,000 steps, ~100 s). 0: the model stays random."""
    induction_lr: float = Field(3e-3, gt=0)
    """Peak learning rate of that pre-stage."""

    @model_validator(mode="after")
    def _heads(self) -> "TinyModelConfig":
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads}), "
                             f"and num_heads of num_kv_heads ({self.num_kv_heads})")
        return self


class ModelConfig(Section):
    path: str = ".cache/tiny-model"
    """Hugging Face-format model directory (config.json, safetensors, tokenizer)."""
    bootstrap_tiny: bool = False
    """Create a tiny random model at `path` when it does not exist (`agentrl bootstrap-tiny`)."""
    family: Literal["qwen2", "qwen3", "llama3", "mistral"] = "qwen2"
    """Model family of the tiny model `bootstrap_tiny` creates: its architecture, special tokens and
    chat template (tool-call syntax, tool-result role, end-of-turn token)."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Size of the model bootstrap_tiny creates (the GPU recipe uses a larger one)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of learner and engines. float32 on CPU keeps engine/learner logprobs equal."""
    tokenizer_vocab_only: bool = False
    """The policy is a distribution over the tokenizer's ids only (ids < len(tokenizer)): the
    trainer's engines mask the LM head's logits past them to -inf (sampling and logprobs alike),
    and the learner's log-softmax gets the same mask. For heads with more rows than the tokenizer
    has ids (Qwen2.5: 151,936 rows, 151,665 ids), whose extra rows decode to nothing; verl always
    samples this way (its vLLM server masks the logits past len(tokenizer)). No effect when the
    head is no larger than the tokenizer."""


class EnvConfig(Section):
    id: str = "agentrl/Calculator-v0"
    """Gymnasium id of the training environment, or `module:EnvId` (Gymnasium's form) to import
    `module` first, e.g. `examples.units_env:my/Units-v0`; the module is looked up on the Python
    path, then in the current directory, and imported in the driver and in every rollout actor."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to `gymnasium.make`."""
    step_timeout_s: float = Field(30.0, gt=0)
    """An env step that takes longer marks the episode failed."""

    @field_validator("id")
    @classmethod
    def _module_colon_id(cls, value: str) -> str:
        module, sep, name = value.partition(":")
        if not value or (sep and not name) or ":" in name:
            raise ValueError("expected EnvId or module:EnvId (one ':'), e.g. examples.units_env:my/Units-v0")
        if sep and not all(part.isidentifier() for part in module.split(".")):
            dotted = module.removesuffix(".py").replace("/", ".").replace("\\", ".")
            raise ValueError(f"'{module}' is not a Python module name; write it dotted, as in import "
                             f"statements (e.g. {dotted}:{name})")
        return value


class RolloutConfig(Section):
    num_actors: int = Field(2, ge=1)
    """Rollout actors; each runs many episodes concurrently."""
    group_size: int = Field(8, ge=1)
    """Episodes per task (G in GRPO); a group enters the replay queue when all are done."""
    max_concurrent_groups: int = Field(4, ge=1)
    """Groups in flight per rollout actor."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature. Off-policy correction assumes the learner scores at the same one."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling. Below 1 the engine's logprobs are renormalized over the nucleus and no
    longer match the learner's full-softmax logprobs."""
    max_new_tokens: int = Field(64, ge=1)
    """Tokens the policy may sample in one turn."""
    min_new_tokens: int = Field(0, ge=0)
    """Tokens the engine samples in a turn before it may stop (vLLM's min_tokens; end-of-turn and
    EOS are held back until then). 0: none. Benchmarks set it to max_new_tokens so every reply has
    one length (bench/peers/)."""
    max_turns: int = Field(4, ge=1)
    """Assistant turns before the episode is truncated."""
    max_total_tokens: int = Field(1024, ge=16)
    """Trajectory length cap (prompt + all turns); longer episodes are truncated. The engine's
    max_model_len caps it too: an episode that reaches the smaller of the two ends as truncated."""
    overlong: Literal["zero_reward", "mask", "keep"] = "zero_reward"
    """What a trajectory cut by the token cap (not by max_turns) is trained as. zero_reward: its
    rewards are set to 0 (an unfinished answer is a wrong one); mask: it is left out of the loss
    and of its group's baseline (DAPO's overlong filtering); keep: its rewards stay as the env gave
    them. The turn cut short by the cap is never sent to the env."""
    max_observation_tokens: int | None = Field(None, ge=16)
    """Cap on one tool message's content, in tokens: longer tool outputs are cut there and end
    with a marker saying how much was cut. None: no cap beyond the env's own."""
    seed_offset: int = 0
    """Training tasks use env seeds `seed_offset + k`; eval seeds live elsewhere."""
    sampling_seed: int | None = None
    """None: requests draw their random numbers from the engine's generator, so a request's tokens
    depend on which other requests the engine batches with it. An int: every request samples with
    its own seed, derived from this, the episode (task seed and index) and the turn, so the same
    prompt on the same weights samples the same tokens at any load (`train.deterministic` sets it)."""
    max_episode_s: float | None = Field(None, gt=0)
    """Wall-time budget of one episode (reset, every model call and tool call). An episode past it
    ends as truncated (`info["truncated_by"] == "wall_time"`) with the turns it finished, so one
    runaway agent cannot hold its group (and the batch) hostage. None: no budget."""
    max_model_calls: int | None = Field(None, ge=1)
    """Model calls one episode may make (agent mode: requests to the endpoint; env mode: turns,
    like max_turns). Past it the episode ends as truncated (`truncated_by == "model_calls"`)."""
    max_episode_tokens: int | None = Field(None, ge=1)
    """Sampled tokens one episode may make over all its turns (the prompt and tool outputs do not
    count; max_total_tokens caps the whole). Past it the episode ends as truncated
    (`truncated_by == "sampled_tokens"`). None: no budget."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each actor of this kind needs; pins them to nodes that offer them."""
    tool_parser: str = "auto"
    """vLLM tool parser that reads tool calls in sampled text (hermes, llama3_json, mistral,
    pythonic, ...: any name in vllm.tool_parsers.ToolParserManager). auto: the checkpoint's
    family, from its chat template's call syntax or its model_type."""

    @field_validator("tool_parser")
    @classmethod
    def _known_tool_parser(cls, name: str) -> str:
        error = tool_parser_error(name, key=None)
        if error is not None:
            raise ValueError(error)
        return name


class AgentConfig(Section):
    solve: str | None = None
    """Your agent, as `module:function` (the module looked up as env modules are): `async def
    solve(client, task) -> float` gets an `openai.AsyncOpenAI` client bound to this episode (a
    plain `def` gets an `openai.OpenAI` one and runs in a thread) and returns the reward. When
    set, the rollouts run the agent through the OpenAI-compatible endpoint instead of env.id's
    env (guides/agent-endpoint.md). None: the env path."""
    score: str | None = None
    """Optional `module:function` `score(task, result) -> float`: the reward of what `solve`
    returned, for agents that return an answer rather than a reward."""
    tasks: str | None = None
    """Training tasks: a `.jsonl` file (task k is line k mod the number of lines, one JSON value
    each) or `module:function` called as `function(seed) -> task` (a generator, or a lookup into a
    dataset). Task seeds follow rollout.seed_offset as env seeds do."""
    eval_tasks: str | None = None
    """Held-out tasks for eval, in the same forms, drawn at eval.seed_offset + k. None: `tasks`
    (a function then gets the held-out seeds; a JSONL file would repeat training tasks)."""
    timeout_s: float = Field(120.0, gt=0)
    """An agent that has not returned after this long fails: its episode is counted and never
    trained on, and its key is refused from then on."""
    request_timeout_s: float = Field(60.0, gt=0)
    """Timeout of one HTTP request of the client `solve` is given."""
    model_name: str = "agentrl-policy"
    """The model name the endpoint serves; requests for another model get a 404."""
    temperature: Literal["config", "request"] = "config"
    """config: the engine samples at rollout.temperature (eval.temperature in evaluation)
    whatever a request asks, the temperature the learner's correction assumes; request: a
    request's temperature is used (the importance weights then carry the difference)."""
    host: str = "127.0.0.1"
    """Interface the endpoint listens on (each rollout actor serves one)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the endpoint; 0 picks a free one (several rollout actors run on one machine)."""

    @field_validator("solve", "score")
    @classmethod
    def _module_function(cls, value: str | None) -> str | None:
        if value is None:
            return value
        module, sep, name = value.partition(":")
        if not sep or not module or not name.isidentifier() or not all(p.isidentifier() for p in module.split(".")):
            raise ValueError(f"expected module:function (e.g. examples.calculator_agent:solve), got {value!r}")
        return value

    @model_validator(mode="after")
    def _tasks_with_solve(self) -> "AgentConfig":
        if self.solve is not None and self.tasks is None:
            raise ValueError("agent.solve needs agent.tasks (a .jsonl file or module:function(seed) -> task)")
        return self


class EngineConfig(Section):
    num_engines: int = Field(1, ge=1)
    """vLLM engine actors."""
    max_model_len: int = Field(2048, ge=64)
    """Longest sequence (prompt + generation) the engine accepts."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """KV-cache size per engine on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (CUDA engines only)."""
    enforce_eager: Literal["auto", True, False] = "auto"
    """Skip vLLM's compilation and CUDA-graph capture: a faster start, slower decoding. auto (the
    default): eager on CPU engines (engine.num_gpus 0), where compiling costs minutes; compiled
    with CUDA graphs on GPU engines, where eager decoding of a billion-parameter model is several
    times slower (launch-bound). true/false force it."""
    max_num_seqs: int = Field(64, ge=1)
    """Requests an engine batches at once."""
    num_cpus: float = Field(1.0, gt=0)
    """Ray CPUs reserved per engine actor."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per engine actor (0 on CPU)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each actor of this kind needs; pins them to nodes that offer them."""

    @model_validator(mode="after")
    def _resolve_eager(self) -> EngineConfig:
        if self.enforce_eager == "auto":  # resolved here, so --print-config shows what runs
            object.__setattr__(self, "enforce_eager", self.num_gpus == 0)
        return self


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
    def _band(self) -> "ImportanceSamplingConfig":
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


class KLConfig(Section):
    coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference policy; 0 disables it (no reference pass)."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """k1: log-ratio; k2: half squared log-ratio; k3: the unbiased, non-negative exp(-x) - 1 + x."""


class LossConfig(Section):
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


class AdvantageConfig(Section):
    estimator: Literal["grpo", "rloo", "dr_grpo"] = "grpo"
    """grpo: reward minus group mean (over std if normalize_std); rloo: leave-one-out mean
    baseline; dr_grpo: group mean only, no std (pair with seq_mean_token_sum)."""
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


class TrainConfig(Section):
    num_steps: int = Field(10, ge=0)
    """Learner steps (optimizer steps) to run."""
    time_limit_s: float | None = Field(None, gt=0)
    """Stop after the learner step that crosses this much wall time (None: no limit)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; defaults to RUN_DIR/checkpoints."""
    checkpoint_interval: int = Field(0, ge=0)
    """Learner steps between checkpoints; 0 = only at the end."""
    deterministic: bool = False
    """The same seed trains on the same batches whatever the machine's speed: strictly on-policy
    (sets `replay.max_staleness` to 0), one rollout actor (`rollout.num_actors` 1, so task seeds
    follow admission order), each request sampled with its own seed (`rollout.sampling_seed`, the
    run's seed unless set) and every batch in task order. Costs the async speed-up: generation and
    training no longer overlap (`bench/async_vs_sync.py`: async made 3.3-3.4x the trajectories/s
    of on-policy on 2 CPU cores with slow tools)."""
    overlap_steps: Literal["auto", True, False] = "auto"
    """Queue the next learner step before the current one ends: its batch (taken from the replay
    queue for the version the learner will then hold, so the staleness bound is unchanged) and
    the refit's weight export are waiting on the learner when the step finishes, and the learner
    goes from step to step without waiting for the driver's logging and data transfer. The step
    already queued when the time limit passes also runs. Not with sleeping engines (colocate.
    engine_sleep), which must be put to sleep before each step. auto: on for a GPU learner
    beside awake engines, off elsewhere."""


class SFTConfig(Section):
    enabled: bool = False
    """`agentrl train` first runs (or reuses) the SFT warm start and starts RL from its output."""
    num_demos: int = Field(2000, ge=1)
    """Expert episodes to train on."""
    num_epochs: int = Field(3, ge=1)
    """Passes over the demonstrations."""
    lr: float = Field(3e-3, gt=0)
    """Peak AdamW learning rate (warm-up, then linear decay)."""
    batch_tokens: int = Field(4096, ge=16)
    """Tokens per packed batch (one optimizer step)."""
    digit_loss_weight: float = Field(1.0, gt=0)
    """Loss weight of assistant tokens that are digits, relative to the other assistant tokens.
    Copying numbers (question -> tool call -> answer) is what a small model learns last; weighting
    digits up (e.g. 5) shortens that plateau several-fold."""
    observation_loss_weight: float = Field(0.0, ge=0)
    """Loss weight of the tokens the env wrote (prompt, tool outputs), relative to the assistant's
    tokens; 0 trains on the assistant's tokens only. Above 0 the model also learns to predict the
    documents it reads: where they repeat a line (LongNeedle's `repeats`), every repeat is a copy
    target, which forms the copy circuit far sooner than the one answer per episode does."""
    seed_offset: int = Field(2_000_000, ge=0)
    """Demonstrations use env seeds from here on, apart from RL training and eval seeds."""
    expert_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the env's `expert(seed, ...)` (e.g. `guess_prob` for Calculator)."""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Env keyword arguments for the demonstrations only, over `env.kwargs` (e.g. shorter pages
    for LongRecall: the skill is learned on cheap short episodes, then used on long ones)."""
    output_dir: str = ".cache/sft-model"
    """Where the warm-started model is written (HF format); reused when present."""


class EvalConfig(Section):
    num_episodes: int = Field(64, ge=0)
    """Held-out episodes evaluated before and after training; 0 skips evaluation."""
    seed_offset: int = 1_000_000
    """Held-out seeds start here; training seeds never reach it."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature of evaluation (0 = greedy)."""
    interval: int = Field(0, ge=0)
    """Also evaluate every this many learner steps (logged as eval_step/... at that step: a
    held-out learning curve); 0: only before and after training."""


class ClusterConfig(Section):
    address: str | None = None
    """Ray cluster to join; None starts a local one."""
    num_cpus: int | None = None
    """CPUs of the local Ray instance (None: all of the machine's)."""
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    """Ray runtime environment of the run's actors (`working_dir`, `py_modules`, `pip`, `env_vars`,
    ...: Ray's "Environment dependencies" guide), given to `ray.init` when agentrl starts or joins
    Ray. A program that calls `ray.init` itself passes `Trainer(cfg).runtime_env` to it."""
    ship_env_module: bool = True
    """Add the package (or file) of env.id's `module:` part to `runtime_env.py_modules` unless it
    is installed, so that nodes without the user's code import it."""
    max_task_events: int = Field(10_000, ge=1)
    """When agentrl starts Ray itself (`address` None): how many tasks' events (state changes,
    timings: what `ray list tasks` and Ray's dashboard show) Ray's GCS keeps, the oldest dropped
    first (Ray's `task_events_max_num_task_in_gcs`). Ray's default, 100,000, let gcs_server grow
    to about 330 MiB in an hour's soak run (about 3 KB a task; bench/RESULTS.md, issue 33). A
    cluster agentrl joins keeps its own setting."""
    placement_timeout_s: float = Field(300.0, gt=0)
    """Colocated runs: how long to wait for Ray to place the one-GPU bundles (learner rank i with
    its engines) before stopping with an error that says what the cluster lacks."""


class WandbConfig(Section):
    enabled: bool = False
    """Log the run to Weights & Biases too (needs the `wandb` extra: `pip install 'agentrl[wandb]'`):
    every metric row of metrics.jsonl at its learner step, the held-out evaluation (eval_before/
    at step 0, eval_after/ at the last step), the resolved config, and summary.json as the W&B
    run summary."""
    project: str = "agentrl"
    """W&B project."""
    name: str | None = None
    """W&B run name (None: the last part of `run_dir`)."""
    tags: list[str] = Field(default_factory=list)
    """W&B run tags."""
    entity: str | None = None
    """W&B entity (team or user); None: the logged-in user's default."""
    mode: Literal["online", "offline"] = "online"
    """offline: W&B writes the run under RUN_DIR/wandb only (upload later with `wandb sync`);
    the WANDB_MODE environment variable, when set, wins."""

    @model_validator(mode="after")
    def _unused(self) -> WandbConfig:
        if not self.enabled and self.model_fields_set - {"enabled"}:
            keys = ", ".join(f"metrics.wandb.{k}" for k in sorted(self.model_fields_set - {"enabled"}))
            warnings.warn(f"{keys} has no effect: metrics.wandb.enabled is false", stacklevel=2)
        return self


class MetricsConfig(Section):
    tensorboard: bool = True
    """Write TensorBoard events under RUN_DIR/tensorboard (metrics.jsonl is always written)."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases logging, off by default."""


class Config(Section):
    run_dir: str = "runs/default"
    """Where metrics (JSONL, TensorBoard), plots, summary and checkpoints of the run go."""
    seed: int = 0
    """Seeds torch, the engines' sampling and the tiny model's initialization."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    packing: PackingConfig = Field(default_factory=PackingConfig)
    refit: RefitConfig = Field(default_factory=RefitConfig)
    colocate: ColocateConfig = Field(default_factory=ColocateConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> "Config":
        if self.train.deterministic:
            changed = [f"{key} {old} -> {new}" for key, old, new in (
                ("replay.max_staleness", self.replay.max_staleness, 0),
                ("rollout.num_actors", self.rollout.num_actors, 1)) if old != new]
            if changed:
                warnings.warn(f"train.deterministic: {', '.join(changed)}", stacklevel=2)
            object.__setattr__(self.replay, "max_staleness", 0)
            object.__setattr__(self.rollout, "num_actors", 1)
            if self.rollout.sampling_seed is None:
                object.__setattr__(self.rollout, "sampling_seed", self.seed)
        mc = self.learner.megatron
        if self.colocate.enabled and "cuda_graphs" in mc._auto:
            # The graphs' activation pools stay allocated beside the engine: at 1.5B on one H100 they
            # took 15 GiB and left the learner (split) or the engine's wake (sleep) out of memory
            # (bench/RESULTS.md, GPU loop).
            object.__setattr__(mc, "cuda_graphs", False)
        if self.learner.backend == "megatron" and self.learner.lora.enabled:
            raise ValueError("learner.lora needs learner.backend=torch: the Megatron-Core learner has no LoRA "
                             "(set learner.backend=torch, or learner.lora.rank=0 for full fine-tuning)")
        if self.learner.backend == "megatron":
            world = max(self.learner.num_gpus, 1)
            model_parallel = mc.tensor_parallel_size * mc.pipeline_parallel_size * mc.context_parallel_size
            if world % model_parallel:
                raise ValueError(
                    f"learner.num_gpus ({world}) must be a multiple of tensor_parallel_size * "
                    f"pipeline_parallel_size * context_parallel_size ({model_parallel})"
                )
            if mc.cuda_graphs:
                off = [f"{k}={getattr(mc, k)}" for k, ok in (
                    ("tensor_parallel_size", mc.tensor_parallel_size == 1),
                    ("pipeline_parallel_size", mc.pipeline_parallel_size == 1),
                    ("context_parallel_size", mc.context_parallel_size == 1),
                    ("activation_checkpointing", not mc.activation_checkpointing),
                    ("attention", mc.attention == "flex")) if not ok]
                if off:
                    raise ValueError(f"learner.megatron.cuda_graphs needs attention=flex, no tensor/pipeline/context "
                                     f"parallelism and no activation checkpointing; got {', '.join(off)} "
                                     "(auto, the default, turns it on only where it can run)")
            idle = []  # auto never resolves to these: only a forced true lands here
            if mc.fused_logprobs and mc.tensor_parallel_size > 1:
                idle.append(f"fused_logprobs (tensor_parallel_size={mc.tensor_parallel_size})")
            if mc.flex_expand_kv and (mc.attention != "flex" or mc.context_parallel_size > 1):
                idle.append(f"flex_expand_kv (attention={mc.attention}, "
                            f"context_parallel_size={mc.context_parallel_size})")
            if idle:
                warnings.warn(f"learner.megatron: {', '.join(idle)} set but without effect here", stacklevel=2)
            need = 2 * mc.context_parallel_size * (mc.tensor_parallel_size if mc.sequence_parallel else 1)
            if mc.context_parallel_size > 1 and self.packing.pad_multiple % need:
                raise ValueError(
                    f"packing.pad_multiple ({self.packing.pad_multiple}) must be a multiple of {need} "
                    "(2 * context_parallel_size, times tensor_parallel_size with sequence_parallel)"
                )
        co = self.colocate
        if self.train.overlap_steps is True and co.enabled and co.engine_sleep:
            raise ValueError("train.overlap_steps=true cannot run with colocate.engine_sleep=true: the engines "
                             "sleep before every learner step, so no step can be queued ahead (use auto or false)")
        if co.enabled:
            if self.learner.num_gpus < 1 or self.engine.num_gpus <= 0:
                raise ValueError("colocate.enabled needs GPU engines and a GPU learner: set engine.num_gpus "
                                 f"(e.g. 0.5) and learner.num_gpus >= 1 (given {self.engine.num_gpus} and "
                                 f"{self.learner.num_gpus})")
            world = max(1, self.learner.num_gpus) if self.learner.backend == "megatron" else 1
            per_gpu = -(-self.engine.num_engines // world)  # engines are dealt round-robin over the GPUs
            if per_gpu * self.engine.num_gpus + co.learner_gpu_fraction > 1 + 1e-9:
                raise ValueError(f"colocate: {per_gpu} engine(s) x engine.num_gpus ({self.engine.num_gpus}) + "
                                 f"colocate.learner_gpu_fraction ({co.learner_gpu_fraction}) must fit on one GPU "
                                 f"(<= 1); engine.num_engines ({self.engine.num_engines}) are dealt over the "
                                 f"learner's {world} GPU(s)")
        if self.refit.transport != "auto":
            from agentrl.refit import resolve_transport

            resolve_transport(self.refit.transport, engine_on_gpu=self.engine.num_gpus > 0,
                              same_gpu=co.enabled and self.engine.num_gpus > 0)
        if self.replay.dynamic_sampling:
            if self.rollout.group_size < 2:
                raise ValueError("replay.dynamic_sampling drops groups whose rewards tie; a group of "
                                 f"rollout.group_size = {self.rollout.group_size} always ties (use >= 2)")
            if self.distill.enabled and self.distill.reward_weight == 0:
                raise ValueError("replay.dynamic_sampling filters groups on their task rewards, but "
                                 "distill.reward_weight is 0 (pure distillation trains every group): "
                                 "turn one of them off, or give the task reward a weight")
        dc = self.distill
        if dc.enabled and dc.top_k > 0 and self.learner.backend != "torch":
            raise ValueError("distill.top_k > 0 (dense top-k distillation) needs learner.backend=torch: the "
                             "Megatron-Core learner scores the sampled tokens only (set distill.top_k=0)")
        if dc.enabled and self.cluster.address is None and self.cluster.num_cpus is not None:
            need = (self.engine.num_engines * self.engine.num_cpus + self.learner.num_cpus * max(1, self.learner.num_gpus)
                    + dc.num_engines * dc.num_cpus)
            if need > self.cluster.num_cpus:
                # Ray would never place the teacher's engines, and the run would wait forever.
                raise ValueError(f"distill: the engines, the learner and {dc.num_engines} teacher engine(s) need "
                                 f"{need:g} Ray CPUs, but cluster.num_cpus is {self.cluster.num_cpus}; raise it "
                                 "or lower distill.num_cpus (e.g. 0: the teacher only prefills)")
        if self.rollout.max_total_tokens > self.engine.max_model_len:
            raise ValueError(
                f"rollout.max_total_tokens ({self.rollout.max_total_tokens}) exceeds "
                f"engine.max_model_len ({self.engine.max_model_len})"
            )
        if self.packing.max_tokens_per_microbatch < self.rollout.max_total_tokens:
            raise ValueError(
                f"packing.max_tokens_per_microbatch ({self.packing.max_tokens_per_microbatch}) must hold "
                f"the longest trajectory (rollout.max_total_tokens = {self.rollout.max_total_tokens})"
            )
        return self


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            parent, _, key = path.rpartition(".")
            known = _known_keys(parent)
            hint = difflib.get_close_matches(key, known, n=1)
            msg = f"unknown key '{path}'"
            msg += f"; did you mean '{(parent + '.' if parent else '') + hint[0]}'?" if hint else ""
            msg += f" (allowed: {', '.join(sorted(known))})" if known else ""
        else:
            given = e.get("input")
            msg = f"{path}: {e['msg']} (given: {given!r})"
        lines.append("  " + msg)
    return "\n".join(lines)


def _known_keys(dotted: str) -> list[str]:
    model: type[BaseModel] = Config
    for part in [p for p in dotted.split(".") if p]:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _parse_value(text: str) -> Any:
    # YAML scalars: "3" -> 3, "true" -> True, "null" -> None, "[1,2]" -> list; anything else a string.
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides to a nested dict (values parsed as YAML scalars)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form dotted.key=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{item}': '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = _parse_value(value)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config, apply dotted overrides and validate.

    Example:
        >>> cfg = load_config(None, ["replay.max_staleness=0"])
        >>> cfg.replay.max_staleness
        0
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p} must hold a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
        source = str(p)
    data = apply_overrides(data, list(overrides or []))
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None
