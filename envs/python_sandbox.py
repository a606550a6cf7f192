"""PythonSandbox-v0: small programming tasks, a ``run_python`` tool, hidden tests for the answer.

The final answer must contain a fenced code block that defines the function. Scoring runs the answer in
a fresh sandbox of its own with a harness that calls the function on the hidden inputs and prints the
``repr`` of each result; the reference implementation and the expected outputs never leave this process,
so printing fake results, rewriting the harness or reading files earns nothing. A result line that is
not a list of strings, one per input, scores 0 and says why in ``last_grading_note``.
"""

from __future__ import annotations

import difflib
import json
import random
import re
from collections.abc import Callable
from typing import Any

from agentrl.envs.base import Message, ToolEnv
from agentrl.envs.sandbox import BACKENDS, SandboxLimits, run_sandboxed
from agentrl.envs.tools import tool

__all__ = ["PythonSandboxEnv", "extract_code"]

SYSTEM = ("Write the requested Python function. You can test code with the run_python tool. Finish with a "
          "message that contains the complete function in a ```python code block.")
MARKER = "__agentrl_results__:"
Task = tuple[str, str, Callable[..., Any], list[tuple]]  # name, description, reference, inputs


def _ints(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(-20, 99) for _ in range(n)]


def _word(rng: random.Random, alphabet: str = "aabbcst") -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 9)))


def _task(rng: random.Random) -> Task:
    k, a, b, ch = rng.randint(2, 9), *rng.sample(range(2, 10), 2), rng.choice("aeost")
    lists = [tuple([_ints(rng, n)]) for n in (0, 1, 3, 5, 6, 8)]
    families: list[Task] = [
        ("add_k", f"add_k(xs) returns a new list with {k} added to every integer in the list xs.",
         lambda xs: [x + k for x in xs], lists),
        ("count_char", f"count_char(s) returns how many times the letter '{ch}' occurs in the string s, "
                       "ignoring case.", lambda s: s.lower().count(ch),
         [(_word(rng, "aeostAEOSTxy"),) for _ in range(6)]),
        ("sum_multiples", f"sum_multiples(n) returns the sum of all positive integers below n that are "
                          f"divisible by {a} or {b}.",
         lambda n: sum(i for i in range(1, n) if i % a == 0 or i % b == 0),
         [(n,) for n in (0, 1, a + 1, rng.randint(10, 50), rng.randint(50, 200), 1000)]),
        ("rotate_left", f"rotate_left(xs) returns the list xs rotated left by {k} positions, wrapping "
                        "around; an empty list stays empty.",
         lambda xs: xs[k % len(xs):] + xs[:k % len(xs)] if xs else [], lists),
        ("second_largest", "second_largest(xs) returns the second largest distinct value in the list of "
                           "integers xs, or None if there is none.",
         lambda xs: sorted(set(xs))[-2] if len(set(xs)) > 1 else None, [([7, 7],), *lists[1:]]),
        ("run_length", "run_length(s) encodes the string s by runs: each run of equal characters becomes "
                       "the character followed by the run length, e.g. 'aaab' -> 'a3b1'.",
         lambda s: "".join(m.group(1) + str(len(m.group(0))) for m in re.finditer(r"(.)\1*", s)),
         [(_word(rng),) for _ in range(6)]),
    ]
    return rng.choice(families)


