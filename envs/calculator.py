"""Calculator-v0: integer word problems with a ``calculate`` tool on a safe AST evaluator.

Prompts are short and regular so that a tiny model can learn the format from scratch; the operands
(2–3 digits, one- and two-step problems) make mental arithmetic hard for it, so the tool pays off.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from fractions import Fraction
from typing import Any

from agentrl.rollout.chat import format_tool_call
from agentrl.envs.base import Message, ToolEnv
from agentrl.envs.tools import tool

__all__ = ["EASY_SHAPES", "CalculatorEnv", "evaluate", "expert", "first_step", "last_integer"]

SYSTEM = "Solve the problem. Use the calculate tool, then reply: The answer is N."
NAMES = ("Tom", "Ann", "Sam", "Lily", "Ben", "Mia", "Max", "Zoe")
ITEMS = ("apples", "pens", "cards", "eggs", "books", "stamps", "shells", "marbles")
MAX_MAGNITUDE = 10**15
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_eval(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > 64):
            raise ValueError("exponents must be integers between -64 and 64")
        if isinstance(node.op, ast.Pow) and abs(left) > 1 and abs(right) * len(str(abs(int(left)))) > 17:
            raise ValueError(f"result too large (limit {MAX_MAGNITUDE:.0e})")
        if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise ValueError("division by zero")
        if left == 0 and right < 0 and isinstance(node.op, ast.Pow):
            raise ValueError("division by zero")
        value = _BINARY[type(node.op)](left, right)
    else:
        raise ValueError(f"unsupported syntax '{type(node).__name__}': use numbers, + - * / // % ** and ( )")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"result too large (limit {MAX_MAGNITUDE:.0e})")
    return value


def evaluate(expression: str) -> str:
    """Evaluate arithmetic without ``eval``: numbers, + - * / // % ** (small exponents), parentheses.

    Example:
        >>> evaluate("(37 + 48) * 12")
        '1020'

    Raises:
        ValueError: the expression is too long, malformed, uses other syntax, or overflows.
    """
    if len(expression) > 200:
        raise ValueError("expression too long (limit 200 characters)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"not a valid expression: {expression[:60]!r}") from exc
    if sum(1 for _ in ast.walk(tree)) > 100:
        raise ValueError("expression too complex (limit 100 nodes)")
    value = _eval(tree.body)
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


def _problem(rng: random.Random) -> tuple[str, str]:
    """A word problem and its expression."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(10, 999), rng.randint(10, 999), rng.randint(10, 99)
    x, y = rng.randint(10, 99), rng.randint(10, 99)
    kind = rng.randrange(6)
    if kind == 0:
        return f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have?", f"{a} + {b}"
    if kind == 1:
        a = rng.randint(200, 999)
        b = rng.randint(10, a - 100)
        return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", f"{a} - {b}"
    if kind == 2:
        return f"{name} buys {x} boxes of {y} {item}. How many {item} does {name} buy?", f"{x} * {y}"
    if kind == 3:
        return (f"{name} has {a} {item}, buys {b} more and gives away {c}. How many {item} does {name} have?",
                f"{a} + {b} - {c}")
    if kind == 4:
        return (f"{name} has {x} bags of {item} and buys {c} more bags. Each bag holds {y} {item}. "
                f"How many {item} does {name} have?", f"({x} + {c}) * {y}")
    c = rng.randint(10, min(999, x * y - 1))
    return (f"{name} buys {x} boxes of {y} {item} and gives away {c}. How many {item} are left?",
            f"{x} * {y} - {c}")


