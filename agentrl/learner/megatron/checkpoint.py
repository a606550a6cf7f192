"""Checkpoints of the Megatron learner.

Layout of ``DIR``:

* ``model/``: a Hugging Face model directory (``config.json``, ``model.safetensors``, tokenizer
  files copied from the source model), loadable by transformers, vLLM and the torch learner.
* ``optim/rank00000.pt`` ...: each rank's optimizer state (fp32 master weights and Adam moments of
  its shard, keyed by parameter name) and RNG state. Resuming it needs the same TP/PP/CP/DP layout;
  the HF model alone loads under any layout (the optimizer then starts fresh).
* ``learner_state.json``: step counter and the parallel layout that wrote it.

Both functions are collective: every rank calls them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.model.loading import copy_tokenizer_files
from agentrl.learner.optim import fuse_adamw

__all__ = ["load_checkpoint", "save_checkpoint"]



def _optimizers(opt: Any) -> list[Any]:
    return list(getattr(opt, "chained_optimizers", [opt]))


def _param_names(model: Any) -> dict[Any, str]:
    return {p: n for n, p in model.named_parameters()}


def _optimizer_state(learner: Any) -> list[dict[str, Any]] | None:
    """Each optimizer's state (None before the first step: Adam has no state yet)."""
    names = _param_names(learner.ddp.module)
    out = []
    for opt in _optimizers(learner.optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is not None and not inner.state:
            return None
        entry: dict[str, Any] = {"state_dict": opt.state_dict()}
        if hasattr(opt, "_get_main_param_and_optimizer_states"):  # DistributedOptimizer: shard by param
            params = {}
            for gbuf_ranges in opt.gbuf_ranges:
                for per_dtype in gbuf_ranges.values():
                    for bucket in per_dtype:
                        for p in bucket["param_map"]:
                            params[names[p]] = {k: v.cpu() for k, v in
                                                opt._get_main_param_and_optimizer_states(p).items()}
            entry["param_state"] = params
        out.append(entry)
    return out


def save_checkpoint(learner: Any, path: Path) -> None:
    """Write the HF model (rank 0), every rank's optimizer shard, and the step counter."""
    weights = learner.export_weights()
    rank = dist.get_rank()
    if rank == 0:
        from safetensors.torch import save_file

        (path / "model").mkdir(parents=True, exist_ok=True)
        (path / "optim").mkdir(parents=True, exist_ok=True)
        learner.hf_config.save_pretrained(path / "model")
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model" / "model.safetensors"),
                  metadata={"format": "pt"})
        copy_tokenizer_files(learner.model_path, path / "model")
        (path / "learner_state.json").write_text(json.dumps(
            {"version": learner.version, "layout": learner.layout.describe()}, indent=2))
    dist.barrier()
    torch.save({
        "optimizers": _optimizer_state(learner),
        "torch_rng": torch.get_rng_state(), "cuda_rng": torch.cuda.get_rng_state(), "python_rng": random.getstate(),
    }, path / "optim" / f"rank{rank:05d}.pt")
    dist.barrier()


def load_checkpoint(learner: Any, path: Path) -> None:
    """Load the HF weights, then (when present) this rank's optimizer shard and the step counter."""
    from agentrl.learner.megatron.weights import load_hf_weights, read_hf_state_dict

    state_file = path / "learner_state.json"
    if not (path / "model").is_dir() or not state_file.is_file():
        raise FileNotFoundError(f"{path} is not a learner checkpoint (needs model/ and learner_state.json)")
    meta = json.loads(state_file.read_text())
    load_hf_weights(learner.model, read_hf_state_dict(path / "model"), learner.shape)
    for opt in _optimizers(learner.optimizer):
        opt.reload_model_params()  # fp32 master weights from the loaded model weights
    learner.version = int(meta["version"])
    shard = path / "optim" / f"rank{dist.get_rank():05d}.pt"
    if not shard.is_file():
        return
    if meta.get("layout") != learner.layout.describe():
        raise ValueError(f"{path}: optimizer state was written under layout '{meta.get('layout')}', this run is "
                         f"'{learner.layout.describe()}'; resume with the same layout or delete {path / 'optim'}")
    saved = torch.load(shard, weights_only=False, map_location="cpu")
    by_name = {n: p for p, n in _param_names(learner.ddp.module).items()}
    for opt, entry in zip(_optimizers(learner.optimizer), saved["optimizers"] or []):
        opt.load_state_dict(entry["state_dict"])
        # Megatron's torch-optimizer path hands every parameter the *same* "step" tensor, which
        # torch's foreach Adam would then increment once per parameter: give each its own.
        inner = getattr(opt, "optimizer", None)
        for st in (inner.state.values() if inner is not None else []):
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()
        for name, tensors in entry.get("param_state", {}).items():
            opt._set_main_param_and_optimizer_states(by_name[name], tensors)
        if "param_state" in entry:
            opt._copy_main_params_to_model_params()
    fuse_adamw(learner.optimizer)  # the loaded groups carry the saved flags; steps go to the GPU
    torch.set_rng_state(saved["torch_rng"])
    torch.cuda.set_rng_state(saved["cuda_rng"])
    random.setstate(saved["python_rng"])
