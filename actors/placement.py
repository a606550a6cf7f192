"""Where colocated actors go: one Ray placement-group bundle per GPU, holding learner rank i and the
engines that share its GPU.

Ray's fractional GPU booking alone (``num_gpus=0.5`` on each actor) fills GPUs in whatever order
the scheduler finds them: on a machine of several GPUs an engine could land beside another rank's
learner, or two engines on one GPU and none on the next. A bundle of exactly one GPU per learner
rank, with the rank and its engines scheduled into that bundle, pins them to the same device.

This module knows nothing of what the actors do; :class:`agentrl.driver.trainer.Trainer` and
:class:`agentrl.actors.learner.LearnerGroup` schedule into the bundles it reserves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

from agentrl.config import Config

__all__ = ["ColocatedPlan", "colocated_plan", "learner_world_size"]


def learner_world_size(cfg: Config) -> int:
    """Learner ranks: one per GPU for a backend registered ``distributed`` (Megatron), else a
    single actor (the torch learner)."""
    from agentrl.learner.base import learner_traits

    return max(1, cfg.learner.num_gpus) if learner_traits(cfg).get("distributed") else 1


def _add(total: dict[str, float], extra: dict[str, float], times: int = 1) -> None:
    for key, value in extra.items():
        total[key] = total.get(key, 0.0) + value * times


@dataclass(frozen=True)
class ColocatedPlan:
    """One bundle per GPU: bundle ``i`` holds learner rank ``i`` and the engines that map to it."""

    bundles: list[dict[str, float]]
    """Ray resources of each bundle: one GPU plus the CPUs and custom resources of its actors."""
    engine_bundle: list[int]
    """The bundle (hence GPU) of engine ``i``: engines are dealt round-robin over the GPUs."""

    @property
    def num_gpus(self) -> int:
        return len(self.bundles)

    def reserve(self, *, timeout_s: float | None = None) -> Any:
        """Create the placement group and wait until Ray has placed every bundle."""
        pg = ray.util.placement_group(self.bundles, strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            ray.util.remove_placement_group(pg)
            raise RuntimeError(f"colocate: Ray could not place {self.num_gpus} bundle(s) of {self.bundles[0]} "
                               f"within {timeout_s:.0f}s: the cluster lacks the GPUs or CPUs they ask for")
        return pg

    def learner_options(self, cfg: Config, pg: Any, rank: int) -> dict[str, Any]:
        """Ray actor options of learner rank ``rank``: its share of bundle ``rank``'s GPU."""
        return dict(num_cpus=cfg.learner.num_cpus, num_gpus=cfg.colocate.learner_gpu_fraction,
                    resources=cfg.learner.resources, scheduling_strategy=self.on(pg, rank))

    def engine_options(self, cfg: Config, pg: Any, engine: int) -> dict[str, Any]:
        """Ray actor options of engine ``engine``: ``engine.num_gpus`` of its bundle's GPU."""
        return dict(num_cpus=cfg.engine.num_cpus, num_gpus=cfg.engine.num_gpus, resources=cfg.engine.resources,
                    scheduling_strategy=self.on(pg, self.engine_bundle[engine]))

    @staticmethod
    def on(pg: Any, bundle: int) -> Any:
        """The scheduling strategy that puts an actor or task into ``bundle`` of ``pg``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)


def colocated_plan(cfg: Config) -> ColocatedPlan:
    """The bundles for ``cfg`` (``colocate.enabled``): learner rank ``i`` in bundle ``i`` with
    ``colocate.learner_gpu_fraction`` of its GPU, engine ``j`` in bundle ``j % world`` with
    ``engine.num_gpus`` of it.

    Example:
        >>> from agentrl.config import load_config
        >>> cfg = load_config(None, ["learner.backend=megatron", "learner.num_gpus=2", "engine.num_engines=2",
        ...                          "engine.num_gpus=0.5", "colocate.enabled=true"])
        >>> colocated_plan(cfg).engine_bundle
        [0, 1]
    """
    world = learner_world_size(cfg)
    engine_bundle = [j % world for j in range(cfg.engine.num_engines)]
    bundles = []
    for i in range(world):
        engines = engine_bundle.count(i)
        bundle = {"GPU": 1.0, "CPU": cfg.learner.num_cpus + cfg.engine.num_cpus * engines}
        _add(bundle, cfg.learner.resources)
        _add(bundle, cfg.engine.resources, engines)
        bundles.append(bundle)
    return ColocatedPlan(bundles, engine_bundle)

