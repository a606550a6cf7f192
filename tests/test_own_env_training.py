"""The README's `UnitsEnv`, from a module outside the package, trains: with `agentrl train` on one
machine, and on a simulated multi-node cluster whose nodes cannot import the module by
themselves (it reaches them through Ray's runtime_env, `py_modules`)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from agentrl.config import load_config

from .test_pipeline_e2e import REPO, e2e_overrides, read_rows

pytestmark = pytest.mark.slow

TRAIN = ["sft.enabled=false", "train.num_steps=2", "rollout.max_turns=3"]


@pytest.mark.full  # `agentrl train` as a subprocess: test_resume_continues_a_run_from_its_last_checkpoint
def test_agentrl_train_on_the_readme_env(tiny_model_dir, tmp_path):
    """The command of docs/guides/training-your-env.md, run as a user would: the console script,
    from the project directory, with no PYTHONPATH."""
    run_dir = tmp_path / "run"
    # (the session's tiny model has no induction pre-stage; the quickstart config asks for one)
    overrides = e2e_overrides(tiny_model_dir, run_dir, "env.id=examples.units_env:my/Units-v0", *TRAIN,
                              "eval.num_episodes=2", "model.tiny.induction_steps=0")
    cmd = [str(Path(sys.executable).parent / "agentrl"), "train", "configs/quickstart.yaml", *overrides, "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    assert any("eval_after/success" in r for r in rows)
    assert "held-out evaluation" in proc.stdout


@pytest.mark.full  # a multi-node train run; the runtime_env's py_modules have unit tests
def test_cluster_nodes_get_the_env_module_through_the_runtime_env(tiny_model_dir, tmp_path, monkeypatch):
    import ray
    from ray.cluster_utils import Cluster

    from agentrl.driver.trainer import Trainer

    project = tmp_path / "project"
    project.mkdir()
    module = "user_units_env_for_cluster"
    source = (Path(REPO) / "examples" / "units_env.py").read_text().replace("my/Units-v0", "user/Units-v0")
    (project / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(project))  # the driver finds it; nothing tells the nodes

    def engine_cores() -> set[int]:
        return {p.pid for p in psutil.process_iter(["name"]) if "EngineCore" in (p.info["name"] or "")}

    cores_before = engine_cores()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    cluster.add_node(num_cpus=1, resources={"engine_slot": 1})
    cluster.add_node(num_cpus=1, resources={"learner_slot": 1, "rollout_slot": 3})  # 2 rollout actors + a probe
    run_dir = tmp_path / "run"
    cfg = load_config(None, e2e_overrides(
        tiny_model_dir, run_dir, f"env.id={module}:user/Units-v0", *TRAIN, f"cluster.address={cluster.address}",
        "engine.resources={engine_slot: 1}", "learner.resources={learner_slot: 1}",
        "rollout.resources={rollout_slot: 1}"))

    @ray.remote(num_cpus=0, resources={"rollout_slot": 1})
    def importable(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    trainer = None
    try:
        # Without the runtime_env, the rollout node cannot import the module: the run below would fail.
        ray.init(address=cluster.address, log_to_driver=False)
        assert not ray.get(importable.remote(module), timeout=120)
        ray.shutdown()

        trainer = Trainer(cfg, progress=False)
        assert trainer.runtime_env == {"py_modules": [str((project / f"{module}.py").resolve())]}
        trainer.start()  # agentrl joins the cluster itself, with the runtime_env
        rollout_node = ray.get(trainer.rollouts[0].node_id.remote())
        assert rollout_node != ray.get_runtime_context().get_node_id()
        assert ray.get(importable.remote(module), timeout=120)
        summary = trainer.run()
        assert summary["final/train/version"] == 2
    finally:
        if trainer is not None:
            trainer.shutdown()
        ray.shutdown()
        cluster.shutdown()
        for pid in engine_cores() - cores_before:  # see tests/test_cluster.py
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
    assert [r["step"] for r in read_rows(run_dir) if "train/loss" in r] == [1, 2]
