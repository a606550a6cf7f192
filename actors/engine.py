"""Ray actor around :class:`agentrl.engines.vllm_engine.VLLMEngine` (thin: no logic of its own)."""

from __future__ import annotations

from typing import Any

import ray

from agentrl.config import EngineConfig

__all__ = ["EngineActor"]


@ray.remote
class EngineActor:
    def __init__(self, model_path: str, cfg: EngineConfig, *, dtype: str = "float32", seed: int = 0) -> None:
        from agentrl.engines.vllm_engine import VLLMEngine

        self.engine = VLLMEngine(model_path, cfg, dtype=dtype, seed=seed)

    async def start(self, weights: Any = None, version: int = 0) -> int:
        """Start vLLM; with ``weights``, load them before taking work (a restarted engine)."""
        await self.engine.start()
        if weights is not None:
            await self.engine.update_weights(weights, version, mode="drain")
        return self.engine.version

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float, stop_token_ids=None):
        return await self.engine.generate(
            prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop_token_ids=stop_token_ids
        )

    async def score(self, token_ids: list[int]) -> list[float]:
        return await self.engine.score(token_ids)

    async def update_weights(self, weights: dict, version: int, mode: str = "continue") -> float:
        return await self.engine.update_weights(weights, version, mode)  # type: ignore[arg-type]

    def version(self) -> int:
        return self.engine.version

    def num_inflight(self) -> int:
        return self.engine.num_inflight

    def pid(self) -> int:
        import os

        return os.getpid()
