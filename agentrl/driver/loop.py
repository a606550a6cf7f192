"""The training loop's modes: how a step takes its batch, trains, and refits the engines.

- :class:`Sequential`: take a batch, train on it, then start the refit on the refit thread (the
  next batch's wait overlaps the engines' weight load; ``replay.max_staleness`` 0 makes it
  strictly on-policy, since admission opens at a version only once every engine serves it);
- :class:`Colocated`: the engines sleep while the learner steps on their GPU, and wake with the
  new weights (``colocate.engine_sleep``);
- :class:`Overlapped`: the next step is queued on the learner before this one ends
  (``train.overlap_steps``), on a batch taken for the version the learner will then hold;
- the fixed lag (``replay.lag``) is :func:`agentrl.driver.fixed_lag.fixed_lag_loop`.

:func:`run_loop` is what every mode but the fixed lag shares: the stop signal, logging, the
held-out evaluation and checkpoints. ``tr`` is the :class:`agentrl.driver.trainer.Trainer`: its
``cfg``, ``step`` and ``version`` (the learner's), ``actors``, ``supervisor``, ``weights``,
``progress``, ``evaluate`` and ``save_checkpoint``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentrl.driver.supervision import stop_if_signalled
from agentrl.driver.watchdog import RunStopped
from agentrl.learner.distill import reverse_kl_summary
from agentrl.rollout.episode import summarize

__all__ = ["Colocated", "Overlapped", "Sequential", "batch_metrics", "mode_for", "overlap_steps", "run_loop",
           "sleeping_engines", "wake_failure"]


def sleeping_engines(cfg: Any) -> bool:
    """Whether the engines sleep while the learner steps (colocated, ``colocate.engine_sleep``)."""
    return cfg.colocate.enabled and cfg.colocate.engine_sleep


def overlap_steps(cfg: Any) -> bool:
    """Whether the loop queues step N+1 on the learner before step N ends (train.overlap_steps)."""
    if sleeping_engines(cfg):
        return False  # the engines sleep before each step (the config refuses an explicit true)
    ov = cfg.train.overlap_steps
    return cfg.learner.num_gpus > 0 if ov == "auto" else bool(ov)


@dataclass
class StepDone:
    """What a mode's step hands the loop."""

    groups: list[Any]  #: the batch trained on
    metrics: dict[str, Any]  #: the learner's, and the mode's own
    refit_wait_s: float  #: waited for the refit before this step's
    learner_s: float  #: the learner's time on the step
    waiting_s: float  #: the learner's wait for the batch
    t0: float  #: when the batch was asked for
    t2: float  #: when the learner step ended
    step_s: float | None = None  #: the step's time (None: from ``t0`` to the loop's metrics)


class Sequential:
    """Take a batch, train on it, then begin the refit in the background: the learner's next step
    overlaps the engines' weight load, and admission opens at the new version only once every
    engine serves it, so the staleness bound is unchanged."""

    def __init__(self, tr: Any) -> None:
        self.tr = tr

    def _batch(self) -> tuple[list[Any], float, float, bool]:
        """The next batch: (its groups, when it was asked for, when it came, whether a refit is due)."""
        tr = self.tr
        t0 = time.perf_counter()
        take = tr.actors.replay.take.remote(tr.cfg.replay.groups_per_step, tr.version)
        tr.supervisor.check_rollouts()
        groups = tr.supervisor.take(take, step=tr.step, version=tr.version, on_stall=tr.save_checkpoint)
        return groups, t0, time.perf_counter(), (tr.version + 1) % tr.cfg.refit.interval == 0

    def step(self, may_start: Callable[[int], bool], prev_end: float) -> StepDone | None:
        tr = self.tr
        if not may_start(tr.step):
            return None
        groups, t0, t1, refit_due = self._batch()
        metrics = tr.supervisor.learner_step(tr.actors.learner.train_step.remote(groups), groups, step=tr.step)
        t2 = time.perf_counter()
        tr.version += 1
        tr.step += 1
        refit_wait_s = tr.weights.start_refit(tr.version) if refit_due else 0.0
        return StepDone(groups, metrics, refit_wait_s, learner_s=t2 - t1, waiting_s=t1 - t0, t0=t0, t2=t2)


