"""Parallelism for the Megatron learner, composed in one ordered place.

Order: torch.distributed (NCCL, one process per GPU; a world of one: ``solo``, no NCCL) ->
``parallel_state`` (TP x PP x CP x DP) ->
model-parallel RNG -> model on this rank's stage -> HF weights -> Megatron DDP -> (distributed)
optimizer -> schedule hooks (grad sync, finalize).

What a learner process needs (the Ray learner actor passes these as constructor kwargs; each falls
back to the environment variable of the same name in capitals, as torchrun sets them):
``rank`` (RANK), ``world_size`` (WORLD_SIZE), ``local_rank`` (LOCAL_RANK, the CUDA device index;
default ``rank % num_visible_gpus``), ``master_addr`` (MASTER_ADDR) and ``master_port``
(MASTER_PORT). If torch.distributed is already initialized it is used as it is.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ParallelLayout", "build_ddp_and_optimizer", "init_distributed", "init_parallel_state",
           "start_process_group"]


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees and this rank's coordinates, read back from ``parallel_state``."""

    world_size: int
    rank: int
    tp: int
    pp: int
    cp: int
    dp: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int

    def describe(self) -> str:
        return (f"world={self.world_size} = tp {self.tp} x pp {self.pp} x cp {self.cp} x dp {self.dp}; "
                f"rank {self.rank}: tp {self.tp_rank}, pp {self.pp_rank}, cp {self.cp_rank}, dp {self.dp_rank}")


def _env(value: Any, name: str, default: Any = None) -> Any:
    if value is not None:
        return value
    return os.environ.get(name, default)


def init_distributed(*, rank: int | None = None, world_size: int | None = None, local_rank: int | None = None,
                     master_addr: str | None = None, master_port: int | None = None,
                     backend: str | None = None, timeout_s: float = 1800.0) -> torch.device:
    """Start torch.distributed for this process (if not yet started) and pick its CUDA device."""
    if not torch.cuda.is_available():
        raise RuntimeError("the Megatron learner needs CUDA GPUs; use learner.backend=torch on CPU")
    rank = int(_env(rank, "RANK", 0))
    world_size = int(_env(world_size, "WORLD_SIZE", 1))
    local_rank = int(_env(local_rank, "LOCAL_RANK", rank % torch.cuda.device_count()))
    torch.cuda.set_device(local_rank)
    start_process_group(rank=rank, world_size=world_size, device=torch.device("cuda", local_rank),
                        master_addr=master_addr, master_port=master_port, backend=backend, timeout_s=timeout_s)
    return torch.device("cuda", local_rank)


def start_process_group(*, rank: int, world_size: int, device: torch.device | None = None,
                        master_addr: str | None = None, master_port: int | None = None,
                        backend: str | None = None, timeout_s: float = 1800.0) -> str:
    """``init_process_group`` unless already started; returns the default group's backend.

    A world of one process gets :mod:`agentrl.learner.megatron.solo` (every collective is its
    one-rank result, no NCCL communicator: each held its own buffers, 2.4 GiB outside the allocator
    on the H200); ``AGENTRL_ONE_RANK_NCCL=1`` keeps NCCL there, for measuring the difference. More
    processes get NCCL, its communicators made lazily: with ``device_id`` torch may make them
    eagerly for every group Megatron creates (a few dozen); ``AGENTRL_NCCL_EAGER_INIT=1`` restores
    the eager start.
    """
    if dist.is_initialized():
        return str(dist.get_backend())
    timeout = datetime.timedelta(seconds=timeout_s)
    if world_size == 1 and backend is None and os.environ.get("AGENTRL_ONE_RANK_NCCL", "0") != "1":
        from agentrl.learner.megatron.solo import register

        if rank != 0:
            raise ValueError(f"rank {rank} in a world of one process")
        dist.init_process_group(register(), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return str(dist.get_backend())
    os.environ["MASTER_ADDR"] = str(_env(master_addr, "MASTER_ADDR", "127.0.0.1"))
    os.environ["MASTER_PORT"] = str(_env(master_port, "MASTER_PORT", 29500))
    eager = os.environ.get("AGENTRL_NCCL_EAGER_INIT", "0") == "1" and device is not None
    dist.init_process_group(backend or "nccl", rank=rank, world_size=world_size, timeout=timeout,
                            **({"device_id": device} if eager else {}))
    return str(dist.get_backend())


def init_parallel_state(mcfg: Any, seed: int = 0) -> ParallelLayout:
    """``parallel_state.initialize_model_parallel`` with ``mcfg``'s degrees (DP is what is left)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    model_parallel = mcfg.tensor_parallel_size * mcfg.pipeline_parallel_size * mcfg.context_parallel_size
    if world % model_parallel:
        raise ValueError(f"world size {world} is not a multiple of tensor_parallel_size * pipeline_parallel_size "
                         f"* context_parallel_size = {model_parallel}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=mcfg.tensor_parallel_size,
            pipeline_model_parallel_size=mcfg.pipeline_parallel_size,
            context_parallel_size=mcfg.context_parallel_size,
        )
    model_parallel_cuda_manual_seed(seed)
    return ParallelLayout(
        world_size=world, rank=dist.get_rank(),
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(), dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
    )


def build_ddp_and_optimizer(model: torch.nn.Module, learner_cfg: Any) -> tuple[Any, Any]:
    """Wrap ``model`` in Megatron DDP and build Adam(W) (distributed when configured).

    Also installs the schedule hooks on the model's config: ``no_sync_func``, ``grad_sync_func``
    (when overlapping) and ``finalize_model_grads_func`` (DP all-reduce / reduce-scatter, tied
    embedding and sequence-parallel norm grads).
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from agentrl.learner.optim import fuse_adamw

    mcfg = learner_cfg.megatron
    config = model.config
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=mcfg.grad_reduce_in_fp32, overlap_grad_reduce=mcfg.overlap_grad_reduce,
            use_distributed_optimizer=mcfg.use_distributed_optimizer,
        ),
        module=model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=learner_cfg.lr, min_lr=learner_cfg.lr, weight_decay=learner_cfg.weight_decay,
            adam_beta1=learner_cfg.betas[0], adam_beta2=learner_cfg.betas[1], clip_grad=learner_cfg.grad_clip,
            bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype,
            use_distributed_optimizer=mcfg.use_distributed_optimizer,
        ),
        [ddp],
    )
    fuse_adamw(opt)  # torch's AdamW (no TE/Apex here): the fused kernel, no parameter-sized temporary
    if mcfg.master_weight_remainders:
        from agentrl.learner.megatron.remainders import use_remainders

        for one in getattr(opt, "chained_optimizers", None) or [opt]:
            use_remainders(one)
        torch.cuda.empty_cache()  # the fp32 masters' blocks go back to the device
    config.no_sync_func = ddp.no_sync
    if mcfg.overlap_grad_reduce:
        config.grad_sync_func = ddp.start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    return ddp, opt
