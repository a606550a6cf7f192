"""Per-episode budgets (rollout.max_episode_s, max_model_calls, max_episode_tokens): an episode
past one ends as truncated, keeps the turns it finished, and is counted in the metrics."""

from __future__ import annotations

import time

import anyio
import pytest
from transformers import AutoTokenizer

from agentrl.rollout.chat import ChatRenderer
from agentrl.config import RolloutConfig
from agentrl.engine.vllm_engine import GenerationResult
from agentrl.rollout.episode import run_episode, summarize
from tests.e2e_envs import ChaosEnv


class TalkingEngine:
    """Replies ``text`` (no digit: SayNumber goes on) every turn, after ``delay_s``."""

    def __init__(self, renderer: ChatRenderer, text: str = "hello there friend", delay_s: float = 0.0) -> None:
        self.renderer, self.text, self.delay_s, self.calls = renderer, text, delay_s, 0

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id):
        self.calls += 1
        await anyio.sleep(self.delay_s)
        ids = (self.renderer.encode(self.text) + [self.renderer.end_of_turn_id])[:max_tokens]
        return GenerationResult(ids, [-0.5] * len(ids), [0] * len(ids), "stop" if len(ids) < max_tokens else "length")


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))


def _run(renderer, engine, *, env=None, **rollout):
    cfg = RolloutConfig(max_new_tokens=32, max_turns=8, max_total_tokens=1024, **rollout)
    return anyio.run(lambda: run_episode(env or ChaosEnv(), renderer, engine, seed=1, cfg=cfg, episode_id="e"))


def _consistent(traj):
    assert len(traj.turn_rewards) == len(traj.turn_spans) and traj.num_turns == len(traj.turn_spans)
    assert sum(traj.loss_mask) == sum(e - s for s, e in traj.turn_spans)


def test_the_model_call_budget_truncates(renderer):
    engine = TalkingEngine(renderer)
    traj = _run(renderer, engine, max_model_calls=3)
    assert traj.status == "truncated" and traj.info["truncated_by"] == "model_calls"
    assert engine.calls == 3 and traj.num_turns == 3 and not traj.success
    _consistent(traj)


def test_the_sampled_token_budget_cuts_the_turn_that_crosses_it(renderer):
    engine = TalkingEngine(renderer)
    per_turn = len(renderer.encode(engine.text)) + 1
    budget = 2 * per_turn + 2
    traj = _run(renderer, engine, max_episode_tokens=budget)
    assert traj.status == "truncated" and traj.info["truncated_by"] == "sampled_tokens"
    assert sum(traj.loss_mask) == budget and traj.num_turns == 3 and traj.turn_rewards[-1] == 0.0
    _consistent(traj)


@pytest.mark.parametrize("where", ["tool", "engine"])
def test_the_wall_time_budget_truncates_mid_tool_or_mid_generation(renderer, where):
    engine = TalkingEngine(renderer, delay_s=0.0 if where == "tool" else 0.4)
    env = ChaosEnv(delay_s=0.6 if where == "tool" else 0.0)
    t0 = time.perf_counter()
    traj = _run(renderer, engine, env=env, max_episode_s=2.0)
    took = time.perf_counter() - t0
    assert traj.status == "truncated" and traj.info["truncated_by"] == "wall_time", traj.info
    assert took < 2.0 + 1.0 and traj.num_turns >= 1 and not traj.success
    _consistent(traj)


def test_a_wall_time_budget_spent_before_the_first_turn_fails_the_episode(renderer):
    traj = _run(renderer, TalkingEngine(renderer, delay_s=5.0), max_episode_s=0.5)
    assert traj.status == "failed" and "rollout.max_episode_s" in traj.info["error"]


@pytest.mark.parametrize("overlong", ["zero_reward", "mask", "keep"])
def test_over_budget_episodes_are_counted_and_trained_as_overlong_says(renderer, overlong):
    ok = _run(renderer, TalkingEngine(renderer, text="7"))
    cut = _run(renderer, TalkingEngine(renderer), max_model_calls=2, overlong=overlong)
    assert ok.status == "ok" and ok.success
    assert cut.info.get("loss_excluded", False) == (overlong == "mask")
    m = summarize([ok, cut])
    assert m["rollout/over_budget_frac"] == 0.5 and m["rollout/over_budget_model_calls"] == 1.0
    assert m["rollout/truncated_frac"] == 0.5 and "rollout/over_budget_wall_time" not in m
