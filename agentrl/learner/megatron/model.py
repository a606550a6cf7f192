"""Megatron-Core GPTModel for Llama 3 / Qwen2 / Qwen3 / Qwen3-MoE, built from a Hugging Face config.

Parallelism state (`parallel_state`) must be initialized before `build_model`. The model is the
stock ``GPTModel`` with two changes, both in `AgentGPTModel`:

* RoPE is applied inside the project's core attention from cos/sin tables made once per
  micro-batch from ``position_ids`` (which restart at 0 for every packed document), with the
  HF config's RoPE type (default, llama3, linear, yarn, ...) via transformers' RoPE init functions.
* The last stage returns float32 token logprobs ``[T]`` of the given ``labels`` instead of logits,
  computed vocab-parallel in token chunks (`logprobs.vocab_parallel_logprobs`).

Without TransformerEngine the layer spec is Megatron's local spec with `PackedCoreAttention` as
``core_attention`` and `RMSNorm` (HF's float32 normalization) for every norm; a
mixture-of-experts layer is Megatron's own ``MoELayer`` (`moe_config` sets its routing so that it
picks and weighs the experts as transformers does) with the SequentialMLP experts. With
``attention == "te"`` and TransformerEngine importable, TE's spec and fused attention are used
instead (untested here: no machine in this project has TE).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from torch import Tensor

from agentrl.learner.megatron.attention import PackedAttentionParams, PackedCoreAttention
from agentrl.learner.megatron.compiled import compiled
from agentrl.learner.megatron.convert import ModelShape
from agentrl.learner.megatron.logprobs import vocab_parallel_logprobs

__all__ = ["AgentGPTModel", "HostTopKRouter", "RMSNorm", "moe_config", "activation_bytes_per_token", "attention_bytes_per_token", "build_model", "core_attention",
           "layer_spec", "layers_to_recompute", "recompute_plan", "rope_inv_freq", "transformer_config"]

AUTO_RECOMPUTE_SHARE = 0.85
"""``recompute_above_tokens: auto`` recomputes a micro-batch whose estimated activations exceed
this share of the memory free at its forward (the rest: allocator rounding, kernels' workspaces,
the estimate's error)."""


def activation_bytes_per_token(shape: ModelShape, *, layers: int, tp: int = 1, element_bytes: int = 2,
                               head: bool = True, keep_grad_logits: bool = False) -> int:
    """What one token of a micro-batch keeps on a rank for backward without recompute, in bytes.

    Per transformer layer (elements): the two norms' inputs and outputs, the attention's output and
    the residual (~7 hidden-sized tensors, whole on every tensor-parallel rank), and the QKV
    projection, the attention's inputs and the SwiGLU MLP's gate, up and activated outputs (~3
    hidden- and 3 FFN-sized tensors, split over tensor parallelism): ``7h + (3h + 3f) / tp``.
    The last stage's head adds its hidden state and, with ``keep_grad_logits``, d logp / d logits
    (a vocabulary row). At the Qwen2.5-1.5B shape this gives 2.68 MB a token with the kept logits,
    7 % above what the H200 measured: 2.50 (the step's peak less the static state, 77.4 GiB, over
    33,279 tokens on 2026-11-29: bench/history/peers.md)."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    per_layer = 7 * h + (3 * h + 3 * f) // max(tp, 1)
    total = layers * per_layer
    if head:
        total += 2 * h + (shape.padded_vocab_size(tp) // max(tp, 1) if keep_grad_logits else 0)
    return total * element_bytes


def layers_to_recompute(tokens: int, limit: int | str, *, shape: ModelShape | None, layers: int, tp: int = 1,
                        element_bytes: int = 2, head: bool = True, keep_grad_logits: bool = False,
                        available: int | None = None) -> int:
    """How many of a stage's ``layers`` a micro-batch of ``tokens`` (this rank's) recomputes in
    backward under ``recompute_above_tokens = limit``: all of them above an integer limit, none at
    or below it. With ``auto``: none where its activations (:func:`activation_bytes_per_token`) fit
    in :data:`AUTO_RECOMPUTE_SHARE` of ``available`` bytes (None: unknown, none); else the fewest
    that make them fit, all where none do. A recomputed layer keeps only its input (one hidden
    vector a token) and rebuilds the rest in backward, one layer at a time; a micro-batch that
    recomputes any layer does not keep d logp / d logits. Fewer recomputed layers, less time: at 64k
    tokens on one H200 about half of the 1.5B shape's 28 layers instead of all of them."""
    if limit != "auto":
        return layers if limit and tokens > int(limit) else 0
    if available is None or shape is None or layers <= 0:
        return 0
    budget = AUTO_RECOMPUTE_SHARE * available
    sizes = dict(tp=tp, element_bytes=element_bytes)
    if tokens * activation_bytes_per_token(shape, layers=layers, head=head, keep_grad_logits=keep_grad_logits,
                                           **sizes) <= budget:
        return 0
    for n in range(1, layers):
        if tokens * _planned_bytes_per_token(shape, layers, n, 0, head=head, **sizes) <= budget:
            return n
    return layers


