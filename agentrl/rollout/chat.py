"""Token-in/token-out chat rendering with a model's own chat template.

The prompt is rendered to token ids once. After that, every turn appends the tokens the engine
sampled, exactly, and then the *delta* of the observation messages: the text the chat template
puts between the end of an assistant turn and the start of the next generation. Past turns are
never re-rendered, so the learner trains on exactly the tokens the policy produced (templates that
rewrite past turns, such as Qwen3's, which drops the reasoning of turns before the last user
message, would otherwise change them).

The token that ends an assistant turn is read from the template (``<|im_end|>`` for Qwen,
``<|eot_id|>`` for Llama 3, ``</s>`` for Mistral); it need not be the tokenizer's EOS token.
Tool-call parsing lives in :mod:`agentrl.rollout.tool_calls` (re-exported here). This module knows
nothing of engines, envs or Ray.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentrl.rollout.tool_calls import ToolCall, ToolCallParse, format_tool_call, format_tool_calls, parse_tool_calls

__all__ = [
    "ChatRenderer",
    "ToolCall",
    "ToolCallParse",
    "format_tool_call",
    "format_tool_calls",
    "parse_tool_calls",
]

_PLACEHOLDER = "\u2063agentrl-placeholder\u2063"
_CACHE_SIZE = 256  # rendered prompts and deltas kept (a GRPO group's episodes share their first prompt)


def _generation_eos_ids(tokenizer: Any) -> list[int]:
    path = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "generation_config.json"
    if not path.is_file():
        return []
    ids = json.loads(path.read_text()).get("eos_token_id")
    return [ids] if isinstance(ids, int) else [i for i in ids or [] if isinstance(i, int)]


class ChatRenderer:
    """Renders chat messages to token ids with a tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template that ends every assistant turn
            with a special token (its end-of-turn token).

    Attributes:
        end_of_turn_id: the token the template puts right after an assistant message's content.
        stop_token_ids: ids that end a sampled turn: the end-of-turn token, the EOS token and the
            checkpoint's ``generation_config.json`` EOS ids (where vLLM stops; Llama 3's ``<|eom_id|>``).
    """

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer has no chat_template; agentrl needs one to render episodes")
        self.tokenizer = tokenizer
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.end_of_turn: str = self._find_end_of_turn()
        self.end_of_turn_id: int = tokenizer.convert_tokens_to_ids(self.end_of_turn)
        self.stop_token_ids: frozenset[int] = frozenset(
            i for i in (self.end_of_turn_id, self.eos_token_id, *_generation_eos_ids(tokenizer)) if i is not None)
        # Rendering is a pure function of the messages and tools (jinja, then the tokenizer: 0.3-0.7 ms
        # for a 100-token prompt on CPU), and the episodes of a group start from the same prompt.
        self._rendered: dict[str, tuple[int, ...]] = {}

    def _cached(self, kind: str, messages: list[dict], tools: list[dict] | None, render: Any) -> list[int]:
        try:
            key = json.dumps([kind, messages, tools], ensure_ascii=False)
        except (TypeError, ValueError):  # not JSON (an env's own objects): rendered every time
            return render()
        ids = self._rendered.get(key)
        if ids is None:
            ids = tuple(render())
            if len(self._rendered) >= _CACHE_SIZE:
                self._rendered.clear()
            self._rendered[key] = ids
        return list(ids)

    def _template(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _find_end_of_turn(self) -> str:
        text = self._template([{"role": "user", "content": "x"}, {"role": "assistant", "content": _PLACEHOLDER}],
                              None, add_generation_prompt=False)
        after = text[text.find(_PLACEHOLDER) + len(_PLACEHOLDER):] if _PLACEHOLDER in text else ""
        special = sorted(set(self.tokenizer.all_special_tokens) | {
            t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
        for token in special:
            if token and after.startswith(token):
                return token
        raise ValueError("the chat template does not end an assistant turn with a special token (it renders "
                         f"{after[:40]!r} after the assistant's text); agentrl cannot tell where turns end")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of the initial messages plus the generation prompt."""
        return self._cached("prompt", messages, tools,
                            lambda: self.encode(self._template(messages, tools, add_generation_prompt=True)))

    def observation_delta_ids(self, messages: list[dict]) -> list[int]:
        """Token ids that follow an assistant turn's end-of-turn token: the observation messages
        and the next generation prompt, as the chat template renders them after an assistant turn."""
        return self._cached("delta", messages, None, lambda: self._delta_ids(messages))

    def _delta_ids(self, messages: list[dict]) -> list[int]:
        prefix = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PLACEHOLDER}]
        full = self._template(prefix + list(messages), None, add_generation_prompt=True)
        at = full.find(_PLACEHOLDER) + len(_PLACEHOLDER)
        if at < len(_PLACEHOLDER) or not full.startswith(self.end_of_turn, at):
            raise ValueError(f"the chat template does not end assistant turns with {self.end_of_turn!r} when "
                             "observations follow; cannot render deltas")
        return self.encode(full[at + len(self.end_of_turn):])

    def decode(self, ids: list[int]) -> str:
        """The text an env sees for sampled ids: stop tokens and padding dropped, but special
        tokens that carry meaning (``<tool_call>``, ``[TOOL_CALLS]``) kept."""
        drop = self.stop_token_ids | {self.tokenizer.pad_token_id}
        return self.tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False)
