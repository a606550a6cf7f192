"""Every built-in env: Gymnasium's check_env, seeded determinism, and env.step on arbitrary text."""

from __future__ import annotations

import asyncio
import json
import math
import time
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentrl.rollout.chat import format_tool_call
from agentrl.envs import BUILTIN_ENV_IDS, ChatMessages

FAST = {"agentrl/PythonSandbox-v0": {"cpu_time_s": 1, "wall_time_s": 2.0, "memory_mb": 256},
        "agentrl/FileNavigator-v0": {"num_files": 6, "lines_per_file": 8}}


def make(env_id: str):
    return gymnasium.make(env_id, **FAST.get(env_id, {})).unwrapped


def task_of(env) -> tuple:
    """What the seed chose, beyond the first messages (Wordle's first message is always the same)."""
    return tuple(repr(getattr(env, name, None)) for name in ("expression", "gold", "inputs", "secret", "facts", "pages",
                                                              "task"))


@pytest.mark.parametrize("env_id", BUILTIN_ENV_IDS)
def test_check_env_passes_without_warnings(env_id):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(gymnasium.make(env_id).unwrapped)


@pytest.mark.parametrize("env_id", BUILTIN_ENV_IDS)
def test_seeds_reproduce_the_task(env_id):
    env, other = make(env_id), make(env_id)
    seen = set()
    for seed in range(20):
        obs, info = env.reset(seed=seed)
        assert (obs, info, task_of(env)) == (*other.reset(seed=seed), task_of(other))
        seen.add((json.dumps(obs), task_of(env)))
    assert len(seen) >= 18, "different seeds should give different tasks"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
fragments = st.sampled_from([
    "<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", ",", "[", "]", "```python\n", "```",
    "<answer>", "</answer>", "\x00", "\ud800", "🙂", "[crane]", "/logs/", "The answer is 42.", "\n", "print(1)",
])


def actions_for(env) -> st.SearchStrategy[str]:
    """Arbitrary text, biased towards this env's tool names and argument names."""
    schemas = {s["function"]["name"]: list(s["function"]["parameters"]["properties"]) for s in env.tool_schemas()}
    names = st.sampled_from([*schemas, "nope", ""])
    args = st.dictionaries(st.sampled_from([a for v in schemas.values() for a in v] + ["x"]),
                           st.one_of(st.text(max_size=60), json_values), max_size=3)
    calls = st.builds(
        lambda name, arguments, tail: (f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"
                                       if not tail else f'<tool_call>{{"name": {json.dumps(name)}, {tail}'),
        names, args, st.sampled_from(["", "", "", '"arguments": {', '"arguments": "{}"}</tool_call>', "[]"]),
    )
    well_typed = st.one_of([  # every built-in tool takes strings
        st.fixed_dictionaries({a: st.text(max_size=60) for a in arg_names}).map(
            lambda arguments, name=name: format_tool_call(name, arguments))
        for name, arg_names in schemas.items()
    ]) if schemas else calls
    return st.one_of(
        st.text(max_size=200),
        st.lists(st.one_of(fragments, st.text(max_size=20)), max_size=12).map("".join),
        calls,
        well_typed,
        st.lists(st.one_of(calls, well_typed), min_size=2, max_size=4).map("\n".join),
        st.text(max_size=40).map(lambda t: f"<tool_call><tool_call>{t}</tool_call></tool_call>"),
    )


def check_step(env, action) -> tuple[bool, dict]:
    """Step once and check the contract; returns whether the episode ended, and the info."""
    obs, reward, terminated, truncated, info = env.step(action)
    assert ChatMessages().contains(obs)
    assert isinstance(reward, float) and math.isfinite(reward) and 0.0 <= reward <= 1.0
    assert isinstance(terminated, bool) and isinstance(truncated, bool)
    assert isinstance(info["success"], bool) and isinstance(info["num_tool_calls"], int)
    if "error" in info:
        assert isinstance(info["error"], str) and not terminated and any("Error" in m["content"] for m in obs)
    if not terminated:
        assert obs, "a turn that does not end the episode must answer with messages"
    return terminated or truncated, info


@pytest.mark.parametrize("env_id", BUILTIN_ENV_IDS)
def test_step_never_raises_on_arbitrary_text(env_id):
    env = make(env_id)

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(seed=st.integers(0, 2**31), turns=st.lists(actions_for(env), min_size=1, max_size=3))
    def run(seed, turns):
        env.reset(seed=seed)
        for action in turns:
            done, info = check_step(env, action)
            event(f"tool calls: {min(info['num_tool_calls'], 1)}, error: {'error' in info}, done: {done}")
            if done:
                break

    run()


PATHOLOGICAL = [
    "x" * 1_000_000, "1" * 100_000, "<tool_call>" * 20_000, "<answer>" * 20_000, "```\n" * 50_000,
    "[" + " " * 100_000, "/logs/" + "." * 100_000, "1," * 100_000, "\ud800\udfff\x00" * 1000,
]


@pytest.mark.parametrize("env_id", BUILTIN_ENV_IDS)
def test_huge_and_pathological_actions_are_fast(env_id):
    env = make(env_id)
    env.reset(seed=0)
    huge_calls = [json.dumps({"name": fn["function"]["name"], "arguments": {arg: "y" * 1_000_000}})
                  for fn in env.tool_schemas() for arg in fn["function"]["parameters"]["properties"]]
    for action in PATHOLOGICAL + [f"<tool_call>{c}</tool_call>" for c in huge_calls]:
        env.reset(seed=0)
        start = time.monotonic()
        check_step(env, action)
        assert time.monotonic() - start < 3.0, f"slow on {action[:40]!r}"


ASTEP_CALLS = {
    "agentrl/Calculator-v0": ("calculate", {"expression": "(37 + 48) * 12"}),
    "agentrl/Search-v0": ("search", {"query": "company founded"}),
    "agentrl/PythonSandbox-v0": ("run_python", {"code": "print(sum(range(5)))"}),
    "agentrl/FileNavigator-v0": ("ls", {"path": "/services"}),
}


@pytest.mark.parametrize("env_id", list(ASTEP_CALLS))
def test_astep_matches_step(env_id):
    env = make(env_id)
    action = format_tool_call(*ASTEP_CALLS[env_id])
    env.reset(seed=5)
    expected = env.step(action)
    env.reset(seed=5)
    got = asyncio.run(env.astep(action))
    assert got == expected and "error" not in got[4] and got[0][0]["role"] == "tool"
