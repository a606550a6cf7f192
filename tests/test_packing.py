"""Bin packing, packed tensors and micro-batches (agentrl/learner/packing.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.learner.packing import (
    PACKERS,
    PackedBatch,
    _mffd_only,
    bin_lower_bound,
    build_packer,
    ffd,
    make_microbatches,
    mffd,
    microbatch_slots,
    pack_sequences,
    padded_length,
    unpack,
    unpack_padded,
)

PACKER_FNS = {**PACKERS, "mffd_only": _mffd_only}


@st.composite
def lengths_and_capacity(draw, max_items: int = 60):
    capacity = draw(st.integers(1, 4096))
    lengths = draw(st.lists(st.integers(1, capacity), min_size=0, max_size=max_items))
    return lengths, capacity


def _check_bins(bins: list[list[int]], lengths: list[int], capacity: int) -> None:
    assert sorted(i for b in bins for i in b) == list(range(len(lengths))), (
        "every sequence exactly once"
    )
    assert all(b for b in bins), "no empty bin"
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins), "no bin over capacity"


@pytest.mark.parametrize("name", sorted(PACKER_FNS))
@settings(max_examples=150, deadline=None)
@given(case=lengths_and_capacity())
def test_packers_place_every_sequence_once_within_capacity(name, case):
    lengths, capacity = case
    bins = PACKER_FNS[name](lengths, capacity)
    _check_bins(bins, lengths, capacity)
    assert len(bins) >= math.ceil(sum(lengths) / capacity)
    assert len(bins) >= bin_lower_bound(lengths, capacity)
    assert PACKER_FNS[name](lengths, capacity) == bins, "deterministic"


def _first_fit_by_scan(lengths: list[int], capacity: int) -> list[list[int]]:
    # The textbook FFD, each item scanning the bins in order (what the segment tree must match).
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = next((b for b, space in enumerate(free) if lengths[i] <= space), len(bins))
        if b == len(bins):
            bins.append([])
            free.append(capacity)
        bins[b].append(i)
        free[b] -= lengths[i]
    return bins


@settings(max_examples=200, deadline=None)
@given(case=lengths_and_capacity(max_items=80))
def test_ffd_equals_the_textbook_scan(case):
    lengths, capacity = case
    assert ffd(lengths, capacity) == _first_fit_by_scan(lengths, capacity)


def _optimal_bins(lengths: list[int], capacity: int) -> int:
    # Exhaustive: each item (largest first) into every distinct open bin or a new one.
    best = len(lengths)

    def place(k: int, loads: list[int]) -> None:
        nonlocal best
        if len(loads) >= best:
            return
        if k == len(lengths):
            best = len(loads)
            return
        n, tried = lengths[k], set()
        for b, load in enumerate(loads):
            if load + n <= capacity and load not in tried:
                tried.add(load)
                loads[b] += n
                place(k + 1, loads)
                loads[b] -= n
        place(k + 1, [*loads, n])

    place(0, [])
    return best


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 60),
    data=st.data(),
)
def test_bin_lower_bound_is_a_valid_and_useful_bound(capacity, data):
    lengths = sorted(data.draw(st.lists(st.integers(1, capacity), max_size=9)), reverse=True)
    bound = bin_lower_bound(lengths, capacity)
    assert bound <= _optimal_bins(lengths, capacity), "never above the optimum"
    assert bound >= math.ceil(sum(lengths) / capacity)
    assert bound >= sum(2 * n > capacity for n in lengths)


def test_bin_lower_bound_beats_the_volume_bound():
    # No 45 fits beside a 60, so the three 45s need two more bins: 5, not ceil(315/100) = 4.
    assert bin_lower_bound([60, 60, 60, 45, 45, 45], 100) == 5
    assert len(mffd([60, 60, 60, 45, 45, 45], 100)) == 5


@settings(max_examples=300, deadline=None)
@given(case=lengths_and_capacity(max_items=40))
def test_mffd_never_uses_more_bins_than_ffd(case):
    lengths, capacity = case
    assert len(mffd(lengths, capacity)) <= len(ffd(lengths, capacity))


def test_mffd_beats_ffd_where_its_phases_pay_off():
    # FFD: [90] [66 25] [55 21 20] [12] -> 4 bins; MFFD pairs the large items with small ones: 3.
    lengths = [55, 66, 90, 21, 12, 25, 20]
    assert len(ffd(lengths, 100)) == 4
    assert len(_mffd_only(lengths, 100)) == 3
    assert len(mffd(lengths, 100)) == 3


def test_mffd_alone_can_lose_to_ffd_so_mffd_takes_the_better():
    lengths = [2, 8, 6, 10, 10, 2, 4, 3, 7, 4, 1, 8, 5, 3, 9, 6, 3, 2, 9, 6]
    assert (len(_mffd_only(lengths, 10)), len(ffd(lengths, 10))) == (12, 11)
    assert mffd(lengths, 10) == ffd(lengths, 10)


@pytest.mark.parametrize("packer", [ffd, mffd])
def test_sequence_longer_than_capacity_is_a_clear_error(packer):
    with pytest.raises(
        ValueError, match=r"sequence 1 has 101 tokens.*capacity of 100.*max_tokens_per_microbatch"
    ):
        packer([10, 101, 5], 100)
    with pytest.raises(ValueError, match="at least one token"):
        packer([10, 0], 100)


def test_padding_counts_toward_capacity():
    # 13 tokens padded to 16 no longer fits a 15-token budget.
    with pytest.raises(ValueError, match="16 tokens"):
        make_microbatches([13], 15, pad_multiple=8)
    assert make_microbatches([5, 5], 16, pad_multiple=8) == [[[0, 1]]]
    assert [len(r) for r in make_microbatches([5, 5], 15, pad_multiple=8)] == [2]


def test_build_packer_names_the_allowed_values():
    assert build_packer("mffd") is mffd and build_packer("ffd") is ffd
    with pytest.raises(ValueError, match="unknown packing algorithm 'bfd'; allowed: ffd, mffd"):
        build_packer("bfd")
    with pytest.raises(ValueError, match="allowed: ffd, mffd"):
        make_microbatches([3], 8, algorithm="best")


@st.composite
def sequences_with_fields(draw):
    lens = draw(st.lists(st.integers(1, 40), min_size=0, max_size=12))
    seqs = [draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n)) for n in lens]
    adv = [[float(draw(st.integers(-5, 5)))] * n for n in lens]
    mask = [draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)) for n in lens]
    return seqs, adv, mask


@settings(max_examples=100, deadline=None)
@given(case=sequences_with_fields(), pad_multiple=st.integers(1, 8), data=st.data())
def test_pack_then_unpack_is_the_identity(case, pad_multiple, data):
    seqs, adv, mask = case
    order = data.draw(st.permutations(range(len(seqs))))
    batch = pack_sequences(
        seqs, {"adv": adv, "loss_mask": mask}, indices=order, pad_multiple=pad_multiple, pad_id=7
    )
    padded = [padded_length(len(seqs[i]), pad_multiple) for i in order]
    assert batch.indices == list(order)
    assert batch.seq_lens == [len(seqs[i]) for i in order]
    assert batch.input_ids.shape == batch.position_ids.shape == (1, sum(padded))
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [sum(padded[:k]) for k in range(len(padded) + 1)]
    assert all(n % pad_multiple == 0 for n in batch.padded_lens)
    assert batch.position_ids[0].tolist() == [p for n in padded for p in range(n)]
    assert batch.real_mask().sum().item() == batch.num_tokens
    assert batch.input_ids[~batch.real_mask()].eq(7).all()
    assert [t.tolist() for t in unpack(batch.input_ids, batch)] == [seqs[i] for i in order]
    assert [t.tolist() for t in unpack(batch.fields["adv"][0], batch)] == [adv[i] for i in order]
    assert [t.tolist() for t in unpack(batch.fields["loss_mask"], batch)] == [
        mask[i] for i in order
    ]
    if order:
        assert batch.fields["loss_mask"].dtype == torch.long
        assert batch.document_ids().tolist() == [k for k, n in enumerate(padded) for _ in range(n)]


@settings(max_examples=100, deadline=None)
@given(case=sequences_with_fields(), pad_multiple=st.integers(1, 8))
def test_host_built_masks_equal_the_device_formulas(case, pad_multiple):
    # real_mask / document_ids / document_starts / scored_positions are built on the host from the
    # lengths (no GPU read-back); they must equal what the packed tensors themselves say, also for
    # a batch made without the host boundaries (read from cu_seqlens) and for its device copy.
    seqs, adv, _ = case
    batch = pack_sequences(seqs, {"adv": adv}, pad_multiple=pad_multiple)
    bare = PackedBatch(input_ids=batch.input_ids, position_ids=batch.position_ids,
                       cu_seqlens=batch.cu_seqlens, seq_lens=batch.seq_lens, indices=batch.indices,
                       fields=batch.fields)
    moved = batch.to("cpu", non_blocking=True)
    pos = batch.position_ids[0]
    cu = batch.cu_seqlens.long()
    doc = torch.repeat_interleave(torch.arange(len(seqs)), cu[1:] - cu[:-1])
    real = pos < torch.tensor(batch.seq_lens, dtype=torch.long)[doc] if seqs else pos < 0
    for b in (batch, bare, moved):
        assert b.bounds == cu.tolist() and b.padded_lens == (cu[1:] - cu[:-1]).tolist()
        assert torch.equal(b.real_mask()[0], real)
        assert torch.equal(b.document_ids(), doc)
        assert torch.equal(b.document_starts(), cu[:-1][doc] if seqs else doc)
        assert torch.equal(b.scored_positions(), (real & (pos > 0)).nonzero()[:, 0])
        assert [t.tolist() for t in unpack(b.input_ids, b)] == seqs
    assert torch.equal(moved.fields["adv"], batch.fields["adv"]) and moved.seq_lens == batch.seq_lens
    bare_copy = batch.to("cpu", with_fields=False)
    assert bare_copy.fields == {} and torch.equal(bare_copy.input_ids, batch.input_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_batch_goes_to_the_gpu_and_builds_its_masks_without_waiting_for_it():
    batch = pack_sequences([[1, 2, 3], [4], [5, 6, 7, 8, 9]], {"adv": [[1.0] * 3, [2.0], [3.0] * 5]},
                           pad_multiple=4)
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        moved = batch.to("cuda", non_blocking=True)
        masks = (moved.real_mask(), moved.document_ids(), moved.document_starts(), moved.scored_positions())
        parts = unpack(moved.fields["adv"], moved)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [p.tolist() for p in parts] == [[1.0] * 3, [2.0], [3.0] * 5]
    assert masks[3].tolist() == [1, 2, 9, 10, 11, 12]
    assert masks[0].sum().item() == 9 and masks[1].tolist() == [0] * 4 + [1] * 4 + [2] * 8


def test_unpack_padded_is_differentiable_and_pads():
    batch = pack_sequences([[1, 2, 3], [4], [5, 6]], pad_multiple=2)
    flat = torch.arange(batch.input_ids.shape[1], dtype=torch.float64, requires_grad=True)
    out = unpack_padded(flat, batch, pad_value=-1.0)
    assert out.tolist() == [[0, 1, 2], [4, -1, -1], [6, 7, -1]]
    out.clamp(min=0).sum().backward()
    assert flat.grad.tolist() == [1, 1, 1, 0, 1, 0, 1, 1]


def test_field_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="field 'adv' of sequence 1 has 1 values for 2 tokens"):
        pack_sequences([[1], [2, 3]], {"adv": [[0.0], [1.0]]})


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 512), min_size=0, max_size=60),
    algorithm=st.sampled_from(["ffd", "mffd", "none"]),
    num_ranks=st.integers(1, 5),
    pad_multiple=st.sampled_from([1, 2, 8]),
)
def test_microbatches_cover_all_fit_and_balance_ranks(lengths, algorithm, num_ranks, pad_multiple):
    max_tokens = 1024
    out = make_microbatches(
        lengths, max_tokens, algorithm=algorithm, num_ranks=num_ranks, pad_multiple=pad_multiple
    )
    assert len(out) == num_ranks
    assert len({len(r) for r in out}) == 1, "same number of micro-batches on every rank"
    assert sorted(i for r in out for mb in r for i in mb) == list(range(len(lengths)))

    def slots(mb):
        return microbatch_slots(mb, lengths, algorithm=algorithm, pad_multiple=pad_multiple)

    assert all(slots(mb) <= max_tokens for r in out for mb in r)
    loads = [sum(slots(mb) for mb in r) for r in out]
    biggest = max((slots(mb) for r in out for mb in r), default=0)
    assert max(loads) - min(loads) <= biggest
    assert all(
        [slots(mb) for mb in r] == sorted((slots(mb) for mb in r), reverse=True) for r in out
    )
    if len(lengths) >= num_ranks:
        assert all(mb for r in out for mb in r), "empty micro-batches only when sequences < ranks"
    assert (
        make_microbatches(
            lengths, max_tokens, algorithm=algorithm, num_ranks=num_ranks, pad_multiple=pad_multiple
        )
        == out
    )


def test_fewer_sequences_than_ranks_gives_empty_microbatches():
    assert make_microbatches([10, 20], 64, num_ranks=4) == [[[1]], [[0]], [[]], [[]]]


def test_microbatches_are_split_to_line_up_across_ranks():
    # One bin of 4 sequences, 2 ranks: split into two similar halves.
    out = make_microbatches([30, 20, 10, 5], 100, num_ranks=2)
    assert sorted(sorted(r[0]) for r in out) == [[0, 3], [1, 2]]


def test_padded_groups_keep_rows_times_longest_within_budget():
    out = make_microbatches([10, 30, 30, 5, 60], 64, algorithm="none")
    assert sorted(out[0]) == [[0, 1], [2, 3], [4]]
