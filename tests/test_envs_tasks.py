"""The built-in tasks are solvable through their tools alone, and wrong answers earn less.

Each solver reads only observations (never the env's hidden answer), so a passing test shows the
information needed is reachable with the tools and the reward recognises a right answer.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from agentrl.rollout.chat import format_tool_call
from agentrl.envs import FileNavigatorEnv, PythonSandboxEnv, SearchEnv, WordleEnv
from agentrl.envs.wordle import WORDS, feedback


def tools(env, *calls: tuple[str, dict]) -> list[str]:
    obs, _, terminated, truncated, info = env.step("".join(format_tool_call(n, a) for n, a in calls))
    assert not terminated and not truncated and "error" not in info, info
    assert info["num_tool_calls"] == len(calls)
    return [m["content"] for m in obs]


def tool_error(env, name: str, **arguments) -> str:
    obs, _, terminated, _, info = env.step(format_tool_call(name, arguments))
    assert not terminated and obs[0]["content"].startswith("Error: ") and info["error"] in obs[0]["content"]
    return obs[0]["content"]


def finish(env, answer: str) -> tuple[float, bool]:
    _, reward, terminated, _, info = env.step(answer)
    assert terminated
    return reward, info["success"]


def search_env_solve(env: SearchEnv, question: str) -> str:
    def doc(name: str) -> str:
        hits = tools(env, ("search", {"query": name}))[0].splitlines()
        doc_id = next(h.split("]")[0][1:] for h in hits if h.split("] ", 1)[1].startswith(name + ":"))
        return tools(env, ("open", {"doc_id": doc_id}))[0]

    def fact(text: str, pattern: str) -> str:
        return re.search(pattern, text).group(1)

    entity = (re.search(r"founder of (.+?)(?: born)?\?$", question)
              or re.search(r"company that (.+?) works at", question)).group(1)
    if question.startswith(("Who is the manager", "In which city was")):
        founder = fact(doc(entity), r"founded in \d+ by (.+?)\.")
        pattern = r"manager of .+? is (.+?)\." if "manager" in question else r"born in (.+?)\."
        return fact(doc(founder), pattern)
    company = fact(doc(entity), r"works at (.+?),")
    return fact(doc(company), r"based in (.+?)\." if "city" in question else r"founded in \d+ by (.+?)\.")


def test_search_is_solvable_by_two_hops():
    env = SearchEnv(max_turns=8)
    kinds = set()
    for seed in range(12):
        messages, info = env.reset(seed=seed)
        question = messages[-1]["content"]
        kinds.add(question.split(" the ")[0])
        answer = search_env_solve(env, question)
        assert finish(env, f"Found it.\n<answer>{answer}</answer>") == (1.0, True)
    assert kinds == {"Who is", "In which city was", "In which city is", "Who founded"}


def test_search_partial_answers_get_partial_credit():
    env = SearchEnv()
    seed = next(s for s in range(20) if not env.reset(seed=s)[0][-1]["content"].startswith("In which city"))
    messages, _ = env.reset(seed=seed)
    first_name = search_env_solve(env, messages[-1]["content"]).split()[0]
    reward, success = finish(env, f"<answer>{first_name}</answer>")
    assert reward == pytest.approx(2 / 3) and not success
    env.reset(seed=0)
    assert tool_error(env, "open", doc_id="d999").startswith("Error: ValueError: no document 'd999'")


def test_wordle_feedback_handles_repeated_letters():
    assert feedback("paper", "apple") == "YYGY-"
    assert feedback("bobby", "abbey") == "Y-G-G"
    assert feedback("crane", "crane") == "GGGGG"


def test_wordle_is_solvable_from_feedback_alone():
    env = WordleEnv()
    solved = 0
    for seed in range(20):
        env.reset(seed=seed)
        candidates = list(WORDS)
        for _ in range(6):
            guess = candidates[0]
            obs, reward, terminated, truncated, info = env.step(f"I will try [{guess}].")
            marks = re.search(r": ([GY-]{5})\.", obs[0]["content"]).group(1)
            candidates = [w for w in candidates if feedback(guess, w) == marks]
            if terminated:
                solved += info["success"]
                assert reward == float(info["success"])
                break
    assert solved >= 16


def test_wordle_rejects_malformed_guesses_and_ends_after_six():
    env = WordleEnv(max_guesses=6, max_turns=10)
    env.reset(seed=0)
    obs, _, terminated, _, info = env.step("crane")
    assert "square brackets" in info["error"] and not terminated
    wrong = next(w for w in WORDS if w != env.secret)
    for turn in range(6):
        obs, reward, terminated, truncated, info = env.step(f"[{wrong}]")
    assert terminated and reward == 0.0 and not info["success"] and env.secret.upper() in obs[0]["content"]


@pytest.mark.parametrize("task", ["sum", "find"])
def test_file_navigator_needs_many_files_and_is_solvable(task):
    env = FileNavigatorEnv(task=task, max_tool_calls_per_turn=8)
    messages, _ = env.reset(seed=3)
    top = tools(env, ("ls", {"path": "/"}))[0].split()
    assert top == ["README.md", "logs/", "services/"]
    read_chars = 0
    if task == "sum":
        services = tools(env, ("ls", {"path": "/services"}))[0].split()
        total = 0
        for i in range(0, len(services), 8):
            for text in tools(env, *[("read", {"path": f"/services/{s}config.ini"}) for s in services[i:i + 8]]):
                total += int(re.search(r"^workers = (\d+)", text, re.M).group(1))
                read_chars += len(text)
        answer, wrong = f"The answer is {total}.", f"The answer is {total + 1}."
    else:
        target = re.search(r"req-[0-9a-f]{6}", messages[-1]["content"]).group(0)
        logs = tools(env, ("ls", {"path": "logs"}))[0].split()
        found = []
        for i in range(0, len(logs), 8):
            texts = tools(env, *[("read", {"path": f"/logs/{name}"}) for name in logs[i:i + 8]])
            read_chars += sum(map(len, texts))
            found += [f"/logs/{name}" for name, text in zip(logs[i:i + 8], texts) if target in text]
        assert len(found) == 1
        answer, wrong = f"It is {found[0]}.", f"It is /logs/{next(n for n in logs if n not in found[0])}."
    assert read_chars > 50_000  # ~16k tokens of context with the defaults
    assert finish(env, answer) == (1.0, True)
    env.reset(seed=3)
    assert finish(env, wrong) == (0.0, False)


def test_file_navigator_path_errors():
    env = FileNavigatorEnv(num_files=2, lines_per_file=3)
    env.reset(seed=0)
    assert tool_error(env, "read", path="/services").startswith("Error: IsADirectoryError")
    assert tools(env, ("read", {"path": "//services//auth/./config.ini"}))[0].startswith("[auth]")
    assert tool_error(env, "ls", path="/nope/../../etc").startswith("Error: FileNotFoundError")
    assert tools(env, ("read", {"path": "../README.md"}))[0].startswith("Services live in")


SOLUTIONS = {
    "add_k": "def add_k(xs):\n    return [x + K for x in xs]",
    "count_char": "def count_char(s):\n    return s.lower().count(C)",
    "sum_multiples": "def sum_multiples(n):\n    return sum(i for i in range(1, n) if i % A == 0 or i % B == 0)",
    "rotate_left": "def rotate_left(xs):\n    k = K % len(xs) if xs else 0\n    return xs[k:] + xs[:k]",
    "second_largest": "def second_largest(xs):\n    s = sorted(set(xs))\n    return s[-2] if len(s) > 1 else None",
    "run_length": "import itertools\ndef run_length(s):\n"
                  "    return ''.join(c + str(len(list(g))) for c, g in itertools.groupby(s))",
}


def solution(prompt: str, name: str) -> str:
    numbers = [int(n) for n in re.findall(r"\b\d+\b", prompt.split("e.g.")[0])]
    letter = re.search(r"letter '(.)'", prompt)
    code = SOLUTIONS[name].replace("K", str(numbers[0]) if numbers else "0")
    if name == "sum_multiples":
        code = code.replace("A", str(numbers[0])).replace("B", str(numbers[1]))
    return code.replace("C", repr(letter.group(1))) if letter else code


def test_python_sandbox_tasks_are_solvable_and_fakes_score_zero():
    env = PythonSandboxEnv(cpu_time_s=1, wall_time_s=3.0, memory_mb=256)
    names = set()
    for seed in range(14):
        messages, _ = env.reset(seed=seed)
        names.add(env.function_name)
        code = solution(messages[-1]["content"], env.function_name)
        assert tools(env, ("run_python", {"code": code + "\nprint('defined')"})) == ["defined"]
        assert finish(env, f"Here it is:\n```python\n{code}\n```") == (1.0, True)
        env.reset(seed=seed)
        fake = f"def {env.function_name}(*args):\n    return None\nprint('__agentrl_results__:' + '[]' )"
        reward, success = finish(env, f"```python\n{fake}\n```")
        assert reward < 1.0 and not success
        env.reset(seed=seed)
        assert finish(env, "I would write a loop.") == (0.0, False)
    assert names == set(SOLUTIONS)


def test_python_sandbox_astep_scores_off_the_event_loop():
    env = PythonSandboxEnv(cpu_time_s=1, wall_time_s=3.0, memory_mb=256)
    messages, _ = env.reset(seed=0)
    answer = f"```python\n{solution(messages[-1]['content'], env.function_name)}\nimport time\ntime.sleep(0.3)\n```"
    ticks = []

    async def ticker():
        for _ in range(100):
            ticks.append(1)
            await asyncio.sleep(0.01)

    async def main():
        task = asyncio.create_task(ticker())
        result = await env.astep(answer)
        task.cancel()
        return result

    _, reward, terminated, _, info = asyncio.run(main())
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    assert len(ticks) >= 10  # the loop kept running while the hidden tests ran for >= 0.3 s
