"""Moving weights between HF checkpoints and a TP/PP-sharded Megatron model.

`load_hf_weights` copies HF tensors into this rank's shard; `gather_hf_weights` collects every
rank's shard (TP all-gather, PP all-gather of the stages) and returns full HF-named CPU tensors.
Both are collective over the model-parallel groups: every rank calls them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.learner.megatron.convert import (
    ModelShape,
    gather_tp,
    globalize_layers,
    hf_to_megatron,
    localize_layers,
    megatron_to_hf,
    shard_tp,
)

__all__ = ["gather_hf_weights", "load_hf_weights", "read_hf_state_dict", "stage_layer_range"]


def read_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF model directory (``model.safetensors`` or a sharded index), on CPU."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (path / name).exists():
            raise FileNotFoundError(f"{path / name} not found: the Megatron learner reads safetensors checkpoints")
        state.update(load_file(str(path / name)))
    return state


def stage_layer_range(model: Any) -> tuple[int, int]:
    """(first global layer index, number of layers) of this pipeline stage."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config), len(model.decoder.layers)


def _model_tensors(model: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if torch.is_tensor(v) and not k.endswith("_extra_state")}


@torch.no_grad()
def load_hf_weights(model: Any, hf_state: dict[str, torch.Tensor], shape: ModelShape) -> None:
    """Copy HF tensors into ``model`` (this rank's TP shard of its PP stage), casting to its dtype."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    first, num = stage_layer_range(model)
    full = hf_to_megatron(hf_state, shape, tp_size=tp)
    local = localize_layers(full, first, num, pre_process=model.pre_process, post_process=model.post_process,
                            tied=shape.tied_embeddings)
    mine = shard_tp(local, tp, ps.get_tensor_model_parallel_rank())
    target = _model_tensors(model)
    missing, extra = set(target) - set(mine), set(mine) - set(target)
    if missing or extra:
        raise KeyError(f"HF -> Megatron mismatch: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}")
    for name, dst in target.items():
        src = mine[name]
        if src.shape != dst.shape:
            raise ValueError(f"{name}: converted shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
        dst.copy_(src.to(dst.dtype))


@torch.no_grad()
def gather_hf_weights(model: Any, shape: ModelShape, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Full HF-named weights on ``device`` (CPU by default; the GPU for a CUDA IPC or NCCL refit),
    assembled from all TP ranks and PP stages (collective)."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp = dist.get_world_size(tp_group)
    local = _model_tensors(model)
    if tp > 1:
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        for name, t in local.items():
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            for r in range(tp):
                shards[r][name] = parts[r].to(device)
        full_stage = gather_tp(shards)
    else:
        full_stage = {k: v.detach().to(device) for k, v in local.items()}
    first, _ = stage_layer_range(model)
    stage = globalize_layers(full_stage, first, drop_tied_copy=shape.tied_embeddings and not model.pre_process)
    pp_group = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp_group) > 1:
        stages: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, stage, group=pp_group)
        stage = {k: v for s in stages for k, v in s.items()}
    return megatron_to_hf(stage, shape)
