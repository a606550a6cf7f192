"""The driver's side of weight syncs: refits of the engines and, colocated, their sleep and wake.

:class:`WeightService` is the one owner of the weights the engines serve: the version every engine
serves (``engines_version``), the staged weights a restarted engine loads (in the weight store
actor, :mod:`agentrl.actors.weights`), the learner's export for a refit by ``refit.transport``
(object store on CPU, CUDA IPC on the same GPU, NCCL broadcast across GPUs), the load into every
engine on the refit thread (a lost object is exported again), the admission that opens at the new
version once every engine serves it, and the colocated engines' sleep and wake around the
learner's step. Its waits go through a :class:`Waits` (the driver's supervisor: deadlines under the
watchdog); it imports nothing of the driver.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import ray

__all__ = ["Waits", "WeightService"]


class Waits(Protocol):
    """How the weights service waits: under the driver's watchdog (agentrl.driver.supervision.Supervisor)."""

    def get(self, kind: str, refs: Any, what: str, *, recover: bool = True, focus: tuple[str, ...] = ()) -> Any:
        """``ray.get`` of ``refs`` under a deadline of ``kind``."""

    def result(self, kind: str, future: Future, what: str) -> Any:
        """A future's result (the refit thread's) under a deadline; frozen engines are restarted."""

    def on_engines(self, kind: str, method: str, *args: Any) -> int:
        """Call ``method`` on every engine, asking a restarted one again; returns how many were."""


