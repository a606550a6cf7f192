"""Ray actor around :class:`agentrl.engines.vllm_engine.VLLMEngine`.

Created with ``max_restarts=-1``: when the actor dies, Ray restarts it, and the first call on
the new instance starts vLLM and loads the weights the engines currently serve (from the replay
actor, which holds a reference to them) before it takes any work. The trainer names the replay
actor rather than passing its handle: a constructor argument holding a reference makes Ray warn
that a restart could fail (ray-project/ray#53727), while a name is looked up afresh.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from agentrl.config import EngineConfig

__all__ = ["EngineActor"]


@ray.remote
class EngineActor:
    def __init__(self, model_path: str, cfg: EngineConfig, *, dtype: str = "float32", seed: int = 0,
                 weight_source: Any = None) -> None:
        """``weight_source``: the replay actor (a handle, or the name of a named actor) whose
        ``latest_weights`` a (re)started engine loads before it serves."""
        from agentrl.engines.vllm_engine import VLLMEngine

        self.engine = VLLMEngine(model_path, cfg, dtype=dtype, seed=seed)
        self.weight_source = weight_source
        self._started = False
        self._lock: asyncio.Lock | None = None

    async def _ready(self) -> None:
        if self._started:
            return
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if self._started:
                return
            await self.engine.start()
            if isinstance(self.weight_source, str):  # a named actor (the trainer's replay actor)
                self.weight_source = ray.get_actor(self.weight_source)
            if self.weight_source is not None:
                version, refs = await self.weight_source.latest_weights.remote()
                if refs:
                    await self.engine.update_weights(await refs[0], version, mode="drain")
            self._started = True

    async def start(self) -> int:
        """Start vLLM (and catch up on weights); returns the version served."""
        await self._ready()
        return self.engine.version

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float,
                       stop_token_ids=None, ignore_eos: bool = False):
        await self._ready()
        return await self.engine.generate(
            prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
        )

    async def score(self, token_ids: list[int]) -> list[float]:
        await self._ready()
        return await self.engine.score(token_ids)

    async def update_weights(self, weights: dict, version: int, mode: str = "continue") -> float:
        await self._ready()
        if version <= self.engine.version:  # a restarted engine may already have caught up
            return 0.0
        return await self.engine.update_weights(weights, version, mode)  # type: ignore[arg-type]

    def version(self) -> int:
        return self.engine.version

    def num_inflight(self) -> int:
        return self.engine.num_inflight

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        import os

        return os.getpid()
