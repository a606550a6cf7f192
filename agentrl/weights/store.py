"""The staged weights: the newest object-store refit, kept where a (re)starting engine finds it.

:class:`StagedWeights` is plain state (no Ray); the actor that holds it on the driver's node, and
that engines reach by name, is :class:`agentrl.actors.weights.WeightStoreActor`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StagedWeights"]


class StagedWeights:
    """The newest weights version staged for engines that (re)start, and where its weights are.

    The weights are a list of object refs, kept wrapped (never resolved here): the store holds a
    reference, so the object lives as long as it is the staged one. An empty list stages a version
    without weights (a GPU transport's refit: nothing an engine could replay).

    >>> s = StagedWeights()
    >>> s.latest()
    (0, [])
    >>> s.stage(3, ["ref"])
    >>> s.latest()
    (3, ['ref'])
    >>> s.stage(3, [])  # the same version, its weights dropped: a restarted engine keeps its start weights
    >>> s.latest()
    (3, [])
    """

    def __init__(self) -> None:
        self._version, self._refs = 0, []

    def stage(self, version: int, refs: list[Any]) -> None:
        self._version, self._refs = version, list(refs)

    def latest(self) -> tuple[int, list[Any]]:
        return self._version, list(self._refs)
