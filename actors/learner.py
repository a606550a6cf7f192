"""Ray learner actors: one per GPU (a torch.distributed group among them), or one on CPU.

:class:`LearnerGroup` fans each call out to every rank (Megatron's calls are collective) and
returns rank 0's answer, so the driver sees a single learner.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from agentrl.actors.watchdog import DIAG_GROUPS, SyncDiag
from agentrl.config import Config

__all__ = ["LearnerActor", "LearnerGroup"]


def _busy(method: Callable[..., Any]) -> Callable[..., Any]:
    """Marks the learner busy for the call: ``train_step`` reports the idle gap before it."""
    @functools.wraps(method)
    def wrapper(self: LearnerActor, *args: Any, **kwargs: Any) -> Any:
        self._current = (method.__name__, time.perf_counter())  # what the watchdog's ping reports
        try:
            return method(self, *args, **kwargs)
        finally:
            self._current = None
            self._idle_since = time.perf_counter()
    return wrapper


@ray.remote(concurrency_groups={**DIAG_GROUPS, "refit": 1})
class LearnerActor(SyncDiag):
    def __init__(self, cfg: Config, model_path: str, **kwargs: Any) -> None:
        from agentrl.learner.common import STARTUP

        STARTUP.restart()  # start_timeline: from here
        import torch

        from agentrl.learner.base import build_learner

        torch.set_num_threads(max(1, int(cfg.learner.num_cpus)))
        self.rank = int(kwargs.get("rank", 0))
        self.lora = cfg.learner.lora.serves_adapter  # a refit moves the adapter's tensors only
        self.merged = cfg.learner.lora.serves_merged  # a refit moves base + adapter as full weights
        self._refit_buf = None
        self._refit_generation = 0  # exports so far: a release names the one it frees
        self._refit_lock = threading.Lock()  # release_refit runs in a thread of its own
        self._weight_group = None
        self._idle_since: float | None = None  # end of the last call that used the learner
        self._current: tuple[str, float] | None = None
        # before the first CUDA allocation of this process (the model's weights)
        self._expandable = bool(cfg.learner.expandable_segments) and torch.cuda.is_available()
        if self._expandable:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        self.learner = build_learner(cfg, model_path=model_path, **kwargs)
        from agentrl.weights.transports import ReadersGuard

        self._readers = ReadersGuard()  # refit.zero_copy: engines reading the parameters in place
        self.zero_copy_wait_s = 0.0  # how long optimizer steps waited for them, in all
        self._zero_copy = bool(cfg.refit.zero_copy)
        if cfg.refit.zero_copy:
            if not hasattr(self.learner, "export_views"):
                raise ValueError("refit.zero_copy needs learner.backend=megatron (the torch learner copies "
                                 "its weights for each refit)")
            self.learner.before_optimizer_step = self._wait_for_readers
        from agentrl.learner.common import PEAKS

        PEAKS.note("built")  # the model and optimizer in place, before any step
        STARTUP.mark("built")

    @_busy
    def train_step(self, groups) -> dict[str, float]:
        t0 = time.perf_counter()
        waited = self.zero_copy_wait_s
        out = self.learner.train_step(groups)
        if self._zero_copy:  # refit.zero_copy: the optimizer step's wait for the engines' release
            out["timing/refit_readers_wait"] = self.zero_copy_wait_s - waited
        # idle: since the learner's last call ended (waiting for this batch, or for the driver)
        out["timing/learner_idle"] = t0 - self._idle_since if self._idle_since is not None else 0.0
        out["timing/learner_busy"] = time.perf_counter() - t0
        return out

    def _wait_for_readers(self) -> None:
        self.zero_copy_wait_s += self._readers.wait()

    @_busy
    def logprobs(self, trajectories) -> list[list[float]]:
        return self.learner.logprobs(trajectories)

    @_busy
    def export_weights(self) -> dict:
        return self.learner.export_weights()

    # -- GPU refit (agentrl/weights/transports.py) -------------------------------------------------------------
    @_busy
    def export_for_refit(self, transport: str):
        """Weights for one refit (with learner.lora served as an adapter: the adapter's tensors
        only; served merged: base + adapter): a dict of CPU tensors (object_store), or, on rank 0, a
        RefitPayload whose flat GPU buffer this actor keeps until :meth:`release_refit`
        (cuda_ipc: the engines open its handle; nccl: :meth:`broadcast_weights` sends it).
        Collective under Megatron: every rank calls it; other ranks return None."""
        import torch

        from agentrl.learner.common import PEAKS
        from agentrl.weights.transports import (
            RefitPayload,
            flatten_weights,
            ipc_handle,
            plain_allocations,
            spec_to_bytes,
        )

        export = self.learner.export_adapter if self.lora else self.learner.export_weights
        if transport == "object_store":
            return export()
        with self._refit_lock:  # a release of the last export running beside this one sees the new generation
            self._refit_generation += 1  # every rank counts every export: the generations agree
            generation = self._refit_generation
            # The driver exports only after every engine has loaded the last export: a buffer
            # whose release has not run yet is done with, and two never coexist.
            self._refit_buf = None
        if transport == "cuda_ipc" and not self.lora and getattr(self.learner, "param_buffer", None) is not None:
            # refit.zero_copy: the engines read the parameters where they lie; no buffer is made,
            # and the next optimizer step waits for their release (ReadersGuard).
            from agentrl.weights.transports import describe_views

            if self.rank != 0:  # every rank holds the whole model (TP and PP 1): rank 0's is read
                return None
            with PEAKS.phase("refit_export"):
                buf, views = self.learner.export_views()
                spec = describe_views(buf, views)
                del views
            torch.cuda.synchronize()  # the last optimizer step's writes land before another process reads
            self._readers.begin(generation)
            return RefitPayload(transport, spec_to_bytes(spec), ipc_handle(buf), generation=generation)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if transport == "cuda_ipc" and not self.lora:
            # The engines share this GPU: the blocks the step left cached go back to the device
            # first, so the model-sized buffer takes their place instead of adding to them (the
            # GPU's peak, engines included).
            torch.cuda.empty_cache()
        with PEAKS.phase("refit_export"), plain_allocations(self._expandable and transport == "cuda_ipc"):
            if self.merged:  # merged into the flat buffer itself: no merged copy of the model beside it
                buf, spec = self.learner.export_merged_flat(device)
            else:
                weights = export(device=device)
                if self.rank != 0:
                    return None
                buf, spec = flatten_weights(weights)
                del weights
        if buf.is_cuda:
            torch.cuda.synchronize()  # the buffer is complete before another process reads it
        with self._refit_lock:
            self._refit_buf = buf
        handle = ipc_handle(buf) if transport == "cuda_ipc" else None
        return RefitPayload(transport, spec_to_bytes(spec), handle,  # type: ignore[arg-type]
                            generation=generation)

    def init_weight_group(self, host: str, port: int, world_size: int) -> int:
        """Rank 0 of the refit broadcast group (nccl transport; gloo when the learner is on CPU)."""
        import torch

        from agentrl.weights.transports import WeightGroup

        if self.rank == 0:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            self._weight_group = WeightGroup(host, port, 0, world_size, backend=backend)
        return self.rank

    @_busy
    def broadcast_weights(self) -> float:
        """Send the buffer of the last :meth:`export_for_refit` to the engines (rank 0)."""
        import time

        t0 = time.perf_counter()
        if self.rank == 0:
            self._weight_group.broadcast(self._refit_buf)
        return time.perf_counter() - t0

    @ray.method(concurrency_group="refit")
    def release_refit(self, generation: int | None = None) -> bool:
        """Drop the refit buffer of export ``generation`` (None: whichever is held) once every
        engine has loaded from it; True if it was dropped.

        Runs in a concurrency group of its own, so it does not queue behind a training step the
        driver has already sent (train.overlap_steps): the buffer (the model's size) no longer
        lives through the next step's forward, backward and optimizer step (it did: 2.9 GiB of
        the learner's peak at 1.5B, H200 2026-11-28). It only drops the reference: the block goes
        back to the allocator's cache, where the step's own tensors reuse it; no empty_cache or
        gc here (either would stall the step running beside it); the next export empties the
        cache first. A release that arrives after a newer export leaves that newer buffer alone."""
        from agentrl.learner.common import PEAKS

        with self._refit_lock:
            if generation is not None and generation != self._refit_generation:
                return False
            self._refit_buf = None
            self._readers.end(generation)  # zero-copy: the optimizer step may write the parameters again
        PEAKS.note("released")  # what stays outside the allocator between refits
        return True

    def free_memory(self) -> dict[str, float]:
        """Return cached GPU memory to the device (colocated: the engine wakes next); GiB held."""
        import gc

        import torch

        if not torch.cuda.is_available():
            return {}
        gc.collect()
        torch.cuda.empty_cache()
        return {"allocated_gib": torch.cuda.memory_allocated() / 2**30,
                "reserved_gib": torch.cuda.memory_reserved() / 2**30,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30}

    def memory_report(self) -> dict[str, float]:
        """GiB this learner holds on its device, by holder (weights, gradients, optimizer state,
        the refit buffer, ...: :func:`agentrl.learner.common.learner_memory`), and its peak."""
        from agentrl.learner.common import learner_memory

        return learner_memory(self.learner, {"refit_buffer": self._refit_buf})

    def start_timeline(self) -> dict[str, float]:
        """Seconds from this actor's start to each point of its build (``imports``: the learner's
        modules, ``distributed``, ``parallel_state``, ``model_built``, ``weights_read``,
        ``weights_loaded``, ``optimizer`` on the Megatron learner; ``built``: the actor ready)."""
        from agentrl.learner.common import STARTUP

        return dict(STARTUP.marks)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def diag_status(self) -> dict[str, Any]:
        current = self._current
        if current is None:
            return {"busy": False, "rank": self.rank}
        return {"busy": True, "rank": self.rank, "call": current[0], "for_s": round(time.perf_counter() - current[1], 1)}

    def version(self) -> int:
        return self.learner.version

    def save(self, path: str) -> None:
        self.learner.save(path)

    def load(self, path: str) -> int:
        self.learner.load(path)
        return self.learner.version


@ray.remote(num_cpus=0)
def _address() -> tuple[str, int]:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


class LearnerGroup:
    """``learner.num_gpus`` actors (one per GPU) with a torch.distributed group, or one CPU actor.

    Method calls return ObjectRefs of rank 0's result, like a single actor's ``.remote`` calls.
    """

    def __init__(self, cfg: Config, model_path: str, *, placement: tuple[Any, Any] | None = None) -> None:
        """``placement``: colocated, ``(plan, placement group)`` of :mod:`agentrl.actors.placement`:
        rank ``i`` takes its share of bundle ``i``'s GPU, beside the engines dealt to that GPU."""
        from agentrl.actors.placement import ColocatedPlan, learner_world_size
        from agentrl.learner.base import learner_traits

        lc = cfg.learner
        world = learner_world_size(cfg)
        ranked = bool(learner_traits(cfg).get("distributed"))  # built with rank, world_size, ...
        gpus = 1 if lc.num_gpus else 0
        opts: Callable[[int], dict[str, Any]]
        if placement is not None:
            plan, pg = placement
            opts = functools.partial(plan.learner_options, cfg, pg)
        elif not ranked:
            opts = lambda i: dict(num_cpus=lc.num_cpus, num_gpus=gpus, resources=lc.resources)  # noqa: E731
        else:
            # Rank 0's node hosts the rendezvous; Ray gives each actor one GPU (local rank 0).
            pg = ray.util.placement_group([{"CPU": lc.num_cpus, "GPU": gpus}] * world, strategy="PACK")
            ray.get(pg.ready())
            opts = lambda i: dict(num_cpus=lc.num_cpus, num_gpus=gpus, resources=lc.resources,  # noqa: E731
                                  scheduling_strategy=ColocatedPlan.on(pg, i))

        if not ranked:
            self.actors = [LearnerActor.options(**opts(0)).remote(cfg, model_path)]
        else:
            strategy = opts(0).get("scheduling_strategy")
            addr, port = ray.get(_address.options(scheduling_strategy=strategy).remote())
            self.actors = [
                LearnerActor.options(**opts(i)).remote(
                    cfg, model_path, rank=i, world_size=world, local_rank=0, master_addr=addr, master_port=port)
                for i in range(world)
            ]
        self.rank0 = self.actors[0]

    def weight_group_address(self) -> tuple[str, int]:
        """A free address on rank 0's node for the nccl refit transport's process group."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(node_id=ray.get(self.rank0.node_id.remote()), soft=False)
        return ray.get(_address.options(scheduling_strategy=here).remote())

    def _all(self, method: str, *args: Any):
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        return refs[0] if len(refs) == 1 else _first.remote(*refs)

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return _Method(self, method)

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a)


class _Method:
    def __init__(self, group: LearnerGroup, name: str) -> None:
        self.group, self.name = group, name

    def remote(self, *args: Any):
        if self.name == "node_id":
            return self.group.rank0.node_id.remote()
        return self.group._all(self.name, *args)


@ray.remote(num_cpus=0)
def _first(*results: Any) -> Any:
    # Waits for every rank (the calls are collective), returns rank 0's result.
    return results[0]
