"""The work and the engine stand-ins of bench/agent_endpoint.py: the ``--work turns`` episodes (the
same messages by seed on both paths: ``TurnsEnv`` for the env path, ``turns_solve``, a plain
openai-SDK loop, for the endpoint's), and the engines the bench puts behind both paths.

A module of its own so that the benchmark (run as ``__main__``) and the agents loaded by name
(``agent.solve=bench.agent_endpoint_work:turns_solve``, in the rollout worker or in an agent
worker process) read one copy of ``TURNS``.
"""

from __future__ import annotations

import asyncio


def turns_words(seed: int, turn: int) -> str:
    """The observation after reply ``turn`` of the episode of ``seed`` (both paths: same text)."""
    import random

    rng = random.Random(seed * 1000 + turn)
    return "Go on. " + " ".join(rng.choice(["red", "green", "blue", "seven", "eight"]) for _ in range(12))


def turns_tasks(seed: int) -> dict:
    """--work turns: the task of ``seed`` (the first user message), with the turns and tokens per
    request (an agent worker process has its own copy of TURNS, which main does not set)."""
    return {"seed": seed, "question": f"Task {seed}: " + turns_words(seed, -1), **TURNS}


TURNS = {"n": 4, "max_tokens": 64}  # set by main from --turns / --max-tokens (the agent reads them)


async def turns_solve(client, task: dict) -> float:
    """--work turns, the endpoint path: a plain openai-SDK loop of TURNS["n"] requests, each
    followed by a user message, as TurnsEnv does on the env path."""
    messages = [{"role": "user", "content": task["question"]}]
    for turn in range(task["n"]):
        response = await client.chat.completions.create(model="agentrl-policy", messages=messages,
                                                        max_tokens=task["max_tokens"])
        messages.append(response.choices[0].message.model_dump(exclude_none=True))
        if turn + 1 < task["n"]:
            messages.append({"role": "user", "content": turns_words(task["seed"], turn)})
    return float(len(messages[-1].get("content") or "") % 2)


def turns_env(turns: int):
    """--work turns, the env path: TURNS["n"] replies per episode, a user message after each but the last."""
    import random

    from agentrl.envs.base import TextEnv, Turn

    class TurnsEnv(TextEnv):
        def new_task(self, rng: random.Random, options: dict) -> list[dict]:
            self._seed = self._episode_seed
            return [{"role": "user", "content": turns_tasks(self._seed)["question"]}]

        def reset(self, *, seed=None, options=None):
            self._episode_seed = seed
            return super().reset(seed=seed, options=options)

        def respond(self, action: str) -> Turn:
            if self.num_turns >= turns:
                return Turn([], reward=float(len(action) % 2), terminated=True, success=True)
            return Turn([{"role": "user", "content": turns_words(self._seed, self.num_turns - 1)}], reward=0.0)

    return TurnsEnv(max_turns=turns)


class Direct:
    def __init__(self, engine):
        self.engine = engine

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id, **kwargs):
        return await self.engine.generate(prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                          **kwargs)


class Replay:
    """The real engine's greedy answers, replayed by prompt after ``latency_s`` of sleep (no CPU):
    an engine as fast as a GPU's that takes none of this machine's cores, so the throughput part
    measures what limits the rollout side alone. A prompt not seen before goes to the engine
    (``misses``); at equal work the timed passes have none."""

    def __init__(self, engine, latency_s: float) -> None:
        self.engine = engine
        self.latency_s = latency_s
        self.cache: dict = {}
        self.misses = 0

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id=None, **_):
        key = (tuple(prompt_ids), max_tokens)
        out = self.cache.get(key)
        if out is None:
            self.misses += 1
            out = self.cache[key] = await self.engine.generate(list(prompt_ids), max_tokens=max_tokens,
                                                               temperature=0.0, top_p=1.0)
        await asyncio.sleep(self.latency_s)
        return out


class Instant:
    """An engine that answers every request at once with one fixed sample."""

    def __init__(self, out):
        self.out = out

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id=None, **_):
        return self.out
