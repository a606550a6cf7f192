"""Context parallelism (CP) for packed document-causal attention, without TransformerEngine.

A packed micro-batch of ``T`` tokens holds several documents (trajectories) delimited by
``cu_seqlens``. With ``cp_size`` ranks, every document is cut into ``2 * cp_size`` equal chunks
and rank ``r`` keeps chunks ``r`` and ``2 * cp_size - 1 - r`` ("zigzag"), so every rank holds
``T / cp_size`` tokens and exactly the same amount of causal attention work.

Attention all-gathers K and V over the CP group (one collective for both), puts them back in
global token order, and lets the local queries attend to every key of their own document at a
global position not after their own. The backward pass reduce-scatters dK and dV to the ranks
that own those tokens (the adjoint of the all-gather). On CUDA the attention runs in compiled
FlexAttention (grouped-query heads read the shared K/V heads, no repeat) with a block mask made
directly from the document boundaries (`document_causal_block_mask`: no dense [t, T] mask, no
compiled mask builder), which skips the tiles the document-causal mask empties and applies the
mask only on the tiles it cuts; on CPU (and with ``backend="sdpa"``) it runs in SDPA with an
explicit boolean mask.

Example:
    >>> import torch
    >>> cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    >>> zigzag_indices(cu, cp_size=2, cp_rank=0).tolist()
    [0, 1, 6, 7, 8, 11]
    >>> zigzag_positions(cu, cp_size=2, cp_rank=0).tolist()
    [0, 1, 6, 7, 0, 3]
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "all_gather_zigzag",
    "cp_document_attention",
    "document_causal_attention",
    "document_causal_block_mask",
    "document_causal_blocks",
    "document_causal_mask_mod",
    "zigzag_indices",
    "zigzag_local_cu_seqlens",
    "zigzag_positions",
]

Backend = Literal["auto", "flex", "sdpa"]

# Newer torch renames the tensor collectives; the old names still work on torch 2.11 (device).
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _doc_lengths(
    cu_seqlens: torch.Tensor | tuple[int, ...], cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Validate ``cu_seqlens`` and CP coordinates; return the document lengths [N] (CPU int64)."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(
            f"need cp_size >= 1 and 0 <= cp_rank < cp_size, got cp_size={cp_size}, cp_rank={cp_rank}"
        )
    cu = torch.as_tensor(cu_seqlens).detach().to("cpu", torch.int64)
    if cu.dim() != 1 or cu.numel() < 1 or cu[0] != 0:
        raise ValueError(f"cu_seqlens must be 1-D and start at 0, got {cu.tolist()[:8]}")
    lengths = cu[1:] - cu[:-1]
    if (lengths < 0).any():
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()[:8]}")
    if cp_size > 1:
        bad = torch.nonzero(lengths % (2 * cp_size)).flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"document {i} has {int(lengths[i])} tokens; with context_parallel_size={cp_size} every "
                f"document length must be a multiple of 2 * cp = {2 * cp_size} "
                f"(pack with packing.pad_multiple = a multiple of {2 * cp_size})"
            )
    return lengths


def _zigzag(
    cu_seqlens: torch.Tensor | tuple[int, ...], cp_size: int, cp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global indices and per-document positions of the tokens rank ``cp_rank`` holds (CPU int64)."""
    lengths = _doc_lengths(cu_seqlens, cp_size, cp_rank)
    starts = torch.cumsum(lengths, 0) - lengths
    if cp_size == 1:
        doc = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        index = torch.arange(int(lengths.sum()))
        return index, index - starts[doc]
    chunk = lengths // (2 * cp_size)  # [N]
    local = 2 * chunk  # tokens of each document on every rank
    doc = torch.repeat_interleave(torch.arange(lengths.numel()), local)  # [t_local]
    offset = torch.arange(doc.numel()) - torch.repeat_interleave(
        torch.cumsum(local, 0) - local, local
    )
    c = chunk[doc]
    # First half of a document's local tokens is chunk r, second half chunk 2*cp-1-r.
    position = torch.where(
        offset < c, cp_rank * c + offset, (2 * cp_size - 2 - cp_rank) * c + offset
    )
    return starts[doc] + position, position


