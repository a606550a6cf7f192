"""The project's core attention for Megatron-Core: packed (THD) documents, document-causal mask.

Megatron's local ``DotProductAttention`` materializes the full score matrix and refuses packed
input and context parallelism; without TransformerEngine this module takes its place through the
layer spec (``SelfAttentionSubmodules.core_attention``). It also applies RoPE, from cos/sin
tables computed once per micro-batch from the per-document position ids, so every document's
positions restart at 0 (and under context parallelism each local token gets its global position).

Backends: ``flex`` (FlexAttention, compiled, block-sparse document-causal mask), ``sdpa`` (one
causal SDPA call per document), ``auto`` (per micro-batch: SDPA where its documents are long,
FlexAttention where they are many and short; `auto_backend`) and, when ``context_parallel_size > 1``,
the project's ``cp_attention.cp_document_attention`` over zigzag shards. RoPE and FlexAttention run compiled on
CUDA through `agentrl.learner.megatron.compiled` (any length, never silently eager).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from agentrl.learner.megatron.compiled import compiled, flex_attention

__all__ = ["AUTO_SDPA_MEAN_DOC_TOKENS", "PackedAttentionParams", "PackedCoreAttention", "apply_rope", "auto_backend",
           "document_block_mask", "document_bounds", "make_packed_params"]

AUTO_SDPA_MEAN_DOC_TOKENS = 8192
"""``attention=auto`` runs a micro-batch with SDPA when its documents average at least this many
tokens, with FlexAttention otherwise. Qwen2.5-1.5B heads, bf16, H200, torch 2.11 (SDPA picks cuDNN),
forward+backward (bench/attention.py, 2026-11-29: bench/history/peers_long.md):
on one document of 4k-128k tokens SDPA takes 1/1.4-1/1.9 of FlexAttention's time; packed documents
of 16k (4 in 64k) 1/1.3; but at 4k a document the two tie (1.10x SDPA with 4 in 16k, 0.73x with 16
in 64k, where one block-sparse call beats 16 kernel launches a layer), and shorter ones are
FlexAttention's (1k: 0.26x, 256: 0.07x). 8,192 keeps the tie on FlexAttention's side."""


@dataclass
class PackedAttentionParams(PackedSeqParams):
    """``PackedSeqParams`` plus what `PackedCoreAttention` reads; one object per micro-batch.

    ``cu_seqlens_q``/``cu_seqlens_kv`` are int32 ``[N+1]`` over the *global* packed sequence
    (all context-parallel shards); ``rope_cos``/``rope_sin`` are ``[t, head_dim]`` for the local
    tokens. ``cache`` holds the block mask, built by the first layer and reused by the rest.
    """

    rope_cos: Tensor | None = None
    rope_sin: Tensor | None = None
    cache: dict[str, Any] = field(default_factory=dict)


def make_packed_params(cu_seqlens: Tensor, max_seqlen: int, cp_group: Any = None) -> PackedAttentionParams:
    """THD params for one packed micro-batch (``cu_seqlens`` int32 on the compute device)."""
    return PackedAttentionParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen, cp_group=cp_group,
    )


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [t, heads, D] by per-token ``cos``/``sin`` [t, D] (HF's half-split layout)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def document_bounds(params: PackedAttentionParams) -> list[int]:
    """The micro-batch's document boundaries as host ints (from ``cache["cu_seqlens_cpu"]`` when the
    learner put them there: no device sync; read once and cached)."""
    bounds = params.cache.get("bounds")
    if bounds is None:
        cu = params.cache.get("cu_seqlens_cpu", params.cu_seqlens_q)
        bounds = params.cache["bounds"] = [int(x) for x in cu.tolist()]
    return bounds


def auto_backend(params: PackedAttentionParams) -> str:
    """What ``attention=auto`` runs for this micro-batch: ``"sdpa"`` when its documents average at
    least `AUTO_SDPA_MEAN_DOC_TOKENS` tokens, ``"flex"`` otherwise; decided once (every layer, and
    a recomputed layer's second forward, runs the same kernel)."""
    choice = params.cache.get("auto_backend")
    if choice is None:
        bounds = document_bounds(params)
        docs = max(1, len(bounds) - 1)
        choice = "sdpa" if (bounds[-1] - bounds[0]) / docs >= AUTO_SDPA_MEAN_DOC_TOKENS else "flex"
        params.cache["auto_backend"] = choice
    return choice


def document_block_mask(params: PackedAttentionParams, t: int, device: torch.device) -> Any:
    """The micro-batch's document-causal ``BlockMask`` over ``t`` packed tokens (made once, cached)."""
    from agentrl.learner.megatron.cp_attention import document_causal_block_mask

    if "block_mask" not in params.cache:
        cu = params.cu_seqlens_q.to(device=device, dtype=torch.int64)
        pos = torch.arange(t, device=device)
        doc_start = cu[torch.searchsorted(cu, pos, right=True) - 1]  # [t] start of each token's document
        # Built from the document boundaries, not by torch's compiled create_block_mask: no mask
        # compile (a fresh H200 spent ~160 s compiling one graph of the first 16k forward, most
        # likely that builder; compiled FlexAttention fwd+bwd alone took 9 s there).
        params.cache["block_mask"] = document_causal_block_mask(doc_start, pos, t)
        params.cache["mask_rows"] = (doc_start.to(torch.int32), pos.to(torch.int32))  # the mask_mod's inputs
    return params.cache["block_mask"]


class PackedCoreAttention(MegatronModule):
    """Core attention over packed documents (drop-in for Megatron's ``DotProductAttention``).

    Takes ``query`` [t, np, hn] and ``key``/``value`` [t, ng, hn] (this TP rank's heads, THD
    layout), applies RoPE from the params' tables, and returns [t, np * hn].
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: Any,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None, backend: str = "flex", expand_kv: bool = False) -> None:
        super().__init__(config=config)
        if backend not in ("auto", "flex", "sdpa"):
            raise ValueError(f"learner.megatron.attention: unknown core attention '{backend}'")
        self.backend = backend
        # FlexAttention backward with GQA runs one dK/dV program per KV head and block, each looping
        # over the query heads that share it: few, long programs at a few thousand tokens. With
        # expand_kv, K/V are repeated to the query heads first (exact; the repeat's backward sums).
        # Under auto it is the flex path's alone: SDPA's cuDNN kernel takes GQA as it is, and the
        # repeated K/V it would save for backward are ng/np more memory for no speed (bench/attention.py).
        self.expand_kv = expand_kv
        self.layer_number = layer_number
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("PackedCoreAttention has no attention dropout; set attention_dropout=0")
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.cp_size = config.context_parallel_size
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedAttentionParams | None = None) -> Tensor:
        if not isinstance(packed_seq_params, PackedAttentionParams):
            raise TypeError("PackedCoreAttention needs PackedAttentionParams (packed THD input)")
        if attention_bias is not None:
            raise ValueError("PackedCoreAttention does not take an attention bias")
        p = packed_seq_params
        if p.rope_cos is not None:
            rope = compiled(apply_rope) if query.is_cuda else apply_rope
            query = rope(query, p.rope_cos, p.rope_sin)
            key = rope(key, p.rope_cos, p.rope_sin)
        t, nq, hn = query.shape
        keep = p.cache.get("keep_attention")
        if keep and self.layer_number in keep and self.cp_size == 1:  # recompute_keeps_attention
            slot = ("kept_attention", self.layer_number)
            if not torch.is_grad_enabled():  # a recomputed layer's first forward (its checkpoint runs it without grad)
                with torch.enable_grad():  # a graph of the kernel alone: what its backward needs, kept
                    leaves = tuple(_compact(x).detach().requires_grad_() for x in (query, key, value))
                    # the kernels' own outputs (views of what their backward saved), not a copy joined from them
                    parts = self._attend_parts(*leaves, p)
                p.cache[slot] = (leaves, parts)
                return _joined([x.detach() for x in parts]).reshape(t, nq * hn)
            kept = p.cache.pop(slot, None)
            if kept is not None:  # its recompute in backward: the kept output, the kept kernel's backward
                return _KeptAttention.apply(query, key, value, kept).reshape(t, nq * hn)
        if self.cp_size > 1:
            from agentrl.learner.megatron.cp_attention import cp_document_attention

            group = self.cp_group if self.cp_group is not None else p.cp_group
            cu = p.cache.get("cu_seqlens_cpu", p.cu_seqlens_q)  # read on the host
            # attention=flex: compiled FlexAttention with a block mask made from the document
            # boundaries (CUDA; SDPA on CPU); attention=sdpa: SDPA with an explicit [t, T] mask.
            out = cp_document_attention(query, key, value, cu, group, softmax_scale=self.softmax_scale,
                                        backend="sdpa" if self.backend == "sdpa" else "auto")
        else:
            out = self._attend(query, key, value, p)
        return out.reshape(t, nq * hn)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, p: PackedAttentionParams) -> Tensor:
        """[t, np, hn] attention output on one rank (no context parallelism)."""
        return _joined(self._attend_parts(q, k, v, p))

    def _attend_parts(self, q: Tensor, k: Tensor, v: Tensor, p: PackedAttentionParams) -> list[Tensor]:
        """The attention output as the kernels made it: one [t, np, hn] view for FlexAttention's one
        call, one [t_d, np, hn] view a document for SDPA's."""
        if q.is_cuda and (self.backend == "flex" or (self.backend == "auto" and auto_backend(p) == "flex")):
            return [self._flex(q, k, v, p)]  # FlexAttention has no CPU backward: SDPA there
        return self._sdpa(q, k, v, p, expand_kv=self.expand_kv and self.backend == "sdpa")

    def _flex(self, q: Tensor, k: Tensor, v: Tensor, p: PackedAttentionParams) -> Tensor:
        t = q.shape[0]
        mask = document_block_mask(p, t, q.device)
        if self.expand_kv and k.shape[1] != q.shape[1]:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        # [t, h, d] -> [1, h, t, d]; the head dim stays contiguous, as the kernel wants. Compiled
        # only (CUDA): eager FlexAttention would materialize the [h, t, t] scores.
        out = flex_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                             v.transpose(0, 1).unsqueeze(0), mask, self.softmax_scale)
        return out.squeeze(0).transpose(0, 1)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, p: PackedAttentionParams, expand_kv: bool) -> list[Tensor]:
        bounds = document_bounds(p)
        if expand_kv and k.shape[1] != q.shape[1]:  # for SDPA kernels without GQA (bench/attention.py)
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        outs = []
        for s, e in itertools.pairwise(bounds):
            qd, kd, vd = (x[s:e].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=self.softmax_scale,
                                               enable_gqa=q.shape[1] != k.shape[1])
            outs.append(o.squeeze(0).transpose(0, 1))
        return outs


def _joined(parts: list[Tensor]) -> Tensor:
    """Per-document outputs as one [t, np, hn] tensor (one document: its output as it is)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _compact(x: Tensor) -> Tensor:
    """``x``, copied when it is a view into a larger buffer (Megatron's V is a slice of the fused QKV
    projection's output): a kept tensor must not keep the whole buffer alive."""
    return x.clone() if x.untyped_storage().nbytes() > x.numel() * x.element_size() else x


class _KeptAttention(torch.autograd.Function):
    """The core attention of a recomputed layer that kept it (``recompute_keeps_attention``): forward
    hands back the output the layer's first forward made, without running the kernel again; backward
    runs that forward's own backward (its saved q, k, v, output and softmax statistics) and gives
    the gradients to the recomputed q, k, v, which equal the kept ones."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, kept: tuple) -> Tensor:
        ctx.kept = kept
        return _joined([x.detach() for x in kept[1]])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        (leaves, parts), ctx.kept = ctx.kept, None
        grads = torch.split(grad, [x.shape[0] for x in parts]) if len(parts) > 1 else (grad,)
        dq, dk, dv = torch.autograd.grad(parts, leaves, grads)
        return dq, dk, dv, None

