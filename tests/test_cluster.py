"""Beyond one machine: a simulated Ray cluster (head + 3 nodes). Engines, rollouts and the learner land on
different nodes (custom resources); removing the node that holds the engine mid-run does not stop
training: Ray restarts the engine on the spare node, which loads the current weights first."""

import threading
import time
import traceback

import pytest

from agentrl.config import load_config

from .test_pipeline_e2e import REPO, e2e_overrides, read_rows

pytestmark = pytest.mark.slow


STEPS = 30  # enough that the node goes while training still has work left (a step takes ~0.5 s)


@pytest.mark.full  # engine death: the chaos run's frozen engine
def test_three_nodes_survive_losing_the_engine_node(tiny_model_dir, tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    from agentrl.driver.trainer import Trainer

    import psutil

    def engine_cores() -> set[int]:
        return {p.pid for p in psutil.process_iter(["name"]) if "EngineCore" in (p.info["name"] or "")}

    cores_before = engine_cores()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "resources": {"rollout_slot": 2}})
    cluster.add_node(num_cpus=1, resources={"engine_slot": 1})
    cluster.add_node(num_cpus=1, resources={"learner_slot": 1})
    cluster.add_node(num_cpus=1, resources={"engine_slot": 1})  # spare, for the restart
    run_dir = tmp_path / "run"
    cfg = load_config(None, e2e_overrides(
        tiny_model_dir, run_dir, f"train.num_steps={STEPS}", f"cluster.address={cluster.address}",
        "engine.resources={engine_slot: 1}", "learner.resources={learner_slot: 1}",
        "rollout.resources={rollout_slot: 1}"))
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": REPO}}, log_to_driver=False)
    trainer = Trainer(cfg, progress=False)
    errors = []

    def train():
        try:
            trainer.run()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    try:
        trainer.start()
        nodes = {
            "engine": ray.get(trainer.engines[0].node_id.remote()),
            "learner": ray.get(trainer.learner.node_id.remote()),
            "rollout": ray.get(trainer.rollouts[0].node_id.remote()),
        }
        assert len(set(nodes.values())) == 3, nodes
        # the replay queue stays beside the driver, off the node that is about to go
        assert ray.get(trainer.replay.node_id.remote()) == ray.get_runtime_context().get_node_id()
        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        deadline = time.time() + 300
        while not (run_dir / "metrics.jsonl").is_file() or not any(r.get("step", 0) >= 1 for r in read_rows(run_dir)):
            assert time.time() < deadline and thread.is_alive(), errors
            time.sleep(0.1)
        engine_node = next(n for n in cluster.worker_nodes if n.node_id == nodes["engine"])
        cluster.remove_node(engine_node, allow_graceful=False)
        step_at_removal = max(r.get("step", 0) for r in read_rows(run_dir))
        assert step_at_removal < STEPS, "training finished before the node was removed"
        thread.join(timeout=480)
        assert not thread.is_alive() and not errors, (
            "".join(traceback.format_exception(errors[0])) if errors else "training still running")
        new_node = ray.get(trainer.engines[0].node_id.remote())
        assert new_node != nodes["engine"], "the engine was not restarted on another node"
        assert ray.get(trainer.engines[0].version.remote()) == trainer.version == STEPS
    finally:
        trainer.shutdown()
        ray.shutdown()
        cluster.shutdown()
        # Simulated nodes share this host: removing one kills its Ray workers but not the vLLM
        # engine-core process an engine actor had started, which would go on using CPU and memory
        # for the rest of the test session.
        for pid in engine_cores() - cores_before:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
    assert [r["step"] for r in read_rows(run_dir) if "train/loss" in r] == list(range(1, STEPS + 1))
