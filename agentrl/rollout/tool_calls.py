"""Tool calls in sampled text: parsed by vLLM's tool parsers, written in a family's format.

Parsing runs offline (no OpenAI server): :class:`ToolCallParser` wraps one of vLLM's parsers
(``vllm.tool_parsers.ToolParserManager``: hermes, llama3_json, mistral, pythonic, ...) and turns
its output into :class:`ToolCall` objects plus one error per malformed call, which an env answers
with an ``Error: ...`` tool message. For formats whose calls start with a marker (``<tool_call>``,
``[TOOL_CALLS]``), the text is cut at the markers and each block is handed to vLLM on its own: one
malformed block then costs only its own call (vLLM's parsers drop every call of a message when one
fails), and the work stays linear in the text with any number of calls.

:func:`format_tool_call` writes one call as a family's model would emit it (for demonstrators
and tests); every parser it supports parses its output back.

vLLM is imported when a parser is first built, never at import time; the parser names are read
from vLLM's registry source without importing it (config validation stays instant). This module
knows nothing of envs, rollouts or Ray.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import logging
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_TOOL_PARSER",
    "build_tool_parser",
    "FAMILY_TOOL_PARSERS",
    "FORMATTED_PARSERS",
    "ToolCall",
    "ToolCallParse",
    "ToolCallParser",
    "detect_tool_parser",
    "format_tool_call",
    "format_tool_calls",
    "known_parser_names",
    "parse_tool_calls",
    "tool_parser_error",
]

DEFAULT_TOOL_PARSER = "hermes"
# Model family (config.json model_type, or agentrl's tiny-model family) -> vLLM parser name.
FAMILY_TOOL_PARSERS: dict[str, str] = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama": "llama3_json",
    "llama3": "llama3_json",
    "llama4": "llama4_pythonic",
    "mistral": "mistral",
    "mistral3": "mistral",
    "ministral": "mistral",
}
MAX_ERROR_SNIPPET = 80
DEFAULT_MAX_CALLS = 64


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments object."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ToolCallParse:
    """Result of parsing one assistant message.

    ``items`` holds, in the order the model wrote them, a :class:`ToolCall` for each call that
    parsed and an error string for each that did not; ``calls`` and ``errors`` are the two kinds
    apart. ``content`` is the text outside the calls (the answer when there is no call).
    """

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""
    items: list[ToolCall | str] = field(default_factory=list)

    def add(self, item: ToolCall | str) -> None:
        self.items.append(item)
        (self.calls if isinstance(item, ToolCall) else self.errors).append(item)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Writing calls in a family's format.


def _hermes(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _llama3_json(name: str, arguments: dict[str, Any]) -> str:
    # Llama 3.1-3.3 custom tools: one bare JSON object with "parameters" (the documented key).
    return json.dumps({"name": name, "parameters": arguments})


def _mistral(name: str, arguments: dict[str, Any]) -> str:
    # Mistral tokenizer v11+ (Mistral Small 3.2, Magistral, Devstral): [TOOL_CALLS]name[ARGS]{json}.
    return "[TOOL_CALLS]" + name + "[ARGS]" + json.dumps(arguments)


_FORMATTERS = {
    "hermes": _hermes,
    "qwen3_json": _hermes,
    "llama3_json": _llama3_json,
    "llama4_json": _llama3_json,
    "mistral": _mistral,
}
FORMATTED_PARSERS = tuple(sorted(_FORMATTERS))
# Between two calls of one message (Llama 3's JSON calls are separated by semicolons).
_SEPARATORS = {"llama3_json": "; ", "llama4_json": "; ", "hermes": "\n", "qwen3_json": "\n"}
# The text that starts each call, for formats that have one: the text is cut there.
_CALL_MARKERS = {"hermes": "<tool_call>", "qwen3_json": "<tool_call>", "qwen3_xml": "<tool_call>",
                 "qwen3_coder": "<tool_call>", "mistral": "[TOOL_CALLS]"}
# Special tokens a format needs in the vocabulary of the tokenizer its vLLM parser is built with.
_MARKER_TOKENS = {
    "hermes": ["<tool_call>", "</tool_call>"],
    "qwen3_json": ["<tool_call>", "</tool_call>"],
    "llama3_json": ["<|python_tag|>"],
    "llama4_json": ["<|python_tag|>"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]"],
}
# What a call looks like, for error messages.
_EXAMPLES = {name: fn("name", {"arg": "value"}) for name, fn in _FORMATTERS.items()}
# A message without a marker "attempts" a call (and a parse failure is an error, not the answer)
# when it looks like one of these.
_ATTEMPT_RES = {
    "llama3_json": re.compile(r"\{\s*\"name\"\s*:"),
    "llama4_json": re.compile(r"\{\s*\"name\"\s*:"),
}
_PYTHONIC_ATTEMPT = re.compile(r"^\s*\[\s*[A-Za-z_][\w.]*\s*\(")
# Characters a vLLM parser spends super-linear time on, and how many one call may hold before it
# is reported as malformed unread. vLLM's mistral parser makes an event (a pydantic object) per
# "[" of a call and slows quadratically: 20k "[" take 0.3 s, 160k take 9 s (tests/test_tool_calls.py).
_SLOW_CHARS = {"mistral": ("[", 4096)}


def format_tool_call(name: str, arguments: dict[str, Any], parser: str = DEFAULT_TOOL_PARSER) -> str:
    """The text a model of ``parser``'s format emits for one call (demonstrators, tests).

    Example:
        >>> format_tool_call("f", {"x": 1})
        '<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>'
        >>> format_tool_call("f", {"x": 1}, "llama3_json")
        '{"name": "f", "parameters": {"x": 1}}'

    Raises:
        ValueError: agentrl cannot write calls in this format (it can still parse them).
    """
    try:
        fn = _FORMATTERS[parser]
    except KeyError:
        raise ValueError(f"format_tool_call: no writer for tool parser {parser!r} (rollout.tool_parser); "
                         f"agentrl writes calls in: {', '.join(FORMATTED_PARSERS)}") from None
    return fn(name, arguments)


def format_tool_calls(calls: list[tuple[str, dict[str, Any]]], parser: str = DEFAULT_TOOL_PARSER) -> str:
    """Several calls in one message, as ``parser``'s format separates them.

    Example:
        >>> format_tool_calls([("f", {}), ("g", {"y": 2})], "llama3_json")
        '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"y": 2}}'
    """
    return _SEPARATORS.get(parser, "").join(format_tool_call(n, a, parser) for n, a in calls)


# ---------------------------------------------------------------------------------------------
# Parser names, validation and detection (no vLLM import).


@functools.lru_cache(maxsize=1)
def known_parser_names() -> tuple[str, ...]:
    """Names in vLLM's tool-parser registry, read from its source (vLLM is not imported)."""
    spec = importlib.util.find_spec("vllm")  # a top-level spec: finding it imports nothing
    for root in (spec.submodule_search_locations or []) if spec else []:
        for where in ("tool_parsers", "entrypoints/openai/tool_parsers"):  # vLLM >= 0.11, older
            source = Path(root) / where / "__init__.py"
            names = _registry_names(source.read_text()) if source.is_file() else set()
            if names:
                return tuple(sorted(names))
    return tuple(FORMATTED_PARSERS)  # vLLM absent: the formats agentrl itself writes


