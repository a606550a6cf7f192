"""Env steps run in worker threads: a rollout actor lets as many run at once as it has episodes in
flight, so slow (blocking) tools of hundreds of concurrent episodes overlap instead of queueing
behind anyio's default of 40 threads."""

import threading

import anyio
import pytest

from agentrl.rollout.episode import widen_env_threads


def _all_at_once(calls: int, *, widen: bool) -> None:
    barrier = threading.Barrier(calls, timeout=5)  # passes only when every call is running at once

    async def main() -> None:
        if widen:
            widen_env_threads(calls)
        async with anyio.create_task_group() as tg:
            for _ in range(calls):
                tg.start_soon(anyio.to_thread.run_sync, barrier.wait)

    anyio.run(main)


def test_env_calls_of_every_episode_run_at_once() -> None:
    _all_at_once(100, widen=True)


def test_without_widening_calls_queue_behind_the_default_pool() -> None:
    # The control: the same 100 blocking calls with anyio's default pool of 40 cannot all meet.
    with pytest.raises(BaseException) as info:
        _all_at_once(100, widen=False)
    assert "BrokenBarrierError" in repr(info.value) or isinstance(info.value, threading.BrokenBarrierError)


def test_widening_never_shrinks_the_pool() -> None:
    async def main() -> float:
        widen_env_threads(4)
        return anyio.to_thread.current_default_thread_limiter().total_tokens

    assert anyio.run(main) == 40
