"""RepoFix-v0: fix a seeded bug in a generated Python package, graded by hidden tests after the episode.

Each seed makes a small package (three modules, twelve functions, a unittest suite) with one bug from one
of six families (``BUG_FAMILIES``: off-by-one ranges, a wrong comparison, a wrong operator, a missing
normalisation, a wrong call, swapped bounds). One visible test fails because of it. The agent works in a
:class:`~agentrl.envs.workspace.Workspace` through the ``CodingEnv`` tools; when it answers (or runs out
of turns), the final tree is graded in a fresh sandbox it never touched: a harness (kept in this process
until then, never in the agent's workspace) calls the bugged function on hidden inputs, and the results
are compared here with the reference implementation's. Most hidden inputs are ones on which the bugged and
the correct function differ (so doing nothing scores 0); reward = the share of those that now match, or 0
if any of the others (on which the bugged function was right: they catch a "fix" such as ``return True``)
now fails.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from gymnasium.utils import seeding

from agentrl.envs.base import Message
from agentrl.envs.coding import CodingEnv
from agentrl.envs.workspace import WorkspaceLimits, make_tar

from agentrl.rollout.chat import format_tool_call

__all__ = ["BUG_FAMILIES", "RepoFixEnv", "expert"]

MARKER = "__agentrl_hidden__:"
TEST_COMMAND = "python3 -m unittest discover -s tests -t ."
PACKAGES = ("mathkit", "toolbelt", "numlib", "textops", "utilpack", "helpers", "smalllib", "corekit")


@dataclass(frozen=True)
class Fn:
    module: str
    name: str
    source: str  # the correct function
    family: str
    correct: str  # the snippet the bug replaces (unique in the module)
    buggy: str
    gen: Any  # rng -> args tuple


def _ints(rng: random.Random, n: int, lo: int = -9, hi: int = 9) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcAB") for _ in range(rng.randint(1, 5)))


FUNCTIONS = (
    Fn("arith", "sum_to", 'def sum_to(n):\n    """The sum of the integers 1..n."""\n    total = 0\n'
       "    for i in range(1, n + 1):\n        total += i\n    return total\n",
       "off_by_one", "range(1, n + 1)", "range(1, n)", lambda r: (r.randint(0, 40),)),
    Fn("arith", "factorial", 'def factorial(n):\n    """n! for n >= 0."""\n    result = 1\n'
       "    for k in range(2, n + 1):\n        result *= k\n    return result\n",
       "off_by_one", "range(2, n + 1)", "range(2, n)", lambda r: (r.randint(0, 12),)),
    Fn("arith", "to_fahrenheit", 'def to_fahrenheit(celsius):\n    """Degrees Celsius in degrees Fahrenheit."""\n'
       "    return celsius * 9 / 5 + 32\n", "operator", "celsius * 9 / 5 + 32", "celsius * 9 / 5 - 32",
       lambda r: (r.randint(-40, 100),)),
    Fn("arith", "average", 'def average(xs):\n    """The mean of the numbers xs (0.0 when empty)."""\n'
       "    if not xs:\n        return 0.0\n    return sum(xs) / len(xs)\n", "operator", "sum(xs) / len(xs)",
       "sum(xs) // len(xs)", lambda r: (_ints(r, r.randint(1, 6)),)),
    Fn("seqs", "count_at_least", 'def count_at_least(xs, t):\n    """How many items of xs are >= t."""\n'
       "    return sum(1 for x in xs if x >= t)\n", "comparison", "x >= t", "x > t",
       lambda r: (_ints(r, r.randint(0, 7), 0, 5), r.randint(0, 5))),
    Fn("seqs", "last_index", 'def last_index(xs, v):\n    """The index of the last v in xs, or -1."""\n'
       "    for i in range(len(xs) - 1, -1, -1):\n        if xs[i] == v:\n            return i\n    return -1\n",
       "off_by_one", "range(len(xs) - 1, -1, -1)", "range(len(xs) - 1, 0, -1)",
       lambda r: (_ints(r, r.randint(1, 6), 0, 4), r.randint(0, 4))),
    Fn("seqs", "running_max", 'def running_max(xs):\n    """The largest item seen so far, at each position."""\n'
       "    out, best = [], None\n    for x in xs:\n        if best is None or x > best:\n            best = x\n"
       "        out.append(best)\n    return out\n", "comparison", "x > best", "x < best",
       lambda r: (_ints(r, r.randint(1, 6)),)),
    Fn("seqs", "clamp", 'def clamp(x, lo, hi):\n    """x limited to the range [lo, hi]."""\n'
       "    return max(lo, min(x, hi))\n", "swapped", "max(lo, min(x, hi))", "max(hi, min(x, lo))",
       lambda r: (r.randint(-20, 20), r.randint(-10, -1), r.randint(0, 10))),
    Fn("text", "is_palindrome", 'def is_palindrome(s):\n    """Whether s reads the same backwards, ignoring case."""\n'
       "    cleaned = s.lower()\n    return cleaned == cleaned[::-1]\n", "normalization", "cleaned = s.lower()",
       "cleaned = s", lambda r: ((lambda w: r.choice((w + w[::-1].swapcase(), w + w[::-1], w)))(_word(r)),)),
    Fn("text", "initials", 'def initials(name):\n    """The capitalised first letters of the words of name."""\n'
       '    return "".join(part[0].upper() for part in name.split())\n', "normalization", "part[0].upper()",
       "part[0]", lambda r: (" ".join(_word(r) for _ in range(r.randint(1, 3))),)),
    Fn("text", "count_words", 'def count_words(text):\n    """The number of whitespace-separated words in text."""\n'
       "    return len(text.split())\n", "call", "text.split()", 'text.split(" ")',
       lambda r: (r.choice(("  ", " ")).join(_word(r) for _ in range(r.randint(1, 4))) + " " * r.randint(0, 2),)),
    Fn("text", "shout", 'def shout(text):\n    """text in capitals, with one "!" at the end."""\n'
       '    return text.upper() + "!"\n', "call", "text.upper()", "text.title()",
       lambda r: (" ".join(_word(r).lower() for _ in range(r.randint(1, 3))),)),
)
BUG_FAMILIES = tuple(sorted({f.family for f in FUNCTIONS}))
MODULES = ("arith", "seqs", "text")


def _load(source: str, name: str):
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<{name}>", "exec"), namespace)  # our own generated code, never the agent's
    return namespace[name]


def _result(fn, args: tuple) -> str:
    try:
        return repr(fn(*args))
    except Exception as exc:
        return "error: " + type(exc).__name__


@dataclass
class Task:
    package: str
    bugged: Fn
    files: dict[str, str]
    hidden_args: list[tuple]  # inputs on which the bugged function is wrong, then some on which it is right
    expected: list[str]
    num_differing: int


def make_task(rng: random.Random, family: str | None = None, num_hidden: int = 8,
              function: str | None = None) -> Task:
    """The package, its bug and the hidden cases of one seed (see the module docstring)."""
    package = rng.choice(PACKAGES)
    pool = [f for f in FUNCTIONS if (family is None or f.family == family) and (function is None or f.name == function)]
    bugged = rng.choice(pool)
    right, wrong = _load(bugged.source, bugged.name), _load(bugged.source.replace(bugged.correct, bugged.buggy),
                                                                 bugged.name)
    differing, agreeing, seen = [], [], set()
    for _ in range(2000):
        args = bugged.gen(rng)
        if repr(args) in seen:
            continue
        seen.add(repr(args))
        if _result(right, args) != _result(wrong, args):
            differing.append(args)
        elif len(agreeing) < num_hidden // 2:
            agreeing.append(args)
        if len(differing) > num_hidden and len(agreeing) >= num_hidden // 2:
            break
    differing = differing[:num_hidden + 1]
    visible_args, hidden_args = differing[0], differing[1:] + agreeing
    files = {f"{package}/__init__.py": f'"""{package}: small helpers."""\n',
             "README.md": f"# {package}\n\nSmall helpers. Run the tests with `{TEST_COMMAND}`.\n"}
    for module in MODULES:
        fns = [f for f in FUNCTIONS if f.module == module]
        body = [f.source if f is not bugged else f.source.replace(f.correct, f.buggy) for f in fns]
        files[f"{package}/{module}.py"] = f'"""{package}.{module}."""\n\n\n' + "\n\n".join(body)
        tests = [f"import unittest\n\nfrom {package}.{module} import {', '.join(f.name for f in fns)}\n\n\n"
                 f"class Test{module.title()}(unittest.TestCase):\n"]
        for f in fns:
            ref = _load(f.source, f.name)
            cases = [visible_args] if f is bugged else [f.gen(rng) for _ in range(2)]
            asserts = "".join(f"        self.assertEqual({f.name}({', '.join(map(repr, args))}), {ref(*args)!r})\n"
                              for args in cases)
            tests.append(f"    def test_{f.name}(self):\n{asserts}\n")
        files[f"tests/test_{module}.py"] = "".join(tests).rstrip() + "\n"
        files["tests/__init__.py"] = ""
    assert files[f"{package}/{bugged.module}.py"].count(bugged.buggy) == 1
    expected = [_result(right, args) for args in hidden_args]
    return Task(package, bugged, files, hidden_args, expected, len(differing) - 1)


def _harness(task: Task) -> str:
    """The hidden tests' program: calls the bugged function on the hidden inputs, prints the results."""
    return (f"import importlib, json, sys\nsys.path.insert(0, '/workspace')\nsys.setrecursionlimit(200)\nout = []\n"
            f"for args in {task.hidden_args!r}:\n    try:\n"
            f"        fn = getattr(importlib.import_module('{task.package}.{task.bugged.module}'), "
            f"'{task.bugged.name}')\n        out.append(repr(fn(*args)))\n"
            f"    except BaseException as exc:\n        out.append('error: ' + type(exc).__name__)\n"
            f"print()\nprint({MARKER!r} + json.dumps(out), flush=True)\n")


