"""The ``@tool`` decorator, argument validation against a tool's JSON schema, and timed calls.

A tool is an env method with type hints and a Google-style docstring. Its JSON schema comes from
``transformers.utils.get_json_schema`` (the format ``apply_chat_template(..., tools=...)`` takes),
computed once when the class body runs, so a missing docstring fails at import, not mid-episode.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from transformers.utils import get_json_schema

__all__ = ["ToolTimeoutError", "call_with_timeout", "format_tool_output", "tool", "validate_arguments"]

F = TypeVar("F", bound=Callable[..., Any])
SCHEMA_ATTR = "__agentrl_tool_schema__"

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


class ToolTimeoutError(TimeoutError):
    """A tool call ran past the env's ``tool_timeout_s``."""


def tool(fn: F) -> F:
    """Mark an env method as a tool; its schema comes from its type hints and docstring.

    Example:
        >>> class Env:
        ...     @tool
        ...     def add(self, a: int, b: int) -> int:
        ...         '''Add two integers.
        ...
        ...         Args:
        ...             a: The first integer.
        ...             b: The second integer.
        ...         '''
        ...         return a + b
        >>> Env.add.__agentrl_tool_schema__["function"]["parameters"]["required"]
        ['a', 'b']

    Raises:
        TypeError: the function lacks type hints or a docstring that describes every argument.
    """
    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers raises its own parsing exception types
        raise TypeError(
            f"@tool {fn.__qualname__}: cannot build a JSON schema ({exc}). A tool needs a type hint on "
            "every argument and a Google-style docstring with an 'Args:' entry for each one."
        ) from exc
    setattr(fn, SCHEMA_ATTR, schema)
    return fn


def _type_ok(value: Any, json_type: str) -> bool:
    if json_type == "any":
        return True
    if json_type in ("integer", "number") and isinstance(value, bool):
        return False  # JSON true is not a number, although Python's bool subclasses int
    return isinstance(value, _JSON_TYPES.get(json_type, object))


def _check(value: Any, schema: dict[str, Any], where: str, errors: list[str]) -> None:
    if value is None and schema.get("nullable"):
        return
    types = schema.get("type", "any")
    types = types if isinstance(types, list) else [types]
    if not any(_type_ok(value, t) for t in types):
        errors.append(f"{where} must be {' or '.join(types)}, got {type(value).__name__}")
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where} must be one of {schema['enum']}, got {value!r}"[:300])
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{where}[{i}]", errors)
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            _check(item, schema["additionalProperties"], f"{where}[{key!r}]", errors)


def validate_arguments(schema: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """Check call arguments against a tool schema: required, unknown, types, enums, items.

    Args:
        schema: the tool's schema, ``{"type": "function", "function": {...}}``.
        arguments: the parsed ``arguments`` object of the call.

    Returns:
        One message per problem; empty when the call is valid.
    """
    params = schema["function"].get("parameters", {})
    properties: dict[str, Any] = params.get("properties", {})
    errors = [f"missing required argument '{name}'" for name in params.get("required", []) if name not in arguments]
    for name, value in arguments.items():
        if name not in properties:
            errors.append(f"unexpected argument {name!r}"[:200] + f" (expected: {', '.join(properties) or 'none'})")
        else:
            _check(value, properties[name], f"argument '{name}'", errors)
    return errors


def call_with_timeout(fn: Callable[..., Any], arguments: dict[str, Any], timeout_s: float) -> Any:
    """Call ``fn(**arguments)`` (sync or async) in a daemon thread and wait at most ``timeout_s``.

    A call that overruns is abandoned, not killed (Python threads cannot be): in-process tools should
    be bounded; untrusted code belongs in :mod:`agentrl.envs.sandbox`, which kills its process.

    Raises:
        ToolTimeoutError: the call did not finish in time.
        Exception: whatever the tool raised.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            result = fn(**arguments)
            box["value"] = asyncio.run(result) if inspect.iscoroutine(result) else result
        except Exception as exc:  # handed to the caller's thread
            box["error"] = exc
        except BaseException as exc:  # SystemExit and the like must not escape env.step
            box["error"] = RuntimeError(f"the tool raised {type(exc).__name__}")

    thread = threading.Thread(target=target, name=f"tool-{getattr(fn, '__name__', 'call')}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ToolTimeoutError(f"the tool did not finish within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def format_tool_output(value: Any, max_chars: int) -> str:
    """Render a tool's return value as message text, truncated to ``max_chars`` characters."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError, RecursionError):
            text = repr(value)
    if len(text) > max_chars:
        text = text[:max_chars] + f"\n[output truncated: showing {max_chars} of {len(text)} characters]"
    return text
