"""The user's side of the agent endpoint: an agent function, a task source, and the episode around them.

An agent is a function of an OpenAI client and a task that returns the reward::

    async def solve(client: openai.AsyncOpenAI, task) -> float: ...

(or a plain ``def`` that gets an ``openai.OpenAI`` client and runs in a worker thread; or an
agent plus a separate ``score(task, result) -> float``). Each episode gets a client bound to its
own key on the rollout worker's endpoint (:mod:`agentrl.rollout.agent.endpoint`); the agent never sees the
engine, Ray or token ids. Tasks come from a JSONL file or a function ``tasks(seed) -> task``.
Functions are named in the config as ``module:function`` and imported like env modules. With
``agent.workers`` > 0 they run in worker processes of their own (:mod:`agentrl.rollout.agent.pool`), the
endpoint staying in the rollout worker's process.

This module knows nothing of Ray: the rollout actor calls :func:`run_agent_group`.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import anyio

from agentrl.config import AgentConfig, ConfigError, RolloutConfig
from agentrl.rollout.episode import OVER_BUDGET
from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

__all__ = ["Agent", "TaskSource", "load_agent", "load_function", "run_agent_episode", "run_agent_group",
           "shared_http_client", "solve_and_score"]


def load_function(spec: str, *, key: str) -> Callable[..., Any]:
    """Import ``module:function`` (the module from the Python path or the current directory).

    Raises:
        ConfigError: the module does not import, or has no such callable.
    """
    from agentrl.env.ids import import_env_module

    name = import_env_module(spec, key=key)
    module = sys.modules[spec.partition(":")[0]]
    fn = getattr(module, name, None)
    if not callable(fn):
        public = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        import difflib

        close = difflib.get_close_matches(name, public, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{key}: module '{module.__name__}' has no function '{name}'.{hint}")
    return fn


class TaskSource:
    """Tasks by seed: line ``seed mod n`` of a JSONL file, or ``function(seed)``.

    Raises:
        ConfigError: the file is missing, empty or holds a line that is not JSON; the function
            does not import.
    """

    def __init__(self, spec: str, *, key: str = "agent.tasks") -> None:
        self.spec = spec
        self._rows: list[Any] | None = None
        self._fn: Callable[[int], Any] | None = None
        if spec.endswith(".jsonl") or spec.endswith(".json") or "/" in spec or ":" not in spec:
            path = Path(spec)
            if not path.is_file():
                raise ConfigError(f"{key}: no such file: {path} (give a .jsonl file or module:function)")
            rows = []
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise ConfigError(f"{key}: {path} line {i} is not JSON: {exc}") from None
            if not rows:
                raise ConfigError(f"{key}: {path} holds no tasks")
            self._rows = rows
        else:
            self._fn = load_function(spec, key=key)

    @property
    def num_rows(self) -> int | None:
        return len(self._rows) if self._rows is not None else None

    def get(self, seed: int) -> Any:
        if self._rows is not None:
            return self._rows[seed % len(self._rows)]
        return self._fn(seed)  # type: ignore[misc]


@dataclass
class Agent:
    """An agent function, its optional scorer and its task sources, loaded from the ``agent`` config."""

    solve: Callable[..., Any]
    score: Callable[[Any, Any], Any] | None
    tasks: TaskSource
    eval_tasks: TaskSource
    cfg: AgentConfig
    # HTTP clients shared by the episodes' openai clients (one per event loop, one for threads):
    # building an openai client with its own connection pool costs ~36 ms of CPU (an SSL context),
    # with a shared one ~0.15 ms; kept-alive connections are reused across episodes too.
    http_clients: dict[Any, Any] = field(default_factory=dict, repr=False)
    pool: Any = field(default=None, repr=False)  # agent.workers > 0: the AgentWorkerPool

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.solve)

    def http_client(self) -> Any:
        """The HTTP client this context's episodes share (the running loop's, else the threads')."""
        return shared_http_client(self.http_clients)

    def worker_pool(self) -> Any:
        """The agent worker processes (``agent.workers`` > 0), made on first use; None for 0."""
        if self.cfg.workers == 0:
            return None
        if self.pool is None:
            from agentrl.rollout.agent.pool import AgentWorkerPool

            self.pool = AgentWorkerPool(self.cfg.workers)
        return self.pool

    def stats(self) -> dict[str, float]:
        """``rollout/agent_worker_*`` counters (agent.workers > 0): processes started and died."""
        return self.pool.stats() if self.pool is not None else {}

    async def close(self) -> None:
        """Stop the worker processes (none is left) and close the shared HTTP clients. Safe to call twice."""
        if self.pool is not None:
            await self.pool.close()
            self.pool = None
        import asyncio

        loop = asyncio.get_running_loop()
        for key, client in self.http_clients.items():
            if key == "threads":
                client.close()
            elif key is loop:  # another loop's client is left to that loop (its connections are its own)
                await client.aclose()
        self.http_clients.clear()


