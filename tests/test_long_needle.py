"""LongNeedle-v0 without an engine: where the needle and the decoy are, the demonstrator and its
decoy habit, the cut-pages bound, bad settings, and the SFT observation loss weight's cache key."""

from __future__ import annotations

import re

import agentrl.envs  # noqa: F401
import gymnasium
import pytest
from agentrl.envs.long_needle import (
    CODE_WORDS,
    CONTINUED,
    FILLER,
    NOTE_WORDS,
    QUESTION,
    LongNeedleEnv,
    cut_pages,
    decoy_line,
    expert,
    needle_line,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.rollout.chat import format_tool_call
from agentrl.config import load_config

CALL = format_tool_call("next_page", {})


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), num_pages=st.integers(1, 6), repeats=st.integers(1, 5))
def test_the_needle_is_on_one_page_and_the_decoy_right_before_the_question(seed, num_pages, repeats):
    env = LongNeedleEnv(num_pages=num_pages, page_words=[1, 80], repeats=repeats)
    env.reset(seed=seed)
    assert env.code in CODE_WORDS and env.note in NOTE_WORDS
    assert [p.count(needle_line(env.code)) for p in env.pages] == [
        repeats if i == env.needle_page else 0 for i in range(num_pages)]
    assert [p.count(decoy_line(env.note)) for p in env.pages] == [0] * (num_pages - 1) + [repeats]
    assert env.pages[-1].endswith(f"\n{decoy_line(env.note)}\n{QUESTION}")
    assert all(p.endswith(f"\n{CONTINUED}") for p in env.pages[:-1])
    # the answer words occur nowhere else: the filler shares no word with them
    words = re.findall(r"[a-z]+", "\n".join(env.pages))
    assert words.count(env.code) == repeats and words.count(env.note) == repeats
    assert not set(FILLER) & (set(CODE_WORDS) | set(NOTE_WORDS))


def test_the_needle_page_is_uniform_over_the_pages():
    env = LongNeedleEnv(num_pages=4, page_words=5)
    counts = [0] * 4
    for seed in range(4000):
        env.reset(seed=seed)
        counts[env.needle_page] += 1
    assert all(abs(c / 4000 - 0.25) < 0.03 for c in counts), counts


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_expert_reads_every_page_and_its_give_up_habit_is_always_wrong(seed):
    kwargs = {"num_pages": 4, "page_words": 30}
    for give_up_prob, right in ((0.0, True), (1.0, False)):
        env = LongNeedleEnv(**kwargs)
        env.reset(seed=seed)
        actions = expert(seed, give_up_prob=give_up_prob, env_kwargs=kwargs)
        assert actions[:-1] == [CALL] * 4
        for k, action in enumerate(actions[:-1]):
            obs, reward, terminated, _, _ = env.step(action)
            assert obs[0]["content"] == env.pages[k] and not terminated and reward == 0.0
        assert actions[-1] == needle_line(env.code if right else "unknown")
        _, reward, terminated, _, info = env.step(actions[-1])
        assert terminated and info["success"] is right and reward == float(right)


def test_expert_habit_rate_follows_give_up_prob():
    kwargs = {"num_pages": 4, "page_words": 3}
    gave_up = sum(expert(s, give_up_prob=0.6, env_kwargs=kwargs)[-1].endswith("unknown.") for s in range(2000))
    assert abs(gave_up / 2000 - 0.6) < 0.04


@pytest.mark.parametrize("near_pages", [1, 2])
def test_expert_with_near_pages_gives_up_only_on_needles_further_back(near_pages):
    kwargs = {"num_pages": 4, "page_words": 3}
    far = gave_up_far = 0
    for s in range(2000):
        env = LongNeedleEnv(**kwargs)
        env.reset(seed=s)
        answer = expert(s, give_up_prob=0.7, near_pages=near_pages, env_kwargs=kwargs)[-1]
        if env.needle_page >= 4 - near_pages:
            assert answer == needle_line(env.code), (s, env.needle_page)
        else:
            far += 1
            gave_up_far += answer == needle_line("unknown")
    assert abs(far / 2000 - (4 - near_pages) / 4) < 0.04
    assert abs(gave_up_far / far - 0.7) < 0.05


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_with_the_early_pages_cut_only_a_needle_on_the_last_page_is_left(seed):
    env = LongNeedleEnv(num_pages=4, page_words=[1, 40], repeats=3)
    env.reset(seed=seed)
    last = env.pages[-1]
    cut_pages(env)
    document = "\n".join(env.pages)
    on_last = env.needle_page == 3
    assert (env.code in re.findall(r"[a-z]+", document)) == on_last and env.pages[-1] == last
    # so a policy that reads only the last page is right at most when the needle is there, plus a
    # guess among the code words: 1/4 + 3/4 * 1/12 over a uniform needle page
    assert decoy_line(env.note) in env.pages[-1] and env.pages[-1].endswith(QUESTION)


