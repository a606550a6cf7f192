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
from pydantic import BaseModel, Field, ValidationError, model_validator

from agentrl.config.base import ConfigError, Section
from agentrl.config.learner import (
    FAST_OPTIONS,
    LearnerConfig,
    LoRAConfig,
    MegatronConfig,
    graph_length,
    resolve_fast_options,
)
from agentrl.config.rollout import (
    AgentConfig,
    EngineConfig,
    EnvConfig,
    ModelConfig,
    RolloutConfig,
    TinyModelConfig,
)
from agentrl.config.training import (
    AdvantageConfig,
    ColocateConfig,
    DistillConfig,
    ImportanceSamplingConfig,
    KLConfig,
    LossConfig,
    PackingConfig,
    RefitConfig,
    ReplayConfig,
    WatchdogConfig,
)
from agentrl.config.registry import LEARNERS, learner_capability_errors

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
    "MegatronConfig",
    "MetricsConfig",
    "ModelConfig",
    "PackingConfig",
    "RefitConfig",
    "ReplayConfig",
    "RolloutConfig",
    "SFTConfig",
    "TinyModelConfig",
    "TrainConfig",
    "WandbConfig",
    "WatchdogConfig",
    "apply_overrides",
    "load_config",
    "resolve_fast_options",
]




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
    of on-policy on 2 CPU cores with slow tools). With `replay.lag` set it keeps that lag instead
    (generation overlaps learning) and any number of rollout actors, and only sets the sampling
    seed."""
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
    num_threads: int | None = Field(None, ge=1)
    """torch threads of `agentrl train`'s own training before RL: the tiny model's induction
    pre-stage and the SFT (None: torch's default, one per core). 1 keeps a small model's many short
    operations from waiting on a second thread that another process holds: on 2 shared cores a
    busy machine slowed two-thread steps 60-fold; one thread keeps the pace at any load and gives
    the same result on any number of cores."""


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
    max_task_events: int = Field(2_000, ge=1)
    """When agentrl starts Ray itself (`address` None): how many tasks' events (state changes,
    timings: what `ray list tasks` and Ray's dashboard show) Ray's GCS keeps, the oldest dropped
    first (Ray's `task_events_max_num_task_in_gcs`). Ray's default, 100,000, let gcs_server grow
    to about 330 MiB in an hour's soak run (about 3 KB a task); 10,000 still let it climb to ~80 MiB
    in the first 10 minutes (bench/history/chaos-soak.md). 2,000 is a few minutes of a run's tasks.
    A cluster agentrl joins keeps its own setting."""
    worker_niceness: int | None = Field(None, ge=0, le=19)
    """When agentrl starts Ray itself: the nice value of Ray's worker processes, i.e. every actor
    (engines, learner, rollouts), added to the driver's. None keeps Ray's default, 15: on a machine
    shared with busy processes at normal priority the actors then get the CPU last (beside one
    busy-loop process a CPU quickstart's engine got 2-3 % of a core for 20 minutes;
    bench/history/quickstart.md). 0 runs them at the driver's priority. A cluster agentrl joins keeps its own."""
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

    def _check_lag(self) -> None:
        """replay.lag's requirements (agentrl/replay/fixed_lag.py); the staleness bound becomes the lag."""
        lag, conflicts = self.replay.lag, []
        if "max_staleness" in self.replay.model_fields_set and self.replay.max_staleness < lag:
            conflicts.append(f"replay.max_staleness={self.replay.max_staleness} (a lag of {lag} is a staleness of {lag}: "
                             f"drop it or set it to {lag})")
        if self.refit.interval != 1:
            conflicts.append(f"refit.interval={self.refit.interval} (each step's batch needs its own version: use 1)")
        if self.replay.dynamic_sampling:
            conflicts.append("replay.dynamic_sampling=true (a batch is exactly its step's slots: turn it off)")
        if self.train.overlap_steps is True:
            conflicts.append("train.overlap_steps=true (use auto or false)")
        if self.colocate.enabled and self.colocate.engine_sleep:
            conflicts.append("colocate.engine_sleep=true (sleeping engines generate nothing while the learner steps)")
        if lag >= 2:
            from agentrl.config.training import resolve_transport

            transport = resolve_transport(self.refit.transport, engine_on_gpu=self.engine.num_gpus > 0,
                                          same_gpu=self.colocate.enabled and self.engine.num_gpus > 0)
            if transport != "object_store":
                conflicts.append(f"refit.transport={self.refit.transport} (resolves to {transport}; lag >= 2 "
                                 "holds several exports of the weights: use object_store)")
        if conflicts:
            raise ValueError(f"replay.lag={lag} cannot run with " + "; ".join(conflicts))
        object.__setattr__(self.replay, "max_staleness", lag)

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if self.replay.lag is not None:
            self._check_lag()
        if self.train.deterministic and self.replay.lag is None:
            changed = [f"{key} {old} -> {new}" for key, old, new in (
                ("replay.max_staleness", self.replay.max_staleness, 0),
                ("rollout.num_actors", self.rollout.num_actors, 1)) if old != new]
            if changed:
                warnings.warn(f"train.deterministic: {', '.join(changed)}", stacklevel=2)
            object.__setattr__(self.replay, "max_staleness", 0)
            object.__setattr__(self.rollout, "num_actors", 1)
        if self.train.deterministic and self.rollout.sampling_seed is None:
            object.__setattr__(self.rollout, "sampling_seed", self.seed)
        mc = self.learner.megatron
        if self.colocate.enabled and "cuda_graphs" in mc._auto:
            # The graphs' activation pools stay allocated beside the engine: at 1.5B on one H100 they
            # took 15 GiB and left the learner (split) or the engine's wake (sleep) out of memory
            # (bench/history/gpu_loop.md).
            object.__setattr__(mc, "cuda_graphs", False)
        # A graph replays one micro-batch length (the token budget, rounded up to 128) with the
        # activations it captured: no graph where micro-batches of that length recompute.
        rat = mc.recompute_above_tokens
        recompute_graphs = (rat == "auto" or 0 < rat < graph_length(self.packing.max_tokens_per_microbatch)) \
            and not mc.activation_checkpointing
        if recompute_graphs and "cuda_graphs" in mc._auto:
            object.__setattr__(mc, "cuda_graphs", False)
        # What the backend can do is known here for a registered name; a `module:name` backend is
        # imported (and checked) when the run starts (agentrl.config.registry.check_components).
        traits = LEARNERS.meta(self.learner.backend) if ":" not in self.learner.backend else None
        errors = learner_capability_errors(self, traits) if traits is not None else []
        if errors:
            raise ValueError("; ".join(errors))
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
                    ("recompute_above_tokens", not recompute_graphs),
                    ("attention", mc.attention in ("flex", "auto"))) if not ok]
                if off:
                    raise ValueError(f"learner.megatron.cuda_graphs needs attention flex or auto, no tensor/pipeline/context "
                                     f"parallelism and no activation checkpointing (recompute_above_tokens 0 or "
                                     f"at least packing.max_tokens_per_microbatch); got {', '.join(off)} "
                                     "(auto, the default, turns it on only where it can run)")
            if mc.master_weight_remainders and (not mc.use_distributed_optimizer or self.model.dtype != "bfloat16"):
                raise ValueError("learner.megatron.master_weight_remainders needs model.dtype=bfloat16 and "
                                 "learner.megatron.use_distributed_optimizer=true (given "
                                 f"{self.model.dtype} and {mc.use_distributed_optimizer})")
            idle = []  # auto never resolves to these: only a forced true lands here
            if mc.fused_logprobs and mc.tensor_parallel_size > 1:
                idle.append(f"fused_logprobs (tensor_parallel_size={mc.tensor_parallel_size})")
            if mc.flex_expand_kv and (mc.attention not in ("flex", "auto") or mc.context_parallel_size > 1):
                idle.append(f"flex_expand_kv (attention={mc.attention}, "
                            f"context_parallel_size={mc.context_parallel_size})")
            if mc.recompute_above_tokens and mc.activation_checkpointing:
                idle.append("recompute_above_tokens (activation_checkpointing recomputes every micro-batch)")
            if mc.recompute_keeps_attention and (mc.context_parallel_size > 1 or mc.attention == "te" or not (
                    mc.recompute_above_tokens or mc.activation_checkpointing)):
                idle.append("recompute_keeps_attention (it needs recompute_above_tokens or activation_checkpointing, "
                            "the project's core attention and no context parallelism)")
            if idle:
                warnings.warn(f"learner.megatron: {', '.join(idle)} set but without effect here", stacklevel=2)
            need = 2 * mc.context_parallel_size * (mc.tensor_parallel_size if mc.sequence_parallel else 1)
            if mc.context_parallel_size > 1 and self.packing.pad_multiple % need:
                raise ValueError(
                    f"packing.pad_multiple ({self.packing.pad_multiple}) must be a multiple of {need} "
                    "(2 * context_parallel_size, times tensor_parallel_size with sequence_parallel)"
                )
        co = self.colocate
        if self.engine.expandable_segments and co.enabled and co.engine_sleep:
            raise ValueError("engine.expandable_segments cannot run with colocate.engine_sleep=true: vLLM's sleep "
                             "mode allocates through an allocator of its own (set one of them false)")
        if self.train.overlap_steps is True and co.enabled and co.engine_sleep:
            raise ValueError("train.overlap_steps=true cannot run with colocate.engine_sleep=true: the engines "
                             "sleep before every learner step, so no step can be queued ahead (use auto or false)")
        if co.enabled:
            if self.learner.num_gpus < 1 or self.engine.num_gpus <= 0:
                raise ValueError("colocate.enabled needs GPU engines and a GPU learner: set engine.num_gpus "
                                 f"(e.g. 0.5) and learner.num_gpus >= 1 (given {self.engine.num_gpus} and "
                                 f"{self.learner.num_gpus})")
            world = max(1, self.learner.num_gpus) if (traits or {}).get("distributed") else 1
            per_gpu = -(-self.engine.num_engines // world)  # engines are dealt round-robin over the GPUs
            if per_gpu * self.engine.num_gpus + co.learner_gpu_fraction > 1 + 1e-9:
                raise ValueError(f"colocate: {per_gpu} engine(s) x engine.num_gpus ({self.engine.num_gpus}) + "
                                 f"colocate.learner_gpu_fraction ({co.learner_gpu_fraction}) must fit on one GPU "
                                 f"(<= 1); engine.num_engines ({self.engine.num_engines}) are dealt over the "
                                 f"learner's {world} GPU(s)")
        if self.refit.transport != "auto":
            from agentrl.config.training import resolve_transport

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
