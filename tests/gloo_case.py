"""Run a Megatron model case in a spawned process of its own: one gloo rank with Megatron's
parallel state, so a test's model can be built on CPU without touching the test process's state."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _worker(case: Callable[[], Any], store: str, out: Any) -> None:
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                                timeout=timedelta(seconds=120))
        ps.initialize_model_parallel()
        out.put(("ok", case()))
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes back to the test process
        out.put(("error", traceback.format_exc()))


def run_on_one_gloo_rank(case: Callable[[], Any], workdir: Path, timeout: float = 240) -> Any:
    """``case()`` (a module-level function) in a spawned process on one gloo rank; its result, or
    an AssertionError with the worker's traceback."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(case, str(Path(workdir) / "store"), out), daemon=True)
    proc.start()
    try:
        status, payload = out.get(timeout=timeout)
    except queue.Empty:
        status, payload = "error", f"the worker gave no answer in {timeout:.0f} s"
    proc.join(timeout=10)
    if proc.is_alive():
        proc.terminate()
    assert status == "ok", payload
    return payload
