"""train.deterministic: the same seed trains on the same batches whatever the machine's speed.

What async timing decides, and what this mode fixes (bench/history/quickstart.md): which tasks form a
batch (on-policy, one rollout actor: exactly the tasks admitted under that version, listed in task
order), which weights made the tokens (max_staleness 0: the version the batch trains from), and
which tokens a request samples (rollout.sampling_seed: the request's own seed, not the engine's
generator shared with its batch-mates). The runs with a real engine are in tests/test_pipeline_e2e.py.
"""

import warnings
from dataclasses import dataclass, field

import anyio
import gymnasium as gym
import pytest

import agentrl.envs  # noqa: F401
from agentrl.config import RolloutConfig, load_config
from agentrl.replay.queue import ReplayQueue
from agentrl.rollout.episode import request_seed, run_episode
from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup


def test_deterministic_is_on_policy_with_one_actor_and_seeded_requests():
    with pytest.warns(UserWarning, match=r"replay.max_staleness 1 -> 0, rollout.num_actors 2 -> 1"):
        cfg = load_config(None, ["train.deterministic=true", "seed=5", "replay.max_staleness=1", "rollout.num_actors=2"])
    assert (cfg.replay.max_staleness, cfg.rollout.num_actors, cfg.rollout.sampling_seed) == (0, 1, 5)
    with warnings.catch_warnings():  # the quickstart is deterministic by default and says so itself
        warnings.simplefilter("error")
        cfg = load_config("configs/quickstart.yaml", ["seed=5"])
    assert cfg.train.deterministic and (cfg.replay.max_staleness, cfg.rollout.num_actors, cfg.rollout.sampling_seed) == (0, 1, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(None, ["train.deterministic=true", "replay.max_staleness=0", "rollout.num_actors=1",
                                 "rollout.sampling_seed=9"])
    assert cfg.rollout.sampling_seed == 9  # an explicit seed stays
    assert load_config(None, []).rollout.sampling_seed is None  # off by default


def test_request_seeds_differ_by_run_episode_and_turn():
    seeds = {request_seed(s, f"g{g}-e{e}", t) for s in (0, 1) for g in (3, 30) for e in (0, 1) for t in (0, 1)}
    assert len(seeds) == 16 and all(0 <= x < 2**63 for x in seeds)


@dataclass
class _Out:
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"


class _RecordingEngine:
    def __init__(self):
        self.calls = []

    async def generate(self, prompt_ids, **kwargs):
        self.calls.append(kwargs)
        return _Out([7, 2], [-0.1, -0.1], [0, 0])


@pytest.mark.parametrize("sampling_seed", [None, 11])
def test_the_episode_passes_each_request_its_seed(sampling_seed, tiny_model_dir):
    from transformers import AutoTokenizer

    from agentrl.rollout.chat import ChatRenderer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    engine = _RecordingEngine()
    cfg = RolloutConfig(max_turns=2, sampling_seed=sampling_seed)
    env = gym.make("agentrl/Calculator-v0")
    anyio.run(lambda: run_episode(env, renderer, engine, seed=4, cfg=cfg, episode_id="g4-e1"))
    if sampling_seed is None:
        assert all("seed" not in c for c in engine.calls)  # clients without a seed argument keep working
    else:
        assert [c["seed"] for c in engine.calls] == [request_seed(11, "g4-e1", t) for t in range(len(engine.calls))]


def test_task_order_lists_a_batch_by_task_not_by_arrival():
    def group(gid):
        t = Trajectory(token_ids=[1, 2], loss_mask=[0, 1], behavior_logprobs=[0.0, -1.0], policy_versions=[-1, 0])
        return TrajectoryGroup(task_id=str(gid), trajectories=[t], group_id=gid)

    for ordered, expect in ((True, [1, 2, 3]), (False, [3, 1, 2])):
        q = ReplayQueue(4, 0, 3, task_order=ordered)
        tickets = [q.admit() for _ in range(3)]
        for gid, ticket in zip([3, 1, 2], tickets):  # they finish in another order than their tasks
            q.put(group(gid), ticket)
        assert [g.group_id for g in q.take(3, 0)] == expect


def _seeded_crowd(engine, server) -> tuple[list[int], list[list[int]]]:
    """One seeded request alone, then the same request among 40 others whose prompts (200 tokens
    each) overflow one engine step's token budget; returns the lone tokens and the crowd's."""
    import asyncio

    prompts = [[10 + (7 * k + i) % 200 for i in range(200)] for k in range(41)]

    def one(k):
        return engine.generate(prompts[k], max_tokens=12, temperature=1.0, ignore_eos=True, seed=1000 + k)

    async def scenario():
        alone = (await one(0)).token_ids
        crowd = await asyncio.gather(*(one(k) for k in range(41)))
        return alone, [r.token_ids for r in crowd]

    return server.run(scenario(), timeout=600)


@pytest.mark.slow
def test_seeded_requests_survive_a_crowd_on_a_cpu_engine(tiny_engine):
    """Seeded sampling on a CPU engine whose step cannot hold every prompt: with chunked prefill
    vLLM 0.32 rewinds the seeded requests' generators and a CPU generator has no offset, which
    killed the engine in the quickstart's held-out evaluation under train.deterministic (128
    episodes, 32 at once). The CPU engine prefills whole prompts; the request samples the same
    tokens alone and in the crowd."""
    alone, crowd = _seeded_crowd(*tiny_engine)
    assert len(crowd) == 41 and all(len(t) == 12 for t in crowd)
    assert crowd[0] == alone