def shared_http_client(cache: dict[Any, Any]) -> Any:
    """The HTTP client of this context in ``cache``: one per running event loop, one for threads."""
    import asyncio

    import openai

    try:
        key: Any = asyncio.get_running_loop()
    except RuntimeError:
        key = "threads"
    client = cache.get(key)
    if client is None or client.is_closed:
        client = openai.DefaultHttpxClient() if key == "threads" else openai.DefaultAsyncHttpxClient()
        cache[key] = client
    return client


def load_agent(cfg: AgentConfig) -> Agent:
    """Import the agent, scorer and task sources the ``agent`` section names.

    Raises:
        ConfigError: as :func:`load_function` and :class:`TaskSource`; ``agent.solve`` unset.
    """
    if cfg.solve is None or cfg.tasks is None:
        raise ConfigError("agent.solve and agent.tasks must be set to run an agent")
    tasks = TaskSource(cfg.tasks)
    return Agent(
        solve=load_function(cfg.solve, key="agent.solve"),
        score=load_function(cfg.score, key="agent.score") if cfg.score else None,
        tasks=tasks,
        eval_tasks=TaskSource(cfg.eval_tasks, key="agent.eval_tasks") if cfg.eval_tasks else tasks,
        cfg=cfg,
    )


def _reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"the reward must be a finite number, got {value!r} ({type(value).__name__})")
    return float(value)


async def solve_and_score(solve: Callable[..., Any], score: Callable[..., Any] | None, task: Any, *,
                          base_url: str, api_key: str, request_timeout_s: float,
                          http_client: Callable[[], Any]) -> float:
    """Run ``solve`` with an openai client on ``base_url``/``api_key``, then ``score``; the reward.

    Where it runs (the rollout worker's process, or an agent worker's) is the caller's: the
    clients share ``http_client()``'s connections; a plain ``def`` runs in a thread.
    """
    import openai

    kwargs = dict(base_url=base_url, api_key=api_key, max_retries=0, timeout=request_timeout_s)
    # The episode's client is not closed: that would close the shared HTTP client under it.
    if inspect.iscoroutinefunction(solve):
        result = await solve(openai.AsyncOpenAI(**kwargs, http_client=http_client()), task)
    else:
        def run() -> Any:
            return solve(openai.OpenAI(**kwargs, http_client=http_client()), task)

        result = await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
    if score is not None:
        result = await score(task, result) if inspect.iscoroutinefunction(score) else \
            await anyio.to_thread.run_sync(lambda: score(task, result), abandon_on_cancel=True)
    return _reward(result)


async def _call_agent(agent: Agent, ep: Any, task: Any) -> float:
    pool = agent.worker_pool()
    if pool is not None:  # agent.workers > 0: in a worker process; a cancel here cancels it there
        return await pool.run(agent.cfg.solve, agent.cfg.score, task, base_url=ep.base_url, api_key=ep.api_key,
                              request_timeout_s=agent.cfg.request_timeout_s)
    return await solve_and_score(agent.solve, agent.score, task, base_url=ep.base_url, api_key=ep.api_key,
                                 request_timeout_s=agent.cfg.request_timeout_s, http_client=agent.http_client)