def last_integer(text: str) -> int | None:
    """The last integer in ``text`` (commas as thousands separators allowed), or None if none or huge."""
    numbers = re.findall(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+", text)
    last = numbers[-1].replace(",", "") if numbers else ""
    return int(last) if 0 < len(last) <= 30 else None  # a 30-digit number matches no answer; int() caps digits


class CalculatorEnv(ToolEnv):
    """Integer word problems; reward 1.0 when the last integer of the final answer is right.

    Args:
        max_turns: steps before truncation.
        **kwargs: ``tool_timeout_s``, ``max_tool_calls_per_turn``, ``max_tool_output_chars``.
    """

    def __init__(self, *, max_turns: int = 4, **kwargs: Any) -> None:
        super().__init__(max_turns=max_turns, **kwargs)
        self.question = self.expression = ""
        self.answer = 0

    def new_task(self, rng: random.Random, options: dict[str, Any]) -> list[Message]:
        self.question, self.expression = _problem(rng)
        self.answer = int(evaluate(self.expression))
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.question}]

    @tool
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers with + - * / // % ** and parentheses, e.g. "(37 + 48) * 12".
        """
        return evaluate(expression)

    def score(self, answer: str) -> float:
        return 1.0 if last_integer(answer) == self.answer else 0.0


EASY_SHAPES = ("n + n", "n - n", "n * n")
"""Expression shapes of the one-step problems (half of all) a demonstrator is tempted to do in its head."""


def first_step(expression: str) -> str:
    """The operation a person does first in a two-step ``expression`` (the innermost-left one).

    Example:
        >>> first_step("(12 + 30) * 4"), first_step("100 + 20 - 5"), first_step("7 * 8")
        ('12 + 30', '100 + 20', '7 * 8')
    """
    node = ast.parse(expression, mode="eval").body
    while isinstance(node, ast.BinOp) and isinstance(node.left, ast.BinOp):
        node = node.left
    return ast.unparse(node)


def expert(
    seed: int, *, guess_prob: float = 0.4, easy_guess_prob: float | None = None, partial_prob: float = 0.0,
    rng_seed: int | None = None, tool_parser: str = "hermes",
) -> list[str]:
    """An imperfect demonstrator's assistant messages for the episode ``reset(seed=seed)`` starts.

    With probability ``guess_prob`` it answers at once, without the tool, and wrongly: it restates the
    first number of the question as the answer, the way weak models answer arithmetic they cannot
    do; otherwise it calls ``calculate`` on the whole expression and states the result.
    ``easy_guess_prob``, when given, replaces ``guess_prob`` on one-step problems
    (:data:`EASY_SHAPES`), the ones one is tempted to answer without a tool: a demonstrator that
    mostly skips the tool on those teaches the habit on a recognisable kind of problem, which greedy
    decoding then reproduces every time. (The wrong answers are kept learnable on purpose: random
    guesses are targets a model cannot predict, and as SFT targets they slowed the learning of the
    number copying that the tool-using episodes need several-fold.) ``partial_prob``: on two-step
    problems, when it does call the tool, it stops halfway with this probability: it calculates
    only the first operation (:func:`first_step`) and answers with that intermediate result, the
    way a careless solver forgets the second step; every such demonstration still shows the tool
    being used and its numbers copied. ``rng_seed`` varies its choices; by default they are a
    fixed function of ``seed``. ``tool_parser`` names the model's tool-call format the calls are
    written in (:func:`agentrl.rollout.tool_calls.format_tool_call`).

    Example:
        >>> expert(0, guess_prob=0.0)[1]
        'The answer is 8052.'
    """
    env = CalculatorEnv()
    env.reset(seed=seed)
    rng = random.Random(f"expert:{seed}:{rng_seed}")
    easy = re.sub(r"\d+", "n", env.expression) in EASY_SHAPES
    p_guess = easy_guess_prob if easy and easy_guess_prob is not None else guess_prob
    if rng.random() >= p_guess:
        if not easy and rng.random() < partial_prob:
            step = first_step(env.expression)
            return [format_tool_call("calculate", {"expression": step}, tool_parser), f"The answer is {evaluate(step)}."]
        return [format_tool_call("calculate", {"expression": env.expression}, tool_parser), f"The answer is {env.answer}."]
    first_number = re.findall(r"\d+", env.question)[0]
    return [f"The answer is {first_number}."]


CalculatorEnv.expert = staticmethod(expert)  # the same function, reachable from the env class