class WeightService:
    """Refits, staged weights and engine sleep/wake of one run (see the module docstring).

    Args:
        cfg: the run config (``refit.mode``; ``engine.num_gpus`` for the nccl group's backend).
        learner, engines, replay, store: the run's actors (the learner group, the policy's engines,
            the replay queue whose admission follows ``engines_version``, the weight store).
        transport: ``refit.transport`` as resolved for the placement (agentrl.weights.transports).
        waits: how to wait for actors (the supervisor).
    """

    def __init__(self, cfg: Any, *, learner: Any, engines: list[Any], replay: Any, store: Any, transport: str,
                 waits: Waits) -> None:
        self.cfg, self.learner, self.engines, self.replay, self.store = cfg, learner, engines, replay, store
        self.transport, self.waits = transport, waits
        self.engines_version = 0  # the weights version every engine serves (the last refit's)
        self.last_refit_s = 0.0  # how long the last refit took
        self.refit_retries = 0  # refits whose weights were lost and exported again
        self.engines_unavailable = 0  # engines that died or were restarting when asked to load or sleep
        self.engine_catch_ups = 0  # restarted engines given the current weights (catch_up)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentrl-refit")
        self._future: Future[float] | None = None  # the refit on the refit thread
        self._future_version = 0
        self._release_ref: Any = None  # the learner's release of its last refit buffer (GPU transports)
        self._checked_release: Any = None  # overlapped steps: the release before that one
        self._broadcast_ref: Any = None  # nccl: the learner's broadcast of the export being loaded

    def init_group(self) -> None:
        """The nccl transport's process group: the learner's rank 0 and one rank per engine worker
        (engines with tensor parallelism > 1 are not supported by this transport yet)."""
        world = 1 + len(self.engines)
        host, port = self.learner.weight_group_address()
        backend = "nccl" if self.cfg.engine.num_gpus > 0 else "gloo"
        refs = [self.learner.init_weight_group.remote(host, port, world)]
        refs += [e.init_weight_group.remote(host, port, 1 + i, world, backend) for i, e in enumerate(self.engines)]
        ray.get(refs)

    def refit(self, version: int) -> float:
        """Push the learner's weights (``version``) to every engine and wait for them; returns
        seconds taken."""
        self.wait()
        # On the refit thread, waited for under the watchdog: a frozen engine cannot hold it forever.
        self.submit(self.export(), version)
        self.wait()
        return self.last_refit_s

    def export(self, *, overlapped: bool = False) -> Any:
        """Queue the learner's weight export for a refit (before its next step: actor calls from
        one caller run in order); for nccl the broadcast is queued right behind it, so the
        engines never wait for a training step to receive.

        The last refit's buffer release is queued before this export, so two buffers never
        coexist. Its result is checked here (re-raising its error); ``overlapped`` (the step in
        flight sits between the two): the release before it is checked instead, done by now."""
        if overlapped:
            if self._checked_release is not None:
                ray.get(self._checked_release)
            self._checked_release, self._release_ref = self._release_ref, None
        elif self._release_ref is not None:
            ray.get(self._release_ref)  # done by now (queued before this export); re-raises its error
            self._release_ref = None
        payload = self.learner.export_for_refit.remote(self.transport)
        if self.transport == "nccl":
            self._broadcast_ref = self.learner.broadcast_weights.remote()
        return payload

    def submit(self, payload: Any, version: int) -> None:
        """Load ``payload`` (an export) as ``version`` into the engines on the refit thread; the
        refit before must be waited for (:meth:`wait`)."""
        self._future_version = version
        self._future = self._pool.submit(self.refit_engines, payload, version)

    def start_refit(self, version: int) -> float:
        """Begin a refit to ``version`` in the background; returns seconds spent waiting for the
        previous one. The snapshot call is queued on the learner before its next step (actor calls
        from one caller run in order), so the learner's next step overlaps the engines' weight load
        instead of waiting for it; admission opens at the new version only once every engine
        serves it, so the staleness bound is unchanged."""
        waited = self.wait()
        self.submit(self.export(), version)
        return waited

    def refit_in_flight(self) -> bool:
        return self._future is not None and not self._future.done()

    def wait(self) -> float:
        """Block until the background refit (if any) is done; re-raises its error. Returns the
        seconds waited."""
        t0 = time.perf_counter()
        future, self._future = self._future, None
        if future is not None:
            # a frozen engine holds the refit: the watchdog kills it, the refit goes on without it
            self.last_refit_s = self.waits.result("refit", future, f"the refit to version {self._future_version}")
        return time.perf_counter() - t0

    def refit_engines(self, payload: Any, version: int) -> float:
        """Load the exported weights into every engine, then open admission at ``version``.

        object_store: the weights (an ObjectRef: stored once, read by each engine) are staged in
        the weight store too, so an engine that restarts catches up from them. GPU transports send
        a small payload (a CUDA IPC handle, or the layout of the broadcast); the learner drops its
        flat buffer once every engine has loaded."""
        t0 = time.perf_counter()
        try:
            payload = self.load_engines(payload, version)
        except ray.exceptions.ObjectLostError as exc:
            # The weights' object was lost (evicted, its owner's node gone, freed): export them
            # again and load those. The learner may have stepped since, so the engines can get
            # weights one step newer than `version` (the tokens' logprobs are still the engine's
            # own, so the IS correction holds; only the staleness count is off by one).
            self.refit_retries += 1
            print(f"agentrl: the refit to version {version} lost its weights ({type(exc).__name__}); "
                  "exporting them again", file=sys.stderr, flush=True)
            payload = self.learner.export_for_refit.remote(self.transport)
            if self.transport == "nccl":
                self._broadcast_ref = self.learner.broadcast_weights.remote()
            payload = self.load_engines(payload, version)
        ray.get(self.replay.set_weights_version.remote(version))
        self.engines_version = version
        if self.transport != "object_store":
            # Not waited for: with the learner stepping beside the engines (split placement) the
            # release queues behind its step, which held admission at the old version and counted
            # a whole step as refit time (6.3 s of a 0.7 s refit at 1.5B). The learner runs it
            # beside a step already sent (a concurrency group of its own), so the buffer does not
            # live through that step; export checks its result. It names this export's
            # generation: a late release never drops a newer buffer.
            self._release_ref = self.learner.release_refit.remote(getattr(payload, "generation", None))
        return time.perf_counter() - t0

    def load_engines(self, payload: Any, version: int) -> Any:
        """Load ``payload`` (an ObjectRef of the learner's export) into every engine; returns it
        resolved (GPU transports: the RefitPayload, whose generation the release names)."""
        if self.transport == "object_store":
            ray.get(self.store.stage_weights.remote(version, [payload]))
        else:
            payload = ray.get(payload)
        for ref in [e.update_weights.remote(payload, version, self.cfg.refit.mode) for e in self.engines]:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                # The engine died or is restarting; it loads the staged weights before its next request.
                self.engines_unavailable += 1
        if self.transport == "nccl":
            ray.get(self._broadcast_ref)
        return payload

    def catch_up(self, i: int, version: int) -> None:
        """Load the learner's current weights (``version``) into engine ``i`` alone (one that Ray
        restarted with older ones); the learner is idle (no step is queued while the driver waits
        for a batch). Not for nccl: a restarted engine is outside the weight group."""
        payload = self.export()
        if self.transport == "object_store":
            ray.get(self.store.stage_weights.remote(version, [payload]))
        else:
            payload = ray.get(payload)
        try:
            self.waits.get("refit", self.engines[i].update_weights.remote(payload, version, self.cfg.refit.mode),
                           f"engine{i}.update_weights (catching up a restarted engine)", focus=(f"engine{i}",))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            self.engines_unavailable += 1  # died again: it is asked again once it answers
        finally:
            if self.transport != "object_store":
                self._release_ref = self.learner.release_refit.remote(getattr(payload, "generation", None))
        self.engine_catch_ups += 1

    def sleep_engines(self, level: int) -> float:
        """Colocated: engines drain and release their GPU memory before the learner steps."""
        t0 = time.perf_counter()
        self.engines_unavailable += self.waits.on_engines("engine_sleep", "sleep", level)
        return time.perf_counter() - t0

    def wake_engines(self) -> float:
        t0 = time.perf_counter()
        self.waits.get("engine_wake", self.learner.free_memory.remote(), "the learner's free_memory", recover=False)
        self.engines_unavailable += self.waits.on_engines("engine_wake", "wake_up")
        return time.perf_counter() - t0

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
