"""Ray actor around :class:`agentrl.replay.ReplayQueue`: "not now" answers become waiting."""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from agentrl.replay import ReplayQueue
from agentrl.trajectory import TrajectoryGroup

__all__ = ["ReplayActor"]


@ray.remote
class ReplayActor:
    def __init__(self, capacity: int, max_staleness: int, groups_per_step: int, *,
                 wait_for_stragglers: bool = True, task_order: bool = False, dynamic_sampling: bool = False,
                 dynamic_sampling_max_dropped: int = 512) -> None:
        self.queue = ReplayQueue(capacity, max_staleness, groups_per_step, wait_for_stragglers=wait_for_stragglers,
                                 task_order=task_order, dynamic_sampling=dynamic_sampling,
                                 dynamic_sampling_max_dropped=dynamic_sampling_max_dropped)
        self._cond: asyncio.Condition | None = None
        self._staged: tuple[int, list[Any]] = (0, [])  # (version, [ObjectRef]) wrapped: not resolved

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:  # created inside the actor's event loop
            self._cond = asyncio.Condition()
        return self._cond

    async def admit(self) -> int:
        """Wait for admission (staleness bound and capacity), then reserve a slot; returns the
        ticket that the matching put or release hands back."""
        async with self.cond:
            await self.cond.wait_for(self.queue.can_admit)
            return self.queue.admit()

    async def put(self, group: TrajectoryGroup, ticket: int) -> bool:
        """Queue a finished group (False: dynamic sampling dropped it and its slot is free again)."""
        async with self.cond:
            queued = self.queue.put(group, ticket)
            self.cond.notify_all()  # a dropped group frees its slot: a waiting admission goes on
            return queued

    async def release(self, ticket: int) -> None:
        async with self.cond:
            self.queue.release(ticket)
            self.cond.notify_all()

    async def take(self, num_groups: int, learner_version: int) -> list[TrajectoryGroup]:
        async with self.cond:
            batch: list[TrajectoryGroup] | None = None

            def ready() -> bool:
                nonlocal batch
                batch = self.queue.take(num_groups, learner_version)
                return batch is not None

            await self.cond.wait_for(ready)
            self.cond.notify_all()
            return batch  # type: ignore[return-value]

    def stage_weights(self, version: int, weights: list[Any]) -> None:
        """Where the newest weights are (``[ref]``), so an engine that (re)starts during or after a
        refit loads them before taking work."""
        self._staged = (version, list(weights))

    async def set_weights_version(self, version: int) -> None:
        """The engines now serve ``version``: admission control moves on."""
        async with self.cond:
            self.queue.set_weights_version(version)
            self.cond.notify_all()

    def latest_weights(self) -> tuple[int, list[Any]]:
        return self._staged

    def metrics(self) -> dict[str, float]:
        return self.queue.metrics()

    def length_histograms(self) -> dict[str, dict[int, int]]:
        return {
            "generated": dict(self.queue.stats.generated_lengths),
            "consumed": dict(self.queue.stats.consumed_lengths),
        }

    def state_dict(self) -> dict[str, Any]:
        return self.queue.state_dict()

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        async with self.cond:
            self.queue.load_state_dict(state)
            self.cond.notify_all()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()
