"""The PyTorch learner: a Hugging Face causal LM, AdamW, packed micro-batches, the shared loss.

Runs on CPU (the quickstart) or one small GPU. The Megatron-Core learner replaces it at scale.
"""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentrl.learners.common import (
    build_samples,
    global_counts,
    merge_metrics,
    microbatch_loss,
    pack_samples,
    plan_microbatches,
    with_signal,
)
from agentrl.learners.hf_forward import packed_token_logprobs
from agentrl.models import copy_tokenizer_files, load_hf_model  # load_hf_model: also public here, as before
from agentrl.optim import adamw

if TYPE_CHECKING:
    from agentrl.config import Config
    from agentrl.trajectory import Trajectory, TrajectoryGroup

__all__ = ["TorchLearner", "load_hf_model"]



class TorchLearner:
    """Learner over a Hugging Face model; see :class:`agentrl.learners.base.Learner`.

    Args:
        cfg: the run config (model, learner, loss, advantage, packing, rollout.temperature).
        model_path: overrides ``cfg.model.path`` (e.g. the SFT warm start).
    """

    def __init__(self, cfg: "Config", *, model_path: str | None = None, device: str | None = None) -> None:
        self.cfg = cfg
        self.model_path = Path(model_path or cfg.model.path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() and cfg.learner.num_gpus else "cpu"))
        torch.manual_seed(cfg.seed)
        self.model = load_hf_model(self.model_path, cfg.model.dtype, self.device)
        # Eval mode in every pass: no dropout, as in the engine that sampled the tokens (the IS
        # ratios compare the same policy), and the training pass's logprobs are the proximal ones.
        self.model.eval()
        self.ref_model = None
        if cfg.loss.kl.coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = self._make_optimizer(cfg.learner.lr)
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.version = 0

    def _make_optimizer(self, lr: float) -> torch.optim.Optimizer:
        lc = self.cfg.learner
        return adamw(self.model.parameters(), lr, weight_decay=lc.weight_decay, betas=tuple(lc.betas))

    @property
    def temperature(self) -> float:
        t = self.cfg.rollout.temperature
        return t if t > 0 else 1.0

    def _logprobs(self, model: torch.nn.Module, packed) -> torch.Tensor:
        packed = packed.to(self.device)
        return packed_token_logprobs(
            model, packed, temperature=self.temperature, chunk_size=self.cfg.packing.logprob_chunk_size
        )

    def train_step(self, groups: list["TrajectoryGroup"]) -> dict[str, float]:
        """One optimizer step on ``groups`` (advantages, packing, off-policy-corrected loss)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        samples = build_samples(groups, cfg.advantage, cfg.distill)
        num_tokens, num_sequences = global_counts(samples)  # the loss's normalizers: whole batch
        # Samples with all-zero advantages (tied groups) contribute exactly nothing: no passes for
        # them. When none is left, no optimizer step either (AdamW would move on its momentum).
        samples = with_signal(samples, has_kl=self.ref_model is not None)
        plan = plan_microbatches(samples, cfg.packing)[0]
        packs = [pack_samples(samples, mb, pad_multiple=cfg.packing.pad_multiple, pad_id=self.pad_id) for mb in plan]

        refs: list[torch.Tensor | None] = [None] * len(packs)
        t1 = time.perf_counter()
        if self.ref_model is not None:
            with torch.no_grad():
                refs = [self._logprobs(self.ref_model, p) for p in packs]
        t2 = time.perf_counter()

        self.optimizer.zero_grad(set_to_none=True)
        per_mb, total_loss = [], 0.0
        for packed, ref_lp in zip(packs, refs):
            logp = self._logprobs(self.model, packed)
            # One optimizer step per batch: the weights before the step (pi_prox under "recompute")
            # are the weights of this pass, so its own logprobs, detached, are the proximal ones;
            # a separate no-grad pass would repeat the same forward (test_torch_learner.py).
            prox_lp = logp.detach() if cfg.loss.proximal == "recompute" else None
            loss, metrics = microbatch_loss(
                logp, prox_lp, packed.to(self.device), cfg.loss,
                num_tokens=num_tokens, num_sequences=num_sequences, ref_logprobs=ref_lp,
            )
            loss.backward()
            total_loss += float(loss.detach())
            per_mb.append((metrics, float(packed.fields["loss_mask"].sum())))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.learner.grad_clip)
        stepped = bool(samples)  # with no signal AdamW would still move the weights on its momentum
        if stepped:
            self.optimizer.step()
        self.version += 1
        t3 = time.perf_counter()
        out = merge_metrics(per_mb)
        out.update({
            "train/loss": total_loss,
            "train/grad_norm": float(grad_norm),
            "train/num_sequences": num_sequences,
            "train/num_sequences_trained": float(len(samples)),
            "train/num_tokens": float(sum(len(s) for s in samples)),
            "train/num_microbatches": float(len(packs)),
            "train/optimizer_stepped": float(stepped),
            "train/version": float(self.version),
            "timing/logprobs": t2 - t1,  # the reference model's pass (KL), if any
            "timing/training": (t3 - t2) + (t1 - t0),
        })
        return out

    @torch.no_grad()
    def logprobs(self, trajectories: list["Trajectory"]) -> list[list[float]]:
        """Per-token logprobs under the current weights (0.0 at each sequence's first token)."""
        from agentrl.packing import pack_sequences, unpack

        out: list[list[float]] = []
        for traj in trajectories:
            packed = pack_sequences([traj.token_ids], pad_id=self.pad_id)
            out.append([float(x) for x in unpack(self._logprobs(self.model, packed), packed)[0]])
        return out

    def export_weights(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """HF-named weights: copies on CPU, or (``device="cuda"``, for a GPU refit) the model's own
        GPU tensors, which the refit copies into its flat buffer."""
        if torch.device(device).type == "cuda" and self.device.type == "cuda":
            return {k: v.detach() for k, v in self.model.state_dict().items()}
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def save(self, path: str | Path) -> None:
        """HF model (safetensors) + tokenizer under ``path/model``; optimizer, RNG, version beside."""
        path = Path(path)
        (path / "model").mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path / "model", safe_serialization=True)
        copy_tokenizer_files(self.model_path, path / "model")
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "version": self.version,
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
            },
            path / "learner_state.pt",
        )

    def load(self, path: str | Path) -> None:
        path = Path(path)
        state_file = path / "learner_state.pt"
        if not (path / "model").is_dir() or not state_file.is_file():
            raise FileNotFoundError(f"{path} is not a learner checkpoint (needs model/ and learner_state.pt)")
        model = load_hf_model(path / "model", self.cfg.model.dtype, self.device)
        self.model.load_state_dict(model.state_dict())
        state: dict[str, Any] = torch.load(state_file, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])

