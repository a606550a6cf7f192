"""The learner's config sections: backend and optimizer, Megatron-Core layout and speed options, LoRA.

Part of the run configuration (:mod:`agentrl.config` re-exports everything here).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from agentrl.config.base import Section
from agentrl.config.registry import LEARNERS

__all__ = ["FAST_OPTIONS", "LearnerConfig", "LoRAConfig", "MegatronConfig", "graph_length", "resolve_fast_options"]


class MegatronConfig(Section):
    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor (intra-layer) parallel degree."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """Pipeline (inter-layer) parallel degree."""
    context_parallel_size: int = Field(1, ge=1)
    """Context parallel degree: every packed document is split into 2*cp zig-zag chunks."""
    sequence_parallel: bool = False
    """Shard activations along the sequence within the tensor-parallel group."""
    activation_checkpointing: bool = False
    """Recompute each transformer layer in the backward pass (less memory, more compute)."""
    recompute_above_tokens: int | Literal["auto"] = 0
    """Recompute transformer layers in the backward pass only for the micro-batches that need it:
    every layer of those of more than this many tokens (the tokens a rank holds: the micro-batch's
    divided by context_parallel_size); shorter ones keep their activations and their speed.
    ``auto``: those whose activations, estimated from the model's shape, would not fit in 85 % of
    the GPU memory free at their forward (CUDA only), and of those only as many layers as make them
    fit (the first ones of each stage). For long episodes on few GPUs: at the Qwen2.5-1.5B shape a
    token keeps ~2.5 MB of activations without recompute (the estimate says 2.7), so on one H200 a
    32k-token micro-batch fits without and a 64k one trains with (measured on an H200 on
    2026-11-29: bench/history/peers.md, peers_long.md). A micro-batch that recomputes also recomputes its logits in
    backward (no keep_grad_logits). 0 (the default): off; activation_checkpointing recomputes every
    layer of every micro-batch."""
    recompute_keeps_attention: bool = False
    """A recomputed layer keeps its core attention's output and softmax statistics (with the
    kernel's inputs) from the forward, so its recompute in backward rebuilds the rest of the layer
    but not the attention: at long context nearly all of a recompute's time (at 256k tokens the
    attention is ~90 % of a layer's forward FLOPs). It costs ~7 kB a token a layer at the
    Qwen2.5-1.5B shape (a whole layer ~84 kB); under ``recompute_above_tokens: auto`` the plan
    recomputes more layers where that lets every recomputed layer keep its attention, else keeps as
    many as fit. For recompute_above_tokens or activation_checkpointing; not under context
    parallelism (there it does nothing)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (ZeRO-1)."""
    master_weight_remainders: bool = False
    """Keep the fp32 master weights as 16-bit remainders beside the bf16 weights (the bits the
    bf16 rounding drops): the same fp32 values and updates in 2 bytes a parameter instead of 4
    (2.9 GiB less at 1.5B parameters). The bf16 weights then round ties away from zero instead of
    to even (one bf16 unit, in ~1 of 131,072 values). Needs bf16 (model.dtype) and the
    distributed optimizer."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass."""
    grad_reduce_in_fp32: bool = True
    """Reduce gradients in float32 even when training in bf16."""
    attention: Literal["auto", "flex", "sdpa", "te"] = "auto"
    """Core attention for packed sequences. ``flex``: compiled FlexAttention with a block-sparse
    document-causal mask, one call a micro-batch (fast for many short documents; what CUDA graphs
    replay). ``sdpa``: one causal SDPA call a document (cuDNN's kernel on Hopper: 1.4-1.9x
    FlexAttention's forward+backward on one document of 4k-128k tokens, H200). ``auto`` (the
    default): per micro-batch, SDPA when its documents average at least 8,192 tokens, FlexAttention
    otherwise; FlexAttention throughout under cuda_graphs. ``te``: TransformerEngine's, when it is
    importable. Context parallelism has its own attention (FlexAttention unless ``sdpa``)."""
    cuda_graphs: Literal["auto", True, False] = "auto"
    """Replay the decoder's layers (forward and backward) as CUDA graphs: removes the Python
    launch overhead that dominates at small micro-batches. Every micro-batch is padded to
    packing.max_tokens_per_microbatch (one graph shape); needs attention flex or auto, no tensor, pipeline
    or context parallelism and no activation checkpointing. The graph's activations stay
    allocated between steps (set false when memory is short). auto (the default): on exactly where
    it can run (the conditions above) and the learner does not share its GPU with engines
    (colocate.enabled: the engines need that memory), off elsewhere; true/false force it."""
    keep_grad_logits: Literal["auto", True, False] = "auto"
    """Keep d logp / d logits (bf16 [tokens, vocab]) from the forward pass instead of recomputing
    the logits in backward: faster, and tokens x vocab x 2 bytes more memory (5 GB at 16k tokens
    and a 152k vocabulary; divided by the tensor and context parallel degrees). auto (the
    default): on unless activation_checkpointing (which asks for memory over speed); true/false
    force it."""
    fused_logprobs: Literal["auto", True, False] = "auto"
    """Make the logprob head's softmax work (logsumexp, label logprob, d logp / d logits) with
    compiled one-pass kernels over the bf16 logits instead of float32 chunk tensors. Same math,
    another reduction order; no effect under tensor parallelism (the learner's weights are always
    bf16/fp16). auto (the default): on without tensor parallelism; true/false force it."""
    flex_expand_kv: Literal["auto", True, False] = "auto"
    """attention flex (or auto's FlexAttention micro-batches) with grouped-query attention: repeat
    K/V to the query heads before FlexAttention (exact), for a faster backward at a few thousand
    tokens per micro-batch. No effect with attention sdpa/te or context parallelism (which has its
    own attention path). auto (the default): on with attention flex or auto and no context
    parallelism; true/false force it."""

    _auto: frozenset[str] = PrivateAttr(default=frozenset())

    def __setattr__(self, name: str, value: Any) -> None:
        if name in FAST_OPTIONS:  # an explicit true/false stops following the layout; "auto" resumes
            self._auto = self._auto - {name} if value != "auto" else self._auto | {name}
        super().__setattr__(name, value)

    @model_validator(mode="after")
    def _resolve_auto(self) -> MegatronConfig:
        if self.recompute_above_tokens != "auto" and self.recompute_above_tokens < 0:
            raise ValueError(f"learner.megatron.recompute_above_tokens must be >= 0 or 'auto', "
                             f"got {self.recompute_above_tokens}")
        # Resolved here, so the learner, --print-config and the run's config.json all show what runs.
        self._auto = self._auto | {k for k in FAST_OPTIONS if getattr(self, k) == "auto"}
        for name, on in resolve_fast_options(self).items():
            if name in self._auto:
                object.__setattr__(self, name, on)  # plain set: no re-validation from inside the validator
        return self


