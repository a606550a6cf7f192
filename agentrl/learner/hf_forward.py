"""Forward of a Hugging Face causal LM on packed sequences, and chunked token logprobs.

How the per-document mask reaches the model (transformers 5.x): the model's attention
implementation is switched to :data:`PACKED_ATTENTION`, a function registered in transformers'
``AttentionInterface`` (with ``sdpa_mask`` as its mask builder, so ordinary unpacked calls such
as generation or a right-padded batch behave exactly like ``"sdpa"``). For a packed call the
decoder body gets ``position_ids`` that restart per sequence and the document mask itself, and
transformers builds no mask of its own (a 4-D mask is passed through as is, and during the call
the registered mask builder returns none); this works whether the decoder takes a mask per layer
type (Qwen2/3, Mistral) or calls ``create_causal_mask`` itself (Llama):

* on CPU the mask is ``None`` and the sequence boundaries travel as the
  ``cu_seq_lens_q/k`` keyword arguments (the names of transformers' ``FlashAttentionKwargs``);
  attention runs ``scaled_dot_product_attention(is_causal=True)`` on each document's slice, so
  cost is Σ len² instead of T² and no ``[T, T]`` mask exists (FlexAttention has no CPU backward,
  and a dense 4-D block-diagonal mask was 2.9× slower here);
* on CUDA the mask is a FlexAttention ``BlockMask`` (document-causal), run by compiled
  ``flex_attention``, which skips the masked blocks.

Passing packed ``position_ids`` alone is not enough: transformers only derives a packed mask
from them when no cache exists, and ``use_cache`` defaults to True in forward (a cache is
created), so the sequences would silently attend to each other.

Logprobs never materialize ``[T, vocab]``: the LM head, ``log_softmax`` and the gather run per
chunk of ``chunk_size`` tokens inside a custom autograd function whose backward recomputes each
chunk's logits, so only ``[chunk_size, vocab]`` is alive at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from agentrl.learner.packed import PackedBatch, to_device

__all__ = [
    "PACKED_ATTENTION",
    "chunked_logprobs",
    "document_block_mask",
    "enable_packed_attention",
    "packed_token_logprobs",
    "padded_token_logprobs",
]

_IN_PACKED_CALL: ContextVar[bool] = ContextVar("agentrl_in_packed_call", default=False)

PACKED_ATTENTION = "agentrl_packed"
"""Name under which the packed attention function is registered in transformers."""


# ----------------------------------------------------------------------------------------------
# Chunked logprobs
# ----------------------------------------------------------------------------------------------


class _ChunkedLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T / temperature)[targets], chunk by chunk, recomputed in backward.

    One ``[chunk_size, V]`` buffer is reused across chunks and every elementwise step is in place:
    a fresh 32 MB tensor per chunk is a fresh mmap on CPU, and its page faults cost as much as
    an elementwise pass.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size):  # type: ignore[override]
        # targets [T] (one id per row) or [T, K] (K ids per row, e.g. the sampled token and a
        # teacher's top k); the computation is on [T, K] either way.
        compute = torch.promote_types(hidden.dtype, torch.float32)  # float64 stays float64
        vector = targets.dim() == 2
        targets = targets if vector else targets[:, None]
        out = torch.empty(targets.shape, dtype=compute, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=compute, device=hidden.device)
        buf = _logits_buffer(hidden, weight, chunk_size, compute)
        for s in range(0, hidden.shape[0], chunk_size):
            logits = _chunk_logits(hidden[s : s + chunk_size], weight, temperature, buf)  # [C, V]
            out[s : s + chunk_size] = logits.gather(1, targets[s : s + chunk_size])
            # logsumexp in place (torch.logsumexp allocates a [C, V] temporary for x - max).
            peak = logits.amax(dim=1, keepdim=True)
            peak.masked_fill_(~torch.isfinite(peak), 0.0)
            lse[s : s + chunk_size] = logits.sub_(peak).exp_().sum(dim=1).log_().add_(peak[:, 0])
        out -= lse[:, None]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_size, ctx.vector = temperature, chunk_size, vector
        return out if vector else out[:, 0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors  # targets [T, K]
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        grad_out = grad_out if ctx.vector else grad_out[:, None]  # [T, K]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
            if need_weight
            else None
        )
        buf = _logits_buffer(hidden, weight, chunk_size, lse.dtype)
        for s in range(0, hidden.shape[0], chunk_size):
            h = hidden[s : s + chunk_size]
            # d logprob_k / d logits = (onehot(target_k) - softmax) / temperature, times the
            # upstream g_k, summed over the row's K targets.
            g = grad_out[s : s + chunk_size].to(lse.dtype).div(temperature)  # [C, K]
            grad_logits = _chunk_logits(h, weight, temperature, buf)  # [C, V]
            grad_logits.sub_(lse[s : s + chunk_size, None]).exp_().mul_(-g.sum(dim=1, keepdim=True))
            grad_logits.scatter_add_(1, targets[s : s + chunk_size], g)
            grad_logits = grad_logits.to(hidden.dtype)
            if need_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[s : s + chunk_size])
            if need_weight:
                if grad_logits.dtype == grad_weight.dtype:
                    grad_weight.addmm_(grad_logits.T, h)
                else:
                    grad_weight += (grad_logits.T @ h).to(grad_weight.dtype)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _logits_buffer(
    hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int, dtype: torch.dtype
) -> torch.Tensor:
    rows = min(chunk_size, hidden.shape[0])
    return torch.empty(rows, weight.shape[0], dtype=dtype, device=hidden.device)  # [C, V]


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, temperature: float, buf: torch.Tensor
) -> torch.Tensor:
    # h @ weight.T / temperature into the first len(h) rows of buf, in buf's dtype.
    logits = buf[: h.shape[0]]
    if h.dtype == buf.dtype:
        torch.mm(h, weight.T, out=logits)
    else:  # bf16 matmul, float32 softmax
        logits.copy_(h @ weight.T)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def chunked_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Log-probability of each target under ``softmax(hidden @ lm_head_weight.T / temperature)``.

    Only ``[chunk_size, V]`` logits exist at a time, in forward and in backward (which recomputes
    them), instead of ``[T, V]`` float32: 150k vocab × 16k tokens would be ~10 GB.

    Args:
        hidden: ``[T, H]`` final hidden states.
        lm_head_weight: ``[V, H]`` output embedding.
        targets: ``[T]`` token ids; ``out[t]`` scores ``targets[t]`` from ``hidden[t]``. Or
            ``[T, K]``: K ids per row, ``out[t, k]`` scores ``targets[t, k]``.
        temperature: Sampling temperature the logits are divided by (> 0).
        chunk_size: Tokens per chunk.

    Returns:
        ``[T]`` (or ``[T, K]``) logprobs, float32 (float64 for float64 inputs), differentiable
        w.r.t. ``hidden`` and ``lm_head_weight``.

    Example:
        >>> h, w, y = torch.randn(5, 8), torch.randn(11, 8), torch.randint(0, 11, (5,))
        >>> ref = torch.log_softmax(h @ w.T, -1).gather(1, y[:, None])[:, 0]
        >>> torch.allclose(chunked_logprobs(h, w, y, chunk_size=2), ref, atol=1e-6)
        True
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive to score tokens, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    if hidden.dim() != 2 or targets.dim() not in (1, 2) or targets.shape[:1] != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [T, H] and targets [T] or [T, K], got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    return _ChunkedLogprobs.apply(
        hidden, lm_head_weight, targets.long(), float(temperature), int(chunk_size)
    )


# ----------------------------------------------------------------------------------------------
# Packed attention, registered with transformers
# ----------------------------------------------------------------------------------------------


def _packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    # query [B, H, T, D], key/value [B, H_kv, T, D] -> ([B, T, H, D], no attention weights)
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu_seqlens = kwargs.get("cu_seq_lens_q")
    packed = isinstance(attention_mask, BlockMask) or (
        cu_seqlens is not None and attention_mask is None
    )
    if not packed:  # an ordinary call (generation, a right-padded batch): exactly "sdpa"
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    if sliding_window is not None:
        raise NotImplementedError("packed attention does not support sliding-window layers")
    gqa = query.shape[1] != key.shape[1]
    if isinstance(attention_mask, BlockMask):
        # Compiled for any length and grad mode, and never silently eager (eager FlexAttention
        # materializes the [heads, T, T] scores): the Megatron learner's compiled kernels.
        from agentrl.learner.megatron.compiled import flex_attention as compiled_flex

        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = compiled_flex(query, key, value, attention_mask, scale)
    else:
        # split, not slicing: the backward of N slices builds N zero-filled [T]-long gradients.
        sizes = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        pieces = zip(*(t.split(sizes, dim=2) for t in (query, key, value)))
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
                ).transpose(1, 2)  # [B, len, H, D]
                for q, k, v in pieces
            ],
            dim=1,
        )
        return out.contiguous(), None
    return out.transpose(1, 2).contiguous(), None


def document_block_mask(batch: PackedBatch) -> Any:
    """FlexAttention ``BlockMask`` of ``batch``'s document-causal attention, on its device.

    Built from the boundaries kept on the host (no dense mask evaluated, no read back from the
    GPU): tiles inside one document skip the mask function, tiles across a boundary apply it,
    tiles of two documents are never visited."""
    from agentrl.learner.megatron.cp_attention import document_causal_block_mask

    total = batch.input_ids.shape[1]
    dev = batch.input_ids.device
    q_global = torch.arange(total, device=dev, dtype=torch.int32)
    return document_causal_block_mask(batch.document_starts().to(torch.int32), q_global, total)


def enable_packed_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to the :data:`PACKED_ATTENTION` implementation (idempotent).

    Unpacked calls keep behaving like ``"sdpa"``; packed calls from :func:`packed_token_logprobs`
    attend within each document only.

    Raises:
        ValueError: The model does not dispatch attention through transformers' AttentionInterface.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if PACKED_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_ATTENTION, _packed_attention)

        def packed_or_sdpa_mask(*args: Any, **kwargs: Any) -> Any:
            # Inside packed_token_logprobs the attention masks by documents itself (BlockMask or
            # cu_seqlens): transformers must build no mask of its own; elsewhere, sdpa's.
            return None if _IN_PACKED_CALL.get() else sdpa_mask(*args, **kwargs)

        AttentionMaskInterface.register(PACKED_ATTENTION, packed_or_sdpa_mask)
    if model.config._attn_implementation != PACKED_ATTENTION:
        model.set_attn_implementation(PACKED_ATTENTION)
    if model.config._attn_implementation != PACKED_ATTENTION:
        raise ValueError(
            f"{type(model).__name__} cannot switch its attention implementation (it does not use "
            "transformers' AttentionInterface), so it cannot run packed sequences; use packing.algorithm=none"
        )


# ----------------------------------------------------------------------------------------------
# Logprobs of a packed micro-batch and of a padded one
# ----------------------------------------------------------------------------------------------


def _lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError(
            f"{type(model).__name__}: an LM head with a bias is not supported"
        )
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, name, None):
            raise NotImplementedError(
                f"{type(model).__name__}: config.{name} is not supported by chunked logprobs"
            )
    return head.weight


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


FUSED_HEAD = True
"""On a GPU with bf16/fp16 weights, score tokens with the Megatron learner's compiled head
(:func:`agentrl.learner.megatron.logprobs.vocab_parallel_logprobs` with ``fused=True``): the
float32 ``[chunk, vocab]`` logits and their elementwise passes stay in registers instead of memory
(those passes were among the longest kernels of the torch learner's step at 1.5B on the H100:
bench/history/lora.md, 2026-11-28). False: :func:`chunked_logprobs` everywhere."""


def _fused_head(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    return FUSED_HEAD and hidden.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)


def _scores_at(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    where: torch.Tensor,
    weight: torch.Tensor,
    **kw: Any,
) -> torch.Tensor:
    # hidden [M, H], input_ids [M] (or [M, K]), where [K] long positions to score (never 0):
    # out[p] = log p(ids[p] | hidden[p-1]) at those positions, 0 elsewhere.
    h, targets = hidden[where - 1], input_ids[where]
    if targets.dim() == 1 and _fused_head(h, weight):
        from agentrl.learner.megatron.logprobs import vocab_parallel_logprobs

        scores = vocab_parallel_logprobs(h, weight, targets, fused=True, **kw)
    else:
        scores = chunked_logprobs(h, weight, targets, **kw)
    out = torch.zeros(input_ids.shape, dtype=scores.dtype, device=scores.device)
    return out.index_put((where,), scores)


def _router_loss(body: torch.nn.Module, out: Any) -> torch.Tensor:
    """transformers' load-balancing loss of a MoE forward's router logits (its own function, from
    the decoder's module)."""
    import importlib

    logits = getattr(out, "router_logits", None)
    if not logits:
        raise ValueError(f"{type(body).__name__} returned no router logits: not a mixture-of-experts model")
    cfg = body.config
    module = importlib.import_module(type(body).__module__)
    return module.load_balancing_loss_func(logits, cfg.num_experts, cfg.num_experts_per_tok)


def packed_token_logprobs(
    model: torch.nn.Module, batch: PackedBatch, *, temperature: float = 1.0, chunk_size: int = 1024,
    extra_ids: torch.Tensor | None = None, vocab_limit: int | None = None,
    router_losses: list[torch.Tensor] | None = None,
) -> Any:
    """Per-token logprobs of a packed micro-batch, each sequence attending only to itself.

    The model is switched to :data:`PACKED_ATTENTION` on first use (see
    :func:`enable_packed_attention`). Works with transformers 5 decoders that build their masks
    with ``create_causal_mask`` (Llama, Qwen2/2.5/3, Mistral without sliding window, ...; tested
    in tests/test_hf_forward.py).

    Args:
        model: A transformers causal LM (e.g. ``Qwen2ForCausalLM``).
        batch: Packed sequences from :func:`agentrl.learner.packing.pack_sequences`.
        temperature: Logits are divided by it before ``log_softmax``.
        chunk_size: Tokens per LM-head chunk (``packing.logprob_chunk_size``).
        extra_ids: ``[1, T, K]`` or ``[T, K]`` more ids to score at every position (e.g. a
            teacher's top k), from the same forward pass.
        vocab_limit: the softmax runs over ids ``< vocab_limit`` only (``model.tokenizer_vocab_only``:
            the head's later rows get probability 0); every scored id must be below it.
        router_losses: a mixture-of-experts model's router load-balancing loss of this forward
            (transformers' ``load_balancing_loss_func`` over all MoE layers and the micro-batch's
            tokens, pack padding included) is appended to it; differentiable.

    Returns:
        ``[T]`` float32: ``out[t] = log p(input_ids[t] | earlier tokens of its sequence)``, 0 at
        the first token of every sequence and on padding. Differentiable w.r.t. the model's
        parameters. Use :func:`agentrl.learner.packing.unpack` to get per-sequence tensors back. With
        ``extra_ids``: ``(out, extra)``, ``extra[t, k] = log p(extra_ids[t, k] | ...)`` ``[T, K]``.
    """
    enable_packed_attention(model)
    device = _device(model)
    weight = _lm_head_weight(model)
    if vocab_limit is not None and vocab_limit < weight.shape[0]:
        # checked where the batch is given: on the host (the learners' case) it costs no GPU wait
        top = max(int(batch.input_ids.max()) if batch.input_ids.numel() else 0,
                  int(extra_ids.max()) if extra_ids is not None and extra_ids.numel() else 0)
        if top >= vocab_limit:
            raise ValueError(f"token id {top} is past vocab_limit {vocab_limit} "
                             "(model.tokenizer_vocab_only: the policy has no such id)")
        weight = weight[:vocab_limit]  # the rows past it: no logit, probability 0
    # One asynchronous copy per tensor, and the masks built on the host from the lengths: nothing
    # in this function makes the host wait for the GPU, so it queues the next kernels ahead.
    batch = batch.to(device, non_blocking=True, with_fields=False)  # the loss moves the fields it needs
    total = batch.input_ids.shape[1]
    if total == 0:
        return torch.zeros(0, device=device)
    if device.type == "cuda":
        mask = document_block_mask(batch)
        extra: dict[str, Any] = {}
    else:
        mask = None
        extra = {
            "cu_seq_lens_q": batch.cu_seqlens,
            "cu_seq_lens_k": batch.cu_seqlens,
            "max_length_q": batch.max_seqlen,
            "max_length_k": batch.max_seqlen,
        }
    body = model.get_decoder()
    # The mask goes in as is: transformers returns a 4-D mask (the BlockMask) unchanged, and with
    # none (CPU) the packed mask function above builds none, whether the decoder takes a mapping
    # per layer type (Qwen2/3, Mistral) or calls create_causal_mask itself (Llama).
    if router_losses is not None:
        extra["output_router_logits"] = True
    token = _IN_PACKED_CALL.set(True)
    try:
        out = body(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=mask,
            use_cache=False,
            **extra,
        )
    finally:
        _IN_PACKED_CALL.reset(token)
    hidden = out.last_hidden_state[0]  # [T, H]
    if router_losses is not None:
        router_losses.append(_router_loss(body, out))
    ids = batch.input_ids[0]
    if extra_ids is not None:
        extra_ids = to_device(extra_ids.reshape(total, -1).long(), device)
        ids = torch.cat([ids[:, None], extra_ids], dim=1)  # [T, 1 + K]
    scores = _scores_at(
        hidden,
        ids,
        batch.scored_positions(),
        weight,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    return scores if extra_ids is None else (scores[:, 0], scores[:, 1:])


def padded_token_logprobs(
    model: torch.nn.Module,
    token_ids: Sequence[Sequence[int]],
    *,
    temperature: float = 1.0,
    pad_id: int = 0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """The same quantity as :func:`packed_token_logprobs`, from an ordinary right-padded batch.

    Args:
        model: A transformers causal LM.
        token_ids: The sequences (lists or 1-D tensors).
        temperature: Logits are divided by it before ``log_softmax``.
        pad_id: Token id written on padding.
        chunk_size: Tokens per LM-head chunk.

    Returns:
        ``[N, max_len]`` logprobs; 0 at each first token and on padding.
    """
    device = _device(model)
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in token_ids]
    if not seqs:
        return torch.zeros(0, 0, device=device)
    lens = torch.tensor([s.numel() for s in seqs], device=device)
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_id).to(
        device
    )  # [N, L]
    cols = torch.arange(ids.shape[1], device=device)
    real = cols[None, :] < lens[:, None]  # [N, L]
    hidden = model.get_decoder()(
        input_ids=ids, attention_mask=real.long(), use_cache=False
    ).last_hidden_state
    keep = (real & (cols[None, :] > 0)).reshape(-1)
    scores = _scores_at(
        hidden.reshape(-1, hidden.shape[-1]),
        ids.reshape(-1),
        keep.nonzero()[:, 0],
        _lm_head_weight(model),
        temperature=temperature,
        chunk_size=chunk_size,
    )
    return scores.reshape(ids.shape)
