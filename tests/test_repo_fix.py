"""RepoFix-v0: every bug family is solvable by the expert, doing nothing scores 0, grading happens afterwards."""

from __future__ import annotations

import random

import gymnasium
import pytest
from agentrl.rollout.chat import format_tool_call
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


def test_function_kwarg_narrows_the_task_to_one_function():
    kwargs = {"family": "off_by_one", "function": "sum_to"}
    tasks = [task_of_seed(s, **kwargs) for s in range(40)]
    assert {t.bugged.name for t in tasks} == {"sum_to"} and len({t.package for t in tasks}) > 4
    assert {t.bugged.name for t in (task_of_seed(s, function="clamp") for s in range(5))} == {"clamp"}
    env = gymnasium.make("agentrl/RepoFix-v0", max_turns=2, **kwargs)
    messages, _ = env.reset(seed=7)
    assert "test_sum_to" in messages[1]["content"]
    for action in expert(7, env_kwargs=kwargs, steps="fix"):
        _, reward, terminated, _, _ = env.step(action)
    assert terminated and reward == 1.0
    env.close()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="did you mean 'sum_to'"):
        RepoFixEnv(function="sum_too")
    with pytest.raises(ValueError, match="family 'operator', not 'off_by_one'"):
        RepoFixEnv(family="off_by_one", function="average")
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


def test_tools_kwarg_offers_a_subset_and_the_prompt_says_which():
    env = gymnasium.make("agentrl/RepoFix-v0", family="off_by_one", max_turns=2, tools=["str_replace", "bash"])
    messages, info = env.reset(seed=4)
    assert [t["function"]["name"] for t in info["tools"]] == ["bash", "str_replace"]  # the class's order
    assert "with the tools bash and str_replace." in messages[0]["content"]
    obs, reward, terminated, _, info = env.step(format_tool_call("read_file", {"path": "README.md"}))
    assert not terminated and "unknown tool 'read_file'" in obs[-1]["content"]
    env.close()
    kwargs = {"family": "off_by_one", "tools": ["str_replace"]}
    env = gymnasium.make("agentrl/RepoFix-v0", **kwargs)
    messages, _ = env.reset(seed=4)
    assert "with the tool str_replace." in messages[0]["content"]
    for action in expert(4, env_kwargs=kwargs, steps="fix"):
        _, reward, terminated, _, _ = env.step(action)
    assert terminated and reward == 1.0
    env.close()
    with pytest.raises(ValueError, match="read_file"):  # the full demonstrator needs tools it is not offered
        expert(4, env_kwargs=kwargs, steps="full")
    _, messages = gymnasium.make("agentrl/RepoFix-v0").unwrapped.new_repo(random.Random(0), {})
    assert "with the tools bash, read_file, write_file, str_replace and list_dir." in messages[0]["content"]


@pytest.mark.parametrize("tools, match", [(["str_replce"], "did you mean 'str_replace'"), ("bash", "list of tool names"),
                                          ([], "list of tool names"), (["bash", "rm"], "unknown tool 'rm'")])
def test_bad_tools_are_refused(tools, match):
    with pytest.raises(ValueError, match=match):
        RepoFixEnv(tools=tools)


def test_repofix_cpu_recipe_and_its_probe_see_what_reset_gives():
    """configs/repofix_cpu.yaml: one narrow family, short episodes, an imperfect demonstrator, induction
    heads; tools/repofix_probe.py renders the same first messages and tools as the env's reset."""
    import importlib.util
    from pathlib import Path

    from agentrl.config import load_config
    from agentrl.env.ids import check_env
    from agentrl.rollout.tool_calls import ToolCallParser

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "repofix_cpu.yaml")
    kwargs = cfg.env.kwargs
    assert kwargs["family"] in BUG_FAMILIES and kwargs["max_turns"] == cfg.rollout.max_turns == 2
    assert task_of_seed(0, **kwargs).bugged.name == kwargs["function"]
    assert set(kwargs["tools"]) >= {"str_replace"} and cfg.sft.expert_kwargs == {"steps": "fix", "give_up_prob": 0.5}
    assert cfg.sft.output_dir != ".cache/sft-model" and cfg.train.time_limit_s
    check_env(cfg.env.id, kwargs, need_expert=True)
    spec = importlib.util.spec_from_file_location("repofix_probe", root / "tools" / "repofix_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    (seed, messages, tools, expected), = probe.first_turn_prompts(cfg, 1)
    env = gymnasium.make(cfg.env.id, **kwargs)
    assert env.reset(seed=seed) == (messages, {"tools": tools})
    assert expected["old"] in env.unwrapped.task.files[expected["path"]]
    env.close()
    parser = ToolCallParser("hermes")
    assert probe.classify(parser, format_tool_call("str_replace", expected), expected) == "right_fix"
    assert probe.classify(parser, format_tool_call("str_replace", {**expected, "new": "x"}), expected) == "wrong_fix"
    assert probe.classify(parser, format_tool_call("bash", {"command": "ls"}), expected) == "other_call"
    assert probe.classify(parser, "<tool_call>\n{\"name\": \"str_replace\", \"argu</tool_call>", expected) == "malformed"
    assert probe.classify(parser, "I could not find the bug.", expected) == "gives_up"
