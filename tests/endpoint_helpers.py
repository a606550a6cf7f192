"""Shared by the agent-endpoint tests: a real endpoint on real HTTP in a background event loop, and
a recording sampler that stands in for the engine where a property needs thousands of requests
(the tests marked slow use the real vLLM engine)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from agentrl.rollout.chat import ChatRenderer


@dataclass
class Sampled:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str = "stop"


@dataclass(repr=False)
class RecordingSampler:
    """Random continuations of three kinds (a hermes tool call, plain text, a turn cut by
    max_tokens), each recorded per episode with the prompt it was given."""

    renderer: ChatRenderer
    seed: int = 0
    calls: dict[str, list[Sampled]] = field(default_factory=lambda: defaultdict(list))
    kinds: tuple[str, ...] = ("call", "text", "cut")

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.words = self.renderer.encode(" the answer is 42 apples pens and cards Tom buys more")
        call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 + 30"}}\n</tool_call>'
        self.call_ids = self.renderer.encode(call)

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id, **_):
        await asyncio.sleep(0)
        kind = self.rng.choice(self.kinds)
        eot = [self.renderer.end_of_turn_id]
        if kind == "call":
            ids = self.call_ids + eot
        elif kind == "text":
            ids = [self.rng.choice(self.words) for _ in range(self.rng.randint(1, 12))] + eot
        else:
            ids = [self.rng.choice(self.words) for _ in range(max_tokens)]
        ids = ids[:max_tokens]
        out = Sampled(list(prompt_ids), ids, [-self.rng.random() * 5 for _ in ids],
                      [self.rng.randint(0, 3) for _ in ids], "stop" if ids[-1:] == eot else "length")
        self.calls[episode_id].append(out)
        return out


class ServerThread:
    """An event loop in a thread that hosts an endpoint; ``run(coro)`` runs a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def make_endpoint(renderer: ChatRenderer, engine: Any, overrides: list[str] = ()) -> Any:
    from agentrl.config import load_config
    from agentrl.rollout.agent.endpoint import AgentEndpoint
    from agentrl.rollout.tool_calls import ToolCallParser

    cfg = load_config(None, ["rollout.max_new_tokens=16", "rollout.max_turns=64", "rollout.max_total_tokens=4096",
                             "engine.max_model_len=4096", "packing.max_tokens_per_microbatch=4096", *overrides])
    return AgentEndpoint(renderer, ToolCallParser("hermes", renderer.tokenizer), engine, rollout=cfg.rollout,
                         agent=cfg.agent, max_model_len=cfg.engine.max_model_len)


@contextlib.contextmanager
def serving(model_dir: str, overrides: list[str] = ("rollout.max_new_tokens=64",)):
    """A started endpoint over a :class:`RecordingSampler` of the model's tokenizer, on a server
    thread: ``(endpoint, sampler, server)``, stopped on exit."""
    from transformers import AutoTokenizer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
    sampler = RecordingSampler(renderer, kinds=("call", "text"))
    server = ServerThread()
    endpoint = make_endpoint(renderer, sampler, list(overrides))
    server.run(endpoint.start())
    try:
        yield endpoint, sampler, server
    finally:
        server.run(endpoint.stop())
        server.close()


def check_exact_tokens(trajectories: list[Any], calls: list[Any]) -> None:
    """What the learner trains on is what the engine sampled: each sampled turn of each segment
    is one engine call, in order; its tokens, logprobs and versions are the call's, as sampled
    (a prefix of them when a stop string cut it); the prompt the engine saw is exactly the
    segment's tokens before it; every other token is masked out."""
    k = 0
    for traj in trajectories:
        sampled_at = set()
        for start, end in traj.turn_spans:
            call = calls[k]
            k += 1
            assert call.prompt_ids == traj.token_ids[:start], "the engine saw another prompt than the segment holds"
            n = end - start
            assert traj.token_ids[start:end] == call.token_ids[:n]
            assert traj.behavior_logprobs[start:end] == call.logprobs[:n]
            assert traj.policy_versions[start:end] == call.versions[:n]
            sampled_at.update(range(start, end))
        for pos, m in enumerate(traj.loss_mask):
            assert m == (pos in sampled_at), f"token {pos}: loss mask {m}"
            if not m:
                assert traj.behavior_logprobs[pos] == 0.0 and traj.policy_versions[pos] == -1
    assert k == len(calls), f"{len(calls) - k} engine calls are missing from the trajectories"


def tool_results(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": c["id"], "content": str(len(json.dumps(c)))}
            for c in message.get("tool_calls") or []]


CALCULATE = [{"type": "function", "function": {"name": "calculate", "parameters": {"type": "object"}}}]


async def calculate_loop(client, question: str, *, model: str = "agentrl-policy", turns: int = 3) -> bool:
    """A user's plain tool loop on the endpoint (the ``calculate`` tool, answered by
    :func:`tool_results`): True when the model answered without a call within ``turns`` requests."""
    messages = [{"role": "user", "content": question}]
    for _ in range(turns):
        out = await client.chat.completions.create(model=model, messages=messages, tools=CALCULATE)
        msg = out.choices[0].message.model_dump(exclude_none=True)
        if not msg.get("tool_calls"):
            return True
        messages += [msg, *tool_results(msg)]
    return False


@dataclass(repr=False)
class StreamingSampler(RecordingSampler):
    """A :class:`RecordingSampler` that also streams (``stream``): one token per step. With
    ``gate`` set (a threading.Event), it waits for the gate after its first token, so a test
    can show that text reached the client while the turn was still being sampled."""

    gate: Any = None
    aborted: list[str] = field(default_factory=list)

    async def stream(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id, **kwargs):
        out = await self.generate(prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                  episode_id=episode_id, **kwargs)
        done = False
        try:
            for i, tok in enumerate(out.token_ids):
                if i == 1 and self.gate is not None:
                    assert await asyncio.get_running_loop().run_in_executor(None, self.gate.wait, 30), "gate not opened"
                yield Sampled([], [tok], [out.logprobs[i]], [out.versions[i]], out.finish_reason)
                await asyncio.sleep(0)
            done = True
        finally:
            if not done:
                self.aborted.append(episode_id)