class Colocated(Sequential):
    """The engines share the learner's GPU: they sleep before each step and wake after it, with
    the new weights when a refit is due; nothing generates while the learner steps."""

    def step(self, may_start: Callable[[int], bool], prev_end: float) -> StepDone | None:
        tr = self.tr
        if not may_start(tr.step):
            return None
        groups, t0, t1, refit_due = self._batch()
        # Level 2 drops the weights, which a full refit replaces (full fine-tuning, LoRA served
        # merged); an adapter refit keeps the base (level 1).
        sleep_s = tr.weights.sleep_engines(level=2 if refit_due and not tr.cfg.learner.lora.serves_adapter else 1)
        t1b = time.perf_counter()
        metrics = tr.supervisor.learner_step(tr.actors.learner.train_step.remote(groups), groups, step=tr.step)
        t2 = time.perf_counter()
        tr.version += 1
        tr.step += 1
        # What the learner still holds when the engines wake (its step's cache returned).
        mem = tr.supervisor.get("engine_wake", tr.actors.learner.free_memory.remote(), "the learner's free_memory",
                                recover=False)
        metrics.update({f"memory/learner_{k}": v for k, v in mem.items()})
        try:
            tr.weights.last_refit_s = tr.weights.refit(tr.version) if refit_due else tr.weights.wake_engines()
        except Exception as exc:
            raise wake_failure(tr.cfg, exc, mem) from exc
        metrics["timing/engine_sleep"] = sleep_s
        return StepDone(groups, metrics, 0.0, learner_s=t2 - t1b, waiting_s=t1 - t0, t0=t0, t2=t2)


class Overlapped:
    """Step N+1 is queued on the learner before step N ends, on a batch taken for the version the
    learner will hold: the learner never waits for the driver between steps. No step is queued
    past a checkpoint (the save must see the learner right after its step)."""

    def __init__(self, tr: Any) -> None:
        self.tr = tr
        self.pending: tuple[Any, Any, float] | None = None  # (its batch, its learner call, when asked for)

    def _queue(self, version: int) -> tuple[Any, Any, float]:
        tr = self.tr
        take = tr.actors.replay.take.remote(tr.cfg.replay.groups_per_step, version)
        return take, tr.actors.learner.train_step.remote(take), time.perf_counter()

    def step(self, may_start: Callable[[int], bool], prev_end: float) -> StepDone | None:
        tr, cfg = self.tr, self.tr.cfg
        if self.pending is None:
            if not may_start(tr.step):
                return None
            self.pending = self._queue(tr.version)
        take, step_ref, t0 = self.pending
        tr.supervisor.check_rollouts()
        groups = tr.supervisor.take(take, step=tr.step, version=tr.version)  # no save: a step is queued behind it
        t1 = time.perf_counter()
        refit_due = (tr.version + 1) % cfg.refit.interval == 0
        # Queue behind this step, in order: the refit's export of the weights it makes, then the
        # next step, on a batch taken for the version the learner will hold.
        refit_wait_s, payload = (tr.weights.wait(), tr.weights.export(overlapped=True)) if refit_due else (0.0, None)
        self.pending = None
        ci = cfg.train.checkpoint_interval
        if may_start(tr.step + 1) and not (ci and (tr.step + 1) % ci == 0):
            self.pending = self._queue(tr.version + 1)
        metrics = tr.supervisor.learner_step(step_ref, groups, step=tr.step)
        t2 = time.perf_counter()
        tr.version += 1
        tr.step += 1
        if refit_due:
            tr.weights.submit(payload, tr.version)
        # steps follow back to back: a step's time is from the previous one's end to its own
        return StepDone(groups, metrics, refit_wait_s, learner_s=metrics.get("timing/learner_busy", t2 - t1),
                        waiting_s=metrics.get("timing/learner_idle", 0.0), t0=t0, t2=t2, step_s=t2 - prev_end)


def mode_for(tr: Any) -> Sequential | Overlapped:
    """The mode the run's config asks for (the fixed lag aside)."""
    if overlap_steps(tr.cfg):
        return Overlapped(tr)
    return Colocated(tr) if sleeping_engines(tr.cfg) else Sequential(tr)


def batch_metrics(cfg: Any, groups: list[Any], made_for: int) -> dict[str, Any]:
    """A batch's episode summary and its staleness: how many versions older than ``made_for``
    (the version the step trained from) its trajectories' oldest tokens are."""
    trajs = [t for g in groups for t in g.trajectories]
    staleness = [made_for - t.min_version for t in trajs if t.num_sampled_tokens]
    versions = [v for t in trajs for v, m in zip(t.policy_versions, t.loss_mask) if m]
    out = summarize(trajs)
    if cfg.distill.enabled:
        out.update(reverse_kl_summary(groups))
    out.update({
        "replay/staleness_max": float(max(staleness, default=0)),
        "replay/staleness_mean": sum(staleness) / max(len(staleness), 1),
        "replay/token_version_min": float(min(versions, default=-1)),
        "replay/token_version_max": float(max(versions, default=-1)),
    })
    return out


