"""Calculator-v0: the safe evaluator, the prompts, and the imperfect expert."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.rollout.chat import parse_tool_calls
from agentrl.envs import CalculatorEnv
from agentrl.envs.calculator import evaluate, expert, last_integer


@pytest.mark.parametrize(("expression", "value"), [
    ("37 + 48", "85"), ("(37 + 48) * 12", "1020"), ("2 ** 10", "1024"), ("-7 // 2", "-4"), ("7 % 3", "1"),
    ("1 / 4", "0.25"), ("10 / 2", "5"), ("2 ** -1", "0.5"), ("0.1 + 0.2", "0.3"), ("  +5 - -5 ", "10"),
])
def test_evaluate(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(("expression", "message"), [
    ("__import__('os').system('ls')", "unsupported syntax 'Call'"),
    ("x + 1", "unsupported syntax 'Name'"),
    ("(1).real", "unsupported syntax 'Attribute'"),
    ("'a' * 3", "unsupported syntax 'Constant'"),
    ("lambda: 1", "unsupported syntax 'Lambda'"),
    ("True + 1", "unsupported syntax 'Constant'"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("9 ** 60", "result too large"),
    ("2 ** 0.5", "exponents must be integers"),
    ("10 ** 100000", "exponents must be integers"),
    ("999999999 * 999999999", "result too large"),
    ("1 +", "not a valid expression"),
    ("1" * 201, "too long"),
    ("+".join(["1"] * 60), "too complex"),
    ("-" * 150 + "1", "too complex"),
])
def test_evaluate_rejects_with_a_clear_message(expression, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        evaluate(expression)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789+-*/%() .e_jxabc[]{},:'\"\\", max_size=80) | st.text(max_size=80))
def test_evaluate_only_ever_raises_value_error(expression):
    try:
        evaluate(expression)
    except ValueError:
        pass


def test_last_integer():
    assert last_integer("The answer is 1,020.") == 1020
    assert last_integer("3 apples, then 85") == 85
    assert last_integer("no number") is None
    assert last_integer("1" * 5000) is None


def test_prompts_are_short_regular_and_need_real_arithmetic():
    env = CalculatorEnv()
    for seed in range(60):
        messages, info = env.reset(seed=seed)
        assert [m["role"] for m in messages] == ["system", "user"] and len(messages[1]["content"]) < 160
        operands = [int(n) for n in re.findall(r"\d+", env.expression)]
        assert all(10 <= n <= 999 for n in operands) and env.answer >= 0
        assert all(str(n) in messages[1]["content"] for n in operands)
        assert [t["function"]["name"] for t in info["tools"]] == ["calculate"]


def test_problem_kinds_cover_addition_subtraction_products_and_two_steps():
    env = CalculatorEnv()
    shapes = set()
    for seed in range(100):
        env.reset(seed=seed)
        shapes.add(re.sub(r"\d+", "n", env.expression))
    assert shapes == {"n + n", "n - n", "n * n", "n + n - n", "(n + n) * n", "n * n - n"}


def play(seed: int, messages: list[str]) -> tuple[float, bool, int]:
    env = CalculatorEnv()
    env.reset(seed=seed)
    for text in messages:
        obs, reward, terminated, truncated, info = env.step(text)
        if not terminated:
            assert obs[0]["role"] == "tool" and "error" not in info
    return reward, terminated and info["success"], len(messages)


def test_expert_without_guessing_always_succeeds():
    for seed in range(200):
        messages = expert(seed, guess_prob=0.0)
        call = parse_tool_calls(messages[0]).calls[0]
        assert call.name == "calculate" and messages[1].startswith("The answer is ")
        assert play(seed, messages)[:2] == (1.0, True)


def test_expert_guess_rate_is_near_guess_prob_and_guesses_are_mostly_wrong():
    outcomes = [play(seed, expert(seed, guess_prob=0.4)) for seed in range(500)]
    guesses = [reward for reward, _, num_messages in outcomes if num_messages == 1]
    assert 0.34 < len(guesses) / len(outcomes) < 0.46
    assert all(r == 0.0 for r in guesses)  # it restates a number of the question: always wrong
    assert all(reward == 1.0 for reward, _, n in outcomes if n == 2)


def test_expert_is_deterministic_and_rng_seed_varies_it():
    assert expert(3) == expert(3) == CalculatorEnv.expert(3)
    runs = {tuple(expert(3, guess_prob=0.5, rng_seed=r)) for r in range(20)}
    assert len(runs) == 2  # it guesses on some rng seeds and calls the tool on others


def test_easy_guess_prob_makes_guessing_depend_on_the_kind_of_problem():
    from agentrl.envs.calculator import EASY_SHAPES

    easy, hard = [], []
    for seed in range(600):
        env = CalculatorEnv()
        env.reset(seed=seed)
        guessed = len(expert(seed, guess_prob=0.05, easy_guess_prob=0.8)) == 1
        (easy if re.sub(r"\d+", "n", env.expression) in EASY_SHAPES else hard).append(guessed)
    assert 250 < len(easy) < 350  # three of the six problem kinds
    assert 0.7 < sum(easy) / len(easy) < 0.9
    assert sum(hard) / len(hard) < 0.1
    # without easy_guess_prob, guess_prob applies to every problem, as before
    assert expert(5, guess_prob=0.3) == expert(5, guess_prob=0.3, easy_guess_prob=None)


def test_partial_prob_stops_two_step_problems_halfway():
    from agentrl.envs.calculator import EASY_SHAPES, first_step

    easy, hard = [], []
    for seed in range(600):
        env = CalculatorEnv()
        env.reset(seed=seed)
        messages = expert(seed, guess_prob=0.0, partial_prob=0.7)
        call = parse_tool_calls(messages[0]).calls[0].arguments["expression"]
        partial = call != env.expression
        if partial:
            assert call == first_step(env.expression) and call in env.expression.replace("(", "").replace(")", "")
        reward = play(seed, messages)[0]
        assert reward == (0.0 if partial else 1.0)  # the intermediate result is never the answer
        (easy if re.sub(r"\d+", "n", env.expression) in EASY_SHAPES else hard).append(partial)
    assert not any(easy)  # one-step problems have no second step to forget
    assert 0.6 < sum(hard) / len(hard) < 0.8
