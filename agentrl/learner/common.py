"""What every learner backend shares: groups to training samples, micro-batch planning with the
packing module, and the loss on a packed micro-batch (packing undone around the loss)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from agentrl.learner.advantages import trajectory_token_advantages
from agentrl.learner.distill import distill_token_advantages, top_k_kl
from agentrl.learner.losses import LOSSES, aggregate_token_losses
from agentrl.learner.optim import torch_optimizers
from agentrl.learner.packing import PackedBatch, make_microbatches, pack_sequences, unpack_padded

if TYPE_CHECKING:
    from agentrl.config import AdvantageConfig, DistillConfig, LossConfig, PackingConfig
    from agentrl.rollout.trajectory import TrajectoryGroup

__all__ = [
    "PEAKS",
    "PeakByPhase",
    "TrainSample",
    "build_samples",
    "cuda_memory_gib",
    "global_counts",
    "learner_memory",
    "memory_breakdown",
    "merge_metrics",
    "microbatch_loss",
    "pack_samples",
    "plan_microbatches",
    "with_signal",
]


@dataclass
class TrainSample:
    """One trajectory as the learner consumes it (all lists per token, same length)."""

    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    advantages: list[float]
    policy_versions: list[int]
    teacher_top_ids: list[list[int]] | None = None
    """Dense distillation: the teacher's top-k ids per token (see :class:`agentrl.rollout.trajectory.Trajectory`)."""
    teacher_top_logprobs: list[list[float]] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


def build_samples(groups: list["TrajectoryGroup"], adv_cfg: "AdvantageConfig",
                  distill_cfg: "DistillConfig | None" = None) -> list[TrainSample]:
    """Advantages per group, then one sample per trainable trajectory with sampled tokens. With
    ``distill_cfg`` enabled (a teacher), each token's advantage is the distillation one
    (:func:`agentrl.learner.distill.distill_token_advantages`) with the task advantage weighted in."""
    distill = distill_cfg is not None and distill_cfg.enabled
    samples = []
    for group in groups:
        for traj, adv in zip(group.trajectories, trajectory_token_advantages(group, adv_cfg)):
            if not traj.trainable or traj.num_sampled_tokens == 0:
                continue
            if distill:
                adv = distill_token_advantages(traj, adv, distill_cfg)
            top = distill and distill_cfg.top_k > 0
            samples.append(
                TrainSample(traj.token_ids, traj.loss_mask, traj.behavior_logprobs, adv, traj.policy_versions,
                            traj.teacher_top_ids if top else None, traj.teacher_top_logprobs if top else None)
            )
    return samples


def global_counts(samples: list[TrainSample]) -> tuple[float, float]:
    """(masked tokens, sequences) over the whole batch: the normalizers every micro-batch gets."""
    return float(sum(sum(s.loss_mask) for s in samples)), float(len(samples))


def with_signal(samples: list[TrainSample], *, has_kl: bool, loss_type: str = "ppo") -> list[TrainSample]:
    """The samples whose loss terms can be non-zero.

    Every term of the built-in policy loss is a token's advantage times a factor (ratio, clip, IS
    weight), so a sample whose masked advantages are all zero adds exactly zero to the loss and to
    its gradient. Dropping it *after* :func:`global_counts` (the normalizers still count it) leaves
    the step unchanged and saves its forward and backward. A KL term has no advantage factor: with
    a reference model every sample is kept; so does a loss ``loss_type`` not registered with
    ``advantage_factor=True`` (:func:`agentrl.learner.losses.register_loss`). In GRPO a group whose rewards
    tie is such a group.
    """
    if has_kl or not LOSSES.meta(loss_type).get("advantage_factor"):
        return samples
    return [s for s in samples if any(a and m for a, m in zip(s.advantages, s.loss_mask))]


def plan_microbatches(samples: list[TrainSample], cfg: "PackingConfig", num_ranks: int = 1) -> list[list[list[int]]]:
    """[rank][micro-batch] -> sample indices, by token budget."""
    if not samples:
        return [[] for _ in range(num_ranks)]
    return make_microbatches(
        [len(s) for s in samples],
        cfg.max_tokens_per_microbatch,
        algorithm=cfg.algorithm,
        num_ranks=num_ranks,
        pad_multiple=cfg.pad_multiple,
    )