def _planned_bytes_per_token(shape: ModelShape, layers: int, recomputed: int, kept_attention: int, *, tp: int,
                             element_bytes: int, head: bool) -> int:
    """A token's bytes for backward when the first ``recomputed`` of ``layers`` recompute and
    ``kept_attention`` of those keep their attention: the other layers whole, the recomputed ones'
    inputs and kept attentions, one recomputed layer rebuilt, the head (without kept logits)."""
    sizes = {"tp": tp, "element_bytes": element_bytes}
    whole = activation_bytes_per_token(shape, layers=1, head=False, **sizes)
    return ((layers - recomputed) * whole + recomputed * shape.hidden_size * element_bytes + whole
            + kept_attention * attention_bytes_per_token(shape, **sizes)
            + activation_bytes_per_token(shape, layers=0, head=head, **sizes))


def attention_bytes_per_token(shape: ModelShape, *, tp: int = 1, element_bytes: int = 2) -> int:
    """What a recomputed layer that keeps its attention (``recompute_keeps_attention``) holds for
    backward beyond its input, a token on a rank: the core attention's inputs after RoPE (q, k, v),
    its output and the softmax's float32 log-sum-exp, this rank's heads. At the Qwen2.5-1.5B shape
    7.2 kB, against the 84 kB of a layer that keeps everything."""
    q = shape.num_heads * shape.head_dim
    kv = 2 * shape.num_kv_heads * shape.head_dim
    return ((2 * q + kv) * element_bytes + 4 * shape.num_heads) // max(tp, 1)


