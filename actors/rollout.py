"""Rollout actor: many groups of episodes at once, streamed into the replay queue.

The router sends every turn of an episode to the engine that served its previous turn (its
prefix is in that engine's cache) and a new episode to the least-loaded engine.
"""

from __future__ import annotations

import itertools
from typing import Any

import anyio
import ray

from agentrl.actors.watchdog import DIAG_GROUPS, AsyncDiag
from agentrl.config import Config

__all__ = ["RolloutActor", "Router"]


class Router:
    """Sticky, least-loaded routing over engine actor handles."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = list(engines)
        self.load = [0] * len(self.engines)
        self.sticky: dict[str, int] = {}
        self.num_sticky_hits = 0

    def pick(self, episode_id: str) -> int:
        if episode_id in self.sticky:
            self.num_sticky_hits += 1
            return self.sticky[episode_id]
        i = min(range(len(self.engines)), key=lambda k: self.load[k])
        self.sticky[episode_id] = i
        return i

    def end_episode(self, episode_id: str) -> None:
        self.sticky.pop(episode_id, None)

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id, seed=None, min_tokens=0,
                       stop=None):
        i = self.pick(episode_id)
        self.load[i] += 1
        try:
            return await self.engines[i].generate.remote(prompt_ids, max_tokens, temperature, top_p, seed=seed,
                                                         min_tokens=min_tokens, stop=stop)
        finally:
            self.load[i] -= 1

    async def stream(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id, seed=None, stop=None):
        """:meth:`generate` as the engine produces it: one item per engine step (Ray's streaming
        generator from the engine actor). Leaving early cancels the engine's request."""
        i = self.pick(episode_id)
        self.load[i] += 1
        gen = self.engines[i].generate_stream.options(num_returns="streaming").remote(
            prompt_ids, max_tokens, temperature, top_p, seed=seed, stop=stop)
        done = False
        try:
            async for ref in gen:
                yield await ref
            done = True
        finally:
            self.load[i] -= 1
            if not done:
                ray.cancel(gen)


