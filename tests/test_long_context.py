"""Long episodes without an engine: LongRecall's task and demonstrator, the token limit (rollout
.max_total_tokens and engine.max_model_len) ending episodes as truncated under each
``rollout.overlong`` rule, tool outputs capped per call, and staleness over several refits."""

from __future__ import annotations

import re

import anyio
import gymnasium
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import agentrl.envs  # noqa: F401
from agentrl.learner.advantages import trajectory_token_advantages
from agentrl.rollout.chat import ChatRenderer, format_tool_call
from agentrl.config import AdvantageConfig, RolloutConfig, load_config
from agentrl.engine.vllm_engine import GenerationResult
from agentrl.envs.long_recall import LongRecallEnv, expert
from agentrl.learner.common import build_samples
from agentrl.replay.queue import ReplayQueue
from agentrl.rollout.episode import cap_tool_outputs, run_episode
from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup



def next_call(env: LongRecallEnv, k: int | None = None) -> str:
    """The call that reads page k (default: the next one) with its cursor."""
    k = env.next_index if k is None else k
    return format_tool_call("next_page", {"cursor": env.cursors[min(k, len(env.cursors) - 1)]})


# ------------------------------------------------------------------------------ LongRecall


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), num_pages=st.integers(1, 8))
def test_the_asked_value_is_written_once_on_its_page(seed, num_pages):
    env = LongRecallEnv(num_pages=num_pages, page_words=[5, 60])
    env.reset(seed=seed)
    name, value = env.facts[env.asked]
    document = "\n".join(env.pages)
    assert document.count(f"{name} = {value}") == 1 and f"{name} = {value}" in env.pages[env.asked]
    assert len(re.findall(rf"\b{value}\b", document)) == 1 + sum(f"Page {value} " in p for p in env.pages)
    assert env.pages[-1].endswith(f"Question: what is the value of {name}?")


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_expert_reads_every_page_and_its_habit_is_right_only_on_the_last_page(seed):
    kwargs = {"num_pages": 4, "page_words": 30}
    for recency, expect_right in ((0.0, True), (1.0, None)):
        env = LongRecallEnv(**kwargs)
        env.reset(seed=seed)
        actions = expert(seed, recency_prob=recency, env_kwargs=kwargs)
        assert actions[:-1] == [next_call(env, k) for k in range(4)]
        for action in actions[:-1]:
            obs, reward, terminated, truncated, _ = env.step(action)
            assert obs[0]["role"] == "tool" and not terminated and reward == 0.0
        _, reward, terminated, _, info = env.step(actions[-1])
        assert terminated and reward == float(info["success"])
        assert info["success"] == (expect_right if expect_right is not None else env.asked == 3)


def test_an_answer_before_the_last_page_scores_zero_and_paging_past_the_end_is_an_error():
    env = LongRecallEnv(num_pages=2, page_words=10)
    env.reset(seed=3)
    name, value = env.facts[env.asked]
    env.step(next_call(env))
    _, reward, terminated, _, _ = env.step(f"{name} = {value}")
    assert terminated and reward == 0.0
    env.reset(seed=3)
    env.step(next_call(env)), env.step(next_call(env))
    obs, _, terminated, _, info = env.step(next_call(env))
    assert not terminated and "no more pages" in obs[0]["content"] and "error" in info


def test_a_wrong_cursor_is_an_error_and_does_not_turn_the_page():
    env = LongRecallEnv(num_pages=3, page_words=10)
    env.reset(seed=5)
    obs, _, _, _, info = env.step(format_tool_call("next_page", {"cursor": env.cursors[1]}))
    assert "not the next page's cursor" in obs[0]["content"] and env.next_index == 0
    obs, _, _, _, info = env.step(next_call(env))
    assert obs[0]["content"].startswith("Page 1 of 3.") and obs[0]["content"].endswith(
        f"Next page cursor: {env.cursors[1]}") and "error" not in info


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="num_pages"):
        gymnasium.make("agentrl/LongRecall-v0", num_pages=0)
    with pytest.raises(ValueError, match="page_words"):
        LongRecallEnv(page_words=[50, 10])