def zigzag_indices(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.LongTensor:
    """Positions in the packed sequence that CP rank ``cp_rank`` holds, in increasing order.

    Every document is split into ``2 * cp_size`` equal chunks; rank ``r`` gets chunk ``r`` and
    chunk ``2 * cp_size - 1 - r`` of every document, documents in order. Early chunks have little
    causal work and late ones much, so every rank gets the same amount.

    Args:
        cu_seqlens: [N + 1] cumulative document lengths of the packed sequence, starting at 0.
        cp_size: Context-parallel degree. With 1, any lengths are accepted and all tokens returned.
        cp_rank: This rank's index in the CP group.

    Returns:
        [T / cp_size] int64 indices into the packed [T] sequence (on ``cu_seqlens.device``).

    Raises:
        ValueError: A document length is not a multiple of ``2 * cp_size``, or the arguments are
            malformed.

    Example:
        >>> zigzag_indices(torch.tensor([0, 8]), cp_size=2, cp_rank=1).tolist()
        [2, 3, 4, 5]
    """
    index, _ = _zigzag(cu_seqlens, cp_size, cp_rank)
    return index.to(torch.as_tensor(cu_seqlens).device)


def zigzag_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.LongTensor:
    """Per-document position ids (for RoPE) of the tokens :func:`zigzag_indices` gives this rank.

    Args:
        cu_seqlens: [N + 1] cumulative document lengths, starting at 0.
        cp_size: Context-parallel degree.
        cp_rank: This rank's index in the CP group.

    Returns:
        [T / cp_size] int64 positions, each counted from the start of its own document.
    """
    _, position = _zigzag(cu_seqlens, cp_size, cp_rank)
    return position.to(torch.as_tensor(cu_seqlens).device)


def zigzag_local_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``cu_seqlens`` of the local shard: each document keeps ``length / cp_size`` tokens per rank.

    Useful to split per-token outputs of the local shard (logprobs, losses) by document.

    Args:
        cu_seqlens: [N + 1] cumulative document lengths, each a multiple of ``2 * cp_size``.
        cp_size: Context-parallel degree.

    Returns:
        [N + 1] cumulative local lengths, same dtype and device as ``cu_seqlens``.
    """
    _doc_lengths(cu_seqlens, cp_size, 0)
    return torch.div(cu_seqlens, cp_size, rounding_mode="floor")


@dataclass(frozen=True)
class _Plan:
    """Everything one (packing, cp_size, cp_rank, device) needs, built once and cached."""

    total: int  # T
    q_index: torch.Tensor  # [t_local] global index of each local query
    to_global: torch.Tensor  # [T] gathered (rank-major) row of each global token
    to_rank_major: torch.Tensor  # [T] global token of each gathered row
    mask: Any  # [t_local, T] bool for SDPA, a FlexAttention BlockMask, or None (gather only)


def document_causal_mask_mod(q_start: torch.Tensor, q_global: torch.Tensor) -> Any:
    """FlexAttention ``mask_mod`` of local queries against the packed sequence's keys.

    Query row ``i`` sits at global position ``q_global[i]`` of a document starting at
    ``q_start[i]``; it may see key ``j`` iff ``q_start[i] <= j <= q_global[i]``. Documents are
    contiguous, so this is "same document and not after the query" with two lookups, both on the
    query index (the kernel loads them once per query row).

    Args:
        q_start: [t] int32 first global position of each query's document.
        q_global: [t] int32 global position of each query.
    """

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return (kv_idx >= q_start[q_idx]) & (kv_idx <= q_global[q_idx])

    return mask_mod


def document_causal_blocks(
    q_start: torch.Tensor, q_global: torch.Tensor, total: int, block: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which [block x block] tiles of the [t, T] document-causal mask are non-empty and full.

    Exact, in O(t/block * T/block) without evaluating the mask: query rows are in increasing
    global order (zigzag shards are) and documents are contiguous, so tile (query block b, keys
    [k0, k1)) has an allowed pair iff the first row of b at or after ``k0`` belongs to a document
    starting before ``k1``; it is full iff all its rows are in one document starting at or before
    ``k0`` and its first row is at or after ``k1 - 1`` (so that document covers the whole tile),
    and the tile is not cut short by the end of the queries or keys.

    Args:
        q_start: [t] int first global position of each query's document.
        q_global: [t] int global position of each query, increasing.
        total: T, the number of keys.
        block: tile size (FlexAttention's BLOCK_SIZE).

    Returns:
        ``(nonempty, full)``, two [ceil(t / block), ceil(T / block)] bool tensors.
    """
    t, dev = q_global.numel(), q_global.device
    n_q, n_k = -(-t // block), -(-total // block)
    if n_q == 0:
        return (torch.zeros(0, n_k, dtype=torch.bool, device=dev),) * 2
    big = torch.iinfo(torch.int64).max // 2
    pad = n_q * block - t
    g = F.pad(q_global.to(torch.int64), (0, pad), value=big).view(n_q, block)  # padding sorts last
    s = F.pad(q_start.to(torch.int64), (0, pad), value=big).view(n_q, block)
    k0 = torch.arange(n_k, device=dev, dtype=torch.int64) * block  # [n_k]
    k1 = torch.clamp(k0 + block, max=total)
    first = torch.searchsorted(g, k0.expand(n_q, n_k).contiguous())  # [n_q, n_k] in [0, block]
    start_at = torch.cat([s, s.new_full((n_q, 1), big)], dim=1).gather(1, first)
    nonempty = start_at < k1[None, :]
    last = torch.full((n_q, 1), block - 1, device=dev, dtype=torch.int64)
    last[-1] = block - 1 - pad  # last real row of each block
    one_doc = s[:, :1] == s.gather(1, last)  # sorted rows: first and last share the document
    full = one_doc & (s[:, :1] <= k0[None, :]) & (g[:, :1] >= (k1 - 1)[None, :])
    # Tiles cut by the end of the queries or keys stay partial, as create_block_mask makes them.
    if pad:
        full[-1] = False
    if total % block:
        full[:, -1] = False
    return nonempty, full


def document_causal_block_mask(
    q_start: torch.Tensor, q_global: torch.Tensor, total: int, block: int = 128
) -> Any:
    """FlexAttention ``BlockMask`` for local queries (increasing global positions) against T keys.

    Built from :func:`document_causal_blocks` (no dense mask, no compiled mask builder):
    full tiles skip the ``mask_mod``, partial tiles apply :func:`document_causal_mask_mod`, empty
    tiles are never visited.
    """
    from torch.nn.attention.flex_attention import BlockMask

    nonempty, full = document_causal_blocks(q_start, q_global, total, block)
    partial = nonempty & ~full

    def as_kv(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = blocks.sum(-1, dtype=torch.int32)[None, None]  # [1, 1, n_q]
        order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
        return num, order.to(torch.int32)[None, None]  # [1, 1, n_q, n_k], used blocks first

    kv_num, kv_idx = as_kv(partial)
    full_num, full_idx = as_kv(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
        mask_mod=document_causal_mask_mod(q_start.to(torch.int32), q_global.to(torch.int32)),
        seq_lengths=(q_global.numel(), total),
    )


@functools.lru_cache(maxsize=16)
def _plan(
    cu: tuple[int, ...], cp_size: int, cp_rank: int, device: torch.device, backend: str
) -> _Plan:
    rank_major = torch.cat([_zigzag(cu, cp_size, r)[0] for r in range(cp_size)])
    total = rank_major.numel()
    lengths = _doc_lengths(cu, cp_size, cp_rank)
    q_index_cpu, q_pos = _zigzag(cu, cp_size, cp_rank)
    q_index = q_index_cpu.to(device)
    if backend == "flex":
        mask = document_causal_block_mask((q_index_cpu - q_pos).to(device), q_index, total)
    elif backend == "none":
        mask = None
    else:
        doc_ids = torch.repeat_interleave(torch.arange(lengths.numel()), lengths).to(device)
        key = torch.arange(total, device=device)
        mask = (doc_ids[q_index][:, None] == doc_ids[None, :]) & (q_index[:, None] >= key[None, :])
    return _Plan(
        total=total,
        q_index=q_index,
        to_global=torch.argsort(rank_major).to(device),
        to_rank_major=rank_major.to(device),
        mask=mask,
    )


def _get_plan(
    cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, device: torch.device, backend: str
) -> _Plan:
    # A plain tuple is the cache key: the same packing reuses its masks in every layer.
    cu = tuple(int(x) for x in torch.as_tensor(cu_seqlens).tolist())
    return _plan(cu, cp_size, cp_rank, torch.device(device), backend)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan, scale: float, backend: str
) -> torch.Tensor:
    """Local queries [t, Hq, D] against all keys [T, Hkv, D] under the plan's mask -> [t, Hq, D]."""
    q_, k_, v_ = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, S, D]
    if backend == "flex":
        if q.is_cuda:  # compiled (any length, never silently eager)
            from agentrl.learner.megatron.compiled import flex_attention

            out = flex_attention(q_, k_, v_, plan.mask, scale)
        else:  # eager FlexAttention: a slow reference (it materializes the scores)
            from torch.nn.attention.flex_attention import flex_attention

            out = flex_attention(q_, k_, v_, block_mask=plan.mask, scale=scale,
                                 enable_gqa=q.shape[1] != k.shape[1])
    else:
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k_, v_ = k_.repeat_interleave(groups, dim=1), v_.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=plan.mask, scale=scale)
    return out[0].transpose(0, 1).contiguous()


