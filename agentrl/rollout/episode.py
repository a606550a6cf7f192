"""The async multi-turn episode loop: an engine client and a Gymnasium env, token in, token out.

Each turn the engine samples tokens, which are appended exactly as sampled (loss mask 1, with
their logprobs and weight versions); the text goes to ``env.step``; the observation messages are
rendered as a token delta and appended (loss mask 0). Past turns are never re-rendered.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import anyio

from agentrl.rollout.chat import ChatRenderer
from agentrl.config import RolloutConfig
from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

__all__ = ["OVER_BUDGET", "EngineClient", "EpisodeFailed", "cap_tool_outputs", "request_seed", "run_episode", "run_group",
           "summarize", "widen_env_threads"]


class EngineClient(Protocol):
    """What the episode loop needs from an engine (or a router over several)."""

    async def generate(
        self, prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float, episode_id: str
    ) -> Any:  # GenerationResult: token_ids, logprobs, versions, finish_reason
        """Sample one turn. With ``rollout.sampling_seed`` set it is also passed ``seed=`` (an int):
        the request's own sampling seed."""
        ...


def request_seed(sampling_seed: int, episode_id: str, turn: int) -> int:
    """The sampling seed of one request: a function of the run's ``rollout.sampling_seed``, the
    episode (its id holds the task seed and the episode's index in its group) and the turn.

    >>> request_seed(0, "g7-e1", 0) == request_seed(0, "g7-e1", 0) != request_seed(0, "g7-e1", 1)
    True
    """
    digest = hashlib.sha256(f"{sampling_seed}:{episode_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


OVER_BUDGET = ("tokens", "wall_time", "model_calls", "sampled_tokens")
"""``info["truncated_by"]`` values of an episode cut short by a limit (trained as ``rollout.overlong``)."""


class EpisodeFailed(RuntimeError):
    """The env raised or timed out: the episode is never trained on."""


@dataclass
class _Episode:
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]

    def extend(self, ids: list[int], *, sampled: bool, logprobs=None, versions=None) -> None:
        self.ids += ids
        self.mask += [1 if sampled else 0] * len(ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(ids)
        self.versions += list(versions) if sampled else [-1] * len(ids)


def widen_env_threads(episodes: int) -> None:
    """Let ``episodes`` env calls run in worker threads at once (call inside the event loop).

    Env steps run in threads (a tool that blocks on I/O must not stall the loop); anyio's default
    of 40 threads per loop would queue the tool calls of more concurrent episodes than that.
    """
    limiter = anyio.to_thread.current_default_thread_limiter()
    limiter.total_tokens = max(limiter.total_tokens, episodes)


async def _env_call(fn: Callable, *args: Any, timeout: float, **kwargs: Any) -> Any:
    try:
        with anyio.fail_after(timeout):
            return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs), abandon_on_cancel=True)
    except TimeoutError:
        raise EpisodeFailed(f"env call {getattr(fn, '__name__', fn)} exceeded {timeout:.1f}s") from None
    except Exception as exc:  # an env bug must not take the rollout actor down
        raise EpisodeFailed(f"env raised {type(exc).__name__}: {exc}") from exc


async def _env_step(env: Any, action: str, timeout: float):
    astep = getattr(env.unwrapped, "astep", None)
    if astep is None:
        return await _env_call(env.step, action, timeout=timeout)
    try:
        with anyio.fail_after(timeout):
            return await astep(action)
    except TimeoutError:
        raise EpisodeFailed(f"env astep exceeded {timeout:.1f}s") from None
    except Exception as exc:
        raise EpisodeFailed(f"env raised {type(exc).__name__}: {exc}") from exc


def cap_tool_outputs(messages: list[dict], renderer: ChatRenderer, max_tokens: int | None) -> list[dict]:
    """``messages`` with every tool message's content cut to ``max_tokens`` tokens, plus a marker
    that says how many were cut (``rollout.max_observation_tokens``); other messages unchanged."""
    if max_tokens is None:
        return messages
    out = []
    for msg in messages:
        content = msg.get("content")
        if msg.get("role") == "tool" and isinstance(content, str):
            ids = renderer.encode(content)
            if len(ids) > max_tokens:
                kept = renderer.tokenizer.decode(ids[:max_tokens])
                msg = {**msg, "content": f"{kept}\n[tool output cut: {len(ids) - max_tokens} of {len(ids)} tokens "
                                       "not shown (rollout.max_observation_tokens)]"}
        out.append(msg)
    return out


