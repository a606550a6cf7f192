"""An async vLLM engine that speaks token ids and records the weight version of every token.

Logprob mode: ``processed_logprobs``. The engine reports the logprob of each sampled token under
the distribution it was actually sampled from (temperature applied; with top_p/top_k, the
renormalized nucleus). The learner scores tokens with ``log_softmax(logits / temperature)``, so at
top_p = 1 the two agree to float precision (measured ~2e-7 in float32 on CPU), at any temperature.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from agentrl.config import EngineConfig, LoRAConfig
    from agentrl.weights.transports import RefitPayload

from agentrl.progress_watch import ProgressClock

__all__ = ["GenerationResult", "VLLMEngine"]


@dataclass
class GenerationResult:
    """One turn's sampled tokens with their logprobs and the weight version that made each."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"


def _shm_dir() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    _sweep_dead(base, "agentrl-")
    d = base / f"agentrl-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def private_tmpdir() -> Path:
    """A temp folder of this engine process's own, which later engine processes remove once it is
    dead: vLLM leaves files in the temp dir (its ``vllm_dist_*`` rendezvous file) that a killed
    engine cannot remove. Set as the process's ``tempfile.tempdir`` before vLLM starts."""
    base = Path(tempfile.gettempdir())
    _sweep_dead(base, "agentrl-engine-")
    d = base / f"agentrl-engine-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def sweep_dead_engine_files(pids: "list[int]" = (), wait_s: float = 10.0) -> None:  # type: ignore[assignment]
    """Remove what engine processes that are gone left in /dev/shm and the temp dir, after
    waiting up to ``wait_s`` for the engines ``pids`` (just killed) to exit."""
    import time

    end = time.monotonic() + wait_s
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.2)
    for base, prefix in ((Path("/dev/shm"), "agentrl-"), (Path(tempfile.gettempdir()), "agentrl-engine-")):
        if base.is_dir():
            _sweep_dead(base, prefix)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_dead(base: Path, prefix: str) -> int:
    """Remove the folders of engine processes that no longer exist (an engine killed mid-refit
    cannot remove its own; found by the soak run, bench/soak.py)."""
    import shutil

    alive = 0
    for d in base.glob(f"{prefix}*"):
        pid = d.name.removeprefix(prefix)
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            alive += 1
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:  # alive, another user's
            alive += 1
    return alive


