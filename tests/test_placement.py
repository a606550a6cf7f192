"""Colocated placement on several GPUs: learner rank i and the engines dealt to GPU i land on the
same device. Ray is started with logical GPUs (no CUDA needed): what is checked is which GPU id
Ray hands each actor, the same bookkeeping that sets CUDA_VISIBLE_DEVICES on a GPU machine."""

import pytest
import ray

from agentrl.actors.placement import colocated_plan
from agentrl.config import ConfigError, load_config


@ray.remote
class Probe:
    def gpu(self) -> list:
        return [str(g) for g in ray.get_gpu_ids()]


def _cfg(gpus: int, engines: int, engine_share: float, *extra: str):
    return load_config(None, ["learner.backend=megatron", f"learner.num_gpus={gpus}", "learner.num_cpus=0.5",
                              f"engine.num_engines={engines}", f"engine.num_gpus={engine_share}",
                              "engine.num_cpus=0.5", "colocate.enabled=true", "colocate.learner_gpu_fraction=0.5",
                              *extra])


@pytest.fixture
def four_gpu_ray():
    ray.init(address="local", num_cpus=8, num_gpus=4, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("gpus,engines,share", [(4, 4, 0.5), (2, 4, 0.25), (4, 2, 0.5)])
def test_each_engine_shares_the_gpu_of_its_learner_rank(four_gpu_ray, gpus, engines, share) -> None:
    cfg = _cfg(gpus, engines, share)
    plan = colocated_plan(cfg)
    pg = plan.reserve(timeout_s=60)
    learners = [Probe.options(**plan.learner_options(cfg, pg, r)).remote() for r in range(gpus)]
    engine_actors = [Probe.options(**plan.engine_options(cfg, pg, j)).remote() for j in range(engines)]
    learner_gpu = ray.get([a.gpu.remote() for a in learners])
    engine_gpu = ray.get([a.gpu.remote() for a in engine_actors])
    assert all(len(g) == 1 for g in learner_gpu + engine_gpu)
    assert len({g[0] for g in learner_gpu}) == gpus  # one GPU per rank
    for j, g in enumerate(engine_gpu):
        assert g == learner_gpu[j % gpus], (j, g, learner_gpu)
    per_gpu = [sum(1 for g in engine_gpu if g == lg) for lg in learner_gpu]
    assert max(per_gpu) - min(per_gpu) <= 1  # dealt evenly


def test_plan_that_does_not_fit_a_gpu_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="2 engine.*must fit on one GPU"):
        _cfg(2, 4, 0.5)  # two engines of 0.5 beside a learner's 0.5 on each GPU


def test_missing_gpus_are_a_clear_error_not_a_hang(four_gpu_ray) -> None:
    plan = colocated_plan(_cfg(8, 8, 0.5))  # 8 one-GPU bundles on a 4-GPU cluster
    with pytest.raises(RuntimeError, match="could not place 8 bundle"):
        plan.reserve(timeout_s=3)