def recompute_plan(tokens: int, limit: int | str, *, shape: ModelShape | None, layers: int, tp: int = 1,
                   element_bytes: int = 2, head: bool = True, keep_grad_logits: bool = False,
                   available: int | None = None, keep_attention: bool = False) -> tuple[int, int]:
    """``(n, m)``: a micro-batch of ``tokens`` recomputes the first ``n`` of a stage's ``layers`` in
    backward (:func:`layers_to_recompute`), and the first ``m`` of those keep their attention's
    output and softmax statistics from the forward (``keep_attention``), so that their recompute
    rebuilds everything but the attention kernel: at long context most of a recompute's time (at
    256k tokens on the 1.5B shape the attention is ~90 % of a layer's forward FLOPs). ``m`` is 0 without
    ``keep_attention`` and ``n`` under an integer limit. Under ``auto`` a kept attention costs
    :func:`attention_bytes_per_token` a token where a whole layer costs ~12x that, so the plan
    recomputes more layers if that lets every recomputed layer keep its attention (from ``n`` up, the
    fewest that fit), and where even all of them cannot, recomputes all and keeps as many as fit."""
    n = layers_to_recompute(tokens, limit, shape=shape, layers=layers, tp=tp, element_bytes=element_bytes,
                            head=head, keep_grad_logits=keep_grad_logits, available=available)
    if not keep_attention or n == 0 or shape is None:
        return n, 0
    if limit != "auto":
        return n, n
    budget = AUTO_RECOMPUTE_SHARE * available / tokens  # bytes a token (auto with n > 0 had ``available``)
    sizes = {"tp": tp, "element_bytes": element_bytes, "head": head}
    for k in range(n, layers + 1):
        if _planned_bytes_per_token(shape, layers, k, k, **sizes) <= budget:
            return k, k
    room = budget - _planned_bytes_per_token(shape, layers, layers, 0, **sizes)
    return layers, max(0, min(layers, int(room // attention_bytes_per_token(shape, tp=tp, element_bytes=element_bytes))))


def _te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # HF's Llama/Qwen RMSNorm: normalize in float32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(torch.nn.Module):
    """RMSNorm with HF's numerics, compiled on CUDA; usable as any Megatron norm (also q/k)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype,
                                                    device="cpu" if config.use_cpu_initialization else "cuda"))
        # Under sequence parallelism each TP rank sees different tokens: Megatron sums these grads.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        fn = compiled(_rms_norm) if x.is_cuda else _rms_norm
        return fn(x, self.weight, self.eps)


class HostTopKRouter(TopKRouter):
    """Megatron's top-k router, its gate computed where its input is. Megatron 0.16's own gate moves
    a CPU weight to the current CUDA device at the first forward (a CPU model has none), and without
    TransformerEngine its gate function fails (it names TE's GEMM, not imported): there the gate is
    a plain linear in the router dtype, the same product."""

    def gating(self, input: Tensor) -> Tensor:
        if input.is_cuda and moe_utils.HAVE_TE:
            return super().gating(input)
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype or "", input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype), bias)


def moe_config(shape: ModelShape, aux_loss_coef: float | None = 0.0) -> dict[str, Any]:
    """``TransformerConfig`` fields of ``shape``'s mixture-of-experts layers ({} for a dense model).

    Routing equals transformers' Qwen3-MoE router: a float32 softmax over all experts' logits, the
    top k, renormalized to sum to 1 when ``norm_topk_prob``. Renormalized top-k softmax
    probabilities are the softmax of the top-k logits, Megatron's ``moe_router_pre_softmax=False``;
    without renormalization they are the full softmax's top k (``pre_softmax=True``). No expert
    capacity (no token is dropped), no input jitter, no z-loss. ``aux_loss_coef``: the weight of
    Megatron's load-balancing loss (``aux_loss``, per layer; 0: none; None: the checkpoint's
    ``router_aux_loss_coef``)."""
    if not shape.num_experts:
        return {}
    coef = shape.router_aux_loss_coef if aux_loss_coef is None else float(aux_loss_coef)
    return dict(
        num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_topk,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size, moe_layer_freq=[int(m) for m in shape.moe_layers],
        moe_router_score_function="softmax", moe_router_pre_softmax=not shape.moe_norm_topk,
        moe_router_dtype="fp32", moe_router_load_balancing_type="aux_loss" if coef > 0 else "none",
        moe_aux_loss_coeff=coef, moe_grouped_gemm=False,
    )


def transformer_config(shape: ModelShape, mcfg: Any, *, dtype: torch.dtype = torch.bfloat16,
                       use_cpu_initialization: bool = False, moe_aux_loss_coef: float | None = 0.0,
                       **overrides: Any) -> TransformerConfig:
    """A ``TransformerConfig`` for ``shape`` with the parallel degrees of ``mcfg`` (MegatronConfig);
    a mixture-of-experts model's routing from `moe_config` (``moe_aux_loss_coef``: its aux loss)."""
    kwargs: dict[str, Any] = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads, num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=shape.rms_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=mcfg.tensor_parallel_size,
        pipeline_model_parallel_size=mcfg.pipeline_parallel_size,
        context_parallel_size=mcfg.context_parallel_size,
        sequence_parallel=mcfg.sequence_parallel and mcfg.tensor_parallel_size > 1,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=use_cpu_initialization,
        gradient_accumulation_fusion=False,  # needs apex's fused_weight_gradient_mlp_cuda
        bias_activation_fusion=True,  # SwiGLU through Megatron's torch.compile'd fusion
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        variable_seq_lengths=True,  # packed micro-batches differ in length (matters under PP)
        moe_token_dispatcher_type="alltoall",  # no MoE; the default "allgather" refuses variable lengths
        deallocate_pipeline_outputs=True,
    )
    if shape.num_experts and not torch.cuda.is_available():
        # Megatron's alltoall dispatcher makes a CUDA stream when built; the allgather one runs on
        # CPU (one stage only: it refuses variable_seq_lengths, which pipeline stages need).
        if mcfg.pipeline_parallel_size > 1:
            raise ValueError("learner.megatron.pipeline_parallel_size > 1 with a mixture-of-experts model needs CUDA")
        kwargs.update(moe_token_dispatcher_type="allgather", variable_seq_lengths=False)
    kwargs.update(moe_config(shape, moe_aux_loss_coef))
    if mcfg.activation_checkpointing:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif getattr(mcfg, "recompute_above_tokens", 0):  # granularity set per micro-batch (AgentGPTModel)
        kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def core_attention(mcfg: Any) -> str:
    """The core attention the layers get for ``learner.megatron``: its ``attention``, except that
    ``auto`` under CUDA graphs is ``flex`` (a graph replays the kernel it captured for every
    micro-batch: auto's per-micro-batch choice would be the capture batch's)."""
    return "flex" if mcfg.attention == "auto" and getattr(mcfg, "cuda_graphs", False) else mcfg.attention


def layer_spec(shape: ModelShape, attention: str, expand_kv: bool = False, moe: bool = False) -> ModuleSpec:
    """Transformer-layer spec: Megatron's local spec with the project's attention and norms; with
    ``moe``, its MLP Megatron's MoELayer (router and SequentialMLP experts)."""
    if attention == "te":
        if not _te_available():
            raise ImportError("learner.megatron.attention=te needs TransformerEngine, which is not importable; "
                              "use 'flex' or 'sdpa'")
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(num_experts=shape.num_experts if moe else None,
                                                          qk_layernorm=shape.qk_norm)
    spec = get_gpt_layer_local_spec(num_experts=shape.num_experts if moe else None, moe_grouped_gemm=False,
                                    qk_layernorm=shape.qk_norm, normalization="RMSNorm")
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    if moe:
        sub.mlp.submodules.router = HostTopKRouter
    attn = sub.self_attention.submodules
    attn.core_attention = ModuleSpec(module=PackedCoreAttention, params={"backend": attention, "expand_kv": expand_kv})
    if shape.qk_norm:
        attn.q_layernorm = RMSNorm
        attn.k_layernorm = RMSNorm
    return spec


def rope_inv_freq(hf_config: Any) -> tuple[Tensor, float]:
    """RoPE inverse frequencies [head_dim / 2] and the cos/sin scale of the HF config's RoPE type."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scale)


class AgentGPTModel(GPTModel):
    """GPTModel that applies RoPE in the core attention and returns token logprobs.

    ``forward(input_ids [1, t], position_ids [1, t], attention_mask=None, labels=[1, t],
    packed_seq_params=PackedAttentionParams)``: on the last pipeline stage, float32
    ``log p(labels[i] | tokens <= i)`` ``[t]``; elsewhere the hidden states for the next stage.
    """

    def __init__(self, *args: Any, inv_freq: Tensor, rope_scale: float, real_vocab: int,
                 rope_in_attention: bool = True, **kwargs: Any) -> None:
        # With TE attention, Megatron's own RoPE runs instead (kwargs carry its settings).
        kwargs.setdefault("position_embedding_type", "none" if rope_in_attention else "rope")
        super().__init__(*args, **kwargs)
        self.rope_in_attention = rope_in_attention
        self._inv_freq = inv_freq  # plain attribute: stays float32 when the module is cast
        self.rope_scale = rope_scale
        self.real_vocab = real_vocab
        self.temperature = 1.0
        self.chunk_size = 1024
        self.keep_grad_logits = False  # see logprobs.vocab_parallel_logprobs
        self.fused_logprobs = False  # likewise (fused=)
        self.head_grad_to_main_grad = False  # likewise (accumulate_main_grad=): set by the learner
        self.recompute_above_tokens: int | str = 0  # learner.megatron.recompute_above_tokens: set by the learner
        self.shape: ModelShape | None = None  # for the activation estimate of recompute_above_tokens=auto
        self.recomputing = False  # whether the forward in progress recomputes layers in backward
        self.recomputed_microbatches = 0  # forwards that did (the learner reads and resets it)
        self.recomputed_layers = 0  # the layers they recomputed, summed (likewise)
        self.keep_attention = False  # learner.megatron.recompute_keeps_attention: set by the learner
        self.kept_attention_layers = 0  # recomputed layers that kept their attention, summed (likewise)

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, packed_seq_params: PackedAttentionParams | None = None,
                **kwargs: Any) -> Tensor:
        if self.recompute_above_tokens:
            # Megatron's block reads the granularity, method and layer count at each forward: only a
            # long micro-batch (this rank's tokens) with gradients recomputes layers in backward, the
            # first n of its stage ("block"), as many as recompute_plan says (and the first m keep their attention)
            n, m = self.recompute_plan(input_ids.shape[-1], input_ids.device) if torch.is_grad_enabled() else (0, 0)
            self.recomputing = n > 0
            self.config.recompute_granularity = "full" if n else None
            self.config.recompute_method, self.config.recompute_num_layers = "block", max(n, 1)
            self.recomputed_microbatches += int(n > 0)
            self.recomputed_layers += n
        else:  # activation_checkpointing (every layer) or none
            m = len(self.decoder.layers) if self.keep_attention and self.config.recompute_granularity == "full" \
                and self.config.context_parallel_size == 1 and torch.is_grad_enabled() else 0
        self.kept_attention_layers += m
        p = packed_seq_params
        if isinstance(p, PackedAttentionParams):  # which layers' core attention keeps its output (attention.py)
            p.cache["keep_attention"] = frozenset(layer.layer_number for layer in self.decoder.layers[:m])
        if p is not None and self.rope_in_attention and p.rope_cos is None:
            inv = self._inv_freq.to(position_ids.device)
            freqs = position_ids.reshape(-1, 1).float() * inv[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            p.rope_cos = (emb.cos() * self.rope_scale).to(self.config.params_dtype)
            p.rope_sin = (emb.sin() * self.rope_scale).to(self.config.params_dtype)
        return super().forward(input_ids, position_ids, attention_mask, labels=labels,
                               packed_seq_params=p, **kwargs)

    def activation_bytes_per_token(self) -> int:
        """:func:`activation_bytes_per_token` for this rank's stage, as it runs now."""
        if self.shape is None:
            return 0
        return activation_bytes_per_token(self.shape, keep_grad_logits=self.keep_grad_logits, **self._stage_sizes())

    def recompute_plan(self, tokens: int, device: torch.device) -> tuple[int, int]:
        """:func:`recompute_plan` for a micro-batch of ``tokens`` on this rank's stage now."""
        auto = self.recompute_above_tokens == "auto"
        keep = self.keep_attention and self.config.context_parallel_size == 1
        return recompute_plan(tokens, self.recompute_above_tokens, shape=self.shape, keep_grad_logits=self.keep_grad_logits,
                              available=_available_bytes(device) if auto else None, keep_attention=keep,
                              **self._stage_sizes())

    def _stage_sizes(self) -> dict[str, Any]:
        return dict(layers=len(self.decoder.layers), tp=self.pg_collection.tp.size(),
                    element_bytes=self.config.params_dtype.itemsize, head=self.post_process)

    def _postprocess(self, hidden_states: Tensor, input_ids: Tensor, position_ids: Tensor,
                     labels: Tensor | None, *args: Any, **kwargs: Any) -> Tensor:
        if not self.post_process:
            return hidden_states
        if labels is None:
            raise ValueError("AgentGPTModel returns logprobs: pass labels (the next token ids)")
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
            else self.output_layer.weight
        tp_group = self.pg_collection.tp
        if self.config.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=True, group=tp_group)
        else:
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden_states, group=tp_group)
        hidden = hidden.reshape(-1, hidden.shape[-1])  # [t, 1, H] -> [t, H]
        v_local = weight.shape[0]
        return vocab_parallel_logprobs(
            hidden, weight, labels.reshape(-1),
            group=tp_group if tp_group.size() > 1 else None,
            vocab_start=tp_group.rank() * v_local, real_vocab=self.real_vocab,
            temperature=self.temperature, chunk_size=self.chunk_size,
            keep_grad_logits=self.keep_grad_logits and not self.recomputing,
            fused=self.fused_logprobs, accumulate_main_grad=self.head_grad_to_main_grad)


