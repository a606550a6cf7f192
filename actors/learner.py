"""Ray learner actors: one per GPU (a torch.distributed group among them), or one on CPU.

:class:`LearnerGroup` fans each call out to every rank (Megatron's calls are collective) and
returns rank 0's answer, so the driver sees a single learner.
"""

from __future__ import annotations

from typing import Any

import ray

from agentrl.config import Config

__all__ = ["LearnerActor", "LearnerGroup"]


@ray.remote
class LearnerActor:
    def __init__(self, cfg: Config, model_path: str, **kwargs: Any) -> None:
        import torch

        from agentrl.learners.base import build_learner

        torch.set_num_threads(max(1, int(cfg.learner.num_cpus)))
        self.learner = build_learner(cfg, model_path=model_path, **kwargs)

    def train_step(self, groups) -> dict[str, float]:
        return self.learner.train_step(groups)

    def logprobs(self, trajectories) -> list[list[float]]:
        return self.learner.logprobs(trajectories)

    def export_weights(self) -> dict:
        return self.learner.export_weights()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

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

    def __init__(self, cfg: Config, model_path: str) -> None:
        lc = cfg.learner
        world = max(1, lc.num_gpus) if lc.backend == "megatron" else 1
        opts = dict(num_cpus=lc.num_cpus, num_gpus=1 if lc.num_gpus else 0, resources=lc.resources)
        if world == 1 and lc.backend == "torch":
            self.actors = [LearnerActor.options(**opts).remote(cfg, model_path)]
        else:
            # Rank 0's node hosts the rendezvous; Ray gives each actor one GPU (local rank 0).
            pg = ray.util.placement_group([{"CPU": lc.num_cpus, "GPU": 1 if lc.num_gpus else 0}] * world, strategy="PACK")
            ray.get(pg.ready())
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            def on(i: int):
                return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

            addr, port = ray.get(_address.options(scheduling_strategy=on(0)).remote())
            self.actors = [
                LearnerActor.options(**opts, scheduling_strategy=on(i)).remote(
                    cfg, model_path, rank=i, world_size=world, local_rank=0, master_addr=addr, master_port=port)
                for i in range(world)
            ]
        self.rank0 = self.actors[0]

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
