"""What the engine hands vLLM: the config's settings become ``AsyncEngineArgs`` fields."""

import dataclasses

import pytest

from agentrl.config import ConfigError, load_config
from agentrl.engine.vllm_engine import VLLMEngine


def _kwargs(overrides, **engine):
    cfg = load_config(None, overrides)
    return VLLMEngine("/models/m", cfg.engine, dtype="bfloat16", **engine).engine_kwargs()


def test_gpu_kv_cache_size_replaces_the_profiled_one():
    kw = _kwargs(["engine.num_gpus=1", "engine.gpu_kv_cache_gib=1.5"])
    assert kw["kv_cache_memory_bytes"] == 1.5 * 2**30
    assert "enable_chunked_prefill" not in kw
    assert "kv_cache_memory_bytes" not in _kwargs(["engine.num_gpus=1"])
    # a CPU engine sizes its cache by engine.kv_cache_gib (VLLM_CPU_KVCACHE_SPACE), never by this
    cpu = _kwargs(["engine.gpu_kv_cache_gib=1.5"])
    assert "kv_cache_memory_bytes" not in cpu and cpu["enable_chunked_prefill"] is False


def test_engine_args_given_by_the_caller_win():
    kw = _kwargs(["engine.num_gpus=1", "engine.gpu_kv_cache_gib=2"],
                 engine_args={"kv_cache_memory_bytes": 123, "enable_chunked_prefill": True})
    assert kw["kv_cache_memory_bytes"] == 123 and kw["enable_chunked_prefill"] is True


def test_every_key_is_a_vllm_engine_argument():
    from vllm import AsyncEngineArgs

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    for overrides in (["engine.num_gpus=1", "engine.gpu_kv_cache_gib=2"], []):
        kw = _kwargs(overrides)
        assert set(kw) <= fields, set(kw) - fields
        args = AsyncEngineArgs(**kw)
        assert args.max_model_len == kw["max_model_len"]
    assert AsyncEngineArgs(**_kwargs(["engine.num_gpus=1", "engine.gpu_kv_cache_gib=2"])).kv_cache_memory_bytes == 2 * 2**30


@pytest.mark.parametrize("bad", ["0", "-1", "lots"])
def test_bad_kv_cache_size_is_refused(bad):
    with pytest.raises(ConfigError, match="gpu_kv_cache_gib"):
        load_config(None, [f"engine.gpu_kv_cache_gib={bad}"])


def test_gpu_engines_prefill_in_vllm_offline_sized_steps():
    """engine.max_num_batched_tokens auto: 16,384 tokens a step on a CUDA engine (vLLM's async engine
    would take 2,048: a 131k-token episode in 64 steps), vLLM's own default on a CPU engine (whole
    prompts); an int is passed as it is, null leaves vLLM's default, and a budget below the requests
    batched at once is refused."""
    from agentrl.config.rollout import AUTO_BATCHED_TOKENS

    gpu = load_config(None, ["engine.num_gpus=1"])
    assert gpu.engine.max_num_batched_tokens == AUTO_BATCHED_TOKENS == 16384
    assert _kwargs(["engine.num_gpus=1"])["max_num_batched_tokens"] == 16384
    assert load_config(None, []).engine.max_num_batched_tokens is None
    assert "max_num_batched_tokens" not in _kwargs([])  # CPU: chunked prefill off, vLLM sizes the step
    assert _kwargs(["engine.num_gpus=1", "engine.max_num_batched_tokens=8192"])["max_num_batched_tokens"] == 8192
    assert "max_num_batched_tokens" not in _kwargs(["engine.num_gpus=1", "engine.max_num_batched_tokens=null"])
    with pytest.raises(ConfigError, match="max_num_batched_tokens .32. must be at least engine.max_num_seqs .64."):
        load_config(None, ["engine.num_gpus=1", "engine.max_num_batched_tokens=32"])
    from vllm import AsyncEngineArgs

    assert AsyncEngineArgs(**_kwargs(["engine.num_gpus=1"])).max_num_batched_tokens == 16384