def _registry_names(source: str) -> set[str]:
    """Keys of the registry dict and names given to ``register_module`` decorators."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            if any(isinstance(t, ast.Name) and "PARSER" in t.id for t in node.targets):
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return names


def tool_parser_error(name: str, key: str | None = "rollout.tool_parser") -> str | None:
    """A did-you-mean message when ``name`` is neither ``auto`` nor a vLLM parser; else None."""
    known = known_parser_names()
    if name == "auto" or name in known:
        return None
    import difflib

    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    prefix = f"{key}: " if key else ""
    return f"{prefix}unknown tool parser {name!r}.{hint} Use 'auto' or one of: {', '.join(known)}"


def detect_tool_parser(model_path: str | Path) -> str:
    """The parser of a checkpoint's family: from its chat template's call syntax, else its model_type.

    Raises:
        ValueError: neither tells (the message says to set ``rollout.tool_parser``).
    """
    path = Path(model_path)
    template = _chat_template(path)
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "qwen3_xml" if "<function=" in template else "hermes"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    model_type = ""
    if (path / "config.json").is_file():
        model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
    if model_type in FAMILY_TOOL_PARSERS:
        return FAMILY_TOOL_PARSERS[model_type]
    raise ValueError(f"rollout.tool_parser=auto: cannot tell the tool-call format of {path} (model_type "
                     f"{model_type!r}, no known call syntax in its chat template); set rollout.tool_parser to one "
                     f"of: {', '.join(known_parser_names())}")


def _chat_template(path: Path) -> str:
    parts = []
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        if (path / name).is_file():
            text = (path / name).read_text()
            parts.append(str(json.loads(text).get("chat_template", "")) if name.endswith(".json") else text)
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Parsing through vLLM.


def _marker_tokenizer(tokens: list[str]) -> Any:
    """A real (tiny) Hugging Face tokenizer whose vocabulary holds a format's special tokens: what
    vLLM's parsers look up at construction when no model tokenizer is at hand."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=tokens)


