"""The run's actors, in one object that the trainer, its supervisor and its loops share.

The trainer fills a :class:`RunActors` as it starts the actors; the supervisor replaces rollout
actors in it (in place: every holder sees the replacement). Ray handles are kept as ``Any`` here:
this module imports neither Ray nor the actor classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunActors"]


@dataclass
class RunActors:
    """The actors of one run, and the watchdog that watches them."""

    replay: Any = None  #: the replay queue (agentrl.actors.replay.ReplayActor)
    learner: Any = None  #: the learner (agentrl.actors.learner.LearnerGroup, or one actor)
    engines: list[Any] = field(default_factory=list)  #: the policy's engines, refit at each refit
    rollouts: list[Any] = field(default_factory=list)  #: rollout actors (replaced in place when lost)
    teachers: list[Any] = field(default_factory=list)  #: distillation's teacher engines, never refit
    weight_store: Any = None  #: the staged weights (agentrl.actors.weights.WeightStoreActor)
    watchdog: Any = None  #: agentrl.actors.watchdog.Watchdog, once every actor is up
    runs: list[Any] = field(default_factory=list)  #: each rollout actor's run() call, while the loop runs
    rollout_generation: list[int] = field(default_factory=list)  #: replacements of each rollout actor so far

    def named(self) -> dict[str, Any]:
        """Every actor of the run by name (what the watchdog pings)."""
        named = {"replay": self.replay}
        named.update({f"learner{i}": a for i, a in enumerate(self.learner.actors)})
        named.update({f"engine{i}": e for i, e in enumerate(self.engines)})
        named.update({f"rollout{i}": r for i, r in enumerate(self.rollouts)})
        named.update({f"teacher{i}": t for i, t in enumerate(self.teachers)})
        return named

    def engine_names(self) -> tuple[str, ...]:
        return tuple(f"engine{i}" for i in range(len(self.engines)))

    def learner_names(self) -> tuple[str, ...]:
        return tuple(f"learner{i}" for i in range(len(self.learner.actors)))