def test_an_answer_before_the_last_page_scores_zero_and_paging_past_the_end_is_an_error():
    env = LongNeedleEnv(num_pages=2, page_words=10)
    env.reset(seed=3)
    env.step(CALL)
    _, reward, terminated, _, _ = env.step(needle_line(env.code))
    assert terminated and reward == 0.0
    env.reset(seed=3)
    env.step(CALL), env.step(CALL)
    obs, _, terminated, _, info = env.step(CALL)
    assert not terminated and "no more pages" in obs[0]["content"] and "error" in info
    _, reward, terminated, _, _ = env.step(f"It is {env.code}")  # the last word counts
    assert terminated and reward == 1.0


def test_long_prob_makes_a_share_of_the_episodes_full_length():
    def filler_words(env):
        return [len(re.findall(r"[a-z]+", p.split("\n", 1)[1])) for p in env.pages]

    env = LongNeedleEnv(num_pages=3, page_words=[1, 20], long_prob=0.25, long_page_words=[500, 520])
    long = 0
    for seed in range(800):
        env.reset(seed=seed)
        words = filler_words(env)
        assert all(w < 80 for w in words) or all(w >= 500 for w in words)  # a whole episode is short or long
        long += words[0] >= 500
    assert abs(long / 800 - 0.25) < 0.05


def test_bad_settings_are_refused():
    for kwargs, key in (({"num_pages": 0}, "num_pages"), ({"page_words": [50, 10]}, "page_words"),
                        ({"repeats": 0}, "repeats"), ({"long_prob": 1.5}, "long_prob"),
                        ({"long_page_words": [0, 10]}, "long_page_words")):
        with pytest.raises(ValueError, match=key):
            gymnasium.make("agentrl/LongNeedle-v0", **kwargs)


def test_long_context_cpu_config_uses_long_needle_with_the_observation_loss():
    cfg = load_config("configs/long_context_cpu.yaml")
    assert cfg.env.id == "agentrl/LongNeedle-v0" and cfg.env.kwargs["num_pages"] >= 4
    assert cfg.sft.observation_loss_weight > 0 and cfg.sft.expert_kwargs["give_up_prob"] > 0.5
    # the tiny model gets induction heads before SFT (without them the copy formed in some seeds only)
    assert cfg.model.tiny.induction_steps >= 1000


def test_a_zero_observation_loss_weight_keeps_existing_sft_caches_valid():
    import hashlib
    import json

    from agentrl.driver.sft import _fingerprint

    cfg = load_config("configs/quickstart.yaml")
    # the keys added since, at their defaults, are left out of the key: caches made before stay valid
    sft = {k: v for k, v in cfg.sft.model_dump().items() if k not in ("observation_loss_weight", "num_threads")}
    blob = json.dumps({"sft": sft, "env": cfg.env.model_dump(), "model": "m", "seed": cfg.seed}, sort_keys=True)
    assert _fingerprint(cfg, "m") == hashlib.sha256(blob.encode()).hexdigest()[:16]  # as before the key existed
    cfg.sft.observation_loss_weight = 0.2
    assert _fingerprint(cfg, "m") != hashlib.sha256(blob.encode()).hexdigest()[:16]


def test_probe_scores_the_answer_word_and_every_later_needle_repeat(tiny_model_dir):
    """tools/long_needle_probe.py finds its positions in real chat episodes: one answer word per
    episode and the needle's 2nd..k-th repeats in the pages; the figures are probabilities."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "long_needle_probe.py"
    spec = importlib.util.spec_from_file_location("long_needle_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.probe(tiny_model_dir, {"num_pages": 3, "page_words": [5, 40], "repeats": 3}, episodes=4)
    assert out["episodes"] == 4 and out["in_page_repeats_scored"] == 4 * 2
    assert 0 <= out["answer_p_code"] <= out["answer_p_any_code"] <= 1 and 0 <= out["answer_p_unknown"] <= 1
    assert 0 <= out["in_page_p_code"] <= 1 and sum(out["answer_p_code_by_page"].values()) > 0
