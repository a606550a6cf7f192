"""Ray actor around :class:`agentrl.weights.store.StagedWeights`: where a (re)started engine finds
the newest object-store refit (by the actor's name, passed to the engines as ``weight_source``)."""

from __future__ import annotations

from typing import Any

import ray

from agentrl.weights.store import StagedWeights

__all__ = ["WeightStoreActor"]


@ray.remote
class WeightStoreActor:
    def __init__(self) -> None:
        self.staged = StagedWeights()

    def stage_weights(self, version: int, weights: list[Any]) -> None:
        """Where the newest weights are (``[ref]``), so an engine that (re)starts during or after a
        refit loads them before taking work."""
        self.staged.stage(version, weights)

    def latest_weights(self) -> tuple[int, list[Any]]:
        return self.staged.latest()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()
