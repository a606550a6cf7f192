"""Token-in/token-out chat rendering and Hermes/Qwen tool-call parsing.

The prompt is rendered to token ids once. After that, every turn appends the tokens the engine
sampled, exactly, and then the *delta* of the observation messages: the text the chat template
puts between the end of an assistant turn and the start of the next generation. Past turns are
never re-rendered, so the learner trains on exactly the tokens the policy produced.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ChatRenderer",
    "ToolCall",
    "ToolCallParse",
    "format_tool_call",
    "parse_tool_calls",
]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PLACEHOLDER = "\u2063agentrl-placeholder\u2063"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ToolCallParse:
    """Result of parsing one assistant message: the calls that parsed, and one error per block
    that did not. ``content`` is the text outside the tool-call blocks."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""


def parse_tool_calls(text: str) -> ToolCallParse:
    """Parse ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; never raises.

    Example:
        >>> parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>').calls
        [ToolCall(name='f', arguments={'x': 1})]
    """
    result = ToolCallParse()
    if not isinstance(text, str):
        result.errors.append(f"assistant message must be text, got {type(text).__name__}")
        return result
    # A linear scan (a lazy regex is quadratic on many unterminated tags, which a degenerate
    # policy produces).
    pos, rest_parts = 0, []
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            rest_parts.append(text[pos:])
            break
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            result.errors.append("unterminated <tool_call> block (missing </tool_call>)")
            rest_parts.append(text[pos:start])
            break
        rest_parts.append(text[pos:start])
        _parse_block(text[start + len(OPEN): end].strip(), result)
        pos = end + len(CLOSE)
    rest = "".join(rest_parts)
    result.content = rest.strip()
    return result


def _parse_block(body: str, result: ToolCallParse) -> None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        result.errors.append(f"tool call is not valid JSON ({exc.__class__.__name__}: {str(exc)[:80]})")
        return
    if not isinstance(obj, dict):
        result.errors.append(f"tool call must be a JSON object, got {type(obj).__name__}")
        return
    name = obj.get("name")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            result.errors.append("tool call 'arguments' is a string that is not valid JSON")
            return
    if not isinstance(name, str) or not name:
        result.errors.append("tool call needs a string 'name'")
        return
    if not isinstance(args, dict):
        result.errors.append(f"tool call 'arguments' must be an object, got {type(args).__name__}")
        return
    result.calls.append(ToolCall(name=name, arguments=args))


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text a model emits for one call (used by demonstrators and tests)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ChatRenderer:
    """Renders chat messages to token ids with a tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template and an EOS token that ends an
            assistant turn (``<|im_end|>`` for Qwen-style templates).
    """

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer has no chat_template; agentrl needs one to render episodes")
        self.tokenizer = tokenizer
        self.eos_token_id: int = tokenizer.eos_token_id
        self.eos_token: str = tokenizer.eos_token

    def _template(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of the initial messages plus the generation prompt."""
        return self.encode(self._template(messages, tools, add_generation_prompt=True))

    def observation_delta_ids(self, messages: list[dict]) -> list[int]:
        """Token ids that follow an assistant turn's EOS token: the observation messages and the
        next generation prompt, as the chat template renders them after an assistant turn."""
        prefix = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PLACEHOLDER}]
        before = self._template(prefix, None, add_generation_prompt=False)
        full = self._template(prefix + list(messages), None, add_generation_prompt=True)
        cut = before.find(self.eos_token, before.find(_PLACEHOLDER))
        if cut < 0 or not full.startswith(before[: cut + len(self.eos_token)]):
            raise ValueError("chat template does not end assistant turns with the EOS token; cannot render deltas")
        delta = full[cut + len(self.eos_token):]
        return self.encode(delta)

    def decode(self, ids: list[int]) -> str:
        """The text an env sees for sampled ids: EOS and padding dropped, but special tokens that
        carry meaning (``<tool_call>`` is one in many tokenizers) kept."""
        drop = {self.eos_token_id, self.tokenizer.pad_token_id}
        return self.tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False)
