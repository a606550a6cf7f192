"""Packed ``[1, T]`` tensors: sequences concatenated into one row with ``cu_seqlens`` boundaries
and position ids that restart at every sequence (what :mod:`agentrl.learner.packing`'s micro-batches
become), and back.

Example:
    >>> batch = pack_sequences([[5, 6, 7], [8, 9]], {"adv": [[1.0, 1.0, 1.0], [2.0, 2.0]]})
    >>> batch.position_ids.tolist(), batch.cu_seqlens.tolist()
    ([[0, 1, 2, 0, 1]], [0, 3, 5])
    >>> [t.tolist() for t in unpack(batch.fields["adv"], batch)]
    [[1.0, 1.0, 1.0], [2.0, 2.0]]
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["PackedBatch", "pack_sequences", "padded_length", "to_device", "unpack", "unpack_padded"]


def padded_length(length: int, multiple: int) -> int:
    """Round ``length`` up to a multiple of ``multiple`` (context parallelism needs 2·cp)."""
    return -(-length // multiple) * multiple


@dataclass
class PackedBatch:
    """Sequences concatenated into one row, each padded to a multiple of ``pad_multiple``.

    Attributes:
        input_ids: ``[1, T]`` long token ids (``pad_id`` on padding).
        position_ids: ``[1, T]`` long, restarting at 0 for every sequence (and running on through
            its padding).
        cu_seqlens: ``[N+1]`` int32 boundaries of the (padded) sequences in ``T``.
        seq_lens: Real (unpadded) length of each packed sequence.
        indices: Which input sequences, in packed order.
        fields: Extra per-token tensors packed the same way, each ``[1, T]`` or ``[1, T, k]`` (0 on padding).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: list[int]
    indices: list[int]
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    # cu_seqlens as a host list: what unpacking and the masks below are built from, so that a batch
    # on the GPU never reads its own boundaries back (each read would make the host wait for the GPU)
    _bounds: list[int] | None = field(default=None, repr=False, compare=False)

    @property
    def num_sequences(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        """Real tokens, padding excluded."""
        return sum(self.seq_lens)

    @property
    def bounds(self) -> list[int]:
        """``cu_seqlens`` as a list, kept on the host (read from the tensor once, if ever)."""
        if self._bounds is None:
            self._bounds = [int(b) for b in self.cu_seqlens.tolist()]
        return self._bounds

    @property
    def padded_lens(self) -> list[int]:
        b = self.bounds
        return [hi - lo for lo, hi in itertools.pairwise(b)]

    @property
    def max_seqlen(self) -> int:
        """Longest padded sequence (what varlen attention kernels call ``max_seqlen``)."""
        return max(self.padded_lens, default=0)

    # The masks and indices below are built on the host from the lengths (Python lists) and sent
    # to the batch's device with one asynchronous copy each: on a GPU nothing here waits for it.

    def real_mask(self) -> torch.Tensor:
        """``[1, T]`` bool: True on real tokens, False on padding."""
        return to_device(self._host_offsets() < self._per_token(self.seq_lens), self.input_ids.device)[None]

    def document_ids(self) -> torch.Tensor:
        """``[T]`` long: the packed position (0..N-1) of the sequence each token belongs to."""
        return to_device(self._per_token(range(self.num_sequences)), self.input_ids.device)

    def document_starts(self) -> torch.Tensor:
        """``[T]`` long: the packed position of the first token of each token's sequence."""
        return to_device(self._per_token(self.bounds[:-1]), self.input_ids.device)

    def scored_positions(self) -> torch.Tensor:
        """``[K]`` long, increasing: the real tokens that have a token before them in their sequence
        (every real token but each sequence's first): the positions a logprob is computed for."""
        b = self.bounds
        idx = [torch.arange(lo + 1, lo + n) for lo, n in zip(b, self.seq_lens)]
        return to_device(torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long), self.input_ids.device)

    def _per_token(self, values: Sequence[int]) -> torch.Tensor:
        # values[i] repeated over sequence i's padded tokens, on the host: [T] long
        return torch.repeat_interleave(torch.as_tensor(list(values), dtype=torch.long),
                                       torch.as_tensor(self.padded_lens, dtype=torch.long))

    def _host_offsets(self) -> torch.Tensor:
        # each token's offset in its padded sequence (what position_ids hold), on the host
        total = self.bounds[-1] if self.bounds else 0
        return torch.arange(total) - self._per_token(self.bounds[:-1])

    def to(self, device: torch.device | str, non_blocking: bool = False, with_fields: bool = True) -> PackedBatch:
        """A copy with every tensor on ``device``.

        ``non_blocking``: host tensors go to a GPU through pinned memory, asynchronously (the host
        does not wait for the copies, nor for the GPU's earlier work). ``with_fields=False``: the
        tokens and positions only (a forward pass needs no per-token fields)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return to_device(t, device) if non_blocking else t.to(device)

        return PackedBatch(
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            cu_seqlens=move(self.cu_seqlens),
            seq_lens=list(self.seq_lens),
            indices=list(self.indices),
            fields={k: move(v) for k, v in self.fields.items()} if with_fields else {},
            _bounds=self.bounds,
        )


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; a host tensor goes to a GPU from pinned memory, asynchronously.

    A plain ``.to("cuda")`` of pageable memory makes the host wait for the stream to drain, so a
    micro-batch prepared while the GPU works (or any such copy inside the loss) would leave it idle."""
    device = torch.device(device)
    if t.device == device or device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def pack_sequences(
    token_ids: Sequence[Sequence[int]],
    fields: Mapping[str, Sequence[Sequence[float | int]]] | None = None,
    *,
    indices: Sequence[int] | None = None,
    pad_multiple: int = 1,
    pad_id: int = 0,
) -> PackedBatch:
    """Concatenate sequences (and their per-token fields) into one ``[1, T]`` row.

    Args:
        token_ids: All sequences (lists or 1-D tensors); ``indices`` picks which to pack.
        fields: Per-token values of the same sequences (e.g. ``loss_mask``, ``advantages``,
            ``behavior_logprobs``), packed alike; the dtype is what ``torch.as_tensor`` infers
            from the values, padding is 0. A field may hold a vector per token (``[len, k]``,
            e.g. a teacher's top-k ids): it packs to ``[1, T, k]``.
        indices: Which sequences to pack, in this order (default: all, in order).
        pad_multiple: Pad each sequence to a multiple of this many tokens.
        pad_id: Token id used on padding.

    Returns:
        The packed batch.

    Raises:
        ValueError: An empty sequence, or a field whose length differs from its sequence.
    """
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be at least 1, got {pad_multiple}")
    fields = dict(fields or {})
    order = list(range(len(token_ids)) if indices is None else indices)
    ids: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    packed_fields: dict[str, list[torch.Tensor]] = {name: [] for name in fields}
    seq_lens: list[int] = []
    bounds = [0]
    for i in order:
        seq = torch.as_tensor(token_ids[i], dtype=torch.long).reshape(-1)
        n = seq.numel()
        if n == 0:
            raise ValueError(
                f"sequence {i} is empty; every packed sequence needs at least one token"
            )
        pad = padded_length(n, pad_multiple) - n
        ids.append(torch.nn.functional.pad(seq, (0, pad), value=pad_id))
        positions.append(torch.arange(n + pad))
        for name, values in fields.items():
            v = torch.as_tensor(values[i])
            v = v.reshape(-1) if v.dim() <= 1 else v
            if v.shape[0] != n:
                raise ValueError(
                    f"field {name!r} of sequence {i} has {v.shape[0]} values for {n} tokens"
                )
            # pad the token dimension (the first) only; vector fields keep their width
            packed_fields[name].append(torch.nn.functional.pad(v, (0, 0) * (v.dim() - 1) + (0, pad)))
        seq_lens.append(n)
        bounds.append(bounds[-1] + n + pad)

    def cat(parts: list[torch.Tensor], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return (torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)).unsqueeze(0)

    return PackedBatch(
        input_ids=cat(ids),
        position_ids=cat(positions),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        seq_lens=seq_lens,
        indices=order,
        fields={name: cat(parts, torch.float32) for name, parts in packed_fields.items()},
        _bounds=bounds,
    )