async def run_episode(
    env: Any,
    renderer: ChatRenderer,
    client: EngineClient,
    *,
    seed: int,
    cfg: RolloutConfig,
    episode_id: str,
    env_timeout: float = 30.0,
    temperature: float | None = None,
    max_model_len: int | None = None,
) -> Trajectory:
    """Play one episode; never raises for env errors (the trajectory is marked ``failed``).

    The episode's token limit is the smaller of ``cfg.max_total_tokens`` and the engine's
    ``max_model_len``. An episode that reaches it ends as ``truncated`` with
    ``info["truncated_by"] == "tokens"`` (the turn the limit cut short is kept, closed, and never
    sent to the env), and ``cfg.overlong`` decides what it is trained as. An episode that runs out
    of turns ends as ``truncated`` with ``info["truncated_by"] == "turns"``.

    Per-episode budgets (``cfg.max_episode_s``, ``cfg.max_model_calls``, ``cfg.max_episode_tokens``)
    end an episode as ``truncated`` by ``"wall_time"``, ``"model_calls"`` or ``"sampled_tokens"``
    with the turns it finished (a turn cut short is kept, closed, rewarded 0 and never sent to the
    env) and are trained as ``cfg.overlong`` says, like an episode cut by the token limit.
    """
    env_id = getattr(getattr(env, "spec", None), "id", "") or ""
    traj_info: dict[str, Any] = {}
    spans: list[tuple[int, int]] = []
    rewards: list[float] = []
    num_tool_calls = 0
    status = "ok"
    ep = _Episode([], [], [], [])
    temp = cfg.temperature if temperature is None else temperature
    limit = min(cfg.max_total_tokens, max_model_len or cfg.max_total_tokens)
    sampled = 0  # tokens sampled over all turns (rollout.max_episode_tokens)
    wall = anyio.CancelScope(deadline=anyio.current_time() + cfg.max_episode_s if cfg.max_episode_s else float("inf"))

    def cut(by: str) -> None:
        nonlocal status
        status, traj_info["truncated_by"] = "truncated", by

    try:
        with wall:
            obs, info = await _env_call(env.reset, seed=seed, timeout=env_timeout)
            ep.extend(renderer.prompt_ids(obs, info.get("tools")), sampled=False)
            if len(ep.ids) >= limit:
                raise EpisodeFailed(f"prompt of {len(ep.ids)} tokens leaves no room (rollout.max_total_tokens = "
                                    f"{cfg.max_total_tokens}, engine.max_model_len = {max_model_len})")
            for turn in range(cfg.max_turns):
                budget = min(cfg.max_new_tokens, limit - len(ep.ids))
                left = None if cfg.max_episode_tokens is None else cfg.max_episode_tokens - sampled
                if left is not None and left <= 0:
                    cut("sampled_tokens")
                    break
                if left is not None:
                    budget = min(budget, left)
                # rollout.sampling_seed: the request's own seed (its tokens then do not depend on its batch-mates)
                seeded = {} if cfg.sampling_seed is None else {"seed": request_seed(cfg.sampling_seed, episode_id, turn)}
                try:
                    extra = {"min_tokens": min(cfg.min_new_tokens, budget)} if cfg.min_new_tokens else {}
                    out = await client.generate(
                        ep.ids, max_tokens=budget, temperature=temp, top_p=cfg.top_p, episode_id=episode_id,
                        **seeded, **extra
                    )
                except Exception as exc:  # the engine died or refused: drop the episode, count it
                    raise EpisodeFailed(f"engine error: {type(exc).__name__}: {str(exc)[:200]}") from exc
                start = len(ep.ids)
                ep.extend(out.token_ids, sampled=True, logprobs=out.logprobs, versions=out.versions)
                spans.append((start, len(ep.ids)))
                sampled += len(out.token_ids)
                ended = bool(out.token_ids) and out.token_ids[-1] in renderer.stop_token_ids
                if budget < cfg.max_new_tokens and not ended and len(out.token_ids) >= budget:
                    # Cut by the token limit or budget, not by the per-turn cap: an unfinished action
                    # is never scored or run as if complete.
                    rewards.append(0.0)
                    cut("sampled_tokens" if left is not None and budget == left else "tokens")
                    break
                text = renderer.decode(out.token_ids)
                obs, reward, terminated, truncated, step_info = await _env_step(env, text, env_timeout)
                rewards.append(float(reward))
                num_tool_calls += int(step_info.get("num_tool_calls", 0))
                traj_info.update({k: v for k, v in step_info.items() if k in ("success", "error", "answer")})
                if terminated:
                    break
                if truncated or turn == cfg.max_turns - 1:
                    cut("turns")
                    break
                if cfg.max_model_calls is not None and turn + 1 >= cfg.max_model_calls:
                    cut("model_calls")
                    break
                # Close an assistant turn that hit max_tokens, then the observation delta.
                closing = [] if ended else [renderer.end_of_turn_id]
                delta = closing + renderer.observation_delta_ids(cap_tool_outputs(obs, renderer, cfg.max_observation_tokens))
                if len(ep.ids) + len(delta) >= limit:
                    cut("tokens")
                    break
                ep.extend(delta, sampled=False)
        if wall.cancelled_caught:  # rollout.max_episode_s passed mid-reset, mid-generation or mid-tool
            if not spans:
                raise EpisodeFailed(f"the episode's wall-time budget ({cfg.max_episode_s:g} s, rollout.max_episode_s) "
                                    "passed before its first turn")
            rewards += [0.0] * (len(spans) - len(rewards))  # a turn whose tool call was cut off
            cut("wall_time")
    except EpisodeFailed as exc:
        status = "failed"
        traj_info["error"] = str(exc)
    if status != "failed":
        traj_info.setdefault("success", bool(traj_info.get("success", False)))
    # The env's own rewards, before the overlong shaping below: dynamic sampling filters on these.
    traj_info["raw_reward"] = float(sum(rewards))
    if traj_info.get("truncated_by") in OVER_BUDGET:
        traj_info["success"] = False
        if cfg.overlong == "zero_reward":
            rewards = [0.0] * len(rewards)
        elif cfg.overlong == "mask":
            traj_info["loss_excluded"] = True
    return Trajectory(
        token_ids=ep.ids,
        loss_mask=ep.mask,
        behavior_logprobs=ep.logprobs,
        policy_versions=ep.versions,
        turn_spans=spans,
        turn_rewards=rewards if rewards else [0.0],
        status=status,  # type: ignore[arg-type]
        env_id=env_id,
        seed=seed,
        num_tool_calls=num_tool_calls,
        info=traj_info,
    )