class ToolCallParser:
    """Parses tool calls with vLLM's parser ``name``; :meth:`parse` never raises.

    Args:
        name: a vLLM tool-parser name (``hermes``, ``llama3_json``, ``mistral``, ...).
        tokenizer: the model's tokenizer (some parsers read its vocabulary: Mistral's decides
            between the ``[TOOL_CALLS][...]`` and ``[TOOL_CALLS]name[ARGS]{...}`` formats by it).
            Without one, a tiny tokenizer holding the format's marker tokens is used.
        tools: the tools' JSON schemas (parsers that convert argument types read them).

    Example:
        >>> p = ToolCallParser("hermes")
        >>> p.parse('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>').calls
        [ToolCall(name='f', arguments={'x': 1})]
    """

    def __init__(self, name: str = DEFAULT_TOOL_PARSER, tokenizer: Any = None,
                 tools: list[dict[str, Any]] | None = None) -> None:
        error = tool_parser_error(name)
        if error is not None or name == "auto":
            raise ValueError(error or "ToolCallParser needs a parser name; resolve 'auto' with detect_tool_parser")
        self.name = name
        self.marker = _CALL_MARKERS.get(name)
        self._vllm_parser = _build_vllm_parser(name, tokenizer, tools)
        self._request = _request(tools)
        # One parser serves every env of a rollout actor, whose steps run in worker threads; some
        # of vLLM's parsers keep state between calls (Mistral's parser engine).
        self._lock = threading.Lock()

    def format(self, name: str, arguments: dict[str, Any]) -> str:
        """One call in this parser's format (see :func:`format_tool_call`)."""
        return format_tool_call(name, arguments, self.name)

    def parse(self, text: Any, *, max_calls: int = DEFAULT_MAX_CALLS) -> ToolCallParse:
        """Calls and errors in ``text``, in order. Calls past ``max_calls`` are not parsed (one
        error says how many were left out), which keeps the work linear in the text."""
        result = ToolCallParse()
        if not isinstance(text, str):
            result.add(f"assistant message must be text, got {type(text).__name__}")
            return result
        if self.marker is None:
            return self._parse_whole(text, result, max_calls)
        first = text.find(self.marker)
        if first < 0:
            result.content = text.strip()
            return result
        result.content = text[:first].strip()
        starts, pos = [], first
        while pos >= 0:
            starts.append(pos)
            pos = text.find(self.marker, pos + len(self.marker))
        limit = max(max_calls, 0)
        for i, start in enumerate(starts[:limit]):
            end = starts[i + 1] if i + 1 < len(starts) else len(text)
            self._parse_block(text[start:end], result)
        if len(starts) > limit:
            result.add(f"too many tool calls in one message ({len(starts)}); at most {limit} are read")
        return result

    def _extract(self, text: str) -> tuple[list[Any] | None, str | None, str | None]:
        """(vLLM's tool calls or None, its content, an error) for one piece of text."""
        try:
            with self._lock:
                info = self._vllm_parser.extract_tool_calls(text, self._request)
        except Exception as exc:  # a parser bug must read as a malformed call, not crash the rollout
            return None, None, f"{type(exc).__name__}: {str(exc)[:MAX_ERROR_SNIPPET]}"
        calls = list(info.tool_calls or []) if info.tools_called else []
        return calls, info.content, None

    def _convert(self, calls: list[Any], result: ToolCallParse) -> None:
        for call in calls:
            name, raw = call.function.name, call.function.arguments
            try:
                args = json.loads(raw) if isinstance(raw, str) else raw
                if isinstance(args, str):  # some models write the arguments object as a JSON string
                    args = json.loads(args)
            except (ValueError, RecursionError):
                result.add(f"tool call {str(name)[:MAX_ERROR_SNIPPET]!r}: arguments are not valid JSON")
                continue
            if not isinstance(name, str) or not name:
                result.add("tool call needs a non-empty string name")
            elif not isinstance(args, dict):
                result.add(f"tool call {name[:MAX_ERROR_SNIPPET]!r}: arguments must be an object, "
                           f"got {type(args).__name__}")
            else:
                result.add(ToolCall(name=name, arguments=args))

    def _malformed(self, block: str, detail: str | None = None) -> str:
        snippet = block.strip()[:MAX_ERROR_SNIPPET]
        example = _EXAMPLES.get(self.name)
        msg = f"malformed tool call {snippet!r}" + (f" ({detail})" if detail else "")
        return msg + (f"; expected {example}" if example else f"; expected the {self.name} tool-call format")

    def _parse_block(self, block: str, result: ToolCallParse) -> None:
        char, limit = _SLOW_CHARS.get(self.name, ("", 0))
        if char and block.count(char) > limit:
            result.add(self._malformed(block, f"more than {limit} {char!r} in one call"))
            return
        calls, _, error = self._extract(block)
        if calls:
            self._convert(calls, result)
        else:
            result.add(self._malformed(block, error))

    def _parse_whole(self, text: str, result: ToolCallParse, max_calls: int) -> ToolCallParse:
        attempt = _ATTEMPT_RES.get(self.name)
        num_left_out = 0
        if attempt is not None:  # vLLM rescans the rest of the text per call: cut after max_calls
            starts = [m.start() for m, _ in zip(attempt.finditer(text), range(max_calls + 1))]
            if len(starts) > max_calls:
                num_left_out = sum(1 for _ in attempt.finditer(text, starts[-1]))
                text = text[:starts[-1]]
        self._parse_text(text, result, attempt)
        if num_left_out:
            result.add(f"too many tool calls in one message; at most {max_calls} are read")
        return result

    def _parse_text(self, text: str, result: ToolCallParse, attempt: re.Pattern | None) -> None:
        calls, content, error = self._extract(text)
        if calls:
            self._convert(calls, result)
            result.content = (content or "").strip()
            return
        looks_like_call = attempt.search(text) if attempt else (
            "pythonic" in self.name and _PYTHONIC_ATTEMPT.match(text))
        if error is not None or looks_like_call:
            result.add(self._malformed(text, error))
        result.content = text.strip()

    def __getstate__(self) -> dict[str, Any]:  # picklable: a lock is not
        state = dict(self.__dict__)
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())