def unpack(flat: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    """Split a packed per-token tensor back into per-sequence tensors of real length.

    Args:
        flat: ``[T, ...]`` or ``[1, T, ...]``, e.g. packed logprobs.
        batch: The batch it was computed from.

    Returns:
        One ``[len_i, ...]`` view per packed sequence, in packed order (differentiable).
    """
    flat = _drop_row_dim(flat, batch)
    return [flat[s : s + n] for s, n in zip(batch.bounds, batch.seq_lens)]


def unpack_padded(flat: torch.Tensor, batch: PackedBatch, pad_value: float = 0.0) -> torch.Tensor:
    """Unpack into a right-padded ``[N, max_len, ...]`` tensor (differentiable).

    Args:
        flat: ``[T, ...]`` or ``[1, T, ...]``.
        batch: The batch it was computed from.
        pad_value: Value after each sequence's real tokens.
    """
    parts = unpack(flat, batch)
    if not parts:
        return flat.new_full((0, 0, *_drop_row_dim(flat, batch).shape[1:]), pad_value)
    return torch.nn.utils.rnn.pad_sequence(parts, batch_first=True, padding_value=pad_value)


def _drop_row_dim(flat: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    total = batch.input_ids.shape[1]
    if flat.dim() >= 2 and flat.shape[0] == 1 and flat.shape[1] == total:
        flat = flat[0]
    if flat.shape[0] != total:
        raise ValueError(
            f"expected a packed tensor of {total} tokens, got shape {tuple(flat.shape)}"
        )
    return flat