class VLLMEngine:
    """vLLM ``AsyncLLM`` with token-id generation, per-token versions and in-place refit.

    Args:
        model_path: Hugging Face model directory.
        cfg: the ``engine`` config section.
        dtype: parameter dtype ("float32" keeps engine and learner logprobs equal on CPU).
        seed: sampling seed of the engine.
        lora: the learner's ``learner.lora`` when it trains adapters: the engine starts with LoRA
            enabled, every refit loads the new adapter in place (one adapter id, so in-flight
            requests continue on it, as with full weights) and every request uses it. Until the
            first adapter arrives requests run on the base, which equals a fresh adapter (B = 0).
        vocab_limit: ``model.tokenizer_vocab_only``: logits at ids >= this are masked to -inf in
            every forward pass (sampling and logprobs), set in each worker once the engine starts.
    """

    LORA_ID = 1  # the one adapter slot the policy uses; reloaded in place at every refit

    def __init__(self, model_path: str, cfg: "EngineConfig", *, dtype: str = "float32", seed: int = 0,
                 enable_sleep_mode: bool = False, lora: "LoRAConfig | None" = None,
                 engine_args: dict | None = None, vocab_limit: int | None = None) -> None:
        self.model_path = model_path
        self.vocab_limit = vocab_limit
        self.cfg = cfg
        self.dtype = dtype
        self.seed = seed
        self.enable_sleep_mode = enable_sleep_mode
        self.sleeping = False
        self.version = 0
        self.num_inflight = 0
        self.num_tokens_sampled = 0  # ever: what the watchdog reads as progress of a long wait (an evaluation)
        self.num_requests_finished = 0
        # Work pending (requests, weight loads, sleep/wake) and the time since any of it moved: an
        # engine whose core process is frozen keeps answering pings, but this clock runs on.
        self.clock = ProgressClock()
        self._llm = None
        self._ids = itertools.count()
        self.lora = lora if lora is not None and lora.enabled else None
        self.lora_request = None  # vllm LoRARequest of the adapter now served (None: the base)
        self._adapter_dir: Path | None = None
        self.engine_args = dict(engine_args or {})

    async def start(self) -> None:
        """Start the engine (spawns vLLM's engine-core process)."""
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(self.cfg.kv_cache_gib)))))
        if self.cfg.num_gpus == 0:
            # On CPU vLLM otherwise runs the model in a worker process of its own, beside the
            # engine-core process, and the two exchange every step through a spinning shared-memory
            # queue. One process (the "uni" executor) leaves that CPU to the rollouts and the
            # learner: ~1.5x the trajectories/s of the async pipeline on 2 cores (bench/history/async_vs_sync.md).
            # Set VLLM_ENABLE_V1_MULTIPROCESSING=1 to get the worker process back.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_kwargs()))
        if self.vocab_limit is not None:
            await self._llm.collective_rpc("agentrl_limit_vocab", args=(int(self.vocab_limit),))

    def engine_kwargs(self) -> dict:
        """vLLM's ``AsyncEngineArgs`` for this engine: the config's, then ``engine_args`` on top."""
        kwargs = dict(
            model=self.model_path, dtype=self.dtype, seed=self.seed, max_model_len=self.cfg.max_model_len,
            max_num_seqs=self.cfg.max_num_seqs, enforce_eager=self.cfg.enforce_eager,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization, logprobs_mode="processed_logprobs",
            enable_prefix_caching=True, worker_extension_cls="agentrl.weights.vllm_worker.WeightSyncExtension",
            enable_sleep_mode=self.enable_sleep_mode, **self._lora_args())
        if self.cfg.max_num_batched_tokens is not None:  # auto is resolved by the config; None: vLLM's default
            kwargs["max_num_batched_tokens"] = self.cfg.max_num_batched_tokens
        if self.cfg.num_gpus == 0:
            # A prompt prefilled in chunks samples a token at each chunk and throws it away; for a
            # request with its own seed (`rollout.sampling_seed`, train.deterministic, an endpoint
            # client's `seed`) vLLM then rewinds the request's generator by its offset, which a
            # CPU generator does not have: "RuntimeError: CPU Generator does not use offset" kills
            # the engine (vLLM 0.32). Whole prompts per step never take that path.
            kwargs["enable_chunked_prefill"] = False
        elif self.cfg.gpu_kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(self.cfg.gpu_kv_cache_gib * 2**30)
        kwargs.update(self.engine_args)
        return kwargs

    def _lora_args(self) -> dict:
        if self.lora is None:
            return {}
        from agentrl.learner.lora import engine_max_rank

        # One adapter (the policy); its dtype is the model's (lora_dtype "auto").
        return {"enable_lora": True, "max_lora_rank": engine_max_rank(self.lora.rank), "max_loras": 1,
                "max_cpu_loras": 1}

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError("engine not started: call `await engine.start()` first")
        return self._llm

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop: list[str] | None = None,
    ) -> GenerationResult:
        """Sample a continuation of ``prompt_ids``; each token is tagged with the version in force
        when it came out of the engine (with in-flight refit, one turn can span versions).

        ``stop``: strings at which vLLM ends the sampling (the tokens returned end with the one
        that completes the string; the text is the caller's to cut)."""
        result = GenerationResult()
        async for delta in self.generate_stream(
                prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                stop_token_ids=stop_token_ids, seed=seed, ignore_eos=ignore_eos, min_tokens=min_tokens, stop=stop):
            result.token_ids += delta.token_ids
            result.logprobs += delta.logprobs
            result.versions += delta.versions
            result.finish_reason = delta.finish_reason
        return result

    async def generate_stream(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop: list[str] | None = None,
    ) -> AsyncIterator[GenerationResult]:
        """:meth:`generate` as it happens: one :class:`GenerationResult` per engine step holding
        that step's new tokens (the last one carries the finish reason). Leaving the loop early
        aborts the request."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            logprobs=0,
            stop_token_ids=stop_token_ids,
            seed=seed,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            # vLLM matches stop strings in its detokenizer: text is made only when one is asked for,
            # decoded as agentrl decodes sampled text (special tokens kept).
            stop=list(stop) if stop else None,
            detokenize=bool(stop),
            skip_special_tokens=not stop,
            output_kind=RequestOutputKind.DELTA,
        )
        self.num_inflight += 1
        self.clock.begin()
        try:
            request_id = f"agentrl-{next(self._ids)}"
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), params, request_id,
                                               lora_request=self.lora_request):
                comp = out.outputs[0]
                new = list(comp.token_ids)
                lps = comp.logprobs or []
                delta = GenerationResult(new, [float(lp[tok].logprob) for tok, lp in zip(new, lps[-len(new):] if new else [])],
                                         [self.version] * len(new), str(comp.finish_reason or "stop"))
                if len(delta.logprobs) != len(new):
                    raise RuntimeError("vLLM returned a different number of logprobs than tokens")
                self.num_tokens_sampled += len(new)
                self.clock.advance(len(new))
                if new or comp.finish_reason is not None:
                    yield delta
            self.num_requests_finished += 1
        finally:
            self.num_inflight -= 1
            self.clock.end()

    async def score(self, token_ids: list[int]) -> list[float]:
        """Logprob of every token given its prefix under the current weights (0.0 at position 0)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params,
                                           f"score-{next(self._ids)}", lora_request=self.lora_request):
            final = out
        plp = final.prompt_logprobs
        return [0.0] + [float(d[t].logprob) for t, d in zip(token_ids[1:], plp[1:])]

    async def score_top_k(self, token_ids: list[int], k: int) -> dict[str, list]:
        """:meth:`score` plus the engine's ``k`` most likely tokens at every position (what it
        would have put there given the prefix), most likely first: ``{"logprobs": [T],
        "top_ids": [T][k], "top_logprobs": [T][k]}``, zeros at position 0. ``k`` is at most
        vLLM's ``max_logprobs`` (20 by default)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=k, detokenize=False)
        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params,
                                           f"score-{next(self._ids)}", lora_request=self.lora_request):
            final = out
        logprobs, top_ids, top_lps = [0.0], [[0] * k], [[0.0] * k]
        for t, d in zip(token_ids[1:], final.prompt_logprobs[1:]):
            logprobs.append(float(d[t].logprob))
            # The dict holds the top k and the prompt's own token (k + 1 entries when it ranks
            # below k): the k largest are the top k.
            best = sorted(d.items(), key=lambda kv: -kv[1].logprob)[:k]
            top_ids.append([int(i) for i, _ in best])
            top_lps.append([float(lp.logprob) for _, lp in best])
        return {"logprobs": logprobs, "top_ids": top_ids, "top_logprobs": top_lps}

    async def update_weights(
        self, weights: "dict[str, torch.Tensor] | RefitPayload", version: int,
        mode: Literal["drain", "continue"] = "continue",
    ) -> float:
        """Swap in new weights and advance the version.

        ``weights`` is a dict of CPU tensors (object-store transport) or a
        :class:`agentrl.weights.transports.RefitPayload` (CUDA IPC handle, or the layout of a broadcast the
        learner sends at the same time). ``drain`` lets in-flight requests finish first;
        ``continue`` freezes them, swaps, and resumes them on the new weights. While the engine
        sleeps (colocated), the weights are loaded into the woken weight memory and the KV cache
        is woken afterwards. Returns seconds spent paused.

        With LoRA (``lora``) ``weights`` holds the adapter's tensors only (PEFT names), by any
        transport. The first adapter, and every one sent through the object store, is written as
        an adapter directory on the engine's host (/dev/shm) and loaded in place into the policy's
        adapter slot; later CUDA IPC and NCCL refits replace the resident adapter straight from
        the received tensors, with no file."""
        if self.lora is not None:
            return await self._update_adapter(weights, version, mode)
        loop = asyncio.get_running_loop()
        path = None
        if isinstance(weights, dict):
            path = await self._stage_file(weights, version)
            method, args = "agentrl_load_weights", (str(path),)
        elif weights.transport == "cuda_ipc":
            method, args = "agentrl_load_ipc", (weights.handle, weights.spec)
        else:
            method, args = "agentrl_receive_weights", (weights.spec,)
        t0 = loop.time()
        try:
            if self.sleeping:
                await self.llm.wake_up(tags=["weights"])
                await self.llm.collective_rpc(method, args=args)
                await self.llm.wake_up(tags=["kv_cache"])  # fully awake: the scheduler resumes
                self.sleeping = False
                await self.llm.reset_prefix_cache()
                self.version = version
            else:
                await self.llm.pause_generation(mode="wait" if mode == "drain" else "keep", clear_cache=False)
                try:
                    await self.llm.collective_rpc(method, args=args)
                    # Cached prefixes hold KV computed with the old weights.
                    await self.llm.reset_prefix_cache()
                    self.version = version
                finally:
                    await self.llm.resume_generation()
        finally:
            if path is not None:
                path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    path.parent.rmdir()  # empty between refits: nothing of this process stays in /dev/shm
        return loop.time() - t0

    async def _update_adapter(self, weights: "dict[str, torch.Tensor] | RefitPayload", version: int,
                              mode: Literal["drain", "continue"]) -> float:
        import json

        from vllm.lora.request import LoRARequest

        from agentrl.learner.lora import ADAPTER_CONFIG, adapter_config, write_adapter_dir

        loop = asyncio.get_running_loop()
        config = adapter_config(self.lora, self.model_path)
        t0 = loop.time()
        if self.lora_request is not None and not isinstance(weights, dict):
            # The adapter is resident (one id, max_loras = max_cpu_loras = 1, so vLLM never evicts
            # it and never rereads its directory): the worker builds the new adapter from the
            # received tensors and replaces it in place, with no file in between.
            if weights.transport == "cuda_ipc":
                method, args = "agentrl_swap_adapter", (weights.handle, weights.spec, json.dumps(config), self.LORA_ID)
            else:
                method, args = "agentrl_receive_swap_adapter", (weights.spec, json.dumps(config), self.LORA_ID)
            await self._pause_and(lambda: self.llm.collective_rpc(method, args=args), mode)
            self.version = version
            return loop.time() - t0
        path = _shm_dir() / f"adapter-v{version}"
        if isinstance(weights, dict):
            await loop.run_in_executor(None, write_adapter_dir, path, weights, config)
        else:  # the worker writes the tensors it received (CUDA IPC views or the broadcast buffer)
            method = "agentrl_stage_adapter_ipc" if weights.transport == "cuda_ipc" else "agentrl_receive_adapter"
            args = (weights.handle, weights.spec, str(path)) if weights.transport == "cuda_ipc" else (weights.spec, str(path))
            await self.llm.collective_rpc(method, args=args)
            (path / ADAPTER_CONFIG).write_text(json.dumps(config))
        new = LoRARequest("agentrl-policy", self.LORA_ID, str(path))
        inplace = LoRARequest("agentrl-policy", self.LORA_ID, str(path), load_inplace=True)
        old_dir, self._adapter_dir = self._adapter_dir, path
        try:
            await self._pause_and(lambda: self.llm.add_lora(inplace), mode)
            self.lora_request, self.version = new, version
        finally:
            if old_dir is not None and old_dir != path:
                import shutil

                shutil.rmtree(old_dir, ignore_errors=True)
        return loop.time() - t0

    async def _pause_and(self, load: Callable[[], Awaitable[Any]], mode: Literal["drain", "continue"]) -> None:
        # Load an adapter with nothing generating: woken fully if asleep (level 1 keeps the
        # adapter's slots), else paused; cached prefixes hold KV of the old adapter.
        if self.sleeping:
            await self.llm.wake_up()
            self.sleeping = False
            await load()
            await self.llm.reset_prefix_cache()
            return
        await self.llm.pause_generation(mode="wait" if mode == "drain" else "keep", clear_cache=False)
        try:
            await load()
            await self.llm.reset_prefix_cache()
        finally:
            await self.llm.resume_generation()

    async def _stage_file(self, weights: "dict[str, torch.Tensor]", version: int) -> Path:
        from safetensors.torch import save_file

        path = _shm_dir() / f"weights-v{version}.safetensors"
        tensors, seen = {}, set()
        for name, tensor in weights.items():
            # Tied parameters (embed_tokens / lm_head) share storage; the model loader ties them again.
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.detach().contiguous()
        await asyncio.get_running_loop().run_in_executor(None, save_file, tensors, str(path))
        return path

    async def sleep(self, level: int = 1) -> float:
        """Drain in-flight requests and release GPU memory (colocated with the learner): level 1
        offloads the weights to host memory and drops the KV cache; level 2 drops both (the next
        :meth:`update_weights` or :meth:`wake_up` brings weights back). Returns seconds taken."""
        if not self.enable_sleep_mode:
            raise RuntimeError("sleep: the engine was started without sleep mode (colocate.engine_sleep)")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if not self.sleeping:
            await self.llm.sleep(level=level, mode="wait")
            self.sleeping = True
            self.sleep_level = level
        return loop.time() - t0

    async def wake_up(self) -> float:
        """Wake from :meth:`sleep` with the weights it kept (level 1 only); returns seconds."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if self.sleeping:
            if getattr(self, "sleep_level", 1) >= 2:
                raise RuntimeError("wake_up after a level-2 sleep needs new weights: use update_weights")
            await self.llm.wake_up()
            self.sleeping = False
        return loop.time() - t0

    async def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                backend: str) -> list[int]:
        """Join the refit broadcast group (nccl transport); returns the workers' ranks in it."""
        return list(await self.llm.collective_rpc(
            "agentrl_init_weight_group", args=(host, port, rank_offset, world_size, backend)))

    async def memory_stats(self) -> list[dict[str, float]]:
        """Each worker's GPU memory (GiB): allocator counters and the driver's count for its
        process (:meth:`WeightSyncExtension.agentrl_memory_stats`); empty dicts on CPU."""
        return list(await self.llm.collective_rpc("agentrl_memory_stats"))

    async def weight_checksum(self) -> float:
        return float((await self.llm.collective_rpc("agentrl_weight_checksum"))[0])

    def shutdown(self) -> None:
        if self._adapter_dir is not None:
            import shutil

            shutil.rmtree(self._adapter_dir, ignore_errors=True)
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
