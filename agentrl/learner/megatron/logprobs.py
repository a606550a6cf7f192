"""Vocab-parallel token logprobs without a full [T, vocab] float32 tensor.

Each tensor-parallel rank holds a slice of the output layer ``W`` [V/tp, H]. Tokens are processed
in chunks: one chunk's local logits are made in float32, reduced across the TP group (max, sum of
exponentials, target logit) and dropped; backward recomputes them chunk by chunk. Peak extra
memory is one chunk's logits, not the sequence's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from agentrl.learner.megatron.compiled import compiled

__all__ = ["vocab_parallel_logprobs"]


def _chunk_logits(h: Tensor, w: Tensor, vocab_start: int, real_vocab: int, temperature: float) -> Tensor:
    logits = (h @ w.t()).float()
    if temperature != 1.0:
        logits = logits / temperature
    pad_from = real_vocab - vocab_start  # columns at or past the real vocab are padding
    if pad_from < logits.shape[1]:
        logits[:, max(pad_from, 0):] = float("-inf")
    return logits


def _dlogits(logits: Tensor, lse: Tensor, local: Tensor, inside: Tensor, temperature: float) -> Tensor:
    """d logp / d logits = (onehot(label) - softmax) / temperature, float32; consumes ``logits``."""
    d = logits.sub_(lse[:, None]).exp_().neg_()
    # scatter, not nonzero(): no host sync in the middle of the pass
    d.scatter_add_(1, local.clamp(0, d.shape[1] - 1)[:, None], inside[:, None].to(d.dtype))
    return d.div_(temperature) if temperature != 1.0 else d


def _masked(logits: Tensor, temperature: float, pad_from: int) -> Tensor:
    """bf16 logits -> float32, divided by the temperature, padding columns (>= pad_from) at -inf."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    if pad_from < x.shape[1]:
        col = torch.arange(x.shape[1], device=x.device)
        x = torch.where(col[None, :] < pad_from, x, float("-inf"))
    return x


def _fused_stats(logits: Tensor, local: Tensor, inside: Tensor, temperature: float,
                 pad_from: int) -> tuple[Tensor, Tensor]:
    """(logprob of the label, logsumexp) per row of one chunk's bf16 logits (TP = 1)."""
    x = _masked(logits, temperature, pad_from)
    lse = torch.logsumexp(x, dim=1)
    picked = x.gather(1, local.clamp(0, x.shape[1] - 1)[:, None]).squeeze(1)
    return torch.where(inside, picked, 0.0) - lse, lse


def _fused_dlogits(logits: Tensor, lse: Tensor, local: Tensor, inside: Tensor, scale: Tensor,
                   temperature: float, pad_from: int) -> Tensor:
    """``scale`` * d logp / d logits = (onehot(label) - softmax) / temperature, bf16, one pass."""
    x = _masked(logits, temperature, pad_from)
    col = torch.arange(x.shape[1], device=x.device)
    onehot = (col[None, :] == local[:, None]) & inside[:, None]
    d = onehot.to(x.dtype) - torch.exp(x - lse[:, None])
    if temperature != 1.0:
        d = d / temperature
    return (d * scale[:, None]).to(logits.dtype)


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, labels: Tensor, group: Any, vocab_start: int,
                real_vocab: int, temperature: float, chunk_size: int, keep_grad_logits: bool,
                fused: bool, to_main_grad: bool) -> Tensor:
        ctx.to_main_grad = to_main_grad
        t, v_local = hidden.shape[0], weight.shape[0]
        out = torch.empty(t, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(t, dtype=torch.float32, device=hidden.device)
        tp = dist.get_world_size(group) if group is not None else 1
        keep = keep_grad_logits and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        grad_logits = torch.empty(t, v_local, dtype=weight.dtype, device=hidden.device) if keep else None
        fused = fused and tp == 1 and weight.dtype in (torch.bfloat16, torch.float16)
        ctx.args = (vocab_start, real_vocab, temperature, chunk_size, fused)
        if fused:
            # compiled on CUDA: the float32 [chunk, V] intermediates stay in registers
            stats = compiled(_fused_stats) if hidden.is_cuda else _fused_stats
            dlogits = compiled(_fused_dlogits) if hidden.is_cuda else _fused_dlogits
            pad_from = real_vocab - vocab_start
            ones = torch.ones(min(chunk_size, t), dtype=torch.float32, device=hidden.device)
            for s in range(0, t, chunk_size):
                e = min(s + chunk_size, t)
                logits = hidden[s:e] @ weight.t()  # [c, V_local] bf16, as the unfused path rounds it too
                local = labels[s:e] - vocab_start
                inside = (local >= 0) & (local < v_local)
                out[s:e], lse[s:e] = stats(logits, local, inside, temperature, pad_from)
                if grad_logits is not None:
                    grad_logits[s:e] = dlogits(logits, lse[s:e], local, inside, ones[: e - s], temperature, pad_from)
            ctx.save_for_backward(hidden, weight, labels, lse, grad_logits)
            return out
        for s in range(0, t, chunk_size):
            e = min(s + chunk_size, t)
            logits = _chunk_logits(hidden[s:e], weight, vocab_start, real_vocab, temperature)
            local = labels[s:e] - vocab_start
            inside = (local >= 0) & (local < v_local)
            picked = logits.gather(1, local.clamp(0, v_local - 1)[:, None]).squeeze(1)
            target = torch.where(inside, picked, torch.zeros_like(picked))
            mx = logits.max(dim=1).values
            if tp > 1:
                dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
            sumexp = (logits - mx[:, None]).exp_().sum(dim=1)
            if tp > 1:
                dist.all_reduce(sumexp, group=group)
                dist.all_reduce(target, group=group)
            lse[s:e] = mx + sumexp.log()
            out[s:e] = target - lse[s:e]
            if grad_logits is not None:  # d out / d logits, kept so backward needs no recompute
                grad_logits[s:e] = _dlogits(logits, lse[s:e], local, inside, temperature)
        ctx.save_for_backward(hidden, weight, labels, lse, grad_logits)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple:
        hidden, weight, labels, lse, grad_logits = ctx.saved_tensors
        vocab_start, real_vocab, temperature, chunk_size, fused = ctx.args
        v_local = weight.shape[0]
        # Megatron DDP gives each parameter a `main_grad` (float32) that its hook adds `.grad` into:
        # the weight's gradient goes there directly, and autograd gets none for it. No [V, H] grad
        # is made, cast or held until the tied embedding's part arrives at the end of the backward
        # (the hook adds that part on its own). Without main_grad (the torch learner): a .grad.
        main_grad = getattr(weight, "main_grad", None) if ctx.needs_input_grad[1] and ctx.to_main_grad else None
        direct = isinstance(main_grad, torch.Tensor) and main_grad.shape == weight.shape
        if grad_logits is not None:
            # Whole-sequence GEMMs over the kept d logp / d logits (scaled in place: backward runs
            # once); the GEMM accumulates over tokens in float32, no float32 [V, H] buffer or cast.
            if getattr(ctx, "consumed", False):
                raise RuntimeError("vocab_parallel_logprobs(keep_grad_logits=True) supports one backward pass")
            ctx.consumed = True
            if fused:  # scale the [T, H] sides by grad_out instead of the [T, V] one
                g = grad_out.float()[:, None]
                grad_h = (grad_logits @ weight * g).to(hidden.dtype) if ctx.needs_input_grad[0] else None
                grad_w = grad_logits.t() @ (hidden * g).to(hidden.dtype) if ctx.needs_input_grad[1] else None
            else:
                d = grad_logits.mul_(grad_out[:, None].to(grad_logits.dtype))  # [T, V_local]
                grad_h = d @ weight if ctx.needs_input_grad[0] else None
                grad_w = d.t() @ hidden if ctx.needs_input_grad[1] else None
            if direct:
                main_grad.add_(grad_w)
                grad_w = None
            return grad_h, grad_w, *([None] * 9)
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = main_grad if direct else torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, hidden.shape[0], chunk_size):
            e = min(s + chunk_size, hidden.shape[0])
            local = labels[s:e] - vocab_start
            inside = (local >= 0) & (local < v_local)
            if fused:
                dlogits = compiled(_fused_dlogits) if hidden.is_cuda else _fused_dlogits
                d = dlogits(hidden[s:e] @ weight.t(), lse[s:e], local, inside, grad_out[s:e].float(),
                            temperature, real_vocab - vocab_start)
            else:
                logits = _chunk_logits(hidden[s:e], weight, vocab_start, real_vocab, temperature)
                d = (_dlogits(logits, lse[s:e], local, inside, temperature) * grad_out[s:e, None]).to(weight.dtype)
            if grad_h is not None:
                grad_h[s:e] = d @ weight
            if grad_w is not None:
                grad_w.add_(d.t() @ hidden[s:e])
        if direct:
            return grad_h, None, *([None] * 9)
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), *([None] * 9)


