"""Long context end to end on CPU: one episode of more than 12k tokens and several turns through
a real vLLM engine actor, with a refit between its turns, then the replay actor, packing and the
torch learner; and the 16k GPU recipe's config building its actors with CPU sizes."""

from __future__ import annotations

import tempfile
from pathlib import Path

import anyio
import pytest

from agentrl.config import load_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def model_16k(tmp_path_factory):
    from agentrl.model.tiny import bootstrap_tiny

    return str(bootstrap_tiny(tmp_path_factory.mktemp("tiny16k") / "model", max_position_embeddings=16384,
                              rope_theta=1e6, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                              intermediate_size=128))


class _RefitAfter:
    """An engine client that refits the engine to the learner's next weights after ``turns``
    generations: the rest of the episode runs on version 1."""

    def __init__(self, ray, engine, learner, step_groups, turns: int) -> None:
        self.ray, self.engine, self.learner, self.step_groups, self.turns = ray, engine, learner, step_groups, turns
        self.calls = 0
        self.metrics: dict = {}

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id):
        if self.calls == self.turns:
            self.metrics = await self.learner.train_step.remote(self.step_groups)
            await self.engine.update_weights.remote(self.learner.export_weights.remote(), 1, "continue")
        self.calls += 1
        return await self.engine.generate.remote(prompt_ids, max_tokens, temperature, top_p)


def _short_group(renderer):
    """Two short trajectories with different rewards: a learner step on them moves the weights."""
    from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

    trajs = []
    for reward, text in ((1.0, "seven 7"), (0.0, "nothing here")):
        prompt = renderer.encode("say a number") + [renderer.end_of_turn_id]
        out = renderer.encode(text) + [renderer.end_of_turn_id]
        ids = prompt + out
        trajs.append(Trajectory(ids, [0] * len(prompt) + [1] * len(out), [0.0] * len(ids),
                                [-1] * len(prompt) + [0] * len(out), [(len(prompt), len(ids))], [reward]))
    return TrajectoryGroup("short", trajs)