def pack_samples(samples: list[TrainSample], indices: list[int], *, pad_multiple: int = 1, pad_id: int = 0) -> PackedBatch:
    """The samples ``indices`` packed, with their per-token fields (and, under dense
    distillation, the teacher's top-k ``teacher_top_ids`` / ``teacher_top_logprobs``, ``[1, T, k]``)."""
    fields: dict[str, list] = {
        "loss_mask": [s.loss_mask for s in samples],
        "behavior_logprobs": [s.behavior_logprobs for s in samples],
        "advantages": [s.advantages for s in samples],
    }
    if indices and all(samples[i].teacher_top_ids is not None for i in indices):
        fields["teacher_top_ids"] = [s.teacher_top_ids for s in samples]
        fields["teacher_top_logprobs"] = [s.teacher_top_logprobs for s in samples]
    return pack_sequences(
        [s.token_ids for s in samples],
        fields,
        indices=indices,
        pad_multiple=pad_multiple,
        pad_id=pad_id,
    )


def microbatch_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor | None,
    packed: PackedBatch,
    loss_cfg: "LossConfig",
    *,
    num_tokens: float,
    num_sequences: float,
    ref_logprobs: torch.Tensor | None = None,
    top_k_logprobs: torch.Tensor | None = None,
    distill_coef: float = 1.0,
    distill_direction: str = "forward",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one packed micro-batch: unpack the flat [T] tensors to [N, L] and call the loss
    ``loss_cfg.type`` names (:data:`agentrl.learner.losses.LOSSES`: the built-in or a user's).

    ``prox_logprobs`` None means bypass mode (the behaviour policy is the proximal policy).
    ``top_k_logprobs`` (``[T, k]``, dense distillation): the student's logprobs of the teacher's
    top-k ids (``packed.fields["teacher_top_ids"]``); adds ``distill_coef`` times the per-token
    :func:`agentrl.learner.distill.top_k_kl` (``distill_direction``) on the policy tokens, aggregated as
    the policy loss is.
    """
    def rows(flat: torch.Tensor) -> torch.Tensor:
        return unpack_padded(flat.reshape(-1), packed)

    logp = rows(logprobs.float())
    behavior = rows(packed.fields["behavior_logprobs"].float())
    prox = behavior if prox_logprobs is None else rows(prox_logprobs.float())
    mask = rows(packed.fields["loss_mask"].float()) > 0
    loss, metrics = LOSSES.resolve(loss_cfg.type)(
        logp,
        prox.detach(),
        behavior,
        rows(packed.fields["advantages"].float()),
        mask,
        loss_cfg,
        ref_logprobs=None if ref_logprobs is None else rows(ref_logprobs.float()),
        num_tokens=num_tokens,
        num_sequences=num_sequences,
    )
    if top_k_logprobs is not None:
        kl = rows(top_k_kl(top_k_logprobs, packed.fields["teacher_top_logprobs"][0], distill_direction))
        loss = loss + distill_coef * aggregate_token_losses(kl, mask, loss_cfg.aggregation, num_tokens=num_tokens,
                                                            num_sequences=num_sequences)
        metrics["train/distill_top_k_kl"] = torch.where(mask, kl, 0.0).sum().detach() / mask.sum().clamp(min=1)
    return loss, metrics


def merge_metrics(per_microbatch: list[tuple[dict[str, torch.Tensor], float]]) -> dict[str, float]:
    """Token-weighted mean of micro-batch metrics (``max`` for keys ending in ``_max``).

    Device tensors come to the host in one copy (one wait for the GPU, not one per number)."""
    tensors = [v for metrics, _ in per_microbatch for v in metrics.values() if isinstance(v, torch.Tensor)]
    host = iter(torch.stack([t.detach().float().mean() for t in tensors]).cpu().tolist()) if tensors else iter(())
    total = sum(w for _, w in per_microbatch) or 1.0
    out: dict[str, float] = {}
    for metrics, weight in per_microbatch:
        for key, value in metrics.items():
            v = next(host) if isinstance(value, torch.Tensor) else float(value)
            if key.endswith("_max"):
                out[key] = max(out.get(key, float("-inf")), v)
            else:
                out[key] = out.get(key, 0.0) + v * weight / total
    return out




@dataclass
class PeakByPhase:
    """The CUDA allocator's peak by phase of a learner's work, kept over the whole run.

    :meth:`phase` resets the allocator's peak counters on entry and reads them on exit, so each
    phase's figure is its own (``forward_backward``, ``optimizer``, ``refit_export``, ...), and
    the peak over the run is kept across the resets (:meth:`overall`). Host-side counters only:
    nothing here waits for the GPU. A no-op without CUDA.

    ``outside`` is what the driver counts for this process beyond the allocator's reserve (the
    CUDA context, NCCL, cuBLAS workspaces, memory of other allocators), read through NVML at the
    end of each phase and at each :meth:`note` (the largest over the run).
    """

    allocated: dict[str, float] = field(default_factory=dict)  # GiB, max over the run
    reserved: dict[str, float] = field(default_factory=dict)
    outside: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)  # each phase's allocator peak the last time it ran
    _before: tuple[float, float] = (0.0, 0.0)  # the run's peaks before the last reset

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            yield
            return
        self._before = self.overall()
        torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            a, r = torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
            self.allocated[name] = max(self.allocated.get(name, 0.0), a)
            self.reserved[name] = max(self.reserved.get(name, 0.0), r)
            self.last[name] = a
            self.note(name)

    def note(self, name: str) -> None:
        """Record ``outside_<name>``: the driver's count for this process now, less the allocator's
        reserve (nothing where NVML does not list processes)."""
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        process = gpu_memory_by_process().get(os.getpid())
        if process is not None:
            out = process - torch.cuda.memory_reserved() / 2**30
            self.outside[name] = max(self.outside.get(name, float("-inf")), out)

    def overall(self) -> tuple[float, float]:
        """(allocated, reserved) peak in GiB over the run, the phases' resets notwithstanding."""
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return self._before
        return (max(self._before[0], torch.cuda.max_memory_allocated() / 2**30),
                max(self._before[1], torch.cuda.max_memory_reserved() / 2**30))

    def step_metrics(self, *names: str) -> dict[str, float]:
        """``memory/peak_<phase>_gib`` of the last run of each of ``names`` (a step's metrics; empty
        without CUDA)."""
        return {f"memory/peak_{n}_gib": self.last[n] for n in names if n in self.last}

    def report(self) -> dict[str, float]:
        """``peak_<phase>``, ``peak_reserved_<phase>`` and ``outside_<name>`` in GiB, for a memory report."""
        return {**{f"peak_{k}": v for k, v in self.allocated.items()},
                **{f"peak_reserved_{k}": v for k, v in self.reserved.items()},
                **{f"outside_{k}": v for k, v in self.outside.items()}}


