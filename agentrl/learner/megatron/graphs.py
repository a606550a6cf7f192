"""CUDA graphs of the Megatron decoder (all transformer layers, forward and backward).

At a few thousand tokens per micro-batch the GPU finishes a layer faster than Python launches it
(Megatron's layer code, compiled-function wrappers, autograd hooks). `DecoderGraphs` captures the
whole ``TransformerBlock`` once per micro-batch length with ``torch.cuda.make_graphed_callables``
and replays it; everything the block reads becomes a tensor input of the graph (hidden states,
RoPE tables, the document mask's block tables and row bounds), copied into static buffers on each
call, so any packing of the same length replays the same graph. Parameter gradients leave the
graph through autograd as usual, so Megatron DDP's hooks still add them to ``main_grad``.

Supported: TP = PP = CP = 1, ``attention`` flex or auto (FlexAttention then), no activation checkpointing (the config checks);
other lengths than the captured ones (at most ``max_graphs``) run eagerly.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import Tensor

from agentrl.learner.megatron.attention import PackedAttentionParams, document_block_mask

__all__ = ["DecoderGraphs", "use_capture_stream"]


def use_capture_stream(device: torch.device | None = None) -> torch.cuda.Stream:
    """Run all work of this process, and every graph capture, on one side stream.

    Call before Megatron DDP is built: DDP keeps the parameters' AccumulateGrad nodes alive, and
    a node made on the legacy default stream breaks the backward capture ("operation would make
    the legacy stream depend on a capturing blocking stream").
    """
    stream = torch.cuda.Stream(device)
    torch.cuda.set_stream(stream)
    torch.cuda.graph.default_capture_stream = stream
    return stream


class _DecoderCall(torch.nn.Module):
    """The decoder as a function of tensors only (what make_graphed_callables captures)."""

    def __init__(self, decoder: torch.nn.Module, block_size: int) -> None:
        super().__init__()
        self.decoder = decoder  # shared with the model; this wrapper is not part of the model
        self.block_size = block_size

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor, q_start: Tensor, q_global: Tensor,
                kv_num: Tensor, kv_idx: Tensor, full_num: Tensor, full_idx: Tensor) -> Tensor:
        from torch.nn.attention.flex_attention import BlockMask

        from agentrl.learner.megatron.cp_attention import document_causal_mask_mod

        t = hidden.shape[0]
        p = PackedAttentionParams(qkv_format="thd", rope_cos=cos, rope_sin=sin)
        p.cache["block_mask"] = BlockMask.from_kv_blocks(
            kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=self.block_size,
            mask_mod=document_causal_mask_mod(q_start, q_global), seq_lengths=(t, t))
        return type(self.decoder).forward(self.decoder, hidden_states=hidden, attention_mask=None,
                                          packed_seq_params=p)


class DecoderGraphs:
    """Replays ``model.decoder`` as CUDA graphs, one per micro-batch length (see module doc).

    Example (on a GPU)::

        use_capture_stream()            # before Megatron DDP is built
        ...                             # model, DDP, optimizer
        graphs = DecoderGraphs(model)   # patches model.decoder.forward
        out = ddp(input_ids, position_ids, None, labels=labels, packed_seq_params=params)
    """

    def __init__(self, model: torch.nn.Module, max_graphs: int = 2, num_warmup_iters: int = 2) -> None:
        self.decoder = model.decoder
        self.max_graphs = max_graphs
        self.num_warmup_iters = num_warmup_iters
        self.graphed: dict[int, Any] = {}  # length -> graphed _DecoderCall
        self.enabled = True
        self.decoder.forward = self._forward  # instance attribute: nn.Module.__call__ finds it first

    def _inputs(self, hidden: Tensor, p: PackedAttentionParams) -> tuple[Tensor, ...]:
        mask = document_block_mask(p, hidden.shape[0], hidden.device)
        q_start, q_global = p.cache["mask_rows"]
        return (hidden, p.rope_cos, p.rope_sin, q_start, q_global, mask.kv_num_blocks, mask.kv_indices,
                mask.full_kv_num_blocks, mask.full_kv_indices)

    def _forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, *args: Any,
                 packed_seq_params: Any = None, **kwargs: Any) -> Tensor:
        p, t = packed_seq_params, hidden_states.shape[0]
        usable = (self.enabled and not args and attention_mask is None and hidden_states.is_cuda
                  and isinstance(p, PackedAttentionParams) and p.rope_cos is not None
                  and all(v is None for v in kwargs.values())
                  and (t in self.graphed or len(self.graphed) < self.max_graphs))
        if not usable:
            return type(self.decoder).forward(self.decoder, hidden_states, attention_mask, *args,
                                              packed_seq_params=p, **kwargs)
        inputs = self._inputs(hidden_states, p)
        if t not in self.graphed:
            sample = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)
            sample[0].requires_grad_(True)  # the embedding's gradient flows back through the graph
            block = p.cache["block_mask"].BLOCK_SIZE[0]
            with torch.enable_grad():  # the first call may be a no-grad pass; capture both directions
                self.graphed[t] = torch.cuda.make_graphed_callables(
                    _DecoderCall(self.decoder, block), sample, num_warmup_iters=self.num_warmup_iters)
        return self.graphed[t](*inputs)

    def reset(self) -> None:
        """Drop the captured graphs (their memory pools are freed with them)."""
        self.graphed.clear()
        gc.collect()  # the graphed callables sit in reference cycles: free their pools now
        torch.cuda.empty_cache()