def extract_code(text: str) -> str | None:
    """The last fenced code block (```python or bare ```) in ``text``, or None."""
    blocks = re.findall(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", text, re.DOTALL)
    return blocks[-1] if blocks else None


class PythonSandboxEnv(ToolEnv):
    """Programming tasks; reward = fraction of hidden tests passed (success when all pass).

    Args:
        cpu_time_s: CPU limit of each sandboxed run.
        wall_time_s: wall-clock limit of each sandboxed run.
        memory_mb: address-space limit of each sandboxed run.
        max_turns: steps before truncation.
        sandbox_backend: ``"bwrap"`` (OS isolation, the default) or ``"audit_hook"`` (in-process layers
            only; NOT a security boundary, for machines without user namespaces and trusted policies).
        **kwargs: ``tool_timeout_s`` (default ``wall_time_s + 5``), ``max_tool_calls_per_turn``,
            ``max_tool_output_chars``.
    """

    def __init__(self, *, cpu_time_s: int = 2, wall_time_s: float = 5.0, memory_mb: int = 512, max_turns: int = 6,
                 sandbox_backend: str = "bwrap", **kwargs: Any) -> None:
        if sandbox_backend not in BACKENDS:
            close = difflib.get_close_matches(str(sandbox_backend), BACKENDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"env.kwargs.sandbox_backend: unknown backend {sandbox_backend!r}{hint}; "
                             f"expected one of {', '.join(BACKENDS)}")
        self.sandbox_backend = sandbox_backend
        self.last_grading_note = ""
        kwargs.setdefault("tool_timeout_s", wall_time_s + 5.0)
        super().__init__(max_turns=max_turns, **kwargs)
        self.limits = SandboxLimits(cpu_time_s=cpu_time_s, wall_time_s=wall_time_s, memory_mb=memory_mb,
                                    max_output_bytes=max(256, self.max_tool_output_chars - 256))  # room for the note
        self.function_name, self.reference, self.inputs = "", None, []

    def new_task(self, rng: random.Random, options: dict[str, Any]) -> list[Message]:
        self.function_name, description, self.reference, self.inputs = _task(rng)
        prompt = f"Write a Python function so that {description}"
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]

    @tool
    def run_python(self, code: str) -> str:
        """Run Python code in a fresh sandbox (standard library only, no network) and return its output.

        Args:
            code: A complete Python program; use print to see values.
        """
        return run_sandboxed(code, self.limits, backend=self.sandbox_backend).describe()

    def score(self, answer: str) -> float:
        self.last_grading_note = ""
        code = extract_code(answer)
        if code is None:
            self.last_grading_note = "no fenced code block in the answer"
            return 0.0
        harness = (f"\n\nimport json as _j\n_outs = []\nfor _args in {self.inputs!r}:\n"
                   f"    try:\n        _outs.append(repr({self.function_name}(*_args)))\n"
                   f"    except Exception as _e:\n        _outs.append('error: ' + type(_e).__name__)\n"
                   f"print()\nprint({MARKER!r} + _j.dumps(_outs))\n")
        limits = SandboxLimits(cpu_time_s=self.limits.cpu_time_s, wall_time_s=self.limits.wall_time_s,
                               memory_mb=self.limits.memory_mb, max_output_bytes=1 << 16)
        result = run_sandboxed(code + harness, limits, backend=self.sandbox_backend)
        outputs, self.last_grading_note = _parse_results(result.output, len(self.inputs))
        expected = [repr(self.reference(*args)) for args in self.inputs]  # here, never inside the sandbox
        return sum(o == e for o, e in zip(outputs, expected)) / len(expected)


def _parse_results(output: str, num_inputs: int) -> tuple[list[str], str]:
    """The harness's outputs from its last result line, or ([], why they cannot be used)."""
    lines = [line for line in output.splitlines() if line.startswith(MARKER)]
    if not lines:
        return [], "no result line: the answer did not run to the end of the hidden tests"
    try:
        outputs = json.loads(lines[-1][len(MARKER):])
    except (json.JSONDecodeError, RecursionError) as exc:
        return [], f"malformed result line: {type(exc).__name__}"
    if not isinstance(outputs, list) or len(outputs) != num_inputs or not all(isinstance(o, str) for o in outputs):
        shape = f"list of {len(outputs)}" if isinstance(outputs, list) else type(outputs).__name__
        return [], f"malformed result line: expected a list of {num_inputs} strings, got a {shape}"
    return outputs, ""
