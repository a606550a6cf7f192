"""Question: does a LongRecall-v0 or LongNeedle-v0 policy use what it read pages earlier?
Held-out greedy success by the page that
holds the asked fact (the needle), trajectory lengths, and the same episodes with the facts of all
pages but the last removed (``--cut``), which shows whether success comes from content read
thousands of tokens earlier.

    python tools/long_recall_diag.py --model runs/long_context_cpu/final --episodes 48 --cut
    python tools/long_recall_diag.py --env agentrl/LongRecall-v0 --model .cache/long-context-sft --cut
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import defaultdict
from typing import Any


def _cut_env(env_id: str, kwargs: dict[str, Any]):
    from agentrl.envs.long_needle import LongNeedleEnv, cut_pages
    from agentrl.envs.long_recall import LongRecallEnv

    class CutLongNeedle(LongNeedleEnv):
        """The needle is removed from every page but the last (filler, decoy and question unchanged)."""

        def new_task(self, rng, options):
            messages = super().new_task(rng, options)
            cut_pages(self)
            return messages

    class CutLongRecall(LongRecallEnv):
        """Pages before the last lose their fact line (filler and question unchanged)."""

        def new_task(self, rng, options):
            messages = super().new_task(rng, options)
            for i, (name, value) in enumerate(self.facts[:-1]):
                self.pages[i] = self.pages[i].replace(f"\n{name} = {value}", "")
            return messages

    return (CutLongNeedle if env_id == "agentrl/LongNeedle-v0" else CutLongRecall)(**kwargs)


def _asked_page(env) -> int:
    """1-based page of the asked fact (LongRecall) or of the needle (LongNeedle)."""
    return (env.needle_page if hasattr(env, "needle_page") else env.asked) + 1


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import anyio
    import gymnasium as gym
    from transformers import AutoTokenizer

    import agentrl.envs  # noqa: F401
    from agentrl.rollout.chat import ChatRenderer
    from agentrl.config import EngineConfig, RolloutConfig
    from agentrl.engine.vllm_engine import VLLMEngine
    from agentrl.driver.evaluate import _LocalClient
    from agentrl.rollout.episode import run_episode

    env_kwargs = json.loads(args.env_kwargs)
    cfg = RolloutConfig(max_new_tokens=32, max_turns=env_kwargs.get("num_pages", 4) + 2, max_total_tokens=16384)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(args.model))
    engine = VLLMEngine(args.model, EngineConfig(max_model_len=16384, kv_cache_gib=2.0))
    await engine.start()
    client = _LocalClient(engine)
    out: dict[str, Any] = {}
    try:
        for mode in ["full", "cut"] if args.cut else ["full"]:
            by_page: dict[int, list[float]] = defaultdict(list)
            lengths: list[int] = []
            limiter = anyio.CapacityLimiter(16)

            async def one(k: int) -> None:
                async with limiter:
                    env = (_cut_env(args.env, env_kwargs) if mode == "cut"
                           else gym.make(args.env, **env_kwargs).unwrapped)
                    traj = await run_episode(env, renderer, client, seed=args.seed_offset + k, cfg=cfg,
                                             episode_id=f"{mode}-{k}", temperature=0.0, max_model_len=16384)
                    by_page[_asked_page(env)].append(float(traj.success))
                    lengths.append(len(traj))

            async with anyio.create_task_group() as tg:
                for k in range(args.episodes):
                    tg.start_soon(one, k)
            total = [s for v in by_page.values() for s in v]
            out[mode] = {"success": sum(total) / len(total), "tokens_mean": sum(lengths) / len(lengths),
                         "tokens_max": max(lengths),
                         "success_by_asked_page": {p: round(sum(v) / len(v), 3) for p, v in sorted(by_page.items())}}
    finally:
        engine.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--episodes", type=int, default=48)
    p.add_argument("--seed-offset", type=int, default=1_000_000)
    p.add_argument("--env", default="agentrl/LongNeedle-v0", choices=["agentrl/LongNeedle-v0", "agentrl/LongRecall-v0"])
    p.add_argument("--env-kwargs", default='{"num_pages": 4, "page_words": [1750, 1850]}')
    p.add_argument("--cut", action="store_true", help="also run with the early pages' facts removed")
    args = p.parse_args()
    print(json.dumps(asyncio.run(_run(args)), indent=2))


if __name__ == "__main__":
    main()
