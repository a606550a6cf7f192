"""An async vLLM engine that speaks token ids and records the weight version of every token.

Logprob mode: ``processed_logprobs``. The engine reports the logprob of each sampled token under
the distribution it was actually sampled from (temperature applied; with top_p/top_k, the
renormalized nucleus). The learner scores tokens with ``log_softmax(logits / temperature)``, so at
top_p = 1 the two agree to float precision (measured ~2e-7 in float32 on CPU), at any temperature.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from agentrl.config import EngineConfig

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
    d = base / f"agentrl-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


class VLLMEngine:
    """vLLM ``AsyncLLM`` with token-id generation, per-token versions and in-place refit.

    Args:
        model_path: Hugging Face model directory.
        cfg: the ``engine`` config section.
        dtype: parameter dtype ("float32" keeps engine and learner logprobs equal on CPU).
        seed: sampling seed of the engine.
    """

    def __init__(self, model_path: str, cfg: "EngineConfig", *, dtype: str = "float32", seed: int = 0) -> None:
        self.model_path = model_path
        self.cfg = cfg
        self.dtype = dtype
        self.seed = seed
        self.version = 0
        self.num_inflight = 0
        self._llm = None
        self._ids = itertools.count()

    async def start(self) -> None:
        """Start the engine (spawns vLLM's engine-core process)."""
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(self.cfg.kv_cache_gib)))))
        if self.cfg.num_gpus == 0:
            # On CPU vLLM otherwise runs the model in a worker process of its own, beside the
            # engine-core process, and the two exchange every step through a spinning shared-memory
            # queue. One process (the "uni" executor) leaves that CPU to the rollouts and the
            # learner: ~1.5x the trajectories/s of the async pipeline on 2 cores (bench/RESULTS.md).
            # Set VLLM_ENABLE_V1_MULTIPROCESSING=1 to get the worker process back.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=self.model_path,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.cfg.max_model_len,
            max_num_seqs=self.cfg.max_num_seqs,
            enforce_eager=self.cfg.enforce_eager,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            worker_extension_cls="agentrl.engines.worker_ext.WeightSyncExtension",
        )
        self._llm = AsyncLLM.from_engine_args(args)

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
    ) -> GenerationResult:
        """Sample a continuation of ``prompt_ids``; each token is tagged with the version in force
        when it came out of the engine (with in-flight refit, one turn can span versions)."""
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
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        result = GenerationResult()
        self.num_inflight += 1
        try:
            request_id = f"agentrl-{next(self._ids)}"
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), params, request_id):
                comp = out.outputs[0]
                new = list(comp.token_ids)
                result.token_ids.extend(new)
                lps = comp.logprobs or []
                for tok, lp in zip(new, lps[-len(new):] if new else []):
                    result.logprobs.append(float(lp[tok].logprob))
                result.versions.extend([self.version] * len(new))
                if comp.finish_reason is not None:
                    result.finish_reason = str(comp.finish_reason)
        finally:
            self.num_inflight -= 1
        if len(result.logprobs) != len(result.token_ids):
            raise RuntimeError("vLLM returned a different number of logprobs than tokens")
        return result

    async def score(self, token_ids: list[int]) -> list[float]:
        """Logprob of every token given its prefix under the current weights (0.0 at position 0)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params, f"score-{next(self._ids)}"):
            final = out
        plp = final.prompt_logprobs
        return [0.0] + [float(d[t].logprob) for t, d in zip(token_ids[1:], plp[1:])]

    async def update_weights(
        self, weights: dict[str, "torch.Tensor"], version: int, mode: Literal["drain", "continue"] = "continue"
    ) -> float:
        """Swap in new weights and advance the version.

        ``drain`` lets in-flight requests finish first; ``continue`` freezes them, swaps, and
        resumes them on the new weights. Returns seconds spent paused."""
        from safetensors.torch import save_file

        loop = asyncio.get_running_loop()
        path = _shm_dir() / f"weights-v{version}.safetensors"
        tensors, seen = {}, set()
        for name, tensor in weights.items():
            # Tied parameters (embed_tokens / lm_head) share storage; the model loader ties them again.
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.detach().contiguous()
        await loop.run_in_executor(None, save_file, tensors, str(path))
        t0 = loop.time()
        await self.llm.pause_generation(mode="wait" if mode == "drain" else "keep", clear_cache=False)
        try:
            await self.llm.collective_rpc("agentrl_load_weights", args=(str(path),))
            # Cached prefixes hold KV computed with the old weights.
            await self.llm.reset_prefix_cache()
            self.version = version
        finally:
            await self.llm.resume_generation()
            path.unlink(missing_ok=True)
        return loop.time() - t0

    async def weight_checksum(self) -> float:
        return float((await self.llm.collective_rpc("agentrl_weight_checksum"))[0])

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
