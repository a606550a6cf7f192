"""The driver's side of weight syncs: refits of the engines and, colocated, their sleep and wake.

:class:`WeightSync` is a part of :class:`agentrl.driver.trainer.Trainer` (a mixin over the driver's state,
as :class:`agentrl.driver.supervision.Supervision` is): the learner's export for a refit by
``refit.transport`` (object store on CPU, CUDA IPC on the same GPU, NCCL broadcast across GPUs), the
load into every engine on the refit thread (a lost object is exported again), the admission that
opens at the new version once every engine serves it, and the colocated engines' sleep and wake
around the learner's step. The driver's loop stays in ``trainer.py``; this module never imports it.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import ray

from agentrl.driver.watchdog import RunStopped

__all__ = ["WeightSync"]


class WeightSync:
    """Refits and engine sleep/wake of the driver (see the module docstring); the attributes it
    reads are the Trainer's (``learner``, ``engines``, ``replay``, ``transport``, ``version``,
    ``watchdog`` ...), and it waits through Supervision's ``_get``/``_on_engines``."""

    def _init_weight_group(self) -> None:
        """The nccl transport's process group: the learner's rank 0 and one rank per engine worker
        (engines with tensor parallelism > 1 are not supported by this transport yet)."""
        from agentrl.actors.learner import _address

        world = 1 + len(self.engines)
        host, port = ray.get(_address.options(scheduling_strategy=self._learner_node()).remote())
        backend = "nccl" if self.cfg.engine.num_gpus > 0 else "gloo"
        refs = [self.learner.init_weight_group.remote(host, port, world)]
        refs += [e.init_weight_group.remote(host, port, 1 + i, world, backend) for i, e in enumerate(self.engines)]
        ray.get(refs)

    def _learner_node(self):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(node_id=ray.get(self.learner.node_id.remote()), soft=False)

    def refit(self) -> float:
        """Push the learner's weights to every engine and wait for them; returns seconds taken."""
        self._wait_refit()
        # On the refit thread, waited for under the watchdog: a frozen engine cannot hold it forever.
        self._refit_future = self._refit_pool.submit(self._refit_engines, self._export(), self.version)
        self._wait_refit()
        return self._last_refit_s

    def _export(self, *, overlapped: bool = False) -> Any:
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

    def _refit_engines(self, payload: Any, version: int) -> float:
        """Load the exported weights into every engine, then open admission at ``version``.

        object_store: the weights (an ObjectRef: stored once, read by each engine) are staged in
        the replay actor too, so an engine that restarts catches up from them. GPU transports send
        a small payload (a CUDA IPC handle, or the layout of the broadcast); the learner drops its
        flat buffer once every engine has loaded."""
        t0 = time.perf_counter()
        try:
            payload = self._load_engines(payload, version)
        except ray.exceptions.ObjectLostError as exc:
            # The weights' object was lost (evicted, its owner's node gone, freed): export them
            # again and load those. The learner may have stepped since, so the engines can get
            # weights one step newer than `version` (the tokens' logprobs are still the engine's
            # own, so the IS correction holds; only the staleness count is off by one).
            self.num_refit_retries += 1
            print(f"agentrl: the refit to version {version} lost its weights ({type(exc).__name__}); "
                  "exporting them again", file=sys.stderr, flush=True)
            payload = self.learner.export_for_refit.remote(self.transport)
            if self.transport == "nccl":
                self._broadcast_ref = self.learner.broadcast_weights.remote()
            payload = self._load_engines(payload, version)
        ray.get(self.replay.set_weights_version.remote(version))
        self.engines_version = version
        if self.transport != "object_store":
            # Not waited for: with the learner stepping beside the engines (split placement) the
            # release queues behind its step, which held admission at the old version and counted
            # a whole step as refit time (6.3 s of a 0.7 s refit at 1.5B). The learner runs it
            # beside a step already sent (a concurrency group of its own), so the buffer does not
            # live through that step; _export checks its result. It names this export's
            # generation: a late release never drops a newer buffer.
            self._release_ref = self.learner.release_refit.remote(getattr(payload, "generation", None))
        return time.perf_counter() - t0

    def _load_engines(self, payload: Any, version: int) -> Any:
        """Load ``payload`` (an ObjectRef of the learner's export) into every engine; returns it
        resolved (GPU transports: the RefitPayload, whose generation the release names)."""
        if self.transport == "object_store":
            ray.get(self.replay.stage_weights.remote(version, [payload]))
        else:
            payload = ray.get(payload)
        for ref in [e.update_weights.remote(payload, version, self.cfg.refit.mode) for e in self.engines]:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                # The engine died or is restarting; it loads the staged weights before its next request.
                self.engines_unavailable_at_refit += 1
        if self.transport == "nccl":
            ray.get(self._broadcast_ref)
        return payload

    def _start_refit(self) -> float:
        """Begin a refit to the current version in the background; returns seconds spent waiting
        for the previous one. The snapshot call is queued on the learner before its next step
        (actor calls from one caller run in order), so the learner's next step overlaps the
        engines' weight load instead of waiting for it; admission opens at the new version only
        once every engine serves it, so the staleness bound is unchanged."""
        waited = self._wait_refit()
        payload = self._export()
        self._refit_future = self._refit_pool.submit(self._refit_engines, payload, self.version)
        return waited

    def _wait_refit(self) -> float:
        """Block until the background refit (if any) is done; re-raises its error."""
        t0 = time.perf_counter()
        future, self._refit_future = self._refit_future, None
        if future is not None:
            if self.watchdog is None:
                self._last_refit_s = future.result()
            else:  # a frozen engine holds the refit: the watchdog kills it, the refit goes on without it
                self._last_refit_s = self.watchdog.result("refit", future, what=f"the refit to version {self.version}",
                                                          recover=self._recover, focus=self._engine_names())
        return time.perf_counter() - t0

    def _sleep_engines(self, level: int) -> float:
        """Colocated: engines drain and release their GPU memory before the learner steps."""
        t0 = time.perf_counter()
        self._on_engines("engine_sleep", "sleep", level)
        return time.perf_counter() - t0

    def _wake_engines(self) -> float:
        t0 = time.perf_counter()
        self._get("engine_wake", self.learner.free_memory.remote(), "the learner's free_memory", recover=False)
        self._on_engines("engine_wake", "wake_up")
        return time.perf_counter() - t0

    def _wake_failure(self, exc: Exception, mem: dict[str, float]) -> Exception:
        """A colocated engine that cannot wake for lack of GPU memory: say what holds it and what to change.
        The watchdog's own stops (RunStopped: its report, exit status 3) pass through as they are,
        whatever their report quotes; so does any other failure."""
        text = str(exc).lower()
        # vLLM's start-up check: an engine restarted (by Ray) while the learner holds its memory
        restarted = "less than desired gpu memory utilization" in text or "less than the engine's budget" in text
        if isinstance(exc, RunStopped) or not ("out of memory" in text or restarted):
            return exc
        share = self.cfg.engine.gpu_memory_utilization
        held = mem.get("reserved_gib")
        what = "a restarted engine could not start" if restarted else "a sleeping engine could not wake"
        return RuntimeError(
            f"{what}: out of GPU memory. It asks for engine.gpu_memory_utilization={share} "
            f"of the GPU while the learner still holds {'?' if held is None else f'{held:.1f}'} GiB (its weights, "
            "optimizer state and refit buffer stay resident while the engine sleeps). Lower "
            "engine.gpu_memory_utilization to what the KV cache needs, or shrink the learner "
            "(learner.megatron.activation_checkpointing=true, a smaller packing.max_tokens_per_microbatch)."
        )
