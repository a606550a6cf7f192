"""torch.distributed for a learner of one process (agentrl/learner/megatron/solo.py), on CPU.

Each collective of the solo group is checked against gloo's result for a group of the same one
process (the reference: a real backend doing the real collective) and against its definition;
Megatron's parallel state starts on it; the learner's start picks it for a world of one and NCCL
otherwise. The GPU side (a Megatron learner step on it, its loss against the torch learner's) is
tests/test_megatron_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.learner.megatron import parallel
from agentrl.learner.megatron.solo import BACKEND, SoloProcessGroup


@pytest.fixture(scope="module")
def solo_world():
    """The solo backend as this process's default group, and a gloo group of the same one rank."""
    assert not dist.is_initialized(), "an earlier test left torch.distributed started in this process"
    assert parallel.start_process_group(rank=0, world_size=1) == BACKEND
    gloo = dist.new_group([0], backend="gloo")
    yield gloo
    try:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def _tensor(draw, dtype: torch.dtype) -> torch.Tensor:
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    n = 1
    for s in shape:
        n *= s
    if dtype.is_floating_point:
        values = draw(st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=n, max_size=n))
    else:
        values = draw(st.lists(st.integers(-1000, 1000), min_size=n, max_size=n))
    return torch.tensor(values, dtype=torch.float32 if dtype.is_floating_point else dtype).to(dtype).reshape(shape)


@st.composite
def tensors(draw) -> torch.Tensor:
    return _tensor(draw, draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64])))


@settings(max_examples=40, deadline=None)
@given(t=tensors(), op=st.sampled_from(["SUM", "MIN", "MAX", "PRODUCT", "AVG"]))
def test_all_reduce_is_gloos_one_rank_result(solo_world, t: torch.Tensor, op: str) -> None:
    if op == "AVG" and not t.dtype.is_floating_point:
        op = "SUM"
    ours = t.clone()
    dist.all_reduce(ours, op=getattr(dist.ReduceOp, op))
    if op == "AVG":  # gloo has no AVG; the mean of one contribution is that contribution
        assert torch.equal(ours, t)
        return
    ref = t.clone()
    dist.all_reduce(ref, op=getattr(dist.ReduceOp, op), group=solo_world)
    assert torch.equal(ours, ref) and torch.equal(ours, t)


@settings(max_examples=30, deadline=None)
@given(t=tensors())
def test_gathers_and_scatters_copy_the_one_part(solo_world, t: torch.Tensor) -> None:
    def blank(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.full(shape, -7, dtype=t.dtype)

    # all_gather into a list, and gloo's answer for the same call
    ours, ref = [blank(t.shape)], [blank(t.shape)]
    dist.all_gather(ours, t)
    dist.all_gather(ref, t, group=solo_world)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[0], t)
    # into one tensor of world_size x the input (shape [1, ...]), and a flat one
    out = blank((1, *t.shape))
    dist.all_gather_into_tensor(out, t)
    assert torch.equal(out[0], t)
    flat = blank((t.numel(),))
    dist.reduce_scatter_tensor(flat, t.reshape(-1))
    assert torch.equal(flat, t.reshape(-1))
    parts = [blank(t.shape)]
    dist.reduce_scatter(parts[0], [t])
    assert torch.equal(parts[0], t)
    single = blank(t.shape)
    dist.all_to_all_single(single, t)
    assert torch.equal(single, t)
    b = t.clone()
    dist.broadcast(b, src=0)
    assert torch.equal(b, t)
    got = [blank(t.shape)]
    dist.gather(t, got, dst=0)
    assert torch.equal(got[0], t)
    sc = blank(t.shape)
    dist.scatter(sc, [t], src=0)
    assert torch.equal(sc, t)


def test_in_place_gather_and_size_mismatch(solo_world) -> None:
    buf = torch.arange(6.0)
    dist.all_gather_into_tensor(buf, buf)  # output is the input: already the result
    assert torch.equal(buf, torch.arange(6.0))
    with pytest.raises(ValueError, match="same number of elements"):
        dist.all_gather_into_tensor(torch.empty(12), torch.arange(6.0))
    with pytest.raises(ValueError, match="same number of elements"):
        dist.reduce_scatter_tensor(torch.empty(3), torch.arange(6.0))