def vocab_parallel_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, *, group: Any = None,
                            vocab_start: int = 0, real_vocab: int | None = None, temperature: float = 1.0,
                            chunk_size: int = 1024, keep_grad_logits: bool = False, fused: bool = False,
                            accumulate_main_grad: bool = False) -> Tensor:
    """``log softmax(hidden @ weight.T / temperature)[label]`` per token, float32 ``[T]``.

    Args:
        hidden: ``[T, H]`` final hidden states, the same on every TP rank. Its gradient is this
            rank's partial sum; wrap it in Megatron's ``copy_to_tensor_model_parallel_region``
            (or the sequence-parallel gather) so backward reduces it across the group.
        weight: ``[V_local, H]`` this rank's vocabulary slice, rows ``vocab_start ...``.
        labels: ``[T]`` global token ids whose logprob is wanted.
        group: the tensor-parallel process group (None for a single rank).
        real_vocab: columns at or past this global index are padding and get probability 0.
        temperature: logits are divided by it (the sampling temperature).
        chunk_size: tokens per chunk.
        keep_grad_logits: keep d logp / d logits (bf16 ``[T, V_local]``) from the forward pass
            instead of recomputing the logits in backward: faster, more memory.
        fused: without tensor parallelism and with bf16/fp16 weights, one compiled pass per chunk
            makes the logprobs and logsumexp from the GEMM's logits, and one more d logp / d logits,
            with no float32 [chunk, V] tensor in memory (the same math, another reduction order).
        accumulate_main_grad: where ``weight`` has Megatron DDP's ``main_grad``, add the weight's
            gradient into it in backward and give autograd none (no ``[V, H]`` gradient made, cast
            to the weight's dtype or held to the end of the backward). Only where DDP's hook need
            not see that parameter's ``.grad`` (``overlap_grad_reduce`` off: the hook only adds).

    Example:
        >>> h, w = torch.randn(5, 8), torch.randn(11, 8)
        >>> lp = vocab_parallel_logprobs(h, w, torch.tensor([1, 2, 3, 4, 5]))
        >>> bool(torch.allclose(lp, torch.log_softmax(h @ w.T, -1)[range(5), [1, 2, 3, 4, 5]], atol=1e-5))
        True
    """
    if real_vocab is None:
        real_vocab = vocab_start + weight.shape[0]
    return _VocabParallelLogprobs.apply(hidden, weight, labels, group, vocab_start, real_vocab,
                                        float(temperature), int(chunk_size), bool(keep_grad_logits), bool(fused),
                                        bool(accumulate_main_grad))