def _drop_below_critical(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.CRITICAL


def _quiet(logger: logging.Logger) -> None:
    logger.setLevel(logging.CRITICAL)
    if _drop_below_critical not in logger.filters:
        logger.addFilter(_drop_below_critical)


def _build_vllm_parser(name: str, tokenizer: Any, tools: list[dict[str, Any]] | None) -> Any:
    from vllm.tool_parsers import ToolParserManager

    cls = ToolParserManager.get_tool_parser(name)
    # vLLM's parsers log a traceback for every malformed call; here those are expected (the
    # policy learns the format) and are reported to the model instead. A filter, not a level:
    # vLLM re-applies its logging config when an engine starts in the process (dictConfig resets
    # the level of every "vllm.*" logger), and formatting a traceback per reply costs ~0.3 ms.
    for klass in cls.__mro__:  # (Mistral's adapter logs from the parser engine's module)
        if klass.__module__.startswith("vllm."):
            _quiet(logging.getLogger(klass.__module__))
    _quiet(logging.getLogger("vllm.parser.mistral"))
    if tokenizer is None:
        tokenizer = _marker_tokenizer(_MARKER_TOKENS.get(name, []))
    return cls(tokenizer, _tool_params(tools))


def _tool_params(tools: list[dict[str, Any]] | None) -> list[Any] | None:
    if not tools:
        return None
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    return [ChatCompletionToolsParam.model_validate(t) for t in tools]


def _request(tools: list[dict[str, Any]] | None) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="agentrl", messages=[{"role": "user", "content": ""}], tools=tools or None)


def build_tool_parser(name: str, model_path: str | Path, tokenizer: Any = None) -> ToolCallParser:
    """The parser ``rollout.tool_parser`` names (``auto``: the checkpoint's family), built with the
    model's tokenizer."""
    return ToolCallParser(detect_tool_parser(model_path) if name == "auto" else name, tokenizer)


@functools.lru_cache(maxsize=8)
def _default_parser(name: str) -> ToolCallParser:
    return ToolCallParser(name)


def parse_tool_calls(text: Any, parser: str = DEFAULT_TOOL_PARSER) -> ToolCallParse:
    """Parse ``text`` with vLLM's parser ``parser`` (built once per name, without a model tokenizer).

    Example:
        >>> parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>').calls
        [ToolCall(name='f', arguments={'x': 1})]
    """
    return _default_parser(parser).parse(text)
