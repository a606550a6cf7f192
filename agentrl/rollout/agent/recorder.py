"""Exact-token recording of an agent's chat-completion requests: one episode, one or more segments.

An agent talks to the policy in OpenAI chat messages; the learner needs the token ids the policy
sampled. :class:`EpisodeRecorder` turns each request of one episode into the prompt ids the
engine continues, and records what it sampled:

- a request whose messages are the previous request's, then the response the endpoint gave, then
  new messages (tool results, a user turn) *continues* the segment: the new messages are rendered
  as a token delta (:meth:`agentrl.rollout.chat.ChatRenderer.observation_delta_ids`) and appended to the
  tokens already there, exactly as the env path appends observations. Nothing is re-rendered.
- any other request (the agent dropped reasoning, trimmed or summarized its context, changed its
  tools, retried) starts a new *segment*, rendered from scratch. Each segment becomes its own
  :class:`~agentrl.rollout.trajectory.Trajectory` with the episode's reward.

Messages are compared in a canonical form (text content, tool calls as name plus parsed
arguments, ids ignored), so a client that re-serializes the arguments JSON or writes ``None`` for
empty content still continues. This module knows nothing of HTTP, engines or Ray.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from agentrl.rollout.chat import ChatRenderer
from agentrl.rollout.trajectory import Trajectory

__all__ = ["EpisodeRecorder", "MessageError", "Segment", "canonical_messages", "canonical_tools",
           "template_messages"]

_ROLES = {"system", "developer", "user", "assistant", "tool"}


class MessageError(ValueError):
    """A request's messages or tools cannot be rendered; the message names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _text(content: Any, where: str) -> str:
    """Text of an OpenAI message content: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise MessageError(f"{where}.content[{i}]: only text parts are supported, got {kind!r}",
                                   f"{where}.content")
            if not isinstance(part.get("text"), str):
                raise MessageError(f"{where}.content[{i}].text must be a string", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise MessageError(f"{where}.content must be a string, a list of text parts or null, "
                       f"got {type(content).__name__}", f"{where}.content")


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise MessageError(f"{where}.function.arguments is not valid JSON: {raw[:80]!r}",
                               f"{where}.function.arguments") from None
        if isinstance(value, dict):
            return value
    raise MessageError(f"{where}.function.arguments must be a JSON object (as a string)",
                       f"{where}.function.arguments")


def canonical_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages in the form requests are compared in and rendered from: ``role`` (``developer``
    read as ``system``), ``content`` as text, ``tool_calls`` as ``(name, arguments dict)``.

    Raises:
        MessageError: a message is not an object, has an unknown role, or non-text content.
    """
    if not isinstance(messages, list) or not messages:
        raise MessageError("messages must be a non-empty list of message objects", "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise MessageError(f"{where} must be an object, got {type(msg).__name__}", where)
        role = msg.get("role")
        if role not in _ROLES:
            raise MessageError(f"{where}.role: unsupported role {role!r} (supported: "
                               f"{', '.join(sorted(_ROLES))})", f"{where}.role")
        item: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                "content": _text(msg.get("content"), where)}
        calls = msg.get("tool_calls") or []
        if calls and role != "assistant":
            raise MessageError(f"{where}: only assistant messages carry tool_calls", f"{where}.tool_calls")
        if not isinstance(calls, list):
            raise MessageError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        canon_calls = []
        for k, call in enumerate(calls):
            cw = f"{where}.tool_calls[{k}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise MessageError(f"{cw} must be {{'type': 'function', 'function': {{'name': ..., "
                                   "'arguments': ...}}}}", cw)
            canon_calls.append((fn["name"], _arguments(fn.get("arguments"), cw)))
        if canon_calls:
            item["tool_calls"] = canon_calls
        out.append(item)
    return out


def canonical_tools(tools: Any) -> str:
    """The tool list as canonical JSON (a change of tools cannot continue a segment: templates
    render them at the start)."""
    if tools is None:
        return "[]"
    if not isinstance(tools, list):
        raise MessageError("tools must be a list of tool objects", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise MessageError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                               "'description': ..., 'parameters': {...}}}}", f"tools[{i}]")
    return json.dumps(tools, sort_keys=True)


def template_messages(canonical: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical messages in the shape Hugging Face chat templates read (tool calls with their
    arguments as objects)."""
    out = []
    for msg in canonical:
        item = {"role": msg["role"], "content": msg["content"]}
        if msg.get("tool_calls"):
            item["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}}
                                  for n, a in msg["tool_calls"]]
        out.append(item)
    return out


@dataclass
class Segment:
    """One token sequence of an episode: a prompt rendered once, then sampled turns and the
    rendered deltas between them. Per-token lists as in :class:`~agentrl.rollout.trajectory.Trajectory`."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # canonical history incl. the last response
    tools: str = "[]"
    open_turn: bool = False  # the last sampled turn has no end-of-turn token yet

    def append(self, ids: list[int], *, logprobs: list[float] | None = None,
               versions: list[int] | None = None) -> None:
        sampled = logprobs is not None
        self.token_ids += ids
        self.loss_mask += [int(sampled)] * len(ids)
        self.behavior_logprobs += list(logprobs) if sampled else [0.0] * len(ids)
        self.policy_versions += list(versions) if sampled else [-1] * len(ids)


@dataclass
class Prepared:
    """What a request will send to the engine: the full prompt, and how it was built."""

    prompt_ids: list[int]
    new_segment: bool
    delta_ids: list[int]  # the ids appended to the segment (the whole prompt for a new one)
    messages: list[dict[str, Any]]
    tools: str


class EpisodeRecorder:
    """Segments of one episode, built from its requests in order.

    Use: ``prep = rec.prepare(messages, tools)``, send ``prep.prompt_ids`` to the engine, then
    ``rec.record(prep, sampled_ids, logprobs, versions, response_message)``. A request whose
    generation failed is never recorded, and the segment stays as it was.

    Args:
        renderer: the policy's chat renderer.
    """

    def __init__(self, renderer: ChatRenderer) -> None:
        self.renderer = renderer
        self.segments: list[Segment] = []

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    @property
    def num_completions(self) -> int:
        return sum(len(s.turn_spans) for s in self.segments)

    def _continues(self, seg: Segment, messages: list[dict[str, Any]], tools: str) -> bool:
        n = len(seg.messages)
        return bool(seg.turn_spans) and tools == seg.tools and len(messages) > n and messages[:n] == seg.messages

    def prepare(self, messages: Any, tools: Any = None) -> Prepared:
        """The prompt of a request: the current segment plus a rendered delta when the request
        extends it, else a new segment's prompt.

        Raises:
            MessageError: the messages or tools are malformed, or the template cannot render them.
        """
        canon, canon_tools = canonical_messages(messages), canonical_tools(tools)
        seg = self.current
        try:
            if seg is not None and self._continues(seg, canon, canon_tools):
                closing = [self.renderer.end_of_turn_id] if seg.open_turn else []
                delta = closing + self.renderer.observation_delta_ids(template_messages(canon[len(seg.messages):]))
                return Prepared(seg.token_ids + delta, False, delta, canon, canon_tools)
            prompt = self.renderer.prompt_ids(template_messages(canon), json.loads(canon_tools) or None)
        except MessageError:
            raise
        except Exception as exc:  # jinja: a template that rejects these messages (e.g. role order)
            raise MessageError(f"the model's chat template cannot render these messages: "
                               f"{type(exc).__name__}: {str(exc)[:200]}", "messages") from None
        return Prepared(prompt, True, prompt, canon, canon_tools)

    def record(self, prep: Prepared, token_ids: list[int], logprobs: list[float], versions: list[int],
               response: dict[str, Any], *, closed: bool) -> Segment:
        """Append a completed request: its delta (masked), then the sampled tokens (trained).

        Args:
            prep: what :meth:`prepare` returned for the request.
            token_ids, logprobs, versions: what the engine sampled, as sampled.
            response: the assistant message the endpoint returned (canonical form is taken).
            closed: the sampled tokens end the turn (an end-of-turn or EOS token).
        """
        if len(token_ids) != len(logprobs) or len(token_ids) != len(versions):
            raise ValueError("sampled tokens, logprobs and versions differ in length")
        if prep.new_segment:
            seg = Segment(tools=prep.tools)
            self.segments.append(seg)
        else:
            seg = self.segments[-1]
        seg.append(prep.delta_ids)
        start = len(seg.token_ids)
        seg.append(list(token_ids), logprobs=list(logprobs), versions=list(versions))
        seg.turn_spans.append((start, len(seg.token_ids)))
        seg.messages = prep.messages + canonical_messages([response])
        seg.open_turn = not closed
        return seg

    def trajectories(self, reward: float, *, status: str = "ok", info: dict[str, Any] | None = None,
                     episode: str = "", seed: int = 0, num_tool_calls: int = 0) -> list[Trajectory]:
        """One trajectory per segment that sampled anything, each with the episode's reward on
        its last turn. ``info["episode"]`` ties the segments of one episode together (the group
        baseline counts an episode once), ``info["segment"]`` numbers them."""
        segs = [s for s in self.segments if s.turn_spans]
        out = []
        for k, seg in enumerate(segs):
            rewards = [0.0] * (len(seg.turn_spans) - 1) + [float(reward)]
            out.append(Trajectory(
                token_ids=list(seg.token_ids), loss_mask=list(seg.loss_mask),
                behavior_logprobs=list(seg.behavior_logprobs), policy_versions=list(seg.policy_versions),
                turn_spans=list(seg.turn_spans), turn_rewards=rewards, status=status,  # type: ignore[arg-type]
                env_id="agent", seed=seed, num_tool_calls=num_tool_calls if k == len(segs) - 1 else 0,
                info={**(info or {}), "episode": episode, "segment": k, "num_segments": len(segs)},
            ))
        return out