def test_long_episode_with_a_refit_inside_trains_as_sampled(model_16k, ray_local, tmp_path):
    import gymnasium
    from transformers import AutoTokenizer

    import tests.e2e_envs  # noqa: F401  (registers LongObservation-v0)
    from agentrl.actors.engine import EngineActor
    from agentrl.actors.learner import LearnerGroup
    from agentrl.actors.replay import ReplayActor
    from agentrl.rollout.chat import ChatRenderer
    from agentrl.rollout.episode import run_episode
    from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

    ray = ray_local
    cfg = load_config(None, [
        f"model.path={model_16k}", f"run_dir={tmp_path}", "env.id=LongObservation-v0",
        "rollout.temperature=1.0", "rollout.max_new_tokens=24", "rollout.max_turns=6",
        "rollout.max_total_tokens=16384", "engine.max_model_len=16384", "engine.kv_cache_gib=1.0",
        "packing.max_tokens_per_microbatch=16384", "learner.lr=0.01", "learner.num_cpus=1",
        "replay.max_staleness=1", "replay.groups_per_step=1", "replay.capacity=2",
    ])
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_16k))
    replay = ReplayActor.remote(cfg.replay.capacity, cfg.replay.max_staleness, cfg.replay.groups_per_step)
    engine = EngineActor.options(num_cpus=1).remote(model_16k, cfg.engine, dtype="float32", seed=0)
    learner = LearnerGroup(cfg, model_16k)
    ray.get(engine.start.remote())
    v0_dir = str(tmp_path / "learner_v0")
    ray.get(learner.save.remote(v0_dir))

    # One episode: 4 turns, 3 observations of ~4.3k tokens (~13k in all); the refit lands after turn 2.
    client = _RefitAfter(ray, engine, learner, [_short_group(renderer)], turns=2)
    env = gymnasium.make("LongObservation-v0", num_turns=4, words=2400)
    ticket = ray.get(replay.admit.remote())
    traj = anyio.run(lambda: run_episode(env, renderer, client, seed=1, cfg=cfg.rollout, episode_id="long",
                                         max_model_len=cfg.engine.max_model_len))
    assert traj.status == "ok" and traj.num_turns == 4 and len(traj) > 12_000, (traj.status, traj.info, len(traj))
    turn_versions = [sorted({traj.policy_versions[p] for p in range(s, e)}) for s, e in traj.turn_spans]
    assert turn_versions == [[0], [0], [1], [1]]
    assert client.metrics["train/optimizer_stepped"] == 1.0

    # A partner with another reward, so GRPO has signal: the first turn only, as its own episode.
    cut = traj.turn_spans[0][1]
    partner = Trajectory(traj.token_ids[:cut], traj.loss_mask[:cut], traj.behavior_logprobs[:cut],
                         traj.policy_versions[:cut], traj.turn_spans[:1], [1.0 - traj.reward])
    ray.get(replay.put.remote(TrajectoryGroup("long#1", [traj, partner]), ticket))
    ray.get(replay.set_weights_version.remote(1))
    [group] = ray.get(replay.take.remote(1, 1))
    got = group.trajectories[0]
    assert got.token_ids == traj.token_ids and got.loss_mask == traj.loss_mask
    assert got.policy_versions == traj.policy_versions and got.behavior_logprobs == traj.behavior_logprobs

    # Engine logprobs equal the learner's at the version that sampled each token.
    [lp_v1] = ray.get(learner.logprobs.remote([got]))
    ray.get(learner.load.remote(v0_dir))
    [lp_v0] = ray.get(learner.logprobs.remote([got]))
    diffs, moved = {0: [], 1: []}, []
    for pos, (m, v) in enumerate(zip(got.loss_mask, got.policy_versions)):
        if m:
            learner_lp = (lp_v0 if v == 0 else lp_v1)[pos]
            diffs[v].append(abs(learner_lp - got.behavior_logprobs[pos]))
            moved.append(abs(lp_v1[pos] - lp_v0[pos]))
    print(f"long episode: {len(traj)} tokens, {traj.num_turns} turns; mean |engine - learner| logprob: "
          + ", ".join(f"v{v} {sum(d) / max(len(d), 1):.2e} over {len(d)} tokens" for v, d in diffs.items())
          + f"; refit moved logprobs by up to {max(moved):.3f}")
    for v, d in diffs.items():
        assert d and sum(d) / len(d) < 1e-3, f"version {v}: mean |engine - learner| = {sum(d) / len(d):.2e}"
    assert max(moved) > 1e-3  # the refit changed the weights, so the per-version check means something

    # The long trajectory and its partner train in one packed micro-batch of <= 16384 tokens.
    metrics = ray.get(learner.train_step.remote([group]))
    assert metrics["train/num_microbatches"] == 1.0 and metrics["train/num_sequences_trained"] == 2.0
    assert metrics["train/num_tokens"] == len(traj) + cut <= cfg.packing.max_tokens_per_microbatch
    assert metrics["train/optimizer_stepped"] == 1.0 and metrics["train/loss"] == metrics["train/loss"]
    for actor in [engine, replay, *learner.actors]:
        ray.kill(actor)


@pytest.mark.full  # long context: the long episode test; the recipe parses in test_config
def test_long_context_16k_config_builds_its_actors_on_cpu(model_16k, ray_local, tmp_path):
    """The GPU recipe, with the GPU sizes swapped for CPU ones by overrides: parses, validates
    (its Megatron section included) and builds engine, learner, replay and rollout actors. The
    Megatron learner itself needs CUDA, so the learner here is the torch one."""
    from agentrl.driver.trainer import Trainer

    path = REPO / "configs" / "long_context_16k.yaml"
    as_written = load_config(path)
    assert as_written.learner.backend == "megatron" and as_written.learner.megatron.context_parallel_size == 2
    cfg = load_config(path, [
        f"model.path={model_16k}", "model.dtype=float32", f"run_dir={tmp_path}",
        "learner.backend=torch", "learner.num_gpus=0", "learner.num_cpus=1",
        "engine.num_gpus=0", "engine.num_cpus=1", "engine.kv_cache_gib=1.0", "engine.enforce_eager=true",
        "rollout.num_actors=1", "cluster.num_cpus=2",
    ])
    assert cfg.engine.max_model_len == cfg.rollout.max_total_tokens == 16384
    trainer = Trainer(cfg, progress=False)
    try:
        trainer.start()
        ray = ray_local
        assert ray.get([e.version.remote() for e in trainer.engines]) == [0]
        assert ray.get(trainer.learner.version.remote()) == 0
        assert len(ray.get([r.node_id.remote() for r in trainer.rollouts])) == 1
        assert ray.get(trainer.replay.metrics.remote())["replay/weights_version"] == 0.0
    finally:
        trainer.shutdown()
