"""The driver's loop with a fixed lag (``replay.lag``): step ``k`` trains on the batch made by
weights version ``k - L`` while the engines generate step ``k + 1``'s batch; refits are placed so that
no group straddles one. The queue that assigns slots and returns batches in slot order is
:class:`agentrl.replay.fixed_lag.FixedLagQueue` (what makes the run a function of its seed).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from agentrl.driver.supervision import stop_if_signalled
from agentrl.replay.fixed_lag import batch_digest

__all__ = ["fixed_lag_loop"]


def fixed_lag_loop(tr: Any, logger: Any) -> dict[str, Any]:
    """The driver's loop with ``replay.lag`` (``tr``: the Trainer, as in :mod:`agentrl.driver.loop`).
    Step ``k``: take its batch (made by version ``k - L``), queue the learner's step, and refit
    version ``k - L + 1`` to the engines beside it, since every group of that version's
    predecessor is in; the engines then generate step ``k + 1``'s batch while the learner trains
    step ``k``."""
    from agentrl.driver.loop import batch_metrics
    from agentrl.driver.progress import TrainProgress

    cfg, weights, supervisor, replay = tr.cfg, tr.weights, tr.supervisor, tr.actors.replay
    lag, k_groups = cfg.replay.lag, cfg.replay.groups_per_step
    t_start = prev_end = time.perf_counter()
    last: dict[str, Any] = {}
    first = tr.step  # the engines serve this version now (0, or the checkpoint's)
    exported: deque[tuple[int, Any]] = deque()  # (version, the learner's export of it) not in the engines yet

    def refit_through(version: int) -> float:
        """Start loading every export up to ``version`` into the engines, in order, on the refit
        thread; returns the seconds spent waiting for the refit before."""
        waited = 0.0
        while exported and exported[0][0] <= version:
            v, payload = exported.popleft()
            waited += weights.wait()
            weights.submit(payload, v)
        return waited

    def may_start() -> bool:
        return tr.step < cfg.train.num_steps and not (
            cfg.train.time_limit_s and time.perf_counter() - t_start > cfg.train.time_limit_s)

    with TrainProgress(cfg.train.num_steps, start=tr.step, mode="auto" if tr.progress else "lines",
                       log_file=tr.run_dir / "progress.log") as bar:
        while may_start():
            stop_if_signalled()
            k = tr.step
            t0 = time.perf_counter()
            if k > first:  # queued on the learner before step k: the weights of version k
                exported.append((k, weights.export()))
            refit_wait_s = refit_through(k - lag)  # lag 0: step k's batch needs version k
            supervisor.check_rollouts()
            groups = supervisor.take(replay.take.remote(k_groups, k), step=k, version=tr.version,
                                     on_stall=tr.save_checkpoint)
            t1 = time.perf_counter()
            step_ref = tr.actors.learner.train_step.remote(groups)
            refit_wait_s += refit_through(k - lag + 1)  # every group of version k - lag is in
            metrics = supervisor.learner_step(step_ref, groups, step=k)
            t2 = time.perf_counter()
            tr.version += 1
            tr.step += 1
            trajs = [t for g in groups for t in g.trajectories]
            metrics.update(batch_metrics(cfg, groups, k))
            metrics.update(supervisor.get("batch", replay.metrics.remote(), "the replay queue's metrics", recover=False))
            metrics.update(supervisor.fault_metrics())
            metrics.update({
                "replay/batch_sha": batch_digest(groups),
                "timing/waiting": t1 - t0,
                "timing/learner_step": t2 - t1,
                "timing/refit": weights.last_refit_s,
                "timing/refit_wait": refit_wait_s,
                "refit/engines_unavailable": float(weights.engines_unavailable),
                "timing/step": t2 - prev_end,
                "rollout/tokens_per_s": sum(t.num_sampled_tokens for t in trajs) / max(t2 - prev_end, 1e-9),
                "timing/elapsed": time.perf_counter() - t_start,
            })
            prev_end = t2
            logger.log(tr.step, metrics)
            bar.update(tr.step, metrics)
            if tr.actors.watchdog is not None:
                tr.actors.watchdog.refresh_pids()
            last = metrics
            ei = cfg.eval.interval
            if ei and cfg.eval.num_episodes and tr.step % ei == 0 and may_start():
                weights.wait()  # no refit lands mid-evaluation; the engines serve step - lag's weights
                logger.log(tr.step, tr.evaluate("step") | {"eval_step/weights_version": float(weights.engines_version)})
            ci = cfg.train.checkpoint_interval
            if ci and tr.step % ci == 0:
                tr.save_checkpoint()
    weights.wait()
    exported.clear()
    if tr.step > weights.engines_version:  # the final evaluation (and any later use of the engines): the last weights
        weights.refit(tr.version)
    if cfg.train.num_steps and (not cfg.train.checkpoint_interval or tr.step % cfg.train.checkpoint_interval):
        tr.save_checkpoint()
    return {f"final/{key}": v for key, v in last.items() if isinstance(v, (int, float))}