# ------------------------------------------------------------------------------ token limits


class ScriptedEngine:
    """Answers each turn with the next scripted text (cut to max_tokens, like an engine), and
    checks what a vLLM engine would refuse: prompt + max_tokens beyond its max_model_len."""

    def __init__(self, renderer: ChatRenderer, texts: list[str], max_model_len: int, version: int = 0) -> None:
        self.renderer, self.texts, self.max_model_len, self.version = renderer, list(texts), max_model_len, version
        self.calls: list[tuple[int, int]] = []

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id):
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt {len(prompt_ids)} + max_tokens {max_tokens} > max_model_len {self.max_model_len}")
        self.calls.append((len(prompt_ids), max_tokens))
        ids = (self.renderer.encode(self.texts.pop(0)) + [self.renderer.end_of_turn_id])[:max_tokens]
        n = len(ids)
        return GenerationResult(ids, [-0.5] * n, [self.version] * n, "stop" if n < max_tokens else "length")


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))


def _episode(renderer, *, page_words, max_total_tokens, max_model_len, overlong="zero_reward", seed=7, texts=None,
             **rollout):
    env = gymnasium.make("agentrl/LongRecall-v0", num_pages=3, page_words=page_words)
    texts = texts or expert(seed, env_kwargs={"num_pages": 3, "page_words": page_words})
    engine = ScriptedEngine(renderer, texts, max_model_len)
    cfg = RolloutConfig(max_new_tokens=64, max_turns=6, max_total_tokens=max_total_tokens, overlong=overlong, **rollout)
    traj = anyio.run(lambda: run_episode(env, renderer, engine, seed=seed, cfg=cfg, episode_id="e",
                                         max_model_len=max_model_len))
    return traj, env.unwrapped, engine


def test_a_complete_episode_is_ok(renderer):
    traj, env, _ = _episode(renderer, page_words=40, max_total_tokens=4096, max_model_len=4096)
    assert traj.status == "ok" and traj.success and traj.reward == 1.0 and traj.num_turns == 4
    assert "truncated_by" not in traj.info and traj.trainable


@pytest.mark.parametrize("limit_by", ["max_total_tokens", "max_model_len"])
@pytest.mark.parametrize("cut_in", ["observation", "generation"])
def test_the_token_limit_truncates_never_errors(renderer, limit_by, cut_in):
    full, _, _ = _episode(renderer, page_words=40, max_total_tokens=4096, max_model_len=4096)
    # "observation": the limit falls inside the last page; "generation": just inside the answer.
    limit = full.turn_spans[-1][0] - 20 if cut_in == "observation" else full.turn_spans[-1][0] + 3
    kw = {"max_total_tokens": limit, "max_model_len": 4096} if limit_by == "max_total_tokens" else {
        "max_total_tokens": 4096, "max_model_len": limit}
    traj, env, engine = _episode(renderer, page_words=40, **kw)
    assert traj.status == "truncated" and traj.info["truncated_by"] == "tokens" and not traj.success
    assert len(traj) <= limit and all(p + m <= limit for p, m in engine.calls)
    assert traj.token_ids == full.token_ids[:len(traj)]  # the same tokens, only fewer
    if cut_in == "generation":  # the cut answer was kept (to train on) but never scored by the env
        assert env.num_turns == 3 and len(traj) == limit and traj.turn_rewards == [0.0] * 4
    else:
        assert env.num_turns == 3 and traj.num_turns == 3


