"""The Megatron-Core learner: the torch learner's contract on TP x PP x CP x DP GPUs.

One process per GPU (a Ray learner actor each); every process constructs ``MegatronLearner`` with
its rank (see `agentrl.learner.megatron.parallel` for what it reads) and every process must be
given the *same* groups/trajectories in each call: the learner deals micro-batches to its
data-parallel rank itself, and all calls are collective. Results (metrics, logprobs, exported
weights) are the same on every rank.

Per micro-batch: packed tokens (agentrl.learner.packing) -> padded to a multiple of 128 tokens with one
dummy document -> (CP: this rank's zigzag shard) -> GPTModel with the project's core attention ->
vocab-parallel next-token logprobs -> shifted to ``out[t] = log p(token t | earlier)``, 0.0 at each
document's first token -> the shared loss (agentrl.learner.common.microbatch_loss).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from agentrl.config.learner import graph_length
from agentrl.learner.common import (
    PEAKS,
    STARTUP,
    TrainSample,
    build_samples,
    global_counts,
    merge_metrics,
    microbatch_loss,
    pack_samples,
    plan_microbatches,
    with_signal,
)
from agentrl.learner.megatron.attention import PackedAttentionParams, make_packed_params
from agentrl.learner.megatron.convert import ModelShape
from agentrl.learner.megatron.model import build_model
from agentrl.learner.megatron.parallel import (
    build_ddp_and_optimizer,
    init_distributed,
    init_parallel_state,
)
from agentrl.learner.megatron.weights import gather_hf_weights, load_hf_weights, read_hf_state_dict
from agentrl.model.loading import tokenizer_vocab_limit, torch_dtype
from agentrl.learner.packing import PackedBatch, make_microbatches, pack_sequences, padded_length, unpack
from agentrl.learner.packing import to_device as _to_device

if TYPE_CHECKING:
    from collections.abc import Callable

    from agentrl.config import Config
    from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

__all__ = ["MegatronLearner"]

_PAD_TO = 128  # total packed length multiple: steady shapes for compiled kernels


@dataclass
class _MicroBatch:
    packed: PackedBatch  # on the GPU; fields feed the loss
    input_ids: torch.Tensor  # [1, t] (this rank's shard under CP)
    position_ids: torch.Tensor  # [1, t]
    labels: torch.Tensor  # [1, t] next token ids
    params: PackedAttentionParams
    cu_padded: torch.Tensor  # [N+2] int32 on CPU, boundaries incl. the dummy document
    keep: torch.Tensor  # [T] bool: real tokens that have a predecessor (where logprobs count)
    weight: float = 0.0  # trained tokens (loss mask sum), counted on the host
    dummy: bool = False
    ref: torch.Tensor | None = None


class MegatronLearner:
    """Megatron-Core learner; see :class:`agentrl.learner.base.Learner`.

    Args:
        cfg: the run config (model, learner incl. ``learner.megatron``, loss, advantage, packing).
        model_path: overrides ``cfg.model.path`` (an HF directory with safetensors).
        hf_config: build from this transformers config with random weights instead (benchmarks).
        rank, world_size, local_rank, master_addr, master_port: this process's place in the
            torch.distributed group (env vars RANK, ... when omitted).
    """

    def __init__(self, cfg: Config, *, model_path: str | None = None, hf_config: Any = None,
                 rank: int | None = None, world_size: int | None = None, local_rank: int | None = None,
                 master_addr: str | None = None, master_port: int | None = None) -> None:
        self.cfg = cfg
        mcfg = cfg.learner.megatron
        STARTUP.mark("imports")
        self.device = init_distributed(rank=rank, world_size=world_size, local_rank=local_rank,
                                       master_addr=master_addr, master_port=master_port)
        STARTUP.mark("distributed")
        if mcfg.cuda_graphs:
            from agentrl.learner.megatron.graphs import use_capture_stream

            use_capture_stream(self.device)
        self.layout = init_parallel_state(mcfg, seed=cfg.seed)
        PEAKS.note("parallel_state")  # the CUDA context and torch.distributed's communicators, no tensor yet
        STARTUP.mark("parallel_state")
        torch.manual_seed(cfg.seed + self.layout.pp_rank)
        self.model_path = Path(model_path or cfg.model.path)
        random_init = hf_config is not None and model_path is None
        if hf_config is None:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(str(self.model_path))
        self.hf_config = hf_config
        self.shape = ModelShape.from_hf_config(hf_config)
        self.vocab_limit = tokenizer_vocab_limit(self.model_path, cfg.model.tokenizer_vocab_only)
        # Megatron trains in bf16/fp16 with fp32 master weights; model.dtype float32 (the CPU default) -> bf16.
        self.dtype = torch_dtype(cfg.model.dtype) if cfg.model.dtype != "float32" else torch.bfloat16
        self.model = self._build()
        STARTUP.mark("model_built")
        hf_state = None if random_init else read_hf_state_dict(self.model_path)
        STARTUP.mark("weights_read")
        if hf_state is not None:
            load_hf_weights(self.model, hf_state, self.shape)
        STARTUP.mark("weights_loaded")
        self.ref_model = None
        if cfg.loss.kl.coef > 0:
            self.ref_model = self._build()
            if hf_state is not None:
                load_hf_weights(self.ref_model, hf_state, self.shape)
            else:
                self.ref_model.load_state_dict(self.model.state_dict())
            self.ref_model.requires_grad_(False)
        del hf_state
        zero_copy = bool(cfg.refit.zero_copy)
        if zero_copy:
            self._check_zero_copy()
        gathered = self._gather_parameters() if zero_copy and not mcfg.use_distributed_optimizer else None
        PEAKS.note("model")
        from agentrl.weights.transports import plain_allocations

        # zero-copy with the distributed optimizer: its parameter buffer is what the engines open
        # (CUDA IPC needs plain segments where the allocator maps expandable ones)
        with plain_allocations(zero_copy and mcfg.use_distributed_optimizer and cfg.learner.expandable_segments):
            self.ddp, self.optimizer = build_ddp_and_optimizer(self.model, cfg.learner)
        STARTUP.mark("optimizer")
        self.param_buffer = (gathered if gathered is not None else self._ddp_parameter_buffer()) if zero_copy else None
        # A zero-copy refit's engines read the parameters in place: the actor sets this to wait for
        # them (their release) before the optimizer step writes the parameters.
        self.before_optimizer_step: Callable[[], None] | None = None
        self.graphs = None
        if mcfg.cuda_graphs:
            from agentrl.learner.megatron.graphs import DecoderGraphs

            self.graphs = DecoderGraphs(self.model)
        self.pad_id = int(getattr(hf_config, "pad_token_id", None) or 0)
        self.version = 0

    def _check_zero_copy(self) -> None:
        lay = self.layout
        if lay.tp != 1 or lay.pp != 1 or self.cfg.learner.lora.rank:
            raise ValueError(
                "refit.zero_copy shares the learner's parameters as they lie, which needs the whole model in "
                f"each process (tensor_parallel_size 1 and pipeline_parallel_size 1; here {lay.tp} and {lay.pp}) "
                "and full fine-tuning (no learner.lora); set refit.zero_copy=false")

    def _gather_parameters(self) -> torch.Tensor:
        """refit.zero_copy without the distributed optimizer: the model's parameters moved into one
        flat buffer (agentrl.weights.transports.gather_parameters), the memory the engines read a refit from, so
        no model-sized export buffer is made (2.9 GiB at 1.5B, the learner's memory peak at TRL's
        memory settings)."""
        from agentrl.weights.transports import gather_parameters, plain_allocations

        with plain_allocations(self.cfg.learner.expandable_segments):  # CUDA IPC needs plain segments
            buffer = gather_parameters(self.model)
        torch.cuda.empty_cache()  # the parameters' old blocks go back to the device
        return buffer

    def _ddp_parameter_buffer(self) -> torch.Tensor:
        """refit.zero_copy with the distributed optimizer: Megatron's DDP already keeps the bf16
        parameters in one contiguous buffer (each rank holds all of them; only the fp32 master
        weights and Adam's moments are sharded): the engines read that one, as bytes."""
        buffers = [b.param_data for b in list(self.ddp.buffers) + list(self.ddp.expert_parallel_buffers)
                   if b.param_data is not None]
        if len(buffers) != 1:
            raise ValueError(f"refit.zero_copy: Megatron's DDP made {len(buffers)} parameter buffers (one per "
                             "parameter dtype); one is needed. Set refit.zero_copy=false")
        return buffers[0].view(-1).view(torch.uint8)

    def export_views(self) -> tuple[torch.Tensor, dict[str, Any]]:
        """(the parameter buffer, HF-named views into it) for a zero-copy refit; q, k and v come as
        :class:`agentrl.weights.transports.LazyReshape` (the engine reshapes them)."""
        from agentrl.learner.megatron.convert import globalize_layers, megatron_to_hf
        from agentrl.learner.megatron.weights import _model_tensors, stage_layer_range

        if self.param_buffer is None:
            raise RuntimeError("export_views needs refit.zero_copy=true (the parameters in one buffer)")
        first, _ = stage_layer_range(self.model)
        stage = globalize_layers(_model_tensors(self.model), first, drop_tied_copy=False)
        return self.param_buffer, megatron_to_hf(stage, self.shape, lazy=True)

    # ------------------------------------------------------------------ building and data
    def _build(self) -> Any:
        mcfg = self.cfg.learner.megatron
        if self.shape.num_experts and mcfg.tensor_parallel_size > 1 and not mcfg.sequence_parallel:
            # Megatron's MoE layer refuses a training forward under TP without it.
            raise ValueError("learner.megatron.sequence_parallel must be true for a mixture-of-experts model "
                             f"under tensor_parallel_size {mcfg.tensor_parallel_size}")
        model = build_model(self.shape, self.hf_config, mcfg, dtype=self.dtype, perform_initialization=True,
                            vocab_limit=self.vocab_limit, moe_aux_loss_coef=self.cfg.learner.moe_aux_loss_coef,
                            ).to(self.device)
        model.temperature = self.cfg.rollout.temperature or 1.0
        model.chunk_size = self.cfg.packing.logprob_chunk_size
        model.keep_grad_logits = mcfg.keep_grad_logits
        model.recompute_above_tokens = 0 if mcfg.activation_checkpointing else mcfg.recompute_above_tokens
        model.keep_attention = mcfg.recompute_keeps_attention
        model.fused_logprobs = mcfg.fused_logprobs
        # The head's weight gradient straight into DDP's main_grad (see vocab_parallel_logprobs):
        # DDP's hook only adds .grad into main_grad unless it overlaps the gradient reduction.
        model.head_grad_to_main_grad = not mcfg.overlap_grad_reduce
        return model

    @property
    def _pad_to(self) -> int:
        lay = self.layout
        m = math.lcm(_PAD_TO, 2 * lay.cp if lay.cp > 1 else 1)
        return math.lcm(m, lay.tp * lay.cp) if self.model.config.sequence_parallel else m

    def _microbatch(self, packed: PackedBatch | None) -> _MicroBatch:
        """One packed micro-batch on the device. Everything is prepared on the host and sent with
        asynchronous copies, and nothing here waits for the GPU: micro-batch i+1 is built while
        the GPU still runs micro-batch i (the schedule pulls them one at a time)."""
        dummy = packed is None
        if dummy:  # an empty slot of the DP plan: one pad-only document that contributes nothing
            packed = pack_samples([TrainSample([self.pad_id], [0], [0.0], [0.0], [-1])], [0])
        T = packed.input_ids.shape[1]
        extra = (-T) % self._pad_to
        if self.cfg.learner.megatron.cuda_graphs:  # one length, one graph: pad up to the budget
            extra = max(extra, graph_length(self.cfg.packing.max_tokens_per_microbatch) - T)
        cu = packed.cu_seqlens.to(torch.int32).cpu()
        ids, pos = packed.input_ids[0], packed.position_ids[0]
        keep = packed.real_mask()[0] & (pos > 0)  # host tensors: no device round trip
        weight = 0.0 if dummy else float(packed.fields["loss_mask"].sum()) if "loss_mask" in packed.fields else 0.0
        if extra:
            cu = torch.cat([cu, torch.tensor([T + extra], dtype=torch.int32)])
            ids = torch.cat([ids, ids.new_full((extra,), self.pad_id)])
            pos = torch.cat([pos, torch.arange(extra, dtype=pos.dtype)])
        labels = torch.roll(ids, -1)  # label at a document's last token is discarded by the shift
        lay = self.layout
        if lay.cp > 1:
            from agentrl.learner.megatron.cp_attention import zigzag_indices

            idx = zigzag_indices(cu, lay.cp, lay.cp_rank)
            ids, pos, labels = ids[idx], pos[idx], labels[idx]
        dev = self.device
        params = make_packed_params(_to_device(cu, dev), int((cu[1:] - cu[:-1]).max()))
        params.cache["cu_seqlens_cpu"] = cu
        from megatron.core import parallel_state as ps

        if lay.cp > 1:
            params.cp_group = ps.get_context_parallel_group()
        # The loss reads per-token fields on the device; boundaries stay on the host (unpacking
        # slices by them: a device cu_seqlens would cost a sync per micro-batch).
        on_device = PackedBatch(input_ids=_to_device(packed.input_ids, dev), position_ids=_to_device(packed.position_ids, dev),
                                cu_seqlens=packed.cu_seqlens, seq_lens=list(packed.seq_lens), indices=list(packed.indices),
                                fields={k: _to_device(v, dev) for k, v in packed.fields.items()})
        return _MicroBatch(on_device, _to_device(ids[None], dev), _to_device(pos[None], dev),
                           _to_device(labels[None], dev), params, cu, _to_device(keep, dev), weight, dummy)

    def _token_logprobs(self, mb: _MicroBatch, out: torch.Tensor) -> torch.Tensor:
        """Model output (next-token logprobs of this shard) -> ``[T]`` logprobs in the convention."""
        if self.layout.cp > 1:
            from megatron.core import parallel_state as ps

            from agentrl.learner.megatron.cp_attention import all_gather_zigzag

            out = all_gather_zigzag(out, mb.cu_padded, ps.get_context_parallel_group())
        T = mb.packed.input_ids.shape[1]
        shifted = torch.cat([out.new_zeros(1), out[: T - 1]])
        return torch.where(mb.keep, shifted, torch.zeros_like(shifted))

    # ------------------------------------------------------------------ schedule plumbing
    def _run(self, model: Any, mbs: Any, loss_fn: Any, forward_only: bool, *,
             num_microbatches: int | None = None, seq_length: int | None = None) -> list[Any]:
        """Megatron's schedule over ``mbs``: a list, or (one pipeline stage) an iterator that
        builds each micro-batch when the schedule asks for it, with its count and longest length."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if isinstance(mbs, list):
            num_microbatches, seq_length = len(mbs), max(mb.input_ids.shape[1] for mb in mbs)

        def forward_step(data_iterator: Any, m: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data_iterator)
            out = m(mb.input_ids, mb.position_ids, None, labels=mb.labels, packed_seq_params=mb.params)
            return out, partial(loss_fn, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=model, num_microbatches=num_microbatches,
            seq_length=seq_length, micro_batch_size=1, forward_only=forward_only)

    def _collect_logprobs(self, model: Any, mbs: list[_MicroBatch]) -> list[torch.Tensor] | None:
        """Forward-only pass; the ``[T]`` logprobs of every micro-batch on the last stage, else None."""
        def loss_fn(mb: _MicroBatch, out: torch.Tensor) -> tuple[torch.Tensor, dict]:
            return out.new_zeros(()), {"logprobs": self._token_logprobs(mb, out).detach()}

        with torch.no_grad():
            store = self._run(model, mbs, loss_fn, forward_only=True)
        return [s["logprobs"] for s in store] if store else None

    def _is_last_stage(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage()

    def _from_last_stage(self, obj: Any) -> Any:
        """Broadcast a picklable object from the last pipeline stage to the whole PP group."""
        from megatron.core import parallel_state as ps

        if self.layout.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]

    # ------------------------------------------------------------------ the protocol
    def train_step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """One optimizer step on ``groups`` (collective; every rank gets the same groups).

        Nothing in the step waits for the GPU before the optimizer: micro-batches are built on
        the host as the schedule reaches them (one pipeline stage, no reference model) and
        copied asynchronously, and the loss keeps its numbers on the device, so the host runs
        ahead of the GPU and the next micro-batch's preparation hides behind the current one's
        kernels."""
        from torch.profiler import record_function

        t0 = time.perf_counter()
        cfg, lay = self.cfg, self.layout
        samples = build_samples(groups, cfg.advantage, cfg.distill)
        num_tokens, num_sequences = global_counts(samples)  # the loss's normalizers: whole batch
        # tied groups add nothing
        samples = with_signal(samples, has_kl=self.ref_model is not None, loss_type=cfg.loss.type)
        plan = plan_microbatches(samples, cfg.packing, num_ranks=lay.dp)[lay.dp_rank] if samples else [[]]

        def build(ix: list[int]) -> _MicroBatch:
            with record_function("agentrl.microbatch"):
                return self._microbatch(pack_samples(samples, ix, pad_multiple=cfg.packing.pad_multiple,
                                                     pad_id=self.pad_id) if ix else None)

        lazy = self.ref_model is None and lay.pp == 1
        mbs: Any = (build(ix) for ix in plan) if lazy else [build(ix) for ix in plan]
        t1 = time.perf_counter()
        if not lazy and self.ref_model is not None:
            for mb, lp in zip(mbs, self._collect_logprobs(self.ref_model, mbs) or [None] * len(mbs)):
                mb.ref = lp
        t2 = time.perf_counter()
        scale = len(plan) * lay.dp / lay.cp  # undoes the schedule's 1/M x cp and DDP's 1/(dp*cp)

        def loss_fn(mb: _MicroBatch, out: torch.Tensor) -> tuple[torch.Tensor, dict]:
            with record_function("agentrl.loss"):
                logp = self._token_logprobs(mb, out)
                # One optimizer step per batch: pi_prox ("recompute") is the pre-step weights, i.e. this
                # pass's own logprobs, detached; no separate forward-only pass over the batch.
                prox = logp.detach() if cfg.loss.proximal == "recompute" else None
                loss, metrics = microbatch_loss(logp, prox, mb.packed, cfg.loss, num_tokens=num_tokens,
                                                num_sequences=num_sequences, ref_logprobs=mb.ref)
                if mb.dummy:
                    loss = loss * 0.0
                # Numbers stay on the device (a float() here would wait for this micro-batch's forward).
                return loss * scale, {"metrics": metrics, "weight": 0.0 if mb.dummy else mb.weight,
                                      "loss": loss.detach()}

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.model.recomputed_microbatches = self.model.recomputed_layers = self.model.kept_attention_layers = 0
        # Longest micro-batch, from the plan (the schedule's p2p shapes; unused with one stage).
        pm = cfg.packing.pad_multiple
        longest = max((sum(padded_length(len(samples[i]), pm) for i in ix) for ix in plan), default=1) + self._pad_to
        with record_function("agentrl.forward_backward"), PEAKS.phase("forward_backward"):
            store = self._run(self.ddp, mbs, loss_fn, forward_only=False, num_microbatches=len(plan), seq_length=longest)
        if self.before_optimizer_step is not None:
            self.before_optimizer_step()
        with record_function("agentrl.optimizer"), PEAKS.phase("optimizer"):
            _, grad_norm, _ = self.optimizer.step() if samples else (True, 0.0, None)
        self.version += 1
        t3 = time.perf_counter()
        with record_function("agentrl.metrics"):
            out = self._reduce_metrics(store)
        out.update({
            "train/grad_norm": float(grad_norm or 0.0), "train/num_sequences": num_sequences,
            "train/num_sequences_trained": float(len(samples)), "train/num_tokens": float(sum(len(s) for s in samples)), "train/num_microbatches": float(len(plan) * lay.dp),
            "train/version": float(self.version), "timing/logprobs": t2 - t1, "timing/training": (t3 - t2) + (t1 - t0),
        })
        if self.model.recompute_above_tokens:  # this rank's micro-batches that recomputed layers, and how many
            n = self.model.recomputed_microbatches
            out["train/recomputed_microbatches"] = float(n)
            out["train/recomputed_layers"] = self.model.recomputed_layers / n if n else 0.0  # mean a micro-batch
            if self.model.keep_attention:  # of those, the layers that kept their attention (mean a micro-batch)
                out["train/attention_kept_layers"] = self.model.kept_attention_layers / n if n else 0.0
        out.update(PEAKS.step_metrics("forward_backward", "optimizer"))  # on a GPU: this step's peaks
        return out

    def _reduce_metrics(self, store: list[dict]) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        out: dict[str, float] = {}
        if self._is_last_stage():
            local = merge_metrics([(s["metrics"], s["weight"]) for s in store])
            weight = sum(s["weight"] for s in store)
            loss = float(torch.stack([s["loss"].float() for s in store]).sum()) if store else 0.0
            gathered: list[Any] = [None] * self.layout.dp
            dist.all_gather_object(gathered, (local, weight, loss), group=ps.get_data_parallel_group())
            total = sum(w for _, w, _ in gathered) or 1.0
            for metrics, w, _ in gathered:
                for k, v in metrics.items():
                    out[k] = max(out.get(k, -math.inf), v) if k.endswith("_max") else out.get(k, 0.0) + v * w / total
            out["train/loss"] = sum(lo for _, _, lo in gathered)
        return self._from_last_stage(out)

    def logprobs(self, trajectories: list[Trajectory]) -> list[list[float]]:
        """Per-token logprobs under the current weights (0.0 at each sequence's first token)."""
        lay, pk = self.layout, self.cfg.packing
        lengths = [len(t.token_ids) for t in trajectories]
        plan = make_microbatches(lengths, max(pk.max_tokens_per_microbatch, max(lengths, default=1)),
                                 algorithm=pk.algorithm if pk.algorithm != "none" else "ffd",
                                 num_ranks=lay.dp, pad_multiple=pk.pad_multiple)[lay.dp_rank]
        toks = [t.token_ids for t in trajectories]
        packs = [pack_sequences(toks, indices=ix, pad_multiple=pk.pad_multiple, pad_id=self.pad_id) if ix else None
                 for ix in plan]
        mbs = [self._microbatch(p) for p in packs]
        results: dict[int, list[float]] = {}
        lps = self._collect_logprobs(self.ddp, mbs)
        if lps is not None:
            for mb, lp in zip(mbs, lps):
                if not mb.dummy:
                    for i, row in zip(mb.packed.indices, unpack(lp, mb.packed)):
                        results[i] = row.float().cpu().tolist()
            if lay.dp > 1:
                from megatron.core import parallel_state as ps

                parts: list[Any] = [None] * lay.dp
                dist.all_gather_object(parts, results, group=ps.get_data_parallel_group())
                results = {k: v for p in parts for k, v in p.items()}
        results = self._from_last_stage(results)
        return [results[i] for i in range(len(trajectories))]

    def export_weights(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Full HF-named weights on ``device`` (collective over TP and PP; same on every rank)."""
        return gather_hf_weights(self.model, self.shape, device=self.device if str(device) == "cuda" else device)

    def save(self, path: str | Path) -> None:
        """HF model (safetensors + config + tokenizer) under ``path/model``; per-rank optimizer state."""
        from agentrl.learner.megatron.checkpoint import save_checkpoint

        save_checkpoint(self, Path(path))

    def load(self, path: str | Path) -> None:
        from agentrl.learner.megatron.checkpoint import load_checkpoint

        load_checkpoint(self, Path(path))
