"""End to end on CPU: real Ray actors, a real vLLM engine, the torch learner, refits."""

import json
from pathlib import Path

import pytest

from agentrl.config import ConfigError, load_config

pytestmark = pytest.mark.slow

REPO = str(Path(__file__).resolve().parents[1])
TEST_ENV = "tests.e2e_envs:SayNumber-v0"  # reward varies under a random policy: GRPO has signal


def start_ray():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": REPO}})


def e2e_config(model_dir, run_dir, *extra):
    return load_config(None, [
        f"model.path={model_dir}", f"run_dir={run_dir}", f"env.id={TEST_ENV}",
        "rollout.num_actors=2", "rollout.group_size=4", "rollout.max_concurrent_groups=2",
        "rollout.max_new_tokens=24", "rollout.max_turns=2", "rollout.max_total_tokens=512",
        "engine.max_model_len=1024", "engine.num_cpus=1", "learner.num_cpus=1", "learner.lr=0.003",
        "replay.groups_per_step=2", "replay.max_staleness=1", "replay.capacity=8",
        "packing.max_tokens_per_microbatch=1024", "train.num_steps=3", "refit.interval=1",
        "eval.num_episodes=0", "cluster.num_cpus=2", *extra,
    ])


def test_missing_model_path_fails_before_any_actor(tmp_path):
    from agentrl.trainer import Trainer

    cfg = load_config(None, [f"model.path={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="model.path"):
        Trainer(cfg)


def test_train_three_steps_with_refit(tiny_model_dir, tmp_path):
    import ray

    from agentrl.trainer import Trainer
    from agentrl.trajectory import Trajectory

    cfg = e2e_config(tiny_model_dir, tmp_path / "run")
    start_ray()
    trainer = Trainer(cfg, progress=False)
    try:
        trainer.start()
        fixed = list(range(5, 45))
        engine = trainer.engines[0]
        before = ray.get(engine.score.remote(fixed))
        trainer.run()
        assert trainer.version == 3
        assert ray.get(engine.version.remote()) == 3
        after = ray.get(engine.score.remote(fixed))
        traj = Trajectory(token_ids=fixed, loss_mask=[0] * 40, behavior_logprobs=[0.0] * 40, policy_versions=[-1] * 40)
        learner = ray.get(trainer.learner.logprobs.remote([traj]))[0]
    finally:
        trainer.shutdown()
        ray.shutdown()

    changed = sum(abs(a - b) for a, b in zip(before[1:], after[1:])) / 39
    agree = sum(abs(a - b) for a, b in zip(learner[1:], after[1:])) / 39
    assert changed > 1e-3, "the refit did not change the engine's logprobs"
    assert agree < 1e-3, f"engine and learner logprobs differ after refit (mean abs {agree:.2e})"

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["replay/staleness_max"] <= cfg.replay.max_staleness
        # every consumed sampled token carries the engine version that produced it
        assert 0 <= r["replay/token_version_min"] <= r["replay/token_version_max"] <= r["step"] - 1
        assert r["replay/staleness_max"] == r["step"] - 1 - r["replay/token_version_min"]
    assert steps[-1]["replay/token_version_max"] >= 1, "no token was sampled with refit weights"
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file()
