"""Sequence packing: bin packing into token-budget micro-batches and packed ``[1, T]`` tensors.

Multi-turn trajectories range from a few hundred to many thousand tokens; padding them into a
rectangle wastes most of the batch. Instead, sequences are placed into bins of
``packing.max_tokens_per_microbatch`` tokens (first-fit-decreasing, or Johnson & Garey's
modified first-fit-decreasing), and each bin is concatenated into one row with ``cu_seqlens``
boundaries and position ids that restart at every sequence. Attention is then masked per
document by the learner (see ``agentrl.learners.hf_forward``).

Example:
    >>> bins = mffd([700, 500, 300, 300, 200], capacity=1000)
    >>> sorted(sum([700, 500, 300, 300, 200][i] for i in b) for b in bins)
    [1000, 1000]
    >>> batch = pack_sequences([[5, 6, 7], [8, 9]], {"adv": [[1.0, 1.0, 1.0], [2.0, 2.0]]})
    >>> batch.position_ids.tolist(), batch.cu_seqlens.tolist()
    ([[0, 1, 2, 0, 1]], [0, 3, 5])
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "PACKERS",
    "PackedBatch",
    "bin_lower_bound",
    "build_packer",
    "ffd",
    "make_microbatches",
    "mffd",
    "microbatch_slots",
    "pack_sequences",
    "padded_length",
    "to_device",
    "unpack",
    "unpack_padded",
]

Packer = Callable[[Sequence[int], int], list[list[int]]]


# ----------------------------------------------------------------------------------------------
# Bin packing
# ----------------------------------------------------------------------------------------------


def padded_length(length: int, multiple: int) -> int:
    """Round ``length`` up to a multiple of ``multiple`` (context parallelism needs 2·cp)."""
    return -(-length // multiple) * multiple


def _check_lengths(lengths: Sequence[int], capacity: int) -> None:
    if capacity < 1:
        raise ValueError(f"bin capacity must be at least 1 token, got {capacity}")
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(
                f"sequence {i} has length {n}; every sequence needs at least one token"
            )
        if n > capacity:
            raise ValueError(
                f"sequence {i} has {n} tokens (padding included), more than the bin capacity of {capacity}; "
                "raise packing.max_tokens_per_microbatch or lower rollout.max_total_tokens "
                "(sequences are never truncated silently)"
            )


def _decreasing(lengths: Sequence[int], items: Sequence[int] | None = None) -> list[int]:
    # Ties broken by index, so the result depends only on the input.
    items = range(len(lengths)) if items is None else items
    return sorted(items, key=lambda i: (-lengths[i], i))


def _first_fit(
    order: Sequence[int],
    lengths: Sequence[int],
    capacity: int,
    bins: list[list[int]],
    free: list[int],
) -> None:
    # Appends to `bins`/`free` in place; `free[b]` is the space left in bin b. The free space of
    # the open bins, then of not-yet-opened (empty) ones, sits in a max segment tree, so "the
    # first bin with room" is one descent: O(log bins) per item instead of a scan of every bin.
    size = 1
    while size < len(free) + len(order):
        size *= 2
    tree = [capacity] * (2 * size)  # leaves tree[size + b] = free space of bin b
    tree[size : size + len(free)] = free
    for node in range(size - 1, 0, -1):
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
    for i in order:
        n = lengths[i]
        node = 1
        while node < size:  # leftmost leaf with room
            node *= 2
            if tree[node] < n:
                node += 1
        b = node - size
        if b == len(bins):
            bins.append([i])
            free.append(capacity - n)
        else:
            bins[b].append(i)
            free[b] -= n
        tree[node] -= n
        node //= 2
        while node:
            top = max(tree[2 * node], tree[2 * node + 1])
            if tree[node] == top:
                break
            tree[node] = top
            node //= 2


def ffd(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: longest first, each into the first bin with room.

    Args:
        lengths: Token count of every sequence (padding already included).
        capacity: Tokens per bin.

    Returns:
        Bins of sequence indices, in the order the bins were opened.

    Raises:
        ValueError: A sequence is empty or longer than ``capacity``.
    """
    _check_lengths(lengths, capacity)
    bins: list[list[int]] = []
    _first_fit(_decreasing(lengths), lengths, capacity, bins, [])
    return bins


class _SortedPool:
    """Remaining items of one size class, ascending by (length, index), with 'largest that fits'."""

    def __init__(self, items: Sequence[int], lengths: Sequence[int]):
        self._keys = sorted((lengths[i], i) for i in items)

    def __len__(self) -> int:
        return len(self._keys)

    def smallest(self, k: int = 1) -> int:
        """Sum of the ``k`` smallest lengths (a large number when fewer than ``k`` remain)."""
        if len(self._keys) < k:
            return 1 << 62
        return self._keys[0][0] if k == 1 else sum(n for n, _ in self._keys[:k])

    def items(self) -> list[int]:
        return [i for _, i in self._keys]

    def pop_smallest(self) -> int:
        return self._keys.pop(0)[1]

    def largest_fitting(self, space: int) -> int:
        """Length of the largest item that fits in ``space`` (0 when none does)."""
        pos = bisect.bisect_right(self._keys, (space, 1 << 62))
        return self._keys[pos - 1][0] if pos else 0

    def pop_largest_fitting(self, space: int) -> int:
        # Among equal lengths the lowest index, as in FFD's order.
        length = self.largest_fitting(space)
        assert length > 0, "caller checked that an item fits"
        return self._keys.pop(bisect.bisect_left(self._keys, (length, -1)))[1]