@pytest.mark.parametrize("async_ops", [False, True])
def test_coalesced_collectives_as_megatron_ddp_issues_them(solo_world, async_ops: bool) -> None:
    from torch.distributed import _coalescing_manager

    grads = [torch.randn(5), torch.randn(3, 2)]
    before = [g.clone() for g in grads]
    with _coalescing_manager(None, async_ops=async_ops) as cm:
        for g in grads:
            dist.all_reduce(g, op=dist.ReduceOp.AVG, async_op=async_ops)
    if async_ops:
        cm.wait()
    assert all(torch.equal(a, b) for a, b in zip(grads, before))
    outs = [torch.full((1, 5), float("nan")), torch.full((6,), float("nan"))]
    with _coalescing_manager(None, async_ops=async_ops) as cm:
        dist.all_gather_into_tensor(outs[0], before[0], async_op=async_ops)
        dist.all_gather_into_tensor(outs[1], before[1].reshape(-1), async_op=async_ops)
    if async_ops:
        cm.wait()
    assert torch.equal(outs[0][0], before[0]) and torch.equal(outs[1], before[1].reshape(-1))
    shards = [torch.full((5,), float("nan"))]
    with _coalescing_manager(None, async_ops=async_ops) as cm:
        dist.reduce_scatter_tensor(shards[0], before[0], async_op=async_ops)
    if async_ops:
        cm.wait()
    assert torch.equal(shards[0], before[0])


def test_async_work_is_complete_and_waitable(solo_world) -> None:
    t = torch.ones(4)
    work = dist.all_reduce(t, async_op=True)
    assert work.is_completed()
    work.wait()
    assert torch.equal(t, torch.ones(4))


def test_object_collectives(solo_world) -> None:
    gathered = [None]
    dist.all_gather_object(gathered, {"loss": 1.5, "weight": 3})
    assert gathered == [{"loss": 1.5, "weight": 3}]
    box = [("metrics", [1, 2])]
    dist.broadcast_object_list(box, src=0)
    assert box == [("metrics", [1, 2])]
    out = [None]
    dist.scatter_object_list(out, [{"shard": 0}], src=0)
    assert out == [{"shard": 0}]
    dist.barrier()


def test_what_has_no_one_rank_meaning_raises(solo_world) -> None:
    pg = SoloProcessGroup()
    with pytest.raises(RuntimeError, match="one process"):
        pg.send([torch.ones(1)], 1, 0)
    with pytest.raises(RuntimeError, match="one process"):
        pg.recv([torch.ones(1)], 1, 0)
    opts = dist.BroadcastOptions()
    opts.rootRank = 1
    with pytest.raises(ValueError, match="rootRank=1"):
        pg.broadcast([torch.ones(1)], opts)
    with pytest.raises(ValueError, match="world of one process"):
        SoloProcessGroup(0, 2)


def test_megatron_parallel_state_on_one_rank(solo_world) -> None:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 context_parallel_size=1)
    groups = [ps.get_data_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True),
              ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
              ps.get_model_parallel_group(), ps.get_context_parallel_group()]
    assert all(isinstance(g, SoloProcessGroup) and g.size() == 1 for g in groups)
    assert ps.get_data_parallel_world_size() == 1 and dist.get_backend(groups[0]) == BACKEND
    # the DP all-reduce of a gradient bucket, as Megatron's DDP issues it
    bucket = torch.randn(10)
    expect = bucket.clone()
    dist.all_reduce(bucket, group=groups[1])
    assert torch.equal(bucket, expect)


def test_the_learner_picks_solo_for_one_process_and_nccl_otherwise(monkeypatch) -> None:
    calls: list[tuple[str, dict]] = []
    state = {"backend": None}

    def fake_init(backend, **kw):
        calls.append((backend, kw))
        state["backend"] = backend

    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: state["backend"] is not None)
    monkeypatch.setattr(parallel.dist, "init_process_group", fake_init)
    monkeypatch.setattr(parallel.dist, "get_backend", lambda group=None: state["backend"])
    monkeypatch.delenv("AGENTRL_ONE_RANK_NCCL", raising=False)
    assert parallel.start_process_group(rank=0, world_size=1) == BACKEND
    assert isinstance(calls[-1][1]["store"], dist.HashStore) and calls[-1][1]["world_size"] == 1
    assert parallel.start_process_group(rank=0, world_size=1) == BACKEND and len(calls) == 1  # started once
    state["backend"] = None
    monkeypatch.setenv("AGENTRL_ONE_RANK_NCCL", "1")
    assert parallel.start_process_group(rank=0, world_size=1) == "nccl"
    state["backend"] = None
    monkeypatch.delenv("AGENTRL_ONE_RANK_NCCL")
    assert parallel.start_process_group(rank=1, world_size=2, master_port=29123) == "nccl"
    assert calls[-1][1]["world_size"] == 2 and "device_id" not in calls[-1][1]
    with pytest.raises(ValueError, match="rank 1 in a world of one"):
        state["backend"] = None
        parallel.start_process_group(rank=1, world_size=1)
