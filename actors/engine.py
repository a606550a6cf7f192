"""Ray actor around :class:`agentrl.engine.vllm_engine.VLLMEngine`.

Created with ``max_restarts=-1``: when the actor dies, Ray restarts it, and the first call on
the new instance starts vLLM and loads the weights the engines currently serve (from the weight
store, :mod:`agentrl.actors.weights`, which holds a reference to them) before it takes any work.
The trainer names the store rather than passing its handle: a constructor argument holding a reference makes Ray warn
that a restart could fail (ray-project/ray#53727), while a name is looked up afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import ray
from agentrl.actors.watchdog import DIAG_GROUPS, AsyncDiag

from agentrl.config import EngineConfig

__all__ = ["EngineActor"]


@ray.remote(concurrency_groups=DIAG_GROUPS)
class EngineActor(AsyncDiag):
    def __init__(self, model_path: str, cfg: EngineConfig, *, dtype: str = "float32", seed: int = 0,
                 weight_source: Any = None, enable_sleep_mode: bool = False, lora: Any = None,
                 compile_cache_dir: str | None = None, vocab_limit: int | None = None) -> None:
        """``weight_source``: the weight store (:class:`agentrl.actors.weights.WeightStoreActor`, a
        handle or the name of a named actor) whose ``latest_weights`` a (re)started engine loads
        before it serves. ``compile_cache_dir``:
        torch-inductor's cache, shared by the run's engines (the trainer's, removed at its
        shutdown): vLLM compiles its sampler's rank count on the first request for logprobs (on
        CPU a C++ kernel and a ~150 MB precompiled header: bench/history/chaos-soak.md), which a
        restarted engine then loads instead of compiling again. None: in the private temp dir.
        ``vocab_limit``: see :class:`agentrl.engine.vllm_engine.VLLMEngine`."""
        import tempfile

        from agentrl.engine.vllm_engine import VLLMEngine, private_tmpdir

        tmp = str(private_tmpdir())  # what vLLM leaves there goes when this process does
        tempfile.tempdir = os.environ["TMPDIR"] = tmp  # the env var for vLLM's engine-core process
        # Set, not inherited: torch writes the first cache dir it computes into the environment.
        cache = compile_cache_dir or os.path.join(tmp, "torchinductor")
        os.makedirs(cache, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        if cfg.expandable_segments and not enable_sleep_mode:
            # read by torch in vLLM's engine-core process, which starts after this
            conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(
                [p for p in conf.split(",") if p and not p.startswith("expandable_segments")]
                + ["expandable_segments:True"])
        self.engine = VLLMEngine(model_path, cfg, dtype=dtype, seed=seed, enable_sleep_mode=enable_sleep_mode,
                                 lora=lora, vocab_limit=vocab_limit)
        self.weight_source = weight_source
        self._started = False
        self._start_error = ""  # why vLLM failed to start, for the watchdog's diagnosis
        self._lock: asyncio.Lock | None = None

    async def _ready(self) -> None:
        if self._started:
            return
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if self._started:
                return
            try:
                await self.engine.start()
            except Exception as exc:
                self._start_error = f"{type(exc).__name__}: {str(exc)[:300]}"
                raise
            self._start_error = ""
            if isinstance(self.weight_source, str):  # a named actor (the trainer's weight store)
                self.weight_source = ray.get_actor(self.weight_source)
            if self.weight_source is not None:
                version, refs = await self.weight_source.latest_weights.remote()
                if refs:
                    # Only object-store refits are staged (CPU tensors): a GPU transport's handle
                    # or broadcast cannot be replayed, and the engine serves its start weights.
                    try:
                        weights = await refs[0]
                    except ray.exceptions.ObjectLostError:
                        # Lost with a failed refit; the driver exports again and stages those. The
                        # start weights' tokens carry version 0: the staleness bound drops them.
                        weights = None
                    if isinstance(weights, dict):  # full weights, or the LoRA adapter's tensors
                        await self.engine.update_weights(weights, version, mode="drain")
            self._started = True

    async def start(self) -> int:
        """Start vLLM (and catch up on weights); returns the version served."""
        await self._ready()
        return self.engine.version

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float,
                       stop_token_ids=None, ignore_eos: bool = False, seed: int | None = None,
                       min_tokens: int = 0, stop: list[str] | None = None):
        await self._ready()
        return await self.engine.generate(
            prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, seed=seed, min_tokens=min_tokens, stop=stop,
        )

    async def generate_stream(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float,
                              seed: int | None = None, stop: list[str] | None = None):
        """:meth:`generate` step by step (a Ray streaming generator: call it with
        ``.options(num_returns="streaming")``); each item is one engine step's new tokens."""
        await self._ready()
        async for delta in self.engine.generate_stream(prompt_ids, max_tokens=max_tokens, temperature=temperature,
                                                       top_p=top_p, seed=seed, stop=stop):
            yield delta

    async def score(self, token_ids: list[int]) -> list[float]:
        await self._ready()
        with self.engine.clock.busy():
            return await self.engine.score(token_ids)

    async def score_top_k(self, token_ids: list[int], k: int) -> dict[str, list]:
        await self._ready()
        with self.engine.clock.busy():
            return await self.engine.score_top_k(token_ids, k)

    async def update_weights(self, weights: dict, version: int, mode: str = "continue") -> float:
        await self._ready()
        first_adapter = self.engine.lora is not None and self.engine.lora_request is None
        if version <= self.engine.version and not first_adapter:  # a restarted engine may have caught up
            return 0.0
        with self.engine.clock.busy():  # a load that hangs (the core frozen) is a stall too
            return await self.engine.update_weights(weights, version, mode)  # type: ignore[arg-type]

    async def sleep(self, level: int = 1) -> float:
        """Drain and release GPU memory while a colocated learner steps (vLLM sleep mode)."""
        await self._ready()
        with self.engine.clock.busy():
            return await self.engine.sleep(level)

    async def wake_up(self) -> float:
        await self._ready()
        with self.engine.clock.busy():
            return await self.engine.wake_up()

    async def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                backend: str) -> list[int]:
        await self._ready()
        return await self.engine.init_weight_group(host, port, rank_offset, world_size, backend)

    async def gpu_memory(self) -> dict[str, float]:
        """Memory of this actor's GPU (GiB), used by all processes, read through NVML (no CUDA
        context in this process); empty on CPU."""
        import os

        try:
            import pynvml
        except ImportError:
            return {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        if not visible:
            return {}
        pynvml.nvmlInit()
        try:
            first = visible.split(",")[0]
            handle = (pynvml.nvmlDeviceGetHandleByUUID(first) if first.startswith("GPU-")
                      else pynvml.nvmlDeviceGetHandleByIndex(int(first)))
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        finally:
            pynvml.nvmlShutdown()
        return {"used_gib": info.used / 2**30, "total_gib": info.total / 2**30}

    async def memory_stats(self) -> list[dict[str, float]]:
        """Each vLLM worker's GPU memory in GiB (allocator counters, the driver's count for its
        process); empty dicts on CPU."""
        await self._ready()
        return await self.engine.memory_stats()

    def version(self) -> int:
        return self.engine.version

    def diag_status(self) -> dict[str, Any]:
        n = self.engine.num_inflight
        status = {"busy": n > 0 or self.engine.clock.pending > 0, "requests_in_flight": n,
                  "version": self.engine.version, "started": self._started,
                  "tokens_sampled": getattr(self.engine, "num_tokens_sampled", 0),
                  "requests_finished": self.engine.num_requests_finished, **self.engine.clock.status()}
        return status | ({"start_error": self._start_error} if self._start_error else {})

    @ray.method(concurrency_group="diag")
    async def core_processes(self) -> list[dict[str, Any]]:
        """What /proc says of this actor's child processes (vLLM's engine core, its workers):
        pid, name, state, wchan; read here, so it works for an engine on another node too."""
        from agentrl.progress_watch import describe_processes

        return describe_processes(os.getpid())

    @ray.method(concurrency_group="diag")
    async def kill_core(self) -> list[int]:
        """SIGKILL this actor's child processes (a frozen engine core cannot take a gentler
        signal); returns their pids. The driver calls it before killing the actor itself, whose
        death does not end the core (vLLM's core does not watch its parent)."""
        import signal

        import psutil

        pids = []
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error, OSError):
                os.kill(p.pid, signal.SIGKILL)
                pids.append(p.pid)
        return pids

    def num_inflight(self) -> int:
        return self.engine.num_inflight

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        import os

        return os.getpid()