async def run_group(
    make_env: Callable[[], Any],
    renderer: ChatRenderer,
    client: EngineClient,
    *,
    seed: int,
    cfg: RolloutConfig,
    group_id: int = 0,
    env_timeout: float = 30.0,
    temperature: float | None = None,
    num_episodes: int | None = None,
    max_model_len: int | None = None,
) -> TrajectoryGroup:
    """G episodes of the same task (same env seed), concurrently."""
    n = num_episodes or cfg.group_size
    results: list[Trajectory | None] = [None] * n

    async def one(i: int) -> None:
        env = make_env()
        try:
            results[i] = await run_episode(
                env, renderer, client, seed=seed, cfg=cfg, episode_id=f"g{group_id}-e{i}",
                env_timeout=env_timeout, temperature=temperature, max_model_len=max_model_len,
            )
        finally:
            try:
                env.close()
            except Exception:
                pass

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    trajs = [t for t in results if t is not None]
    return TrajectoryGroup(task_id=f"{trajs[0].env_id if trajs else ''}#{seed}", trajectories=trajs, group_id=group_id)


def summarize(trajectories: list[Trajectory]) -> dict[str, float]:
    """Rollout metrics over finished trajectories. An agent episode recorded as several segments
    (:mod:`agentrl.rollout.agent.recorder`) counts once, by its last segment; ``rollout/segments`` is their
    mean number per episode."""
    if not trajectories:
        return {}
    segmented = [t for t in trajectories if "num_segments" in t.info]
    trajectories = [t for t in trajectories if t.info.get("segment", 0) + 1 >= t.info.get("num_segments", 1)]
    ok = [t for t in trajectories if t.status != "failed"]
    n = max(len(ok), 1)
    return {
        "rollout/trajectories": float(len(trajectories)),
        "rollout/reward": sum(t.reward for t in ok) / n,
        "rollout/success": sum(t.success for t in ok) / n,
        "rollout/turns": sum(t.num_turns for t in ok) / n,
        "rollout/tool_calls": sum(t.num_tool_calls for t in ok) / n,
        "rollout/tool_use_rate": sum(t.num_tool_calls > 0 for t in ok) / n,
        "rollout/tokens": sum(len(t) for t in ok) / n,
        "rollout/failed_frac": (len(trajectories) - len(ok)) / len(trajectories),
        "rollout/truncated_frac": sum(t.status == "truncated" for t in ok) / n,
        "rollout/overlong_frac": sum(t.info.get("truncated_by") == "tokens" for t in ok) / n,
        # cut by a per-episode budget (rollout.max_episode_s, max_model_calls, max_episode_tokens)
        "rollout/over_budget_frac": sum(t.info.get("truncated_by") in OVER_BUDGET[1:] for t in ok) / n,
        **{f"rollout/over_budget_{by}": float(sum(t.info.get("truncated_by") == by for t in trajectories))
           for by in OVER_BUDGET[1:] if any(t.info.get("truncated_by") == by for t in trajectories)},
        "rollout/tokens_max": float(max((len(t) for t in ok), default=0)),
        **({"rollout/segments": sum(t.info["num_segments"] for t in ok if "num_segments" in t.info) / n}
           if segmented else {}),
    }

