"""What a run leaves in Ray's GCS and the temp dir: the trainer starts Ray with a bound on
the tasks' events its GCS keeps (with Ray's default of 100,000, gcs_server grew to ~330 MiB in an
hour's soak run); the engines' compile cache is shared across their restarts and goes at shutdown."""

import time

import pytest

from agentrl.config import ConfigError, load_config


def test_started_ray_keeps_at_most_max_task_events():
    import ray
    from ray._private.state import state

    from agentrl.driver.trainer import ray_init_kwargs

    ray.init(**ray_init_kwargs(num_cpus=1, max_task_events=50))
    try:
        @ray.remote(num_cpus=0)
        def f(i):
            return i

        assert ray.get([f.remote(i) for i in range(300)]) == list(range(300))
        end = time.monotonic() + 30
        while True:  # workers report task events every second
            tasks = {e.task_id for e in state._get_all_task_events()}
            if len(tasks) >= 40 or time.monotonic() > end:
                break
            time.sleep(0.5)
        assert 40 <= len(tasks) <= 50, f"the GCS keeps the events of {len(tasks)} tasks, not at most 50"
    finally:
        ray.shutdown()


def test_trainer_starts_ray_with_the_config_bound(tiny_model_dir, tmp_path, monkeypatch):
    import agentrl.driver.trainer as trainer_mod

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(**kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(trainer_mod.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(trainer_mod.ray, "init", fake_init)
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}", "sft.enabled=false",
                             "cluster.max_task_events=1234", "cluster.worker_niceness=0"])
    with pytest.raises(Stop):
        trainer_mod.Trainer(cfg, progress=False).start()
    assert seen["_system_config"] == {"task_events_max_num_task_in_gcs": 1234, "worker_niceness": 0}
    # a cluster that is joined keeps its own system config (Ray refuses one from a joining driver)
    joined = trainer_mod.ray_init_kwargs("ray://head:10001", None, None, 1234)
    assert "_system_config" not in joined and joined["address"] == "ray://head:10001"


@pytest.mark.parametrize("niceness", [None, 0])
def test_worker_niceness_sets_the_actors_priority(niceness):
    """Ray starts its workers at nice 15 over the driver's unless cluster.worker_niceness says
    otherwise; 0 puts the actors at the driver's priority."""
    import os

    import ray

    from agentrl.driver.trainer import ray_init_kwargs

    ray.init(**ray_init_kwargs(num_cpus=1, worker_niceness=niceness))
    try:
        @ray.remote(num_cpus=0)
        class Probe:
            def nice(self):
                return os.nice(0)

        worker, driver = ray.get(Probe.remote().nice.remote()), os.nice(0)
        if niceness == 0:
            assert worker == driver
        else:  # Ray's default: 15 over the driver's, at most 19
            assert worker == min(driver + 15, 19), (worker, driver)
    finally:
        ray.shutdown()


def test_max_task_events_must_be_positive():
    with pytest.raises(ConfigError, match="max_task_events"):
        load_config(None, ["cluster.max_task_events=0"])


def test_shutdown_removes_the_engines_compile_cache(tiny_model_dir, tmp_path):
    from agentrl.driver.trainer import Trainer

    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}", "sft.enabled=false"])
    trainer = Trainer(cfg, progress=False)
    cache = tmp_path / "agentrl-compile-x"
    (cache / "precompiled_headers").mkdir(parents=True)
    (cache / "precompiled_headers" / "h.gch").write_bytes(b"x" * 100)
    trainer.compile_cache_dir = str(cache)  # what start() makes
    trainer.shutdown()
    assert not cache.exists()