def _describe(exc: Exception) -> str:
    from agentrl.rollout.agent.pool import AgentRaised, AgentWorkerDied

    if isinstance(exc, AgentWorkerDied):
        return str(exc)[:400]
    name, text = (exc.type_name, exc.text) if isinstance(exc, AgentRaised) else (type(exc).__name__, str(exc))
    return f"the agent raised {name}: {text[:300]}"


async def run_agent_episode(agent: Agent, endpoint: Any, task: Any, *, episode_id: str, seed: int,
                            rollout: RolloutConfig, temperature: float) -> list[Trajectory]:
    """Run the agent on ``task`` with a client bound to a new episode of ``endpoint``.

    Never raises for the agent's errors: an agent that raises, returns no number or runs past
    ``agent.timeout_s`` gives ``failed`` trajectories (counted, never trained on). An episode
    whose prompt outgrew the token limit is ``truncated`` and trained as ``rollout.overlong``
    says; one refused a completion past ``rollout.max_turns`` is ``truncated`` by turns.

    Returns:
        One trajectory per segment (at least one, empty when the agent sampled nothing).
    """
    ep = endpoint.open_episode(episode_id, temperature=temperature)
    reward, status, info = 0.0, "ok", {}
    try:
        with anyio.fail_after(agent.cfg.timeout_s):
            # rollout.max_episode_s: the agent is cancelled and the episode keeps what it recorded
            with anyio.move_on_after(rollout.max_episode_s if rollout.max_episode_s else float("inf")) as wall:
                reward = await _call_agent(agent, ep, task)
            if wall.cancelled_caught:
                ep.truncated_by = ep.truncated_by or "wall_time"
    except TimeoutError:
        status, info["error"] = "failed", f"the agent did not return within {agent.cfg.timeout_s:g} s (agent.timeout_s)"
    except Exception as exc:  # the user's agent may raise anything: count the episode, drop it
        status, info["error"] = "failed", _describe(exc)
    finally:
        endpoint.close_episode(ep)
    if ep.error is not None:  # the engine failed under it; whatever the agent made of that
        status, info["error"] = "failed", ep.error
    if status != "failed" and not ep.recorder.num_completions:
        status, info["error"] = "failed", "the agent made no completion request"
    if status != "failed" and ep.truncated_by is not None:
        status, info["truncated_by"] = "truncated", ep.truncated_by
        if ep.truncated_by in OVER_BUDGET:
            info["success"] = False
            if rollout.overlong == "zero_reward":
                reward = 0.0
            elif rollout.overlong == "mask":
                info["loss_excluded"] = True
    if status != "failed":
        info.setdefault("success", reward >= 1.0)
    trajs = ep.recorder.trajectories(reward, status=status, info=info, episode=episode_id, seed=seed,
                                     num_tool_calls=ep.num_tool_calls)
    if not trajs:
        trajs = [Trajectory([], [], [], [], turn_rewards=[0.0], status="failed", env_id="agent", seed=seed,
                            info={**info, "episode": episode_id, "segment": 0, "num_segments": 0})]
    return trajs


async def run_agent_group(agent: Agent, endpoint: Any, *, seed: int, rollout: RolloutConfig, group_id: int = 0,
                          temperature: float | None = None, num_episodes: int | None = None,
                          evaluation: bool = False) -> TrajectoryGroup:
    """G episodes of the agent on the task of ``seed``, concurrently (a GRPO group)."""
    source = agent.eval_tasks if evaluation else agent.tasks
    task = source.get(seed)
    n = num_episodes or rollout.group_size
    temp = rollout.temperature if temperature is None else temperature
    results: list[list[Trajectory]] = [[] for _ in range(n)]

    async def one(i: int) -> None:
        results[i] = await run_agent_episode(agent, endpoint, task, episode_id=f"g{group_id}-e{i}", seed=seed,
                                             rollout=rollout, temperature=temp)

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return TrajectoryGroup(task_id=f"agent#{seed}", trajectories=[t for r in results for t in r], group_id=group_id)
