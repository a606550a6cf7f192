"""ToolEnv / TextEnv contract: schemas from @tool, validation, timeouts, errors, truncation, astep."""

from __future__ import annotations

import asyncio
import time

import gymnasium
import pytest

import agentrl.envs  # noqa: F401  (registers the built-ins)
from agentrl.rollout.chat import format_tool_call
from agentrl.envs import ChatMessages, ToolEnv, tool
from agentrl.envs.tools import validate_arguments


class AdderEnv(ToolEnv):
    """Test env: answer a + b; tools that behave well and badly."""

    def new_task(self, rng, options):
        self.a, self.b = rng.randint(1, 99), rng.randint(1, 99)
        return [{"role": "user", "content": f"What is {self.a} + {self.b}?"}]

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b

    @tool
    def nap(self, seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "awake"

    @tool
    def boom(self) -> str:
        """Raise an exception."""
        raise RuntimeError("kaboom")

    @tool
    def leave(self) -> str:
        """Raise SystemExit inside the tool."""
        raise SystemExit(3)

    @tool
    def flood(self, n: int) -> str:
        """Return a long string.

        Args:
            n: Number of characters.
        """
        return "x" * n

    @tool
    async def echo(self, text: str, delay: float = 0.0) -> str:
        """Echo text, asynchronously.

        Args:
            text: What to echo.
            delay: Seconds to wait first.
        """
        await asyncio.sleep(delay)
        return text

    def score(self, answer):
        return 1.0 if str(self.a + self.b) in answer else 0.0


def make(**kwargs) -> AdderEnv:
    env = AdderEnv(**{"tool_timeout_s": 0.3, "max_tool_output_chars": 100, **kwargs})
    env.reset(seed=0)
    return env


def call(name: str, **args) -> str:
    return format_tool_call(name, args)


def test_schema_comes_from_type_hints_and_docstring():
    _, info = AdderEnv().reset(seed=0)
    schemas = {s["function"]["name"]: s["function"] for s in info["tools"]}
    assert list(schemas) == ["add", "nap", "boom", "leave", "flood", "echo"]  # definition order
    assert schemas["add"]["description"] == "Add two integers."
    assert schemas["add"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first integer."}
    assert schemas["add"]["parameters"]["required"] == ["a", "b"]
    assert schemas["echo"]["parameters"]["required"] == ["text"]


def test_tool_without_docstring_is_rejected_when_the_class_is_defined():
    with pytest.raises(TypeError, match="docstring"):
        class Bad(ToolEnv):
            @tool
            def f(self, x: int) -> int:
                return x


def test_tool_call_then_final_answer():
    env = make()
    obs, reward, terminated, truncated, info = env.step(call("add", a=env.a, b=env.b))
    assert obs == [{"role": "tool", "content": str(env.a + env.b)}]
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info == {"turn": 1, "success": False, "num_tool_calls": 1}
    obs, reward, terminated, truncated, info = env.step(f"It is {env.a + env.b}.")
    assert (obs, reward, terminated, truncated, info["success"]) == ([], 1.0, True, False, True)
    obs, *_, info = env.step("again")  # after the end: an error, not an exception
    assert "reset" in info["error"] and "reset" in obs[0]["content"]


def test_wrong_final_answer_gets_zero():
    env = make()
    _, reward, terminated, _, info = env.step("No idea.")
    assert (reward, terminated, info["success"]) == (0.0, True, False)


@pytest.mark.parametrize(("action", "expected"), [
    ("<tool_call>{not json}</tool_call>", "malformed tool call"),
    ("<tool_call>[1, 2]</tool_call>", "malformed tool call"),
    (call("ad", a=1, b=2), "Did you mean 'add'?"),
    (call("add", a=1), "missing required argument 'b'"),
    (call("add", a="1", b=2), "argument 'a' must be integer, got str"),
    (call("add", a=True, b=2), "argument 'a' must be integer, got bool"),
    (call("add", a=1.5, b=2), "must be integer, got float"),
    (call("add", a=1, b=2, c=3), "unexpected argument 'c'"),
    (call("boom"), "RuntimeError: kaboom"),
    (call("leave"), "SystemExit"),
    (call("nap", seconds=5), "did not finish within 0.3 s"),
    # (vLLM's hermes parser accepts a last block whose </tool_call> is missing; a cut JSON is malformed)
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2', "malformed tool call"),
])
def test_malformed_calls_give_an_error_and_the_episode_continues(action, expected):
    env = make()
    obs, reward, terminated, truncated, info = env.step(action)
    assert not terminated and not truncated and reward == 0.0
    assert obs[0]["role"] == "tool" and obs[0]["content"].startswith("Error: ") and expected in obs[0]["content"]
    assert expected in info["error"]
    obs, *_ = env.step(call("add", a=2, b=3))  # still usable
    assert obs == [{"role": "tool", "content": "5"}]


def test_hanging_tool_returns_within_its_timeout():
    env = make()
    start = time.monotonic()
    env.step(call("nap", seconds=30))
    assert time.monotonic() - start < 2.0


def test_huge_output_is_truncated():
    obs, *_ = make().step(call("flood", n=10**6))
    assert len(obs[0]["content"]) < 200 and "truncated: showing 100 of 1000000 characters" in obs[0]["content"]


def test_calls_answered_in_order_with_errors_in_place_and_a_cap_per_message():
    env = make(max_tool_calls_per_turn=3)
    action = call("add", a=1, b=1) + "<tool_call>oops</tool_call>" + call("add", a=2, b=2) + call("add", a=3, b=3)
    obs, _, _, _, info = env.step(action)
    contents = [m["content"] for m in obs]
    assert contents[0] == "2" and contents[1].startswith("Error: malformed tool call '<tool_call>oops</tool_call>'") and contents[2] == "4"
    assert "too many tool calls" in contents[3]
    assert info["num_tool_calls"] == 2


def test_max_turns_truncates():
    env = make(max_turns=2)
    assert env.step(call("add", a=1, b=1))[3] is False
    _, _, terminated, truncated, info = env.step(call("add", a=1, b=1))
    assert (terminated, truncated, info["turn"]) == (False, True, 2)


def test_step_before_reset_and_non_text_action_do_not_raise():
    env = AdderEnv()
    assert "reset" in env.step("hi")[4]["error"]
    env.reset(seed=1)
    obs, *_, info = env.step(None)
    assert "must be text" in info["error"] and obs[0]["role"] == "user"
    env.close()
    env.close()


def test_astep_awaits_async_tools_and_times_out():
    env = make()

    async def episode():
        first = await env.astep(call("echo", text="hi") + call("add", a=1, b=2))
        slow = await env.astep(call("echo", text="hi", delay=5))
        final = await env.astep(f"{env.a + env.b}")
        return first, slow, final

    start = time.monotonic()
    first, slow, final = asyncio.run(episode())
    assert [m["content"] for m in first[0]] == ["hi", "3"]
    assert "did not finish within 0.3 s" in slow[0][0]["content"] and time.monotonic() - start < 2.0
    assert final[1:4] == (1.0, True, False)


def test_sync_step_runs_async_tools():
    obs, *_ = make().step(call("echo", text="héllo ✓"))
    assert obs == [{"role": "tool", "content": "héllo ✓"}]


def test_validate_arguments_covers_schema_features():
    schema = {"function": {"parameters": {"type": "object", "required": ["xs"], "properties": {
        "xs": {"type": "array", "items": {"type": "integer"}},
        "mode": {"type": "string", "enum": ["a", "b"]},
        "x": {"type": "number", "nullable": True},
        "u": {"type": ["integer", "string"]},
    }}}}
    assert validate_arguments(schema, {"xs": [1, 2], "mode": "a", "x": 3, "u": "s"}) == []
    assert validate_arguments(schema, {"xs": [1], "x": None}) == []
    assert validate_arguments(schema, {"xs": [1, "2"]}) == ["argument 'xs'[1] must be integer, got str"]
    assert "must be one of" in validate_arguments(schema, {"xs": [], "mode": "c"})[0]
    assert "must be integer or string" in validate_arguments(schema, {"xs": [], "u": 1.5})[0]


def test_chat_messages_space():
    space = ChatMessages(seed=0)
    assert space.contains([{"role": "tool", "content": "x"}]) and space.contains([])
    assert not space.contains([{"role": "robot", "content": "x"}])
    assert not space.contains([{"role": "user", "content": 3}])
    assert all(space.contains(space.sample()) for _ in range(10))


def test_unknown_env_id_gets_gymnasiums_did_you_mean():
    with pytest.raises(gymnasium.error.NameNotFound, match="Did you mean: `Calculator`"):
        gymnasium.make("agentrl/Calculater-v0")


def test_json_the_parser_cannot_convert_still_gives_an_error_not_an_exception():
    env = make()
    huge = '<tool_call>{"name": "add", "arguments": {"a": ' + "1" * 5000 + ', "b": 1}}</tool_call>'
    obs, reward, terminated, truncated, info = env.step(huge)
    assert not terminated and "error" in info and obs[0]["content"].startswith("Error: ")
    assert env.step(call("add", a=2, b=3))[0] == [{"role": "tool", "content": "5"}]