class _AllGatherZigzag(torch.autograd.Function):
    """All-gather zigzag shards [t_local, ...] into global order [T, ...]; backward reduce-scatters."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, plan: _Plan) -> torch.Tensor:
        ctx.group, ctx.plan = group, plan
        gathered = x.new_empty(
            (plan.total, *x.shape[1:])
        )  # rank-major: rank r's shard at rows [r*t, (r+1)*t)
        _all_gather_tensor(gathered, x.contiguous(), group=group)
        return gathered.index_select(0, plan.to_global)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad_rank_major = grad.index_select(0, ctx.plan.to_rank_major).contiguous()
        out = grad.new_empty((ctx.plan.q_index.numel(), *grad.shape[1:]))
        _reduce_scatter_tensor(out, grad_rank_major, group=ctx.group)
        return out, None, None


def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _resolve_backend(backend: Backend, device: torch.device) -> str:
    if backend not in ("auto", "flex", "sdpa"):
        raise ValueError(f"backend must be 'auto', 'flex' or 'sdpa', got {backend!r}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return backend


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: int) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"expected q [t, Hq, D] and k, v [t, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[0] != tokens or k.shape[0] != tokens or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must both hold {tokens} local tokens "
            "(cu_seqlens[-1] / cp_size) and share the head dim"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
        )


def all_gather_zigzag(
    x: torch.Tensor, cu_seqlens: torch.Tensor, cp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Gather every rank's zigzag shard [t_local, ...] into the packed global order [T, ...].

    Differentiable: the gradient is reduce-scattered back to the owning ranks.

    Args:
        x: [T / cp_size, ...] this rank's shard, rows in :func:`zigzag_indices` order.
        cu_seqlens: [N + 1] cumulative document lengths of the packed sequence.
        cp_group: The CP process group; ``None`` means no context parallelism.

    Returns:
        [T, ...] the full packed tensor, identical on every rank of the group.
    """
    cp_size, cp_rank = _group_size_rank(cp_group)
    if cp_size == 1:
        return x
    plan = _get_plan(cu_seqlens, cp_size, cp_rank, x.device, "none")
    if x.shape[0] != plan.q_index.numel():
        raise ValueError(
            f"x holds {x.shape[0]} rows, the local shard has {plan.q_index.numel()} tokens"
        )
    return _AllGatherZigzag.apply(x, cp_group, plan)