def build_model(shape: ModelShape, hf_config: Any, mcfg: Any, *, dtype: torch.dtype = torch.bfloat16,
                use_cpu_initialization: bool = False, vocab_limit: int | None = None,
                moe_aux_loss_coef: float | None = 0.0, **config_overrides: Any) -> AgentGPTModel:
    """This rank's pipeline stage of the model (parallel_state must be initialized). ``vocab_limit``
    (``model.tokenizer_vocab_only``): the head's rows at or past it get probability 0 in every
    logprob, as the padding rows of tensor parallelism do. ``moe_aux_loss_coef``: `moe_config`."""
    cfg = transformer_config(shape, mcfg, dtype=dtype, use_cpu_initialization=use_cpu_initialization,
                             moe_aux_loss_coef=moe_aux_loss_coef, **config_overrides)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if shape.num_kv_heads % tp:
        raise ValueError(f"learner.megatron.tensor_parallel_size ({tp}) must divide the number of KV heads "
                         f"({shape.num_kv_heads})")
    attention, expand_kv = core_attention(mcfg), getattr(mcfg, "flex_expand_kv", False)
    spec: Any = layer_spec(shape, attention, expand_kv=expand_kv)
    if shape.num_experts:  # this stage's layers, each dense or MoE as the checkpoint says
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        if mcfg.attention == "te":
            raise ValueError("learner.megatron.attention=te is not supported for mixture-of-experts models yet")
        moe_spec = layer_spec(shape, attention, expand_kv=expand_kv, moe=True)
        first = get_transformer_layer_offset(cfg)
        spec = TransformerBlockSubmodules(layer_specs=[moe_spec if shape.is_moe_layer(first + i) else spec
                                                       for i in range(get_num_layers_to_build(cfg))],
                                          layer_norm=RMSNorm)
    elif mcfg.attention != "te":
        spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(cfg), layer_norm=RMSNorm)
    inv_freq, scale = rope_inv_freq(hf_config)
    te_rope: dict[str, Any] = {}
    if mcfg.attention == "te":
        params = getattr(hf_config, "rope_parameters", None) or {}
        if params.get("rope_type", "default") not in ("default", "llama3"):
            raise ValueError(f"attention=te supports default and llama3 RoPE, not {params.get('rope_type')}")
        te_rope = dict(rope_in_attention=False, rotary_base=int(params.get("rope_theta", 10000)),
                       rope_scaling=params.get("rope_type") == "llama3",
                       rope_scaling_factor=float(params.get("factor", 8.0)))
    model = AgentGPTModel(
        cfg, spec, vocab_size=shape.padded_vocab_size(tp), max_sequence_length=shape.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=shape.tied_embeddings, parallel_output=True,
        inv_freq=inv_freq, rope_scale=scale, real_vocab=min(shape.vocab_size, vocab_limit or shape.vocab_size), **te_rope,
    )
    model.shape = shape
    return model


def _available_bytes(device: torch.device) -> int | None:
    """Bytes a forward can still allocate on ``device``: the driver's free memory plus what the
    caching allocator holds unused. None off CUDA."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
