"""Actors for tests/test_watchdog.py (imported by Ray workers, so in a module of their own)."""

import time

import ray

from agentrl.actors.watchdog import DIAG_GROUPS, AsyncDiag, SyncDiag


@ray.remote(concurrency_groups=DIAG_GROUPS)
class BlockingLoop(AsyncDiag):
    """An async actor whose method blocks its event loop (a sync call in async code)."""

    async def hog(self, seconds: float) -> int:
        time.sleep(seconds)
        return 1


@ray.remote(concurrency_groups=DIAG_GROUPS)
class Worker(SyncDiag):
    """A threaded actor that reports itself busy while it works."""

    def __init__(self) -> None:
        self.working = False

    def work(self, seconds: float) -> int:
        self.working = True
        try:
            time.sleep(seconds)
        finally:
            self.working = False
        return 2

    def diag_status(self) -> dict:
        return {"busy": self.working}


@ray.remote(concurrency_groups=DIAG_GROUPS)
class Sampler(SyncDiag):
    """An engine stand-in whose sampled-token count moves while it works (``rate`` tokens a
    second; 0: busy but sampling nothing, as a hung request)."""

    def __init__(self) -> None:
        self.tokens = 0

    def work(self, seconds: float, rate: float) -> int:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.05)
            self.tokens += int(rate * 0.05)
        return 3

    def diag_status(self) -> dict:
        return {"tokens_sampled": self.tokens}


@ray.remote(num_cpus=0)
class Holder:
    """Re-puts an object so that this actor owns the copy: killing it loses the object (a refit
    whose weights object is gone)."""

    def hold(self, value) -> list:
        return [ray.put(value)]
