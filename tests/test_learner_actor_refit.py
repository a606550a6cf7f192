"""The learner actor's refit buffer: its release runs beside a training step the driver has already
sent (a concurrency group of its own), so the buffer (the model's size) does not live through that
step, and a release that comes late never drops the buffer of a newer export (the generation)."""

from __future__ import annotations

import time

import ray

from agentrl.config import Config


def test_a_refit_release_runs_beside_a_step_and_never_drops_a_newer_buffer(tiny_model_dir, ray_local_2cpu):
    from agentrl.actors.learner import LearnerActor

    class _Busy(LearnerActor.__ray_actor_class__):  # the real actor, plus a call that holds its main thread
        def hold(self, seconds: float) -> bool:
            time.sleep(seconds)
            return True

    busy = ray.remote(concurrency_groups={"diag": 1, "refit": 1})(_Busy)
    # expandable_segments: a GPU learner's option, no effect on the CPU (the refit path is the same)
    cfg = Config.model_validate({"model": {"path": tiny_model_dir}, "learner": {"lr": 1e-3, "expandable_segments": True}})
    actor = busy.remote(cfg, tiny_model_dir)
    try:
        first = ray.get(actor.export_for_refit.remote("nccl"), timeout=120)  # the flat buffer, kept by the actor
        assert first.generation == 1 and first.handle is None
        assert ray.get(actor.memory_report.remote())["refit_buffer"] > 0
        held = actor.hold.remote(3.0)  # stands for the next training step, already sent
        time.sleep(0.3)
        t0 = time.perf_counter()
        assert ray.get(actor.release_refit.remote(first.generation), timeout=60) is True
        assert time.perf_counter() - t0 < 2.0  # it did not queue behind the step
        assert ray.wait([held], timeout=0)[1] == [held]  # the step is still running
        assert "refit_buffer" not in ray.get(actor.memory_report.remote())
        assert ray.get(held)

        second = ray.get(actor.export_for_refit.remote("nccl"))
        assert second.generation == 2
        assert ray.get(actor.release_refit.remote(first.generation)) is False  # late: the newer buffer stays
        assert ray.get(actor.memory_report.remote())["refit_buffer"] > 0
        assert ray.get(actor.release_refit.remote(second.generation)) is True
        assert "refit_buffer" not in ray.get(actor.memory_report.remote())
    finally:
        ray.kill(actor)
