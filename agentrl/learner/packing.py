"""Sequence packing: bin packing into token-budget micro-batches and packed ``[1, T]`` tensors.

Multi-turn trajectories range from a few hundred to many thousand tokens; padding them into a
rectangle wastes most of the batch. Instead, sequences are placed into bins of
``packing.max_tokens_per_microbatch`` tokens (first-fit-decreasing, or Johnson & Garey's
modified first-fit-decreasing), and each bin is concatenated into one row with ``cu_seqlens``
boundaries and position ids that restart at every sequence. Attention is then masked per
document by the learner (see ``agentrl.learner.hf_forward``). The tensors are
:mod:`agentrl.learner.packed`'s, imported here.

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
from collections.abc import Callable, Sequence

# The packed [1, T] tensors live in agentrl.learner.packed; their names are this module's too.
from agentrl.learner.packed import (
    PackedBatch,
    pack_sequences,
    padded_length,
    to_device,
    unpack,
    unpack_padded,
)

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
