"""Ray actor around :class:`agentrl.replay.queue.ReplayQueue`: "not now" answers become waiting."""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from agentrl.actors.watchdog import DIAG_GROUPS, AsyncDiag
from agentrl.replay.fixed_lag import FixedLagQueue
from agentrl.replay.queue import ReplayQueue
from agentrl.rollout.trajectory import TrajectoryGroup

__all__ = ["ReplayActor"]


@ray.remote(concurrency_groups=DIAG_GROUPS)
class ReplayActor(AsyncDiag):
    def __init__(self, capacity: int, max_staleness: int, groups_per_step: int, *,
                 wait_for_stragglers: bool = True, task_order: bool = False, dynamic_sampling: bool = False,
                 dynamic_sampling_max_dropped: int = 512, lag: int | None = None, seed_offset: int = 0) -> None:
        """``lag``: a fixed-lag queue (:class:`agentrl.replay.fixed_lag.FixedLagQueue`, whose tickets are
        slots with their task seeds from ``seed_offset``) instead of the staleness-bounded one."""
        self.queue: ReplayQueue | FixedLagQueue = FixedLagQueue(
            capacity, lag, groups_per_step, seed_offset=seed_offset) if lag is not None else ReplayQueue(capacity, max_staleness, groups_per_step, wait_for_stragglers=wait_for_stragglers,
                                 task_order=task_order, dynamic_sampling=dynamic_sampling,
                                 dynamic_sampling_max_dropped=dynamic_sampling_max_dropped)
        self._cond: asyncio.Condition | None = None
        self._owned: dict[str, list[int]] = {}  # tickets in flight by the rollout actor that holds them
        self._gone: set[str] = set()  # owners abandoned: an admission they still wait for is refused

    def diag_status(self) -> dict[str, Any]:
        return {"queued": len(self.queue), "in_flight": self.queue.in_flight,
                "weights_version": self.queue.weights_version}

    def _own(self, owner: str | None, ticket: int, add: bool) -> None:
        if owner is None:
            return
        held = self._owned.setdefault(owner, [])
        if add:
            held.append(ticket)
        elif ticket in held:
            held.remove(ticket)

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:  # created inside the actor's event loop
            self._cond = asyncio.Condition()
        return self._cond

    async def admit(self, owner: str | None = None) -> int:
        """Wait for admission (staleness bound and capacity), then reserve a slot; returns the
        ticket that the matching put or release hands back. ``owner``: the rollout actor asking,
        whose slots :meth:`abandon` gives back if it dies."""
        async with self.cond:
            await self.cond.wait_for(lambda: owner in self._gone or self.queue.can_admit())
            if owner in self._gone:  # its actor died while it waited: no slot for a dead caller
                raise RuntimeError(f"{owner} was abandoned (its rollout actor died)")
            ticket = self.queue.admit()
            self._own(owner, ticket, True)
            return ticket

    async def put(self, group: TrajectoryGroup, ticket: int, owner: str | None = None) -> bool:
        """Queue a finished group (False: dynamic sampling dropped it and its slot is free again).
        A put without a matching admission raises and leaves the queue as it was."""
        async with self.cond:
            if owner in self._gone:  # sent before its actor died, after its slot was given back
                return False
            queued = self.queue.put(group, ticket)
            self._own(owner, ticket, False)
            self.cond.notify_all()  # a dropped group frees its slot: a waiting admission goes on
            return queued

    async def release(self, ticket: int, owner: str | None = None) -> None:
        async with self.cond:
            if owner in self._gone:
                return
            self.queue.release(ticket)
            self._own(owner, ticket, False)
            self.cond.notify_all()

    async def abandon(self, owner: str) -> int:
        """Give back every slot ``owner`` (a rollout actor that died) still held; returns how many
        groups were lost with it (``replay/abandoned``)."""
        async with self.cond:
            self._gone.add(owner)
            tickets = self._owned.pop(owner, [])
            for ticket in tickets:
                self.queue.abandon(ticket)
            self.cond.notify_all()
            return len(tickets)

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

    async def set_weights_version(self, version: int) -> None:
        """The engines now serve ``version``: admission control moves on."""
        async with self.cond:
            self.queue.set_weights_version(version)
            self.cond.notify_all()

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
