"""RepoFix-v0: every bug family is solvable by the expert, doing nothing scores 0, grading happens afterwards."""

from __future__ import annotations

import random

import gymnasium
import pytest
from agentrl.chat import format_tool_call
from agentrl.envs.repo_fix import BUG_FAMILIES, FUNCTIONS, RepoFixEnv, expert, make_task, task_of_seed


def test_every_function_has_a_unique_bug_and_hidden_cases_that_see_it():
    for fn in FUNCTIONS:
        for seed in range(5):
            task = make_task(random.Random(seed), fn.family)
            assert task.num_differing >= 4
            assert task.files[f"{task.package}/{task.bugged.module}.py"].count(task.bugged.buggy) == 1
            assert not any("hidden" in path for path in task.files)


@pytest.mark.parametrize("family", BUG_FAMILIES)
def test_expert_solves_and_doing_nothing_scores_zero(family):
    env = gymnasium.make("agentrl/RepoFix-v0", family=family)
    seed = BUG_FAMILIES.index(family)
    env.reset(seed=seed)
    assert repr(env.unwrapped.task) == repr(task_of_seed(seed, family=family))
    for action in expert(seed, env_kwargs={"family": family}):
        _, reward, terminated, _, info = env.step(action)
        assert "error" not in info, info
    assert terminated and reward == 1.0 and info["success"]
    env.reset(seed=seed)
    _, reward, terminated, _, _ = env.step("Nothing to do.")
    assert terminated and reward == 0.0
    assert env.unwrapped.workspace is None  # graded: the agent's sandbox is gone
    env.close()


def test_short_and_give_up_demonstrations():
    kwargs = {"family": "off_by_one"}
    assert len(expert(1, env_kwargs=kwargs, steps="fix")) == 2
    gave_up = [expert(s, env_kwargs=kwargs, give_up_prob=0.6) == ["I could not find the bug."] for s in range(50)]
    assert 20 <= sum(gave_up) <= 40
    with pytest.raises(ValueError, match="steps"):
        expert(0, steps="half")


def test_truncated_episode_is_graded_all_the_same():
    env = RepoFixEnv(family="comparison", max_turns=2)
    env.reset(seed=0)
    task = env.task
    path = f"{task.package}/{task.bugged.module}.py"
    env.step(format_tool_call("str_replace", {"path": path, "old": task.bugged.buggy, "new": task.bugged.correct}))
    _, reward, terminated, truncated, info = env.step(format_tool_call("bash", {"command": "ls"}))
    assert truncated and not terminated and reward == 1.0 and info["graded"]
    env.close()


def test_a_return_true_fix_earns_nothing():
    env = RepoFixEnv(family="normalization")
    seed = next(s for s in range(200) if (t := task_of_seed(s, family="normalization")).bugged.name == "is_palindrome"
                and t.num_differing < len(t.expected))
    env.reset(seed=seed)
    path = f"{env.task.package}/text.py"
    env.step(format_tool_call("str_replace", {"path": path, "old": "return cleaned == cleaned[::-1]",
                                               "new": "return True"}))
    _, reward, *_ = env.step("done")
    assert reward == 0.0
    env.close()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="did you mean 'off_by_one'"):
        RepoFixEnv(family="off_by_on")
    with pytest.raises(ValueError, match="num_hidden"):
        RepoFixEnv(num_hidden=0)


def test_astep_grades_a_truncated_episode_too():
    import asyncio

    env = RepoFixEnv(family="comparison", max_turns=2)
    env.reset(seed=0)
    task = env.task
    path = f"{task.package}/{task.bugged.module}.py"
    fix = format_tool_call("str_replace", {"path": path, "old": task.bugged.buggy, "new": task.bugged.correct})
    obs, reward, terminated, truncated, _ = asyncio.run(env.astep(fix))
    assert "replaced 1 occurrence" in obs[0]["content"] and not (terminated or truncated)
    _, reward, terminated, truncated, info = asyncio.run(env.astep(format_tool_call("list_dir", {"path": "."})))
    assert truncated and reward == 1.0 and info["graded"]
    env.close()
