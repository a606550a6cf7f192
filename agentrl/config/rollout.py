"""The config sections of what acts: the model, the env, the rollout workers, a bring-your-own agent, the engines.

Part of the run configuration (:mod:`agentrl.config` re-exports everything here).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from agentrl.config.base import Section
from agentrl.rollout.tool_calls import tool_parser_error

__all__ = ["AgentConfig", "EngineConfig", "EnvConfig", "ModelConfig", "RolloutConfig", "TinyModelConfig"]


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
    num_experts: int = Field(8, ge=1)
    """Routed experts of each MoE layer (mixture-of-experts families: qwen3_moe; the dense ones ignore it)."""
    num_experts_per_tok: int = Field(2, ge=1)
    """Experts each token is routed to (top-k; their weights renormalized to sum to 1)."""
    moe_intermediate_size: int = Field(96, ge=8)
    """Intermediate width of one expert."""

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads}), "
                             f"and num_heads of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must not exceed num_experts "
                             f"({self.num_experts})")
        return self


class ModelConfig(Section):
    path: str = ".cache/tiny-model"
    """Hugging Face-format model directory (config.json, safetensors, tokenizer)."""
    bootstrap_tiny: bool = False
    """Create a tiny random model at `path` when it does not exist (`agentrl bootstrap-tiny`)."""
    family: Literal["qwen2", "qwen3", "qwen3_moe", "llama3", "mistral"] = "qwen2"
    """Model family of the tiny model `bootstrap_tiny` creates: its architecture, special tokens and
    chat template (tool-call syntax, tool-result role, end-of-turn token). qwen3_moe: Qwen3's tokens
    and template, every layer's MLP a mixture of experts (`tiny.num_experts` ...)."""
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
    workers: int = Field(0, ge=0)
    """Agent worker processes per rollout worker. 0: the agent runs in the rollout worker's own
    process and event loop, beside the endpoint's HTTP server and the engine calls, all on one
    GIL. N > 0: the agent functions run in N processes of their own (started on the first
    episode, each episode to the least-loaded one), so the openai SDK's CPU (~3-4 ms per request)
    spreads over cores while the rollout worker only serves HTTP and talks to the engines; the
    endpoint and its exact-token record stay in the rollout worker. Each process costs its
    memory (Python, openai and your module: ~70 MB, ~280 MB if the module imports torch) and a
    core when busy; the task and reward are pickled. A worker
    that dies fails its episodes (counted in rollout/agent_worker_deaths) and is started again.
    Module-level state the agent changes is per process (guides/agent-endpoint.md)."""
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
    def _tasks_with_solve(self) -> AgentConfig:
        if self.solve is not None and self.tasks is None:
            raise ValueError("agent.solve needs agent.tasks (a .jsonl file or module:function(seed) -> task)")
        return self


AUTO_BATCHED_TOKENS = 16384
"""``engine.max_num_batched_tokens: auto`` on a CUDA engine (vLLM's offline default on H100/H200)."""


class EngineConfig(Section):
    num_engines: int = Field(1, ge=1)
    """vLLM engine actors."""
    max_model_len: int = Field(2048, ge=64)
    """Longest sequence (prompt + generation) the engine accepts."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """KV-cache size per engine on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (CUDA engines only)."""
    gpu_kv_cache_gib: float | None = Field(None, gt=0)
    """KV-cache size per CUDA engine, in GiB (vLLM's kv_cache_memory_bytes): set, it replaces the
    size vLLM derives from gpu_memory_utilization and what was free while it profiled, so the cache
    (and the engine's memory) no longer depends on what else started on the GPU at the same time.
    None: sized from gpu_memory_utilization."""
    expandable_segments: bool = False
    """The engine's CUDA allocator (vLLM's worker process) maps expandable segments: less memory
    reserved beyond what it allocates (cf. learner.expandable_segments). Not with
    colocate.engine_sleep: vLLM's sleep mode brings an allocator of its own."""
    enforce_eager: Literal["auto", True, False] = "auto"
    """Skip vLLM's compilation and CUDA-graph capture: a faster start, slower decoding. auto (the
    default): eager on CPU engines (engine.num_gpus 0), where compiling costs minutes; compiled
    with CUDA graphs on GPU engines, where eager decoding of a billion-parameter model is several
    times slower (launch-bound). true/false force it."""
    max_num_seqs: int = Field(64, ge=1)
    """Requests an engine batches at once."""
    max_num_batched_tokens: int | Literal["auto"] | None = "auto"
    """Tokens one engine step may process (vLLM's scheduler budget, shared by the decoding requests'
    tokens and prefill; a long prompt or tool answer is prefilled in chunks of what is left). auto
    (the default): 16,384 on CUDA engines, vLLM's own default for offline batch generation on
    H100/H200-class GPUs (its async engine's default is 2,048: a 131k-token episode then takes 64
    engine steps to prefill; TRL gives its engine 4,096); vLLM's default on CPU engines (null), which
    prefill whole prompts. An int sets it; null takes vLLM's default everywhere."""
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
        if self.max_num_batched_tokens == "auto":
            object.__setattr__(self, "max_num_batched_tokens", AUTO_BATCHED_TOKENS if self.num_gpus > 0 else None)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"engine.max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"engine.max_num_seqs ({self.max_num_seqs}): each running request needs a token a step")
        return self