class RepoFixEnv(CodingEnv):
    """Fix the seeded bug of a generated package; reward = share of hidden tests passing (graded afterwards).

    Args:
        family: restrict bugs to one of ``BUG_FAMILIES`` (None: any).
        function: restrict bugs to one function of ``FUNCTIONS`` by name, e.g. ``"sum_to"`` (None: any of
            the family's); the narrowest task: only the package differs between seeds.
        num_hidden: hidden test cases per task.
        max_turns: steps before truncation (the tree is graded either way).
        limits: the workspace's limits; defaults suit small packages.
        **kwargs: ``tools`` (the tools offered: a subset of the five, see ``CodingEnv``),
            ``max_tool_calls_per_turn``, ``max_tool_output_chars``, ``tool_parser``.
    """

    def __init__(self, *, family: str | None = None, num_hidden: int = 8, max_turns: int = 12,
                 function: str | None = None, limits: WorkspaceLimits | None = None, **kwargs: Any) -> None:
        if family is not None and family not in BUG_FAMILIES:
            import difflib

            close = difflib.get_close_matches(str(family), BUG_FAMILIES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"env.kwargs.family: unknown bug family {family!r}{hint}; expected one of "
                             f"{', '.join(BUG_FAMILIES)} or None")
        names = [f.name for f in FUNCTIONS]
        if function is not None and function not in names:
            import difflib

            close = difflib.get_close_matches(str(function), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"env.kwargs.function: unknown function {function!r}{hint}; expected one of {', '.join(names)}")
        if function is not None and family is not None and FUNCTIONS[names.index(function)].family != family:
            raise ValueError(f"env.kwargs.function: {function!r}'s bug is of the family "
                             f"{FUNCTIONS[names.index(function)].family!r}, not {family!r}")
        if num_hidden < 1:
            raise ValueError(f"env.kwargs.num_hidden must be >= 1, got {num_hidden}")
        limits = limits or WorkspaceLimits(call_timeout_s=10.0, max_disk_bytes=16 << 20, max_processes=16,
                                           memory_mb=512)
        super().__init__(limits=limits, max_turns=max_turns, **kwargs)
        self.family, self.num_hidden, self.function = family, num_hidden, function
        self.task: Task | None = None

    def new_repo(self, rng: random.Random, options: dict[str, Any]) -> tuple[bytes, list[Message]]:
        self.task = make_task(rng, self.family, self.num_hidden, self.function)
        t = self.task
        names = list(self.tools)
        offered = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
        system = (f"You are a coding agent working in a repository at /workspace, with the "
                  f"tool{'s' if len(names) > 1 else ''} {offered}. When you are done, reply with a short summary "
                  "and no tool call; that ends the episode.")
        user = (f"The package `{t.package}` has a bug: the test `test_{t.bugged.name}` in "
                f"tests/test_{t.bugged.module}.py fails. Find the bug in the package and fix it (do not edit the "
                f"tests). Run the tests with `{TEST_COMMAND}`.")
        return make_tar(t.files), [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def grade(self, tree: bytes) -> float:
        task = self.task
        result = self.run_grader(tree, _harness(task))
        lines = [line for line in result.output.splitlines() if line.startswith(MARKER)]
        if not lines:
            self.last_grading_note = f"no result line ({result.status}): {result.output[-300:]}"
            return 0.0
        try:
            outputs = json.loads(lines[-1][len(MARKER):])
        except (ValueError, RecursionError):
            outputs = None
        if not isinstance(outputs, list) or len(outputs) != len(task.expected):
            self.last_grading_note = "malformed result line"
            return 0.0
        ok = [o == e for o, e in zip(outputs, task.expected)]
        passed, kept = sum(ok[:task.num_differing]), all(ok[task.num_differing:])
        self.last_grading_note = (f"{passed}/{task.num_differing} hidden tests of the bug pass; the "
                                  f"{len(ok) - task.num_differing} it did not touch {'pass' if kept else 'FAIL'}")
        return passed / task.num_differing if kept else 0.0


def task_of_seed(seed: int, *, family: str | None = None, num_hidden: int = 8, function: str | None = None,
                 **_: Any) -> Task:
    """The task ``reset(seed=seed)`` draws, without starting a workspace (as ``TextEnv.reset`` seeds it)."""
    np_random, _ = seeding.np_random(seed)
    return make_task(random.Random(int(np_random.integers(1 << 62))), family, num_hidden, function)


def expert(seed: int, *, env_kwargs: dict[str, Any] | None = None, tool_parser: str = "hermes",
           steps: str = "full", give_up_prob: float = 0.0, rng_seed: int | None = None) -> list[str]:
    """The assistant messages of a developer who fixes the bug of the episode ``reset(seed=seed)`` starts.

    ``steps="full"``: run the tests, read the module, ``str_replace`` the line, rerun the tests, answer.
    ``steps="fix"``: the ``str_replace`` and the answer only (short demonstrations for a tiny model).
    With probability ``give_up_prob`` it answers at once without fixing anything (reward 0): an
    imperfect demonstrator whose habit RL has to remove, as in the quickstart.

    Example:
        >>> "str_replace" in expert(0)[2]
        True
    """
    if steps not in ("full", "fix"):
        raise ValueError(f"expert: steps must be 'full' or 'fix', got {steps!r}")
    offered = (env_kwargs or {}).get("tools")
    needed = {"str_replace"} | ({"bash", "read_file"} if steps == "full" else set())
    if offered is not None and not needed <= set(offered):
        raise ValueError(f"expert: steps={steps!r} uses the tools {', '.join(sorted(needed))}, but the env offers "
                         f"only {', '.join(offered)} (env.kwargs.tools)")
    task = task_of_seed(seed, **(env_kwargs or {}))
    if random.Random(f"expert:{seed}:{rng_seed}").random() < give_up_prob:
        return ["I could not find the bug."]
    path = f"{task.package}/{task.bugged.module}.py"
    fix = format_tool_call("str_replace", {"path": path, "old": task.bugged.buggy, "new": task.bugged.correct},
                           tool_parser)
    answer = f"Fixed {task.bugged.name} in {path}: `{task.bugged.buggy}` should be `{task.bugged.correct}`."
    if steps == "fix":
        return [fix, answer]
    return [
        format_tool_call("bash", {"command": TEST_COMMAND + " 2>&1 | tail -n 12"}, tool_parser),
        format_tool_call("read_file", {"path": path}, tool_parser),
        fix,
        format_tool_call("bash", {"command": TEST_COMMAND + " 2>&1 | tail -n 3"}, tool_parser),
        answer,
    ]


RepoFixEnv.expert = staticmethod(expert)
