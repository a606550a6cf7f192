"""torch.distributed for a learner of one process, without NCCL.

Megatron-Core needs ``torch.distributed`` even on one GPU: it makes a few dozen groups and runs its
collectives on them (the DDP gradient all-reduce, the grad-norm all-reduce, our metric gathers).
Over NCCL each group a collective touches gets a communicator, and on one rank NCCL still allocates
its buffers: 2.4 GiB of the one-rank learner's process sat outside its allocator after the first
step on the H200 (bench/history/peers.md, 2026-11-28; NVIDIA/nccl issue 2363 for the 512 MiB
NET pool of a one-rank communicator).

In a world of one process every collective has a closed form: a reduction of one contribution is
that contribution (SUM, AVG, MIN, MAX, PRODUCT, the bitwise ops), a gather or scatter of one part is
a copy, a broadcast from rank 0 to rank 0 is nothing. :class:`SoloProcessGroup` does exactly that
on the caller's current stream (no second stream, no host synchronisation) and hands back completed
work. ``init_distributed`` uses it when the learner's world size is 1 (``AGENTRL_ONE_RANK_NCCL=1``
keeps NCCL, for measuring the difference). Anything without a one-rank meaning (point-to-point,
``PREMUL_SUM``, a root other than 0) raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

__all__ = ["BACKEND", "SoloProcessGroup", "register"]

BACKEND = "agentrl_solo"

_IDENTITY_OPS = {dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MIN, dist.ReduceOp.MAX,
                 dist.ReduceOp.PRODUCT, dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR}


def _done(result: Any = None) -> Any:
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _check_op(opts: Any) -> None:
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    if not any(op == ok for ok in _IDENTITY_OPS):
        raise NotImplementedError(f"{BACKEND}: reduce op {op} has no one-rank form here "
                                  "(PREMUL_SUM carries its factor in C++); use NCCL (AGENTRL_ONE_RANK_NCCL=1)")


def _check_root(opts: Any, name: str) -> None:
    for attr in ("rootRank", "rootTensor"):
        value = getattr(opts, attr, 0)
        if value != 0:
            raise ValueError(f"{BACKEND}: {name} with {attr}={value} in a world of one process")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.numel() != src.numel():
        raise ValueError(f"{BACKEND}: {name} of a {tuple(src.shape)} input into a {tuple(dst.shape)} output: "
                         "in a world of one process they hold the same number of elements")
    if dst.data_ptr() == src.data_ptr() and dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous():
        return  # in place: already the result
    dst.copy_(src.reshape(dst.shape))


def _one(items: Sequence[Any], name: str) -> Any:
    if len(items) != 1:
        raise ValueError(f"{BACKEND}: {name} got {len(items)} entries; a world of one process has one")
    return items[0]


class SoloProcessGroup(dist.ProcessGroup):
    """A process group of one rank whose collectives are their one-rank results (module docstring)."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        if size != 1 or rank != 0:
            raise ValueError(f"{BACKEND} is for a world of one process; got rank {rank} of {size}")
        super().__init__(rank, size)

    # --- identity --------------------------------------------------------------------------
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def getBackendName(self) -> str:
        return BACKEND

    # --- reductions: one contribution is the result -----------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        _check_op(opts)
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        _check_op(opts)
        return _done(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        _check_op(opts)
        _check_root(opts, "reduce")
        return _done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        _check_root(opts, "broadcast")
        return _done(tensors)

    def barrier(self, opts: Any = None) -> Any:
        return _done()

    # --- gathers and scatters: one part is a copy ---------------------------------------------
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        _copy(_one(_one(outputs, "allgather"), "allgather"), _one(inputs, "allgather"), "allgather")
        return _done(outputs)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Any:
        if len(outputs) != 1 or len(outputs[0]) != len(inputs):
            raise ValueError(f"{BACKEND}: allgather_coalesced wants one output list as long as the inputs")
        for dst, src in zip(outputs[0], inputs):
            _copy(dst, src, "allgather_coalesced")
        return _done(outputs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        _copy(output, input, "all_gather_into_tensor")
        return _done([output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Any:
        for dst, src in zip(outputs, inputs, strict=True):
            _copy(dst, src, "all_gather_into_tensor")
        return _done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        _check_op(opts)
        _copy(_one(outputs, "reduce_scatter"), _one(_one(inputs, "reduce_scatter"), "reduce_scatter"),
              "reduce_scatter")
        return _done(outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        _check_op(opts)
        _copy(output, input, "reduce_scatter_tensor")
        return _done([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        _check_op(opts)
        for dst, src in zip(outputs, inputs, strict=True):
            _copy(dst, src, "reduce_scatter_tensor")
        return _done(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        _check_root(opts, "gather")
        _copy(_one(_one(outputs, "gather"), "gather"), _one(inputs, "gather"), "gather")
        return _done(outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        _check_root(opts, "scatter")
        _copy(_one(outputs, "scatter"), _one(_one(inputs, "scatter"), "scatter"), "scatter")
        return _done(outputs)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        _copy(_one(outputs, "all_to_all"), _one(inputs, "all_to_all"), "all_to_all")
        return _done(outputs)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> Any:
        _copy(output, input, "all_to_all_single")
        return _done([output])

    all_to_all_single = alltoall_base

    # --- no peer to talk to ---------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        raise RuntimeError(f"{BACKEND}: send to rank {dst} in a world of one process")

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        raise RuntimeError(f"{BACKEND}: recv from rank {src} in a world of one process")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        raise RuntimeError(f"{BACKEND}: recv in a world of one process")


def _create(store: Any, rank: int, size: int, timeout: Any) -> SoloProcessGroup:
    return SoloProcessGroup(rank, size)


def register() -> str:
    """Register the backend with torch.distributed (idempotent); returns its name."""
    if BACKEND not in dist.Backend.backend_list:
        # devices given so it claims no device's default (cpu stays gloo, cuda stays nccl)
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    return BACKEND
