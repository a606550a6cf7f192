"""Weight transports from the learner to the engines: object store, CUDA IPC, NCCL broadcast.

A refit moves the learner's full Hugging Face-named weights into every engine. Three ways:

- ``object_store``: CPU tensors through Ray's object store, written by the engine as a safetensors
  file in shared memory and reloaded from there (CPU engines, any placement; the slow path).
- ``cuda_ipc``: learner and engine on the same GPU (colocated). The learner packs its weights into
  one flat GPU buffer and sends a CUDA IPC handle of it (a few hundred bytes); the engine's worker
  opens the handle and reloads its weights from views of that buffer: no copy through the host.
- ``nccl``: learner and engines on different GPUs or nodes. The learner's rank 0 and the engines'
  workers form a process group of their own (not the learner's training group) and the flat buffer
  is broadcast from the learner. On CPU the same protocol runs over gloo (tests).

All three carry the same :class:`FlatSpec` (names, dtypes, shapes, byte offsets), so the engine side
is one function that turns a flat buffer into ``(name, tensor)`` pairs. This module knows nothing
of Ray or vLLM: the actors and the worker extension call it. Which transport a placement gets
(:func:`resolve_transport`) is the config's decision, made in :mod:`agentrl.config.training` and
re-exported here.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrl.config.training import TRANSPORTS, Transport, resolve_transport

if TYPE_CHECKING:
    import torch

__all__ = [
    "TRANSPORTS",
    "FlatSpec",
    "LazyReshape",
    "ReadersGuard",
    "RefitPayload",
    "WeightGroup",
    "describe_views",
    "flatten_weights",
    "gather_parameters",
    "ipc_handle",
    "open_ipc_handle",
    "plain_allocations",
    "resolve_transport",
    "spec_from_bytes",
    "spec_to_bytes",
    "unflatten_weights",
]

_ALIGN = 256  # byte alignment of each tensor inside the flat buffer (any dtype's views stay aligned)


@dataclass(frozen=True)
class FlatSpec:
    """Where each named tensor lives inside a flat byte buffer."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # torch dtype names, e.g. "bfloat16"
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # byte offsets
    nbytes: int  # total buffer size
    # Zero-copy refit (describe_views): each tensor is a strided view of the buffer, of this size and
    # these strides (elements), reshaped to ``shapes``; None: contiguous at its offset.
    view_shapes: tuple[tuple[int, ...], ...] | None = None
    strides: tuple[tuple[int, ...], ...] | None = None

    @property
    def num_tensors(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class LazyReshape:
    """``tensor.reshape(shape)``, not taken yet: the tensor is a view the reshape would copy (q, k
    and v out of Megatron's interleaved QKV weight), and a zero-copy refit sends the view; the
    engine reshapes (a copy of one tensor there, none in the learner)."""

    tensor: Any
    shape: tuple[int, ...]

    def materialize(self) -> Any:
        return self.tensor.reshape(self.shape)


def flatten_weights(weights: dict[str, torch.Tensor], device: torch.device | str | None = None,
                    *, skip_shared: bool = True) -> tuple[torch.Tensor, FlatSpec]:
    """Copy ``weights`` into one uint8 buffer (on ``device``, default: the first tensor's).

    A tensor that is the very same memory as an earlier one (same address, shape and dtype: tied
    embeddings) is left out when ``skip_shared``: the engine's loader ties them again. Views of
    one storage at different places (q/k/v split from a fused QKV weight) are all kept.

    Example:
        >>> import torch
        >>> buf, spec = flatten_weights({"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)})
        >>> [(n, tuple(t.shape)) for n, t in unflatten_weights(buf, spec)]
        [('a', (3,)), ('b', (2,))]
    """
    import torch

    items, seen = [], set()
    for name, tensor in weights.items():
        key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if skip_shared and tensor.numel() and key in seen:
            continue
        if tensor.numel():
            seen.add(key)
        items.append((name, tensor.detach()))
    offsets, pos = [], 0
    for _, t in items:
        pos = -(-pos // _ALIGN) * _ALIGN
        offsets.append(pos)
        pos += t.numel() * t.element_size()
    device = torch.device(device) if device is not None else (items[0][1].device if items else torch.device("cpu"))
    buffer = torch.empty(max(pos, 1), dtype=torch.uint8, device=device)
    for (_, t), off in zip(items, offsets):
        nbytes = t.numel() * t.element_size()
        if nbytes:
            buffer[off:off + nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
    spec = FlatSpec(
        names=tuple(n for n, _ in items),
        dtypes=tuple(str(t.dtype).removeprefix("torch.") for _, t in items),
        shapes=tuple(tuple(t.shape) for _, t in items),
        offsets=tuple(offsets),
        nbytes=pos,
    )
    return buffer, spec


def unflatten_weights(buffer: torch.Tensor, spec: FlatSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into ``buffer`` as laid out by :func:`flatten_weights` (no copies),
    or by :func:`describe_views` (strided views, reshaped: a copy only where the view is not one)."""
    import math

    import torch

    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < spec.nbytes:
        raise ValueError(f"refit buffer: expected a flat uint8 buffer of >= {spec.nbytes} bytes, "
                         f"got {buffer.dtype} {tuple(buffer.shape)}")
    strided = spec.strides or (None,) * len(spec.names)
    sizes = spec.view_shapes or (None,) * len(spec.names)
    for name, dtype, shape, off, size, stride in zip(spec.names, spec.dtypes, spec.shapes, spec.offsets,
                                                      sizes, strided):
        dt = getattr(torch, dtype)
        item = torch.empty((), dtype=dt).element_size()
        if stride is None:
            nbytes = math.prod(shape) * item
            yield name, buffer[off:off + nbytes].view(dt).view(shape)
            continue
        span = _span(size, stride)
        view = buffer[off:off + span * item].view(dt).as_strided(size, stride)
        yield name, view.reshape(shape)


def _span(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from a strided view's first to its last element, inclusive (0 if empty)."""
    if any(n == 0 for n in size):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(size, stride))


def describe_views(buffer: torch.Tensor, weights: dict[str, Any]) -> FlatSpec:
    """The layout of ``weights`` (tensors, or :class:`LazyReshape` of tensors) as they already lie
    inside ``buffer`` (a flat uint8 tensor): a zero-copy refit sends ``buffer``'s handle with it
    and the engine takes strided views (:func:`unflatten_weights`). Tied duplicates are left out as
    :func:`flatten_weights` does. Raises ``ValueError`` for a tensor outside the buffer.

    Example:
        >>> import torch
        >>> buf = torch.zeros(64, dtype=torch.uint8)
        >>> w = buf[:24].view(torch.float32).view(2, 3)
        >>> spec = describe_views(buf, {"w": w, "wt": LazyReshape(w.t(), (6,))})
        >>> [(n, tuple(t.shape)) for n, t in unflatten_weights(buf, spec)]
        [('w', (2, 3)), ('wt', (6,))]
    """
    import torch

    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError("describe_views: the buffer must be one flat contiguous uint8 tensor")
    base, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    names, dtypes, shapes, offsets, sizes, strides, seen = [], [], [], [], [], [], set()
    for name, value in weights.items():
        t, shape = (value.tensor, value.shape) if isinstance(value, LazyReshape) else (value, tuple(value.shape))
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        start = t.data_ptr()
        stop = start + _span(tuple(t.shape), t.stride()) * t.element_size()
        if t.device != buffer.device or not base <= start <= stop <= end:
            raise ValueError(f"zero-copy refit: {name} is not inside the learner's parameter buffer "
                             f"({t.device}, offset {start - base}); the parameters were not gathered into it")
        names.append(name)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(tuple(shape))
        offsets.append(start - base)
        sizes.append(tuple(t.shape))
        strides.append(tuple(t.stride()))
    return FlatSpec(names=tuple(names), dtypes=tuple(dtypes), shapes=tuple(shapes), offsets=tuple(offsets),
                    nbytes=buffer.numel(), view_shapes=tuple(sizes), strides=tuple(strides))


def gather_parameters(module: torch.nn.Module, device: torch.device | str | None = None) -> torch.Tensor:
    """Move every parameter of ``module`` into one flat uint8 buffer (each ``param.data`` becomes a
    view of it, aligned as :func:`flatten_weights` aligns) and return the buffer: the memory a
    zero-copy refit shares with the engines. Values are unchanged; the old storage is freed (the
    allocator's cache keeps it until ``empty_cache``). Shared parameters stay shared."""
    import torch

    params: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    offsets, pos = [], 0
    for p in params:
        pos = -(-pos // _ALIGN) * _ALIGN
        offsets.append(pos)
        pos += p.numel() * p.element_size()
    device = torch.device(device) if device is not None else (params[0].device if params else torch.device("cpu"))
    buffer = torch.empty(max(pos, 1), dtype=torch.uint8, device=device)
    with torch.no_grad():
        for p, off in zip(params, offsets):
            nbytes = p.numel() * p.element_size()
            view = buffer[off:off + nbytes].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
    return buffer


def ipc_handle(buffer: torch.Tensor) -> bytes:
    """A picklable CUDA IPC handle of ``buffer`` (the buffer must outlive every reader's use)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.device.type != "cuda":
        raise ValueError("cuda_ipc refit: the flat weight buffer must be on a CUDA device")
    return pickle.dumps(reduce_tensor(buffer))


@contextlib.contextmanager
def plain_allocations(enabled: bool = True) -> Iterator[None]:
    """CUDA allocations inside are plain cudaMalloc segments although this process's allocator
    uses expandable segments (``enabled``; a no-op otherwise): a buffer another process opens by
    :func:`ipc_handle` (CUDA IPC of expandable memory needs ``pidfd_getfd``, which containers often
    refuse). Expandable segments come back on at the end."""
    import torch

    if not enabled:
        yield
        return
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def open_ipc_handle(handle: bytes, device_index: int | None = None) -> torch.Tensor:
    """The tensor behind an :func:`ipc_handle`, opened in this process.

    ``device_index`` is the local CUDA index of the shared GPU in this process (the handle records
    the sender's index, which differs when the two processes see different CUDA_VISIBLE_DEVICES).
    """
    import torch

    rebuild, args = pickle.loads(handle)
    if device_index is None:
        device_index = torch.cuda.current_device()
    args = list(args)
    args[6] = device_index  # rebuild_cuda_tensor's storage_device argument
    return rebuild(*args)


class WeightGroup:
    """A process group of its own between the learner's rank 0 (rank 0 here) and the engines'
    workers (ranks 1..), for broadcasting weights; independent of any default group.

    Args:
        host, port: where rank 0 serves the rendezvous store.
        rank, world_size: this process's place in the group.
        backend: ``nccl`` for CUDA buffers, ``gloo`` for CPU ones.
        timeout_s: how long a rendezvous or a collective may take.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, *, backend: str = "nccl",
                 timeout_s: float = 300.0) -> None:
        import datetime

        import torch.distributed as dist

        self.rank, self.world_size, self.backend = rank, world_size, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore("agentrl-refit", store)
        self._store = store  # the master store must live as long as the group
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            raise ValueError(f"WeightGroup: backend must be nccl or gloo, got {backend!r}")

    def broadcast(self, buffer: torch.Tensor) -> None:
        """Broadcast ``buffer`` in place from rank 0 to every rank (same size everywhere)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([buffer], opts).wait()

    def close(self) -> None:
        import contextlib

        with contextlib.suppress(Exception):
            self.pg.shutdown() if hasattr(self.pg, "shutdown") else None
        self.pg = None


def spec_to_bytes(spec: FlatSpec) -> bytes:
    """A FlatSpec as bytes (collective_rpc serializes arguments; plain bytes pass unchanged)."""
    return pickle.dumps(spec)


def spec_from_bytes(blob: bytes | FlatSpec) -> FlatSpec:
    return blob if isinstance(blob, FlatSpec) else pickle.loads(blob)


def describe(spec: FlatSpec) -> dict[str, Any]:
    return {"refit/tensors": float(spec.num_tensors), "refit/gigabytes": spec.nbytes / 1e9}


@dataclass(frozen=True)
class RefitPayload:
    """What travels to an engine for a GPU refit: the layout, and for cuda_ipc the handle.

    For ``object_store`` the weights themselves travel instead (a dict of CPU tensors)."""

    transport: Transport
    spec: bytes  # spec_to_bytes(FlatSpec)
    handle: bytes | None = None  # cuda_ipc only
    generation: int = 0  # which export of the learner: its release_refit(generation) drops that buffer only


class ReadersGuard:
    """Zero-copy refit: between an export (:meth:`begin`) and its release (:meth:`end`) the engines
    read the learner's parameters in place, so the optimizer step, which writes them, waits in
    :meth:`wait` first. The release names its export's generation: a late release of an older
    export does not end a newer one's reading.

    Example:
        >>> g = ReadersGuard(timeout_s=0.1)
        >>> g.begin(1); g.end(0), g.end(1), g.wait() >= 0.0
        (False, True, True)
    """

    def __init__(self, timeout_s: float = 900.0) -> None:
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._pending: int | None = None

    def begin(self, generation: int) -> None:
        with self._cond:
            self._pending = generation

    def end(self, generation: int | None = None) -> bool:
        with self._cond:
            if self._pending is None or (generation is not None and generation != self._pending):
                return False
            self._pending = None
            self._cond.notify_all()
            return True

    def wait(self) -> float:
        """Block until no export is being read; seconds waited. Raises ``TimeoutError`` after
        ``timeout_s`` (the engines never reported the load done)."""
        import time

        t0 = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending is None, timeout=self.timeout_s):
                raise TimeoutError(
                    f"zero-copy refit: the engines have not released export {self._pending} of the learner's "
                    f"parameters after {self.timeout_s:.0f} s, so its optimizer step cannot write them; an "
                    "engine's weight load hangs or its release was lost (refit.zero_copy=false copies the "
                    "weights for each refit instead)")
        return time.perf_counter() - t0
