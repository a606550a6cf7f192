"""`agentrl eval`: success rate, reward, turns and tool calls of a model on held-out seeds.

Runs one vLLM engine in this process (no Ray) and the same episode loop as training."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["evaluate_model", "run_episodes"]


class _LocalClient:
    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id):
        return await self.engine.generate(prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p)


async def run_episodes(model: str, env_id: str, num_episodes: int, seed_offset: int, temperature: float,
                       rollout_overrides: dict[str, Any]) -> list[Any]:
    """The trajectories of ``num_episodes`` episodes (seeds ``seed_offset + k``) with one local engine;
    tool calls are read by ``rollout_overrides["tool_parser"]`` (default auto: the model's family)."""
    import anyio
    import gymnasium as gym
    from transformers import AutoTokenizer

    from agentrl.rollout.chat import ChatRenderer
    from agentrl.config import EngineConfig, RolloutConfig
    from agentrl.engine.vllm_engine import VLLMEngine
    from agentrl.env.ids import check_env
    from agentrl.envs.base import set_tool_parser
    from agentrl.rollout.episode import run_episode
    from agentrl.rollout.tool_calls import build_tool_parser

    env_id = check_env(env_id, key="--env")  # unknown ids fail here, with gymnasium's suggestions
    cfg = RolloutConfig(**rollout_overrides)
    tokenizer = AutoTokenizer.from_pretrained(model)
    renderer = ChatRenderer(tokenizer)
    parser = build_tool_parser(cfg.tool_parser, model, tokenizer)
    engine = VLLMEngine(model, EngineConfig(max_model_len=max(2048, cfg.max_total_tokens)))
    await engine.start()
    client = _LocalClient(engine)
    trajs = []
    limiter = anyio.CapacityLimiter(32)

    async def one(k: int) -> None:
        async with limiter:
            env = gym.make(env_id)
            set_tool_parser(env, parser)
            try:
                trajs.append(await run_episode(env, renderer, client, seed=seed_offset + k, cfg=cfg,
                                               episode_id=f"eval-{k}", temperature=temperature))
            finally:
                env.close()

    try:
        async with anyio.create_task_group() as tg:
            for k in range(num_episodes):
                tg.start_soon(one, k)
    finally:
        engine.shutdown()
    return sorted(trajs, key=lambda t: t.seed)


async def _evaluate(model: str, env_id: str, num_episodes: int, seed_offset: int, temperature: float,
                    rollout_overrides: dict[str, Any]) -> dict[str, float]:
    from agentrl.rollout.episode import summarize

    trajs = await run_episodes(model, env_id, num_episodes, seed_offset, temperature, rollout_overrides)
    return {k.replace("rollout/", "eval/"): v for k, v in summarize(trajs).items()}


def evaluate_model(model: str, env_id: str, *, num_episodes: int = 64, seed_offset: int = 1_000_000,
                   temperature: float = 0.0, **rollout_overrides: Any) -> dict[str, float]:
    """Evaluate ``model`` (HF directory) on ``num_episodes`` seeds of ``env_id`` starting at ``seed_offset``."""
    from agentrl.config import ConfigError
    from agentrl.env.ids import check_env
    from agentrl.model.loading import is_model_dir
    from agentrl.rollout.tool_calls import tool_parser_error

    if not is_model_dir(model):
        raise FileNotFoundError(f"--model: '{model}' is not a Hugging Face model directory (no config.json)")
    check_env(env_id, key="--env")  # before the engine starts
    error = tool_parser_error(rollout_overrides.get("tool_parser", "auto"), key="--tool-parser")
    if error is not None:
        raise ConfigError(error)
    return asyncio.run(_evaluate(model, env_id, num_episodes, seed_offset, temperature, rollout_overrides))