def _mffd_only(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    # Johnson & Garey (1985), "A 71/60 theorem for bin packing". Classes by size s / capacity:
    # large > 1/2, medium in (1/3, 1/2], small in (1/6, 1/3], tiny <= 1/6. Integer comparisons only.
    order = _decreasing(lengths)
    large = [i for i in order if 2 * lengths[i] > capacity]
    medium = _SortedPool([i for i in order if 3 * lengths[i] > capacity >= 2 * lengths[i]], lengths)
    small = _SortedPool([i for i in order if 6 * lengths[i] > capacity >= 3 * lengths[i]], lengths)
    tiny = _SortedPool([i for i in order if capacity >= 6 * lengths[i]], lengths)

    # 1. One bin per large item, largest first.
    bins = [[i] for i in large]
    free = [capacity - lengths[i] for i in large]

    # 2. Forward through those bins: the largest medium item that fits, if the smallest fits at all.
    for b in range(len(bins)):
        if medium.smallest() <= free[b]:
            i = medium.pop_largest_fitting(free[b])
            bins[b].append(i)
            free[b] -= lengths[i]

    # 3. Backward through bins without a medium item: the smallest small item plus the largest
    #    small item that fits beside it, if the two smallest fit together.
    for b in reversed(range(len(bins))):
        if len(bins[b]) > 1:
            continue
        if small.smallest(2) <= free[b]:
            i = small.pop_smallest()
            free[b] -= lengths[i]
            j = small.pop_largest_fitting(free[b])
            bins[b] += [i, j]
            free[b] -= lengths[j]

    # 4. Forward through all bins: keep placing the largest remaining item that fits.
    pools = (medium, small, tiny)
    for b in range(len(bins)):
        while min(p.smallest() for p in pools) <= free[b]:
            best = max(pools, key=lambda p: p.largest_fitting(free[b]))
            i = best.pop_largest_fitting(free[b])
            bins[b].append(i)
            free[b] -= lengths[i]

    # 5. First-fit decreasing for whatever is left, into new bins.
    rest = _decreasing(lengths, [i for p in pools for i in p.items()])
    _first_fit(rest, lengths, capacity, bins, free)
    return bins


def mffd(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Modified first-fit decreasing (Johnson & Garey, 1985), never worse than :func:`ffd`.

    MFFD first gives every item above half a bin its own bin, then fills those bins with
    medium (1/3..1/2) and small (1/6..1/3) items chosen to complement them, and packs the rest
    first-fit decreasing. Its worst case is 71/60·OPT + 31/6 bins against FFD's 11/9·OPT + 6/9.
    On some inputs plain FFD still needs fewer bins, so this returns FFD's packing whenever it
    uses fewer bins (ties go to MFFD).

    Args:
        lengths: Token count of every sequence (padding already included).
        capacity: Tokens per bin.

    Returns:
        Bins of sequence indices.

    Raises:
        ValueError: A sequence is empty or longer than ``capacity``.
    """
    _check_lengths(lengths, capacity)
    modified = _mffd_only(lengths, capacity)
    plain = ffd(lengths, capacity)
    return plain if len(plain) < len(modified) else modified


def bin_lower_bound(lengths: Sequence[int], capacity: int) -> int:
    """Fewest bins any packing can use: Martello & Toth's (1990) bound L2.

    For every threshold ``k <= capacity/2``: items above ``capacity - k`` share a bin with no item
    of size ``>= k``; items in ``(capacity/2, capacity - k]`` need a bin each; items in
    ``[k, capacity/2]`` can go only into those bins' free space or into new bins. L2 is the
    largest count over ``k``, never below ``ceil(sum / capacity)`` (``k = 0``) or the number of
    items above half a bin. O(n log n).

    Example:
        >>> bin_lower_bound([60, 60, 60, 45, 45, 45], 100), -(-315 // 100)
        (5, 4)
    """
    _check_lengths(lengths, capacity)
    s = sorted(lengths)
    prefix = list(itertools.accumulate(s, initial=0))
    large = bisect.bisect_right(s, capacity // 2)  # s[large:] are the items above capacity/2
    best = -(-prefix[-1] // capacity)
    for k in [0, *sorted(set(s[:large]))]:
        top = max(large, bisect.bisect_right(s, capacity - k))  # s[top:]: above capacity - k
        num_mid, sum_mid = top - large, prefix[top] - prefix[large]  # (capacity/2, capacity - k]
        sum_small = prefix[large] - prefix[bisect.bisect_left(s, k)]  # [k, capacity/2]
        spill = sum_small - (num_mid * capacity - sum_mid)
        best = max(best, len(s) - large + max(0, -(-spill // capacity)))
    return best


PACKERS: dict[str, Packer] = {"ffd": ffd, "mffd": mffd}
"""Bin-packing algorithms by the name used in ``packing.algorithm``."""


def build_packer(name: str) -> Packer:
    """Return the bin packer registered as ``name`` in :data:`PACKERS`.

    Raises:
        ValueError: ``name`` is not registered; the message lists the allowed names.
    """
    try:
        return PACKERS[name]
    except KeyError:
        allowed = ", ".join(sorted(PACKERS))
        raise ValueError(f"unknown packing algorithm {name!r}; allowed: {allowed}") from None


# ----------------------------------------------------------------------------------------------
# Micro-batches across data-parallel ranks
# ----------------------------------------------------------------------------------------------


def microbatch_slots(
    microbatch: Sequence[int], lengths: Sequence[int], *, algorithm: str, pad_multiple: int = 1
) -> int:
    """Token slots one micro-batch occupies: its packed length, or rows × longest when padded."""
    if not microbatch:
        return 0
    padded = [padded_length(lengths[i], pad_multiple) for i in microbatch]
    return len(padded) * max(padded) if algorithm == "none" else sum(padded)


def _padded_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    # "none": consecutive sequences as rows of one right-padded batch while rows * longest fits.
    groups: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(longest, n) <= max_tokens:
            groups[-1].append(i)
            longest = max(longest, n)
        else:
            groups.append([i])
            longest = n
    return groups


def _split(group: list[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    # Two halves of similar token count: longest first, each to the lighter half.
    halves: tuple[list[int], list[int]] = ([], [])
    load = [0, 0]
    for i in _decreasing(lengths, group):
        h = 0 if load[0] <= load[1] else 1
        halves[h].append(i)
        load[h] += lengths[i]
    return halves


def make_microbatches(
    lengths: Sequence[int],
    max_tokens: int,
    *,
    algorithm: str = "mffd",
    num_ranks: int = 1,
    pad_multiple: int = 1,
) -> list[list[list[int]]]:
    """Group sequences into token-budget micro-batches, balanced over data-parallel ranks.

    Every rank receives the same number of micro-batches, so per-micro-batch collectives line up.
    Bins are split (largest first) until their count is a multiple of ``num_ranks``; when there
    are fewer sequences than ranks, some ranks receive empty micro-batches (``[]``) and must still
    join the collectives (e.g. with a zero-weighted dummy forward). Bins are dealt in rounds of
    ``num_ranks``, the largest of a round to the least-loaded rank, so the ranks' token totals
    differ by at most the largest micro-batch. Each rank's micro-batches are ordered largest first.

    Args:
        lengths: Real token count of every sequence.
        max_tokens: Token budget per micro-batch (``packing.max_tokens_per_microbatch``); padding
            to ``pad_multiple`` counts toward it.
        algorithm: A name in :data:`PACKERS`, or ``"none"`` for right-padded rows: consecutive
            sequences share a micro-batch while rows × longest fits the budget.
        num_ranks: Data-parallel world size.
        pad_multiple: Every sequence is padded to a multiple of this.

    Returns:
        ``out[rank][k]`` is the list of sequence indices of rank ``rank``'s ``k``-th micro-batch.

    Raises:
        ValueError: Unknown algorithm, a sequence over the budget, or a bad count.
    """
    if num_ranks < 1 or pad_multiple < 1:
        raise ValueError(
            f"num_ranks ({num_ranks}) and pad_multiple ({pad_multiple}) must be at least 1"
        )
    _check_lengths(lengths, max_tokens)
    padded = [padded_length(n, pad_multiple) for n in lengths]
    _check_lengths(padded, max_tokens)
    if algorithm == "none":
        groups = _padded_groups(padded, max_tokens)
    else:
        groups = build_packer(algorithm)(padded, max_tokens)

    def slots(g: list[int]) -> int:
        return microbatch_slots(g, padded, algorithm=algorithm)

    while len(groups) % num_ranks:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            groups += [[] for _ in range(num_ranks - len(groups) % num_ranks)]
            break
        biggest = max(splittable, key=slots)
        groups.remove(biggest)
        groups += list(_split(biggest, padded))

    # Deal in rounds, largest bins first; in a round the largest bin goes to the lightest rank.
    groups.sort(key=lambda g: (-slots(g), g))
    out: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for start in range(0, len(groups), num_ranks):
        ranks = sorted(range(num_ranks), key=lambda r: (load[r], r))
        for r, g in zip(ranks, groups[start : start + num_ranks]):
            out[r].append(g)
            load[r] += slots(g)
    return out


# ----------------------------------------------------------------------------------------------
# Packed tensors
# ----------------------------------------------------------------------------------------------


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

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """A copy with every tensor on ``device``.

        ``non_blocking``: host tensors go to a GPU through pinned memory, asynchronously (the host
        does not wait for the copies, nor for the GPU's earlier work)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return to_device(t, device) if non_blocking else t.to(device)

        return PackedBatch(
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            cu_seqlens=move(self.cu_seqlens),
            seq_lens=list(self.seq_lens),
            indices=list(self.indices),
            fields={k: move(v) for k, v in self.fields.items()},
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