@ray.remote(concurrency_groups=DIAG_GROUPS)
class RolloutActor(AsyncDiag):
    def __init__(self, cfg: Config, engines: list[Any], replay: Any, actor_index: int, model_path: str,
                 teachers: list[Any] | None = None, *, owner: str | None = None, first_task: int = 0) -> None:
        """``teachers``: on-policy distillation, the teacher's engine actors; every finished group
        is scored by them (round-robin over trajectories) before it goes to the replay queue.
        ``owner``: the name its replay slots are held under (the driver gives them back if this
        actor dies); ``first_task``: a replacement actor starts its task seeds past its
        predecessor's, so no task is generated twice."""
        import time

        self.init_began_at = time.time()  # the wall clock: the trainer builds these while engines start
        import gymnasium as gym
        from transformers import AutoTokenizer

        from agentrl.rollout.chat import ChatRenderer
        from agentrl.config import ConfigError
        from agentrl.env.ids import import_env_module

        self.cfg = cfg
        self.replay = replay
        self.index = actor_index
        self.router = Router(engines)
        self.teachers = list(teachers or [])
        self._teacher_turn = itertools.count()
        from agentrl.envs.base import set_tool_parser
        from agentrl.rollout.tool_calls import build_tool_parser

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.renderer = ChatRenderer(tokenizer)
        self.tool_parser = build_tool_parser(cfg.rollout.tool_parser, model_path, tokenizer)
        self.agent = None
        self._endpoint = None
        try:  # the driver imported it; a node of a cluster has it only through the runtime_env
            if cfg.agent.solve is not None:
                from agentrl.rollout.agent.user import load_agent

                self.agent = load_agent(cfg.agent)
            else:
                env_name = import_env_module(cfg.env.id)
        except ConfigError as err:
            raise ConfigError(f"rollout actor {actor_index} on node {ray.util.get_node_ip_address()}: {err} "
                              "(other nodes get the module through cluster.ship_env_module or "
                              "cluster.runtime_env)") from None

        def make_env():
            env = gym.make(env_name, **cfg.env.kwargs)
            set_tool_parser(env, self.tool_parser)
            return env

        self.make_env = make_env
        if self.agent is None:
            self.make_env().close()  # fail fast on a bad env id or kwargs
        self._stop = False
        self._tasks = itertools.count(first_task)
        self.owner = owner
        self.num_groups = 0
        self.num_failed_groups = 0
        self.num_in_flight = 0
        self._failures_in_a_row = 0

    async def endpoint(self):
        """This worker's OpenAI-compatible endpoint (agent mode), started on first use."""
        if self._endpoint is None:
            from agentrl.rollout.agent.endpoint import AgentEndpoint

            self._endpoint = AgentEndpoint(self.renderer, self.tool_parser, self.router, rollout=self.cfg.rollout,
                                           agent=self.cfg.agent, max_model_len=self.cfg.engine.max_model_len)
        await self._endpoint.start()
        return self._endpoint

    async def endpoint_url(self) -> str:
        return (await self.endpoint()).base_url

    async def _group(self, seed: int, gid: int, *, temperature: float | None = None, num_episodes: int | None = None,
                     evaluation: bool = False):
        if self.agent is not None:
            from agentrl.rollout.agent.user import run_agent_group

            return await run_agent_group(self.agent, await self.endpoint(), seed=seed, rollout=self.cfg.rollout,
                                         group_id=gid, temperature=temperature, num_episodes=num_episodes,
                                         evaluation=evaluation)
        from agentrl.rollout.episode import run_group

        return await run_group(
            self.make_env, self.renderer, self.router, seed=seed, cfg=self.cfg.rollout, group_id=gid,
            env_timeout=self.cfg.env.step_timeout_s, temperature=temperature, num_episodes=num_episodes,
            max_model_len=self.cfg.engine.max_model_len,
        )

    def _next_seed(self) -> int:
        k = next(self._tasks)
        return self.cfg.rollout.seed_offset + k * self.cfg.rollout.num_actors + self.index

    async def _worker(self) -> None:
        from agentrl.replay.fixed_lag import slot_seed
        from agentrl.replay.queue import zero_spread

        while not self._stop:
            ticket = await self.replay.admit.remote(self.owner)
            if self._stop:
                await self.replay.release.remote(ticket, self.owner)
                return
            seed = slot_seed(ticket)  # replay.lag: the slot fixes its task
            seed = self._next_seed() if seed is None else seed
            gid = seed
            self.num_in_flight += 1
            try:
                group = await self._group(seed, gid)
            except Exception:
                self.num_failed_groups += 1
                await self.replay.release.remote(ticket, self.owner)
                continue
            finally:
                self.num_in_flight -= 1
                for i in range(self.cfg.rollout.group_size):
                    self.router.end_episode(f"g{gid}-e{i}")
            if not group.trainable():  # every episode failed (e.g. its engine died): nothing to learn
                self.num_failed_groups += 1
                await self.replay.release.remote(ticket, self.owner)
                # Back off: while an engine restarts its calls fail at once, and retrying at full
                # speed only burns CPU and failed groups (the soak run counted hundreds).
                self._failures_in_a_row += 1
                await anyio.sleep(min(10.0, 0.25 * 2 ** min(self._failures_in_a_row, 6)))
                continue
            self._failures_in_a_row = 0
            if self.teachers and not (self.cfg.replay.dynamic_sampling and zero_spread(group)):
                try:
                    await self._score(group)
                except Exception:  # a teacher engine died: the group cannot be distilled
                    self.num_failed_groups += 1
                    await self.replay.release.remote(ticket, self.owner)
                    continue
            await self.replay.put.remote(group, ticket, self.owner)
            self.num_groups += 1

    def diag_status(self) -> dict[str, Any]:
        # pending/progress: read by the watchdog's ledger (shown in a diagnosis, not acted on: a
        # group waits on engine generations and tools, each bounded by its own watch)
        return {"busy": self.num_in_flight > 0, "groups_in_flight": self.num_in_flight,
                "groups_done": self.num_groups, "groups_failed": self.num_failed_groups,
                "pending": self.num_in_flight, "progress": self.num_groups + self.num_failed_groups}

    async def _score(self, group) -> None:
        from agentrl.learner.distill import score_group

        k = self.cfg.distill.top_k

        async def score(token_ids: list[int]) -> Any:
            teacher = self.teachers[next(self._teacher_turn) % len(self.teachers)]
            return await (teacher.score_top_k.remote(token_ids, k) if k else teacher.score.remote(token_ids))

        await score_group(group, score)

    async def run(self) -> int:
        """Generate groups until :meth:`stop`; returns the number of groups produced."""
        from agentrl.rollout.episode import widen_env_threads

        widen_env_threads(self.cfg.rollout.max_concurrent_groups * self.cfg.rollout.group_size)
        async with anyio.create_task_group() as tg:
            for _ in range(self.cfg.rollout.max_concurrent_groups):
                tg.start_soon(self._worker)
        return self.num_groups

    def stop(self) -> None:
        self._stop = True

    async def close(self) -> None:
        """Stop the agent's worker processes (agent.workers) and the endpoint. A rollout actor
        killed without it leaves no worker either: they exit when their parent dies."""
        if self.agent is not None:
            await self.agent.close()
        if self._endpoint is not None:
            await self._endpoint.stop()

    async def evaluate(self, num_episodes: int, seed_offset: int, temperature: float) -> dict[str, float]:
        """Held-out evaluation: one episode per seed, at ``temperature`` (0 = greedy)."""
        from agentrl.rollout.episode import summarize, widen_env_threads

        widen_env_threads(32)
        results = []

        async def one(k: int) -> None:
            g = await self._group(seed_offset + k, -(k + 1), temperature=temperature, num_episodes=1, evaluation=True)
            results.extend(g.trajectories)
            self.router.end_episode(f"g{-(k + 1)}-e0")

        limiter = anyio.CapacityLimiter(32)

        async def limited(k: int) -> None:
            async with limiter:
                await one(k)

        async with anyio.create_task_group() as tg:
            for k in range(num_episodes):
                tg.start_soon(limited, k)
        return {k.replace("rollout/", "eval/"): v for k, v in summarize(results).items()}

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def init_began(self) -> float:
        """When this actor's construction began (``time.time()``)."""
        return self.init_began_at

    def stats(self) -> dict[str, float]:
        return {
            **(self._endpoint.stats() if self._endpoint is not None else {}),
            **(self.agent.stats() if self.agent is not None else {}),
            f"rollout/actor{self.index}_groups": float(self.num_groups),
            "rollout/sticky_hits": float(self.router.num_sticky_hits),
            "rollout/failed_groups": float(self.num_failed_groups),
        }