@pytest.mark.parametrize("overlong", ["zero_reward", "mask", "keep"])
def test_overlong_rule(renderer, overlong):
    # The limit falls inside the answer: the env never sees it. A right final answer that fits
    # gets reward 1; for the keep rule, a reward the env gave before the cut stays.
    full, _, _ = _episode(renderer, page_words=40, max_total_tokens=4096, max_model_len=4096)
    limit = full.turn_spans[-1][0] - 20
    traj, _, _ = _episode(renderer, page_words=40, max_total_tokens=limit, max_model_len=4096, overlong=overlong)
    traj.turn_rewards[0] = 0.5 if overlong == "keep" else traj.turn_rewards[0]  # as if the env had paid
    ok = Trajectory(**{**full.__dict__, "turn_rewards": [0.0, 0.0, 0.0, 1.0]})
    group = TrajectoryGroup("t", [traj, ok])
    adv = trajectory_token_advantages(group, AdvantageConfig())
    samples = build_samples([group], AdvantageConfig())
    if overlong == "mask":
        assert traj.info["loss_excluded"] and not traj.trainable and group.trainable() == [ok]
        assert all(a == 0.0 for a in adv[0]) and len(samples) == 1
    else:
        assert traj.trainable and len(samples) == 2
        assert min(a for a, m in zip(adv[0], traj.loss_mask) if m) < 0  # it lost to the finished one
    if overlong == "zero_reward":
        assert traj.reward == 0.0


def test_tool_outputs_are_capped_with_a_marker(renderer):
    long = [{"role": "tool", "content": " ".join(["word"] * 500)}, {"role": "user", "content": "x " * 300}]
    capped = cap_tool_outputs(long, renderer, 64)
    assert capped[1] == long[1]
    text = capped[0]["content"]
    assert "[tool output cut:" in text and "rollout.max_observation_tokens" in text
    assert len(renderer.encode(text.split("\n[tool output cut")[0])) <= 64
    assert cap_tool_outputs(long, renderer, None) is long
    traj, _, _ = _episode(renderer, page_words=400, max_total_tokens=16384, max_model_len=16384,
                          max_observation_tokens=100)
    assert traj.status == "ok" and len(traj) < 1000  # three pages of ~500 tokens, each cut to 100


def test_long_context_cpu_config_is_long():
    cfg = load_config("configs/long_context_cpu.yaml")
    assert cfg.engine.max_model_len == cfg.rollout.max_total_tokens == cfg.packing.max_tokens_per_microbatch == 16384
    assert cfg.model.tiny.max_position_embeddings >= 16384 and cfg.learner.backend == "torch"
    assert cfg.env.id == "agentrl/LongNeedle-v0" and cfg.env.kwargs["num_pages"] >= 4 and cfg.sft.enabled


def test_config_errors_name_the_key():
    with pytest.raises(Exception, match="overlong"):
        load_config(None, ["rollout.overlong=drop"])
    with pytest.raises(Exception, match="max_position_embeddings"):
        load_config(None, ["model.tiny.max_position_embedings=16384"])


# ------------------------------------------------------------------------------ staleness


def _spanning(versions: list[int]) -> TrajectoryGroup:
    """A group whose one episode has a turn per version (it spans those refits)."""
    ids, mask, vers = [], [], []
    for v in versions:
        ids += [1, 2, 3, 4]
        mask += [0, 0, 1, 1]
        vers += [-1, -1, v, v]
    return TrajectoryGroup("t", [Trajectory(ids, mask, [0.0] * len(ids), vers)])


@settings(max_examples=50, deadline=None)
@given(max_staleness=st.integers(0, 3), refits=st.integers(0, 4))
def test_staleness_of_an_episode_that_spans_several_refits(max_staleness, refits):
    """The oldest token decides: a group admitted at version 0 whose turns ran on versions
    0..refits is consumed only while the learner is at most max_staleness steps past version 0,
    and the learner never steps past that bound while the group is still in flight."""
    q = ReplayQueue(capacity=8, max_staleness=max_staleness, groups_per_step=1)
    ticket = q.admit()
    for v in range(1, refits + 1):  # the engines refit while the episode runs
        if q.straggling(v - 1) and v - 1 >= max_staleness:
            assert q.take(1, v - 1) is None  # the learner would wait for it here
            return
        q.set_weights_version(v)
    group = _spanning(list(range(refits + 1)))
    assert group.min_version == 0
    q.put(group, ticket)
    learner_version = refits
    batch = q.take(1, learner_version)
    if learner_version <= max_staleness:
        assert batch == [group]
        versions = [v for v, m in zip(group.trajectories[0].policy_versions, group.trajectories[0].loss_mask) if m]
        assert all(learner_version - v <= max_staleness for v in versions)
    else:
        assert batch is None and q.stats.dropped_stale == 1
