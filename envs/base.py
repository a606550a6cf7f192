"""Base classes: ``TextEnv`` (chat messages in, assistant text out) and ``ToolEnv`` (@tool methods).

Contract with the rollout loop:

- ``reset(*, seed=None, options=None) -> (messages, {"tools": [json schemas]})``.
- ``step(text) -> (new_messages, reward, terminated, truncated, info)``; ``info`` always has
  ``"turn"``, ``"success"`` and ``"num_tool_calls"``, and ``"error"`` when the action was malformed.
- ``step`` never raises on any action text; after ``max_turns`` steps the episode is truncated.
"""

from __future__ import annotations

import copy
import difflib
import functools
import inspect
import logging
import random
import string
from dataclasses import dataclass, field
from typing import Any

import anyio
import gymnasium
from gymnasium import spaces

from agentrl.rollout.tool_calls import DEFAULT_TOOL_PARSER, ToolCall, ToolCallParser, tool_parser_error
from agentrl.envs.tools import (
    SCHEMA_ATTR,
    ToolTimeoutError,
    call_with_timeout,
    format_tool_output,
    validate_arguments,
)

__all__ = ["MAX_ACTION_CHARS", "ChatMessages", "Message", "TextEnv", "ToolEnv", "Turn", "set_tool_parser"]

Message = dict[str, str]
MAX_ACTION_CHARS = 1 << 18
_ROLES = ("system", "user", "assistant", "tool")
logger = logging.getLogger(__name__)


class ChatMessages(spaces.Space[list]):
    """Space of chat-message lists: ``[{"role": ..., "content": str}, ...]``."""

    def __init__(self, max_messages: int = 1024, seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_messages = max_messages

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        return isinstance(x, list) and len(x) <= self.max_messages and all(
            isinstance(m, dict) and {"role", "content"} <= m.keys() and m["role"] in _ROLES
            and isinstance(m["content"], str) for m in x
        )

    def sample(self, mask: Any = None, probability: Any = None) -> list[Message]:
        if mask is not None or probability is not None:
            raise NotImplementedError("ChatMessages.sample takes no mask or probability")
        chars = list(string.printable)
        return [
            {"role": str(self.np_random.choice(_ROLES)),
             "content": "".join(self.np_random.choice(chars, size=int(self.np_random.integers(0, 40))))}
            for _ in range(int(self.np_random.integers(1, 4)))
        ]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChatMessages) and other.max_messages == self.max_messages

    def __repr__(self) -> str:
        return f"ChatMessages(max_messages={self.max_messages})"


@dataclass
class Turn:
    """What one step produced, before the base class adds turn counting and truncation."""

    messages: list[Message]
    reward: float = 0.0
    terminated: bool = False
    success: bool = False
    num_tool_calls: int = 0
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _user(content: str) -> Message:
    return {"role": "user", "content": content}


