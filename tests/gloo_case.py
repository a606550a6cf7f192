"""Run a Megatron model case in spawned processes of its own: gloo ranks on CPU with Megatron's
parallel state, so a test's model can be built without touching the test process's state."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _worker(case: Callable[[], Any], rank: int, world: int, parallel: dict[str, int], store: str, out: Any) -> None:
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        ps.initialize_model_parallel(**parallel)
        res = case()
        ps.destroy_model_parallel()
        out.put((rank, "ok", res))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes back to the test process
        out.put((rank, "error", traceback.format_exc()))


def run_on_gloo_ranks(case: Callable[[], Any], workdir: Path, world: int = 1, timeout: float = 240,
                      **parallel: int) -> list[Any]:
    """``case()`` (a module-level function) on ``world`` spawned gloo ranks, after
    ``initialize_model_parallel(**parallel)`` (e.g. ``context_parallel_size=2``): each rank's result
    in rank order, or an AssertionError with the first failing rank's traceback."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = str(Path(workdir) / "store")
    procs = [ctx.Process(target=_worker, args=(case, r, world, parallel, store, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    try:
        for _ in range(world):
            rank, status, payload = out.get(timeout=timeout)
            got[rank] = (status, payload)
    except queue.Empty:
        got.update({r: ("error", f"rank {r} gave no answer in {timeout:.0f} s") for r in range(world) if r not in got})
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
    errors = [payload for r, (status, payload) in sorted(got.items()) if status != "ok"]
    assert not errors, errors[0]
    return [got[r][1] for r in range(world)]


def run_on_one_gloo_rank(case: Callable[[], Any], workdir: Path, timeout: float = 240) -> Any:
    """``case()`` on one gloo rank (:func:`run_on_gloo_ranks`): its result."""
    return run_on_gloo_ranks(case, workdir, 1, timeout)[0]
