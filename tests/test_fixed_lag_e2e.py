"""replay.lag with the real pipeline (vLLM engine on CPU, torch learner): the quickstart's config
without its SFT stage (and its tiny model without the induction pre-stage), run twice at lag 1,
once as it is and once with a slow env and two rollout actors, trains on the same batches and
ends with bit-identical weights. The env is SayNumber (tests/e2e_envs.py), not the calculator: a
random model never answers a calculation right, so every reward would tie and no step would move
the weights; SayNumber's rewards vary, so each version differs and the lag shows in the data."""

from pathlib import Path

import pytest

from agentrl.config import load_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.full  # replay.lag through the real replay actor and refits: test_trainer_loop's fixed-lag test
def test_lag_one_trains_on_the_same_batches_with_a_slow_env_and_two_rollout_actors(tmp_path):
    import ray
    from safetensors.torch import load_file

    from agentrl.driver.trainer import Trainer
    from tests.test_pipeline_e2e import read_rows, start_ray

    steps = 3

    def run(name, *extra):
        cfg = load_config(REPO / "configs" / "quickstart.yaml", [
            # the tiny model without its induction pre-stage (minutes on a busy CPU; not what is tested)
            f"run_dir={tmp_path / name}", f"model.path={tmp_path / 'model'}", "model.tiny.induction_steps=0",
            "sft.enabled=false", "replay.lag=1", "replay.max_staleness=1",
            "replay.groups_per_step=4", f"train.num_steps={steps}", "eval.num_episodes=0",
            "train.checkpoint_interval=0", *extra])
        trainer = Trainer(cfg, progress=False)
        try:
            trainer.run()
        finally:
            trainer.shutdown()
        rows = [r for r in read_rows(cfg.run_dir) if "train/loss" in r]
        model = Path(cfg.run_dir) / "checkpoints" / f"step_{steps:06d}" / "learner" / "model" / "model.safetensors"
        return rows, load_file(str(model))

    start_ray()  # one Ray instance for both runs (tests.e2e_envs is imported through PYTHONPATH)
    try:
        quick_rows, quick_w = run("quick", "env.id=tests.e2e_envs:SayNumber-v0")
        # every env step sleeps 0.15-0.45 s (the same env otherwise), and two actors share the slots
        slow_rows, slow_w = run("slow", "env.id=tests.e2e_envs:Chaos-v0", "env.kwargs={delay_s: 0.3}",
                                "rollout.num_actors=2", "rollout.max_concurrent_groups=3")
    finally:
        ray.shutdown()
    assert [r["step"] for r in quick_rows] == [r["step"] for r in slow_rows] == list(range(1, steps + 1))
    for a, b in zip(quick_rows, slow_rows):
        assert a["replay/token_version_min"] == a["replay/token_version_max"] == max(a["step"] - 2, 0)
        assert a["train/num_sequences_trained"] > 0  # the weights moved: each version is a new policy
        for key in ("replay/batch_sha", "rollout/reward", "rollout/tokens", "train/loss", "train/grad_norm"):
            if key in a:
                assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert quick_w.keys() == slow_w.keys() and all(quick_w[k].equal(slow_w[k]) for k in quick_w), "the weights differ"