def graph_length(budget: int) -> int:
    """Micro-batch length under ``learner.megatron.cuda_graphs``: the token budget
    (packing.max_tokens_per_microbatch), rounded up to 128; every micro-batch is padded to it."""
    return -(-budget // 128) * 128


FAST_OPTIONS = ("cuda_graphs", "keep_grad_logits", "fused_logprobs", "flex_expand_kv")
"""The `learner.megatron` speed options that default to ``auto``."""


def resolve_fast_options(mcfg: MegatronConfig) -> dict[str, bool]:
    """What ``auto`` means for each of :data:`FAST_OPTIONS` under ``mcfg``'s layout: on where it
    can run and helps, off elsewhere (measured on 1x H100: bench/history/learner.md).

    Example:
        >>> resolve_fast_options(MegatronConfig(tensor_parallel_size=2))["cuda_graphs"]
        False
    """
    single = mcfg.tensor_parallel_size == mcfg.pipeline_parallel_size == mcfg.context_parallel_size == 1
    flex = mcfg.attention in ("flex", "auto")  # auto runs FlexAttention wherever these apply
    return {
        "cuda_graphs": single and flex and not mcfg.activation_checkpointing,
        "keep_grad_logits": not mcfg.activation_checkpointing,
        "fused_logprobs": mcfg.tensor_parallel_size == 1,
        "flex_expand_kv": flex and mcfg.context_parallel_size == 1,
    }


class LoRAConfig(Section):
    rank: int = Field(0, ge=0, le=512)
    """LoRA rank r; 0 (the default) trains every weight (full fine-tuning). With r > 0 the torch
    learner trains PEFT adapters on ``target_modules`` over a frozen base; ``serve`` says what a
    refit moves into the engines (docs/guides/lora.md)."""
    serve: Literal["adapter", "merged"] = "adapter"
    """How the engines serve the adapter. ``adapter``: the engines start with vLLM's LoRA enabled
    and each refit moves only the adapter's tensors (megabytes; what matters across nodes or with
    many engines), while every sampled token pays vLLM's LoRA kernels. ``merged``: the engines
    start without LoRA and each refit moves the merged weights ``base + alpha / rank * B @ A`` as
    full weights, by the run's transport, as full fine-tuning does: sampling at full speed, a
    full-size refit (cheap when colocated on one GPU: CUDA IPC). Checkpoints hold the adapter
    either way."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator: the update is ``alpha / rank * B @ A``."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input. The learner runs every pass in eval mode (the engine that
    sampled the tokens has no dropout, so the IS ratios compare the same policy): a value > 0 has no
    effect and is warned about."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Names of the linear layers that get adapters (PEFT's ``target_modules``; vLLM serves these
    for Llama/Qwen/Mistral-style decoders). The LM head and the embeddings cannot be adapted."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def serves_adapter(self) -> bool:
        """The engines run vLLM's LoRA and refits move the adapter's tensors only."""
        return self.enabled and self.serve == "adapter"

    @property
    def serves_merged(self) -> bool:
        """The engines run plain weights and refits move base + adapter, merged."""
        return self.enabled and self.serve == "merged"

    @model_validator(mode="after")
    def _check(self) -> LoRAConfig:
        if not self.target_modules:
            raise ValueError("learner.lora.target_modules must name at least one linear layer (e.g. q_proj)")
        bad = [m for m in self.target_modules if m in ("lm_head", "embed_tokens", "wte", "output")]
        if bad:
            raise ValueError(f"learner.lora.target_modules: {', '.join(bad)} cannot be adapted (the learner's "
                             "chunked logprobs read the LM head's weight; vLLM adapts linear layers only); "
                             "keep the decoder's linear layers, e.g. q_proj, v_proj")
        if not self.enabled and self.serve == "merged":
            warnings.warn("learner.lora.serve=merged has no effect while learner.lora.rank is 0 (full "
                          "fine-tuning); set learner.lora.rank > 0 to train an adapter", stacklevel=2)
        if self.enabled and self.dropout > 0:
            warnings.warn(f"learner.lora.dropout={self.dropout} has no effect: the learner runs in eval mode, "
                          "like the engine that sampled the tokens", stacklevel=2)
        return self


class LearnerConfig(Section):
    backend: str = "torch"
    """torch: Hugging Face model + AdamW (CPU, small GPUs); megatron: Megatron-Core (GPUs). One of
    your own: `<module>:<name>`, a class of the agentrl.learner.base.Learner contract that the
    module registers (`@register_learner("name", distributed=...)`, agentrl.learner.base)."""
    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    num_gpus: int = Field(0, ge=0)
    """Learner actors (one per GPU); 0 runs one learner on CPU."""
    num_cpus: float = Field(1.0, gt=0)
    """Ray CPUs (and torch threads) of the learner actor."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each actor of this kind needs; pins them to nodes that offer them."""
    expandable_segments: bool = False
    """GPU learners: PyTorch's allocator maps the learner process's memory in expandable segments
    (less memory lost between cached blocks of different sizes: the learner's reserve stood 1.6 GiB
    over its peak at 1.5B on an H200). The CUDA IPC refit's buffer stays a plain allocation (IPC of
    expandable memory needs pidfd_getfd, which containers often refuse). Off by default until
    measured in the GPU loop; no effect on CPU."""
    moe_aux_loss_coef: float | None = Field(0.0, ge=0)
    """Weight of a mixture-of-experts model's router load-balancing loss in the learner's loss
    (dense models: no effect). 0 (default): off, the RL loss alone moves the routers, as it moves
    every other weight; a balancing term is an objective of pretraining that no reward weighs, and
    each step it takes moves the learner's routing away from the one the engines sampled with.
    None: the checkpoint's ``router_aux_loss_coef``. The torch learner adds it times transformers'
    load-balancing loss (over all MoE layers of a micro-batch); the Megatron learner gives it to
    Megatron's per-layer ``aux_loss`` (``moe_aux_loss_coeff``)."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    """LoRA adapters instead of full fine-tuning (torch learner only); off while ``rank`` is 0."""

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        return LEARNERS.check(value)