class TextEnv(gymnasium.Env[list, str]):
    """A multi-turn text env. Subclasses implement ``new_task`` and ``respond``.

    Args:
        max_turns: steps after which the episode is truncated.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, *, max_turns: int = 8) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.observation_space = ChatMessages()
        self.action_space = spaces.Text(max_length=MAX_ACTION_CHARS, min_length=0, charset=string.printable)
        self.num_turns = 0
        self._done = True

    def new_task(self, rng: random.Random, options: dict[str, Any]) -> list[Message]:
        """Draw a task with ``rng`` (seeded from ``reset``'s seed); return the first messages."""
        raise NotImplementedError

    def respond(self, action: str) -> Turn:
        """Answer one assistant message. Exceptions become error observations."""
        raise NotImplementedError

    def tool_schemas(self) -> list[dict[str, Any]]:
        """JSON schemas of the tools, as ``reset`` puts them in ``info["tools"]``."""
        return []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[list, dict]:
        """Start an episode: ``(first messages, {"tools": schemas})``; the same seed, the same task."""
        super().reset(seed=seed)
        rng = random.Random(int(self.np_random.integers(1 << 62)))
        messages = self.new_task(rng, dict(options or {}))
        self.num_turns, self._done = 0, False
        return copy.deepcopy(messages), {"tools": copy.deepcopy(self.tool_schemas())}

    def step(self, action: str) -> tuple[list, float, bool, bool, dict]:
        """``(new messages, reward, terminated, truncated, info)``; never raises on any action."""
        if self._done:
            return self._after_end()
        self.num_turns += 1
        try:
            turn = self.respond(action)
        except Exception as exc:  # an env bug must not crash the rollout; the model sees an error
            turn = self._crash(exc)
        return self._finish(turn)

    def close(self) -> None:
        self._done = True

    def _crash(self, exc: Exception) -> Turn:
        logger.exception("%s.respond raised", type(self).__name__)
        error = f"internal environment error: {type(exc).__name__}: {str(exc)[:300]}"
        return Turn([_user(f"Error: {error}")], error=error)

    def _after_end(self) -> tuple[list, float, bool, bool, dict]:
        error = "the episode is over (or was never started); call reset()"
        return [_user(f"Error: {error}")], 0.0, True, False, {
            "turn": self.num_turns, "success": False, "num_tool_calls": 0, "error": error}

    def _finish(self, turn: Turn) -> tuple[list, float, bool, bool, dict]:
        truncated = not turn.terminated and self.num_turns >= self.max_turns
        self._done = turn.terminated or truncated
        info = {**turn.info, "turn": self.num_turns, "success": bool(turn.success and turn.terminated),
                "num_tool_calls": turn.num_tool_calls}
        if turn.error is not None:
            info["error"] = turn.error
        return list(turn.messages), float(turn.reward), bool(turn.terminated), truncated, info


@dataclass
class _Planned:
    call: ToolCall | None
    error: str | None = None


class ToolEnv(TextEnv):
    """A ``TextEnv`` whose tools are methods marked ``@tool``; a message without a call is the answer.

    Subclasses implement ``new_task`` and ``score(answer) -> float`` (reward in [0, 1]; success
    means 1.0). Tool calls are parsed by :attr:`tool_parser` (vLLM's parser of the model's
    format, see :mod:`agentrl.rollout.tool_calls`), validated against each tool's schema, run with a
    timeout, and answered with one ``tool`` message per call, in order.

    Args:
        max_turns: steps after which the episode is truncated.
        tool_timeout_s: wall-clock limit of one tool call.
        max_tool_calls_per_turn: calls beyond this in one message get an error instead of running.
        max_tool_output_chars: longer tool output is truncated.
        tool_parser: name of the vLLM tool parser that reads the model's calls (``hermes``,
            ``llama3_json``, ``mistral``, ...). The rollout replaces it with the parser chosen by
            ``rollout.tool_parser``, built with the model's tokenizer (:func:`set_tool_parser`).
    """

    def __init__(self, *, max_turns: int = 8, tool_timeout_s: float = 10.0, max_tool_calls_per_turn: int = 8,
                 max_tool_output_chars: int = 4000, tool_parser: str = DEFAULT_TOOL_PARSER) -> None:
        super().__init__(max_turns=max_turns)
        self.tool_timeout_s = tool_timeout_s
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.max_tool_output_chars = max_tool_output_chars
        error = tool_parser_error(tool_parser, key="tool_parser")
        if error is not None or tool_parser == "auto":  # (auto needs a model: the rollout resolves it)
            raise ValueError(error or "tool_parser: 'auto' needs a checkpoint; give the parser's name")
        self.tool_parser_name = tool_parser
        self._tool_parser: ToolCallParser | None = None
        marked: dict[str, None] = {}  # definition order; a subclass may override a tool without @tool
        for klass in reversed(type(self).__mro__):
            for attr, value in vars(klass).items():
                if hasattr(value, SCHEMA_ATTR):
                    marked[attr] = None
                else:
                    marked.pop(attr, None)
        self.tools: dict[str, Any] = {
            getattr(self, attr).__agentrl_tool_schema__["function"]["name"]: getattr(self, attr) for attr in marked}

    def score(self, answer: str) -> float:
        """Reward of the final answer (the assistant text without tool calls), in [0, 1]."""
        raise NotImplementedError

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [getattr(fn, SCHEMA_ATTR) for fn in self.tools.values()]

    def respond(self, action: str) -> Turn:
        plan = self._plan(action)
        return plan if isinstance(plan, Turn) else self._tool_turn(plan, [self._run(p) for p in plan])

    async def astep(self, action: str) -> tuple[list, float, bool, bool, dict]:
        """Like ``step``, but awaits async tools; sync tools and scoring run in worker threads."""
        if self._done:
            return self._after_end()
        self.num_turns += 1
        try:  # parsing and scoring may be slow (PythonSandbox runs hidden tests): off the event loop
            plan = await anyio.to_thread.run_sync(self._plan, action, abandon_on_cancel=True)
            turn = plan if isinstance(plan, Turn) else self._tool_turn(plan, [await self._arun(p) for p in plan])
        except Exception as exc:
            turn = self._crash(exc)
        return self._finish(turn)

    @property
    def tool_parser(self) -> ToolCallParser:
        """The parser of the model's tool calls (built on first use from ``tool_parser``)."""
        if self._tool_parser is None:
            self._tool_parser = ToolCallParser(self.tool_parser_name)
        return self._tool_parser

    @tool_parser.setter
    def tool_parser(self, parser: ToolCallParser) -> None:
        self._tool_parser, self.tool_parser_name = parser, parser.name

    def format_tool_call(self, name: str, arguments: dict[str, Any]) -> str:
        """One call as the model's format writes it (for experts and tests)."""
        return self.tool_parser.format(name, arguments)

    def _plan(self, action: Any) -> Turn | list[_Planned]:
        """The final-answer turn, or one entry per tool call in order (a call or an error)."""
        if not isinstance(action, str):
            error = f"the action must be text, got {type(action).__name__}"
            return Turn([_user(f"Error: {error}")], error=error)
        # Blocks past 4x the limit are not even parsed: a degenerate policy can write thousands.
        whole = self.tool_parser.parse(action, max_calls=4 * self.max_tool_calls_per_turn)
        if not whole.items:
            reward = float(self.score(whole.content))
            return Turn([], reward=reward, terminated=True, success=reward >= 1.0)
        plan = [_Planned(item) if isinstance(item, ToolCall) else _Planned(None, item) for item in whole.items]
        for p in plan[self.max_tool_calls_per_turn:]:
            if p.call is not None:
                p.error = f"too many tool calls in one message (limit {self.max_tool_calls_per_turn}); not run"
        return plan

    def _check(self, planned: _Planned) -> str | None:
        if planned.error is not None or planned.call is None:
            return planned.error or "no tool call"
        name = planned.call.name
        if name not in self.tools:
            close = difflib.get_close_matches(name, list(self.tools), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            return f"unknown tool {name[:100]!r}.{hint} Available tools: {', '.join(self.tools) or 'none'}."
        problems = validate_arguments(getattr(self.tools[name], SCHEMA_ATTR), planned.call.arguments)
        return f"invalid arguments for {name}: " + "; ".join(problems[:5]) if problems else None

    def _run(self, planned: _Planned) -> tuple[str, str | None]:
        error = self._check(planned)
        if error is None:
            try:
                value = call_with_timeout(self.tools[planned.call.name], planned.call.arguments, self.tool_timeout_s)
                return format_tool_output(value, self.max_tool_output_chars), None
            except Exception as exc:
                error = _describe(exc)
        return self._error(error)

    async def _arun(self, planned: _Planned) -> tuple[str, str | None]:
        error = self._check(planned)
        if error is None:
            fn, args = self.tools[planned.call.name], planned.call.arguments
            try:
                with anyio.move_on_after(self.tool_timeout_s) as scope:
                    if inspect.iscoroutinefunction(fn):
                        value = await fn(**args)
                    else:
                        value = await anyio.to_thread.run_sync(functools.partial(fn, **args), abandon_on_cancel=True)
                    return format_tool_output(value, self.max_tool_output_chars), None
                error = _describe(ToolTimeoutError(f"the tool did not finish within {self.tool_timeout_s:g} s"))
                assert scope.cancelled_caught
            except Exception as exc:
                error = _describe(exc)
        return self._error(error)

    def _error(self, error: str) -> tuple[str, str]:
        return "Error: " + format_tool_output(error, self.max_tool_output_chars), error[:300]

    def _tool_turn(self, plan: list[_Planned], outputs: list[tuple[str, str | None]]) -> Turn:
        errors = [e for _, e in outputs if e is not None]
        return Turn(
            [{"role": "tool", "content": content} for content, _ in outputs],
            num_tool_calls=sum(p.call is not None and p.error is None for p in plan),
            error="; ".join(errors)[:1000] if errors else None,
        )


def set_tool_parser(env: Any, parser: ToolCallParser) -> bool:
    """Make ``env`` (a gymnasium env, wrapped or not) read tool calls with ``parser``; returns
    whether it takes one (envs without tools do not)."""
    inner = getattr(env, "unwrapped", env)
    if not isinstance(inner, ToolEnv):
        return False
    inner.tool_parser = parser
    return True


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ToolTimeoutError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