PEAKS = PeakByPhase()  # one learner per process: its phases' peaks (learners and the learner actor)


class StartClock:
    """Seconds from the start of a learner's build to each named point of it (CUDA and
    torch.distributed up, the model built, its weights read and loaded, the optimizer made, ...):
    where a run's start-up goes, which a GPU run pays each time. The first time a name is
    marked counts; :meth:`restart` begins a new build."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.marks: dict[str, float] = {}

    def restart(self) -> None:
        self.t0, self.marks = time.perf_counter(), {}

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, round(time.perf_counter() - self.t0, 2))


STARTUP = StartClock()  # one learner per process, like PEAKS


def memory_breakdown(
    modules: list[torch.nn.Module], optimizer: object, named: dict[str, torch.Tensor | None], device: torch.device,
) -> dict[str, float]:
    """GiB of ``device`` memory held by live tensors, by what holds them.

    ``weights`` (the modules' parameters and buffers), ``grads`` (``.grad`` and Megatron's
    ``main_grad``), ``master_weights`` (the parameters a wrapped optimizer updates when they are
    not the modules': fp32 copies of bf16 weights), ``optimizer_state``, each ``named`` tensor
    (e.g. the refit buffer), ``other`` (any other live tensor: caches, buffers of libraries).
    A storage is counted once, under the first of these that holds it (a view counts its whole
    storage: Megatron's parameters and gradients live in contiguous buffers). On a GPU also
    ``allocated``, ``reserved``, ``peak`` and ``peak_reserved`` (PyTorch's allocator), ``unseen``
    (allocated but held by no Python tensor: autograd's saved tensors, CUDA graph pools, C++ caches)
    and, where NVML lists processes, ``process`` (what the driver counts for this process);
    ``peak_<phase>`` / ``peak_reserved_<phase>`` / ``outside_<name>`` for what :data:`PEAKS` has seen.
    """
    import gc

    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    seen: set[int] = set()
    out: dict[str, float] = {}

    def add(kind: str, t: object) -> None:
        if not isinstance(t, torch.Tensor) or t.device != device:
            return
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # no memory of its own: a FakeTensor that torch.compile left
            return
        if ptr and ptr not in seen:
            seen.add(ptr)
            out[kind] = out.get(kind, 0.0) + storage.nbytes() / 2**30

    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        for t in (*m.parameters(), *m.buffers()):
            add("weights", t)
    for p in params:
        add("grads", p.grad)
        add("grads", getattr(p, "main_grad", None))
    for wrapper in (optimizer, *(getattr(optimizer, "chained_optimizers", None) or [])):
        for rem in (getattr(wrapper, "master_weight_remainders", None) or {}).values():
            add("master_weights", rem)  # fp32 masters kept as int16 remainders (megatron/remainders.py)
    for opt in torch_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                add("master_weights", p)
                add("grads", p.grad)  # a master copy's own (fp32) gradient
        for state in opt.state.values():
            for v in state.values():
                add("optimizer_state", v)
    for name, t in named.items():
        add(name, t)
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(), not isinstance: no proxy's __class__ is read
            add("other", obj)
    if device.type == "cuda":
        stats = cuda_memory_gib(device)
        stats["unseen"] = max(0.0, stats["allocated"] - sum(out.values()))
        out.update(stats)
        out.update(PEAKS.report())
    return out


def cuda_memory_gib(device: torch.device | None = None) -> dict[str, float]:
    """GiB of this process's CUDA memory: the allocator's ``allocated``, ``reserved``, ``peak`` and
    ``peak_reserved`` (over the run, across :data:`PEAKS`' resets) and, where NVML lists processes,
    ``process`` (what the driver counts: the reserve plus the CUDA context, NCCL, cuBLAS)."""
    peak, peak_reserved = PEAKS.overall()
    out = {"allocated": torch.cuda.memory_allocated(device) / 2**30,
           "reserved": torch.cuda.memory_reserved(device) / 2**30,
           "peak": max(peak, torch.cuda.max_memory_allocated(device) / 2**30),
           "peak_reserved": max(peak_reserved, torch.cuda.max_memory_reserved(device) / 2**30)}
    process = gpu_memory_by_process().get(os.getpid())  # one GPU per learner or engine worker process
    if process is not None:
        out["process"] = process
    return out


def gpu_memory_by_process(index: int | None = None) -> dict[int, float]:
    """GiB of GPU ``index`` (NVML's numbering; None: every GPU, summed) each process uses, by pid,
    as the driver counts it; empty where NVML is missing or does not list processes (no GPU, a
    sandbox that hides them)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        indices = range(pynvml.nvmlDeviceGetCount()) if index is None else [index]
        out: dict[int, float] = {}
        for i in indices:
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
                out[p.pid] = out.get(p.pid, 0.0) + (p.usedGpuMemory or 0) / 2**30
    except Exception:  # noqa: BLE001 - NVML absent or refusing: nothing to report, nothing lost
        return {}
    return out


def learner_memory(learner: object, named: dict[str, torch.Tensor | None] | None = None) -> dict[str, float]:
    """:func:`memory_breakdown` of a torch or Megatron learner (its model, reference model and
    optimizer) on its device, plus ``named`` tensors its actor holds (the refit buffer)."""
    modules = [m for m in (getattr(learner, "model", None), getattr(learner, "ref_model", None))
               if isinstance(m, torch.nn.Module)]
    device = torch.device(getattr(learner, "device", "cpu"))
    return memory_breakdown(modules, getattr(learner, "optimizer", None), dict(named or {}), device)