def run_loop(tr: Any, logger: Any, mode: Sequential | Overlapped) -> dict[str, Any]:
    """Run ``mode``'s steps up to ``train.num_steps`` (or ``train.time_limit_s``), logging each,
    evaluating and checkpointing at their intervals; returns the last step's metrics as ``final/``."""
    from agentrl.driver.progress import TrainProgress

    cfg = tr.cfg
    last: dict[str, Any] = {}
    t_start = prev_end = time.perf_counter()

    def may_start(done: int) -> bool:  # may another step start once `done` steps are done?
        return done < cfg.train.num_steps and not (
            cfg.train.time_limit_s and time.perf_counter() - t_start > cfg.train.time_limit_s)

    # a bar on a terminal; plain lines with --no-progress or when output goes to a file or a pipe
    with TrainProgress(cfg.train.num_steps, start=tr.step, mode="auto" if tr.progress else "lines",
                       log_file=tr.run_dir / "progress.log") as bar:
        while True:
            stop_if_signalled()
            done = mode.step(may_start, prev_end)
            if done is None:
                break
            prev_end = done.t2
            metrics = done.metrics
            metrics.update(batch_metrics(cfg, done.groups, tr.version - 1))
            metrics.update(tr.supervisor.get("batch", tr.actors.replay.metrics.remote(), "the replay queue's metrics",
                                             recover=False))
            metrics.update(tr.supervisor.fault_metrics())
            step_s = time.perf_counter() - done.t0 if done.step_s is None else done.step_s
            trajs = [t for g in done.groups for t in g.trajectories]
            metrics.update({
                # the learner's wait for this step's batch (overlapped: its idle time before the step)
                "timing/waiting": done.waiting_s,
                "timing/learner_step": done.learner_s,
                # the refit runs beside the next step: its last duration, and how long the loop
                # waited for it before starting the following one
                "timing/refit": tr.weights.last_refit_s,
                "timing/refit_wait": done.refit_wait_s,
                "refit/engines_unavailable": float(tr.weights.engines_unavailable),
                # overlapped: from the previous step's end to this one's (steps follow back to back)
                "timing/step": step_s,
                "rollout/tokens_per_s": sum(t.num_sampled_tokens for t in trajs) / max(step_s, 1e-9),
                "timing/elapsed": time.perf_counter() - t_start,
            })
            logger.log(tr.step, metrics)
            bar.update(tr.step, metrics)
            if tr.actors.watchdog is not None:
                tr.actors.watchdog.refresh_pids()  # restarted actors' pids, for a later diagnosis
            last = metrics
            ei = cfg.eval.interval
            if ei and cfg.eval.num_episodes and tr.step % ei == 0 and may_start(tr.step):
                # A held-out curve: the engines serve this step's weights once the refit is in.
                tr.weights.wait()
                logger.log(tr.step, tr.evaluate("step"))
            ci = cfg.train.checkpoint_interval
            if ci and tr.step % ci == 0:
                tr.save_checkpoint()
    tr.weights.wait()
    if cfg.train.num_steps and (not cfg.train.checkpoint_interval or tr.step % cfg.train.checkpoint_interval):
        tr.save_checkpoint()
    return {f"final/{k}": v for k, v in last.items() if isinstance(v, (int, float))}


def wake_failure(cfg: Any, exc: Exception, mem: dict[str, float]) -> Exception:
    """A colocated engine that cannot wake for lack of GPU memory: say what holds it and what to change.
    The watchdog's own stops (RunStopped: its report, exit status 3) pass through as they are,
    whatever their report quotes; so does any other failure."""
    text = str(exc).lower()
    # vLLM's start-up check: an engine restarted (by Ray) while the learner holds its memory
    restarted = "less than desired gpu memory utilization" in text or "less than the engine's budget" in text
    if isinstance(exc, RunStopped) or not ("out of memory" in text or restarted):
        return exc
    share = cfg.engine.gpu_memory_utilization
    held = mem.get("reserved_gib")
    what = "a restarted engine could not start" if restarted else "a sleeping engine could not wake"
    return RuntimeError(
        f"{what}: out of GPU memory. It asks for engine.gpu_memory_utilization={share} "
        f"of the GPU while the learner still holds {'?' if held is None else f'{held:.1f}'} GiB (its weights, "
        "optimizer state and refit buffer stay resident while the engine sleeps). Lower "
        "engine.gpu_memory_utilization to what the KV cache needs, or shrink the learner "
        "(learner.megatron.activation_checkpointing=true, a smaller packing.max_tokens_per_microbatch)."
    )