def cp_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cp_group: dist.ProcessGroup | None,
    *,
    softmax_scale: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Document-causal attention of this rank's zigzag shard against the whole packed sequence.

    K and V are all-gathered over ``cp_group`` in one collective; each local query attends to all
    keys of its own document at global positions not after its own. In backward, the K/V
    gradients are reduce-scattered back to their owners, so q, k and v all get exact gradients.

    Args:
        q: [T / cp_size, Hq, D] local queries, rows in :func:`zigzag_indices` order.
        k: [T / cp_size, Hkv, D] local keys (``Hq`` a multiple of ``Hkv``: grouped-query attention).
        v: [T / cp_size, Hkv, D] local values.
        cu_seqlens: [N + 1] cumulative document lengths of the packed (global) sequence; each
            length a multiple of ``2 * cp_size``. Best kept on the CPU: it is read on the host.
        cp_group: The CP process group. ``None`` (or a group of size 1) means no context
            parallelism: plain document-causal attention over ``q``, ``k``, ``v``.
        softmax_scale: Scale of the attention logits; default ``1 / sqrt(D)``.
        backend: ``"flex"`` (FlexAttention with a block mask; compiled on CUDA, eager and
            forward-only on CPU), ``"sdpa"`` (explicit boolean [t, T] mask), or ``"auto"``: flex
            on CUDA, SDPA elsewhere.

    Returns:
        [T / cp_size, Hq, D] attention output of the local queries.

    Raises:
        ValueError: Malformed ``cu_seqlens``, a document length not divisible by ``2 * cp_size``,
            or q/k/v shapes that do not match the local shard.
    """
    cp_size, cp_rank = _group_size_rank(cp_group)
    mode = _resolve_backend(backend, q.device)
    plan = _get_plan(cu_seqlens, cp_size, cp_rank, q.device, mode)
    _check_qkv(q, k, v, plan.q_index.numel())
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    if cp_size > 1:
        kv = _AllGatherZigzag.apply(torch.stack((k, v), dim=1), cp_group, plan)  # [T, 2, Hkv, D]
        k, v = kv.unbind(dim=1)
    return _attend(q, k, v, plan, scale, mode)


def document_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Causal attention within each packed document, no context parallelism (the reference).

    Args:
        q: [T, Hq, D] queries of the packed sequence.
        k: [T, Hkv, D] keys (``Hq`` a multiple of ``Hkv``).
        v: [T, Hkv, D] values.
        cu_seqlens: [N + 1] cumulative document lengths, starting at 0 and ending at T.
        softmax_scale: Scale of the attention logits; default ``1 / sqrt(D)``.
        backend: ``"flex"``, ``"sdpa"`` or ``"auto"`` (flex on CUDA, SDPA elsewhere).

    Returns:
        [T, Hq, D] attention output.
    """
    return cp_document_attention(
        q, k, v, cu_seqlens, None, softmax_scale=softmax_scale, backend=backend
    )
