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
from torch.profiler import record_function

from agentrl.learner.common import (
    PEAKS,
    build_samples,
    global_counts,
    merge_metrics,
    microbatch_loss,
    pack_samples,
    plan_microbatches,
    with_signal,
)
from agentrl.learner.hf_forward import packed_token_logprobs
from agentrl.model.loading import copy_tokenizer_files, load_hf_model, tokenizer_vocab_limit  # load_hf_model: also public here, as before
from agentrl.learner.optim import adamw, fuse_adamw

if TYPE_CHECKING:
    from agentrl.config import Config
    from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

__all__ = ["TorchLearner", "load_hf_model"]



class TorchLearner:
    """Learner over a Hugging Face model; see :class:`agentrl.learner.base.Learner`.

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
        self.lora = cfg.learner.lora if cfg.learner.lora.enabled else None
        if self.lora is not None:
            from agentrl.learner.lora import wrap_model

            # Adapters over a frozen base; the KL reference is the base itself (adapters disabled).
            self.model = wrap_model(self.model, self.lora, self.model_path)
        # Eval mode in every pass: no dropout, as in the engine that sampled the tokens (the IS
        # ratios compare the same policy), and the training pass's logprobs are the proximal ones.
        self.model.eval()
        self.ref_model = None
        if cfg.loss.kl.coef > 0 and self.lora is None:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = self._make_optimizer(cfg.learner.lr)
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.vocab_limit = tokenizer_vocab_limit(self.model_path, cfg.model.tokenizer_vocab_only)
        self.version = 0
        # learner.moe_aux_loss_coef: the router balancing loss's weight (0 for a dense model)
        experts = int(getattr(self.model.config, "num_experts", 0) or 0)
        coef = cfg.learner.moe_aux_loss_coef
        if coef is None:
            coef = getattr(self.model.config, "router_aux_loss_coef", 0.0) or 0.0
        self.moe_aux_loss_coef = float(coef) if experts else 0.0

    def _make_optimizer(self, lr: float) -> torch.optim.Optimizer:
        lc = self.cfg.learner
        params = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        return adamw(params, lr, weight_decay=lc.weight_decay, betas=tuple(lc.betas))

    @property
    def temperature(self) -> float:
        t = self.cfg.rollout.temperature
        return t if t > 0 else 1.0

    def _logprobs(self, model: torch.nn.Module, packed, *, top_k: bool = False,
                  router_losses: list[torch.Tensor] | None = None) -> Any:
        """Logprobs of the packed tokens; ``top_k`` (dense distillation): also of the teacher's
        top-k ids at every position, ``(logprobs [T], top_k [T, k])`` from one forward;
        ``router_losses``: a MoE model's load-balancing loss of the pass is appended to it."""
        # the batch as given (on the host: the vocabulary check costs no GPU wait; it moves it)
        return packed_token_logprobs(
            model, packed, temperature=self.temperature, chunk_size=self.cfg.packing.logprob_chunk_size,
            extra_ids=packed.fields["teacher_top_ids"] if top_k else None, vocab_limit=self.vocab_limit,
            router_losses=router_losses,
        )

    def train_step(self, groups: list["TrajectoryGroup"]) -> dict[str, float]:
        """One optimizer step on ``groups`` (advantages, packing, off-policy-corrected loss)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        samples = build_samples(groups, cfg.advantage, cfg.distill)
        num_tokens, num_sequences = global_counts(samples)  # the loss's normalizers: whole batch
        # Samples with all-zero advantages (tied groups) contribute exactly nothing: no passes for
        # them. When none is left, no optimizer step either (AdamW would move on its momentum).
        dense = cfg.distill.enabled and cfg.distill.top_k > 0  # a loss term on every policy token
        samples = with_signal(samples, has_kl=cfg.loss.kl.coef > 0 or dense, loss_type=cfg.loss.type)
        plan = plan_microbatches(samples, cfg.packing)[0]
        packs = [pack_samples(samples, mb, pad_multiple=cfg.packing.pad_multiple, pad_id=self.pad_id) for mb in plan]

        refs: list[torch.Tensor | None] = [None] * len(packs)
        t1 = time.perf_counter()
        if self.ref_model is not None:
            with torch.no_grad():
                refs = [self._logprobs(self.ref_model, p) for p in packs]
        elif self.lora is not None and cfg.loss.kl.coef > 0:
            with torch.no_grad(), self.model.disable_adapter():
                refs = [self._logprobs(self.model, p) for p in packs]
        t2 = time.perf_counter()

        self.optimizer.zero_grad(set_to_none=True)
        # Nothing in this loop reads a value back from the GPU (the loss is summed on the device,
        # copies to it are asynchronous), so the host queues micro-batch i+1 while the GPU runs i.
        # The ranges are those of the Megatron learner (tools/learner_step.py reads them).
        per_mb: list[tuple[dict[str, torch.Tensor], float]] = []
        losses: list[torch.Tensor] = []
        router: list[torch.Tensor] | None = [] if self.moe_aux_loss_coef > 0 else None
        pack_tokens = sum(p.input_ids.numel() for p in packs)
        with record_function("agentrl.forward_backward"), PEAKS.phase("forward_backward"):
            for packed, ref_lp in zip(packs, refs):
                with record_function("agentrl.microbatch"):
                    on_device = packed.to(self.device, non_blocking=True)
                top_lp = None
                if dense:
                    logp, top_lp = self._logprobs(self.model, packed, top_k=True, router_losses=router)
                else:
                    logp = self._logprobs(self.model, packed, router_losses=router)
                # One optimizer step per batch: the weights before the step (pi_prox under "recompute")
                # are the weights of this pass, so its own logprobs, detached, are the proximal ones;
                # a separate no-grad pass would repeat the same forward (test_torch_learner.py).
                prox_lp = logp.detach() if cfg.loss.proximal == "recompute" else None
                with record_function("agentrl.loss"):
                    loss, metrics = microbatch_loss(
                        logp, prox_lp, on_device, cfg.loss,
                        num_tokens=num_tokens, num_sequences=num_sequences, ref_logprobs=ref_lp, top_k_logprobs=top_lp,
                        distill_coef=cfg.distill.coef, distill_direction=cfg.distill.top_k_direction,
                    )
                if router is not None:  # each micro-batch's balancing loss weighed by its share of the tokens
                    loss = loss + self.moe_aux_loss_coef * router[-1] * (packed.input_ids.numel() / pack_tokens)
                loss.backward()
                losses.append(loss.detach())
                per_mb.append((metrics, float(packed.fields["loss_mask"].sum())))  # a host tensor
        with record_function("agentrl.optimizer"), PEAKS.phase("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.learner.grad_clip)
            stepped = bool(samples)  # with no signal AdamW would still move the weights on its momentum
            if stepped:
                self.optimizer.step()
        self.version += 1
        with record_function("agentrl.metrics"):
            out = merge_metrics(per_mb)  # the step's one wait for the GPU
            loss_sum = float(torch.stack(losses).sum()) if losses else 0.0
        t3 = time.perf_counter()  # after the wait: the GPU's work of the step is done
        out.update({
            "train/loss": loss_sum,
            "train/grad_norm": float(grad_norm),
            "train/num_sequences": num_sequences,
            "train/num_sequences_trained": float(len(samples)),
            "train/num_tokens": float(sum(len(s) for s in samples)),
            "train/num_microbatches": float(len(packs)),
            "train/optimizer_stepped": float(stepped),
            "train/version": float(self.version),
            **({"train/moe_aux_loss": float(torch.stack(router).mean())} if router else {}),
            "timing/logprobs": t2 - t1,  # the reference model's pass (KL), if any
            "timing/training": (t3 - t2) + (t1 - t0),
        })
        out.update(PEAKS.step_metrics("forward_backward", "optimizer"))  # on a GPU: this step's peaks
        return out

    @torch.no_grad()
    def logprobs(self, trajectories: list["Trajectory"]) -> list[list[float]]:
        """Per-token logprobs under the current weights (0.0 at each sequence's first token)."""
        from agentrl.learner.packing import pack_sequences, unpack

        out: list[list[float]] = []
        for traj in trajectories:
            packed = pack_sequences([traj.token_ids], pad_id=self.pad_id)
            out.append([float(x) for x in unpack(self._logprobs(self.model, packed), packed)[0]])
        return out

    def export_weights(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """HF-named weights: copies on CPU, or (``device="cuda"``, for a GPU refit) the model's own
        GPU tensors, which the refit copies into its flat buffer. With LoRA: base + adapter, merged."""
        if self.lora is not None:
            from agentrl.learner.lora import merged_weights

            return merged_weights(self.model, device=device)
        if torch.device(device).type == "cuda" and self.device.type == "cuda":
            out = {k: v.detach() for k, v in self.model.state_dict().items()}
        else:
            out = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        if getattr(self.model.config, "num_experts", 0):
            # transformers holds each MoE layer's experts fused ([experts, ...] tensors); the engines
            # load the checkpoint's per-expert names (views of those tensors, no copy)
            from agentrl.learner.megatron.convert import experts_to_checkpoint_names

            out = experts_to_checkpoint_names(out)
        return out

    def export_merged_flat(self, device: str | torch.device = "cpu") -> tuple[torch.Tensor, Any]:
        """LoRA served merged (``learner.lora.serve: merged``), for a CUDA IPC or NCCL refit: base +
        adapter packed into one flat buffer and its :class:`agentrl.weights.transports.FlatSpec`; the merge is
        made in the buffer. The buffer is on the learner's GPU for ``device="cuda"`` (as
        :meth:`export_weights` hands out the GPU tensors), else on the CPU."""
        from agentrl.learner.lora import merged_flat

        if self.lora is None:
            raise RuntimeError("export_merged_flat: learner.lora is off (rank 0); use export_weights")
        own = torch.device(device).type == "cuda" and self.device.type == "cuda"
        return merged_flat(self.model, self.device if own else "cpu")

    def export_adapter(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The LoRA adapter's tensors (PEFT names, the model's dtype): copies on CPU, or with
        ``device="cuda"`` the learner's own GPU tensors (a GPU refit copies them into its buffer)."""
        from agentrl.learner.lora import adapter_tensors

        if self.lora is None:
            raise RuntimeError("export_adapter: learner.lora is off (rank 0); use export_weights")
        own = torch.device(device).type == "cuda" and self.device.type == "cuda"
        return adapter_tensors(self.model, device=None if own else "cpu", dtype=self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        from agentrl.model.loading import torch_dtype

        return torch_dtype(self.cfg.model.dtype)

    def save(self, path: str | Path) -> None:
        """HF model (safetensors) + tokenizer under ``path/model`` (with LoRA: the adapter only,
        under ``path/adapter``); optimizer, RNG, version beside."""
        path = Path(path)
        if self.lora is not None:
            self.model.save_pretrained(path / "adapter", safe_serialization=True)
        else:
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
        weights = "adapter" if self.lora is not None else "model"
        if not (path / weights).is_dir() or not state_file.is_file():
            other = "model" if self.lora is not None else "adapter"
            hint = (f" (it holds {other}/: a checkpoint of a run with learner.lora.rank "
                    f"{'0' if self.lora is not None else '> 0'}; resume with the same learner.lora)"
                    if (path / other).is_dir() else "")
            raise FileNotFoundError(f"{path} is not a learner checkpoint of this run (needs {weights}/ and "
                                    f"learner_state.pt){hint}")
        if self.lora is not None:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            from agentrl.learner.lora import ADAPTER_WEIGHTS

            result = set_peft_model_state_dict(self.model, load_file(str(path / "adapter" / ADAPTER_WEIGHTS),
                                                                     device=str(self.device)))
            missing = [k for k in result.missing_keys if ".lora_" in k]
            if missing:
                raise ValueError(f"{path / 'adapter'}: adapter tensors missing for {missing[:3]} (was it saved with "
                                 "other learner.lora.target_modules?)")
        else:
            model = load_hf_model(path / "model", self.cfg.model.dtype, self.device)
            self.model.load_state_dict(model.state_dict())
        state: dict[str, Any] = torch.load(state_file, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        fuse_adamw(self.optimizer)  # a checkpoint of the unfused optimizer (its flags came with it)
        self.version = int(state["version"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])

