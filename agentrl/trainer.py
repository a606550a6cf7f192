"""The driver: builds the actors from a config and runs the asynchronous training loop.

Rollout actors generate groups continuously into the replay queue (admission-controlled by the
staleness bound); the driver takes batches, has the learner step, refits the engines every
``refit.interval`` steps, logs, and checkpoints. Nothing imports this module but the CLI.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray

from agentrl.config import Config, ConfigError
from agentrl.metrics import MetricsLogger
from agentrl.rollout import summarize

__all__ = ["Trainer", "resolve_model_path"]


def resolve_model_path(cfg: Config) -> str:
    """The model directory to start from; bootstraps the tiny model if asked. Raises ConfigError
    before any actor starts when the path is missing."""
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        if cfg.model.bootstrap_tiny:
            from agentrl.tiny import bootstrap_tiny

            bootstrap_tiny(path, seed=cfg.seed, **cfg.model.tiny_kwargs)
        else:
            raise ConfigError(
                f"model.path: '{path}' is not a Hugging Face model directory (no config.json). "
                "Point it at a local checkpoint, or set model.bootstrap_tiny=true to create a tiny model there."
            )
    return str(path)


class Trainer:
    """Owns the actors of one run.

    Args:
        cfg: validated run config.
        model_path: start from this model instead of ``cfg.model.path`` (e.g. the SFT warm start).
        resume: continue from the last checkpoint in the checkpoint directory.
    """

    def __init__(self, cfg: Config, *, model_path: str | None = None, resume: bool = False, progress: bool = True) -> None:
        self.cfg = cfg
        self.model_path = model_path or resolve_model_path(cfg)
        self.resume = resume
        self.progress = progress
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = Path(cfg.train.checkpoint_dir or self.run_dir / "checkpoints")
        self.step = 0
        self.version = 0
        self.actors_started = False
        self.engines_unavailable_at_refit = 0
        self._refit_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentrl-refit")
        self._refit_future: Future[float] | None = None
        self._last_refit_s = 0.0

    # -- actors -----------------------------------------------------------------------------------
    def start(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from agentrl.actors.engine import EngineActor
        from agentrl.actors.learner import LearnerGroup
        from agentrl.actors.replay import ReplayActor
        from agentrl.actors.rollout import RolloutActor

        cfg = self.cfg
        if not ray.is_initialized():
            ray.init(
                address=cfg.cluster.address,
                num_cpus=cfg.cluster.num_cpus if cfg.cluster.address is None else None,
                include_dashboard=False,
                log_to_driver=os.environ.get("AGENTRL_RAY_LOGS", "0") == "1",
                configure_logging=False,
            )
        # The replay queue (and the staged weights) lives on the driver's node: it holds the run's
        # in-flight state, and a node that holds an engine may go away (tests/test_cluster.py).
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self.replay = ReplayActor.options(num_cpus=0, scheduling_strategy=here).remote(
            cfg.replay.capacity, cfg.replay.max_staleness, cfg.replay.groups_per_step,
            wait_for_stragglers=cfg.replay.wait_for_stragglers,
        )
        self.engines = [
            EngineActor.options(
                num_cpus=cfg.engine.num_cpus, num_gpus=cfg.engine.num_gpus, resources=cfg.engine.resources,
                max_restarts=-1, max_task_retries=0,
            ).remote(self.model_path, cfg.engine, dtype=cfg.model.dtype, seed=cfg.seed + i, weight_source=self.replay)
            for i in range(cfg.engine.num_engines)
        ]
        self.learner = LearnerGroup(cfg, self.model_path)
        ray.get([e.start.remote() for e in self.engines])
        if self.resume:
            self._restore()
        self.rollouts = [
            RolloutActor.options(num_cpus=0, resources=cfg.rollout.resources).remote(
                cfg, self.engines, self.replay, i, self.model_path)
            for i in range(cfg.rollout.num_actors)
        ]
        ray.get([r.node_id.remote() for r in self.rollouts])  # constructed (tokenizer, env checked)
        self.actors_started = True

    def refit(self) -> float:
        """Push the learner's weights to every engine and wait for them; returns seconds taken."""
        self._wait_refit()
        return self._refit_engines(self.learner.export_weights.remote(), self.version)

    def _refit_engines(self, weights: Any, version: int) -> float:
        """Stage ``weights`` (an ObjectRef: stored once, read by each engine) in the replay actor,
        load them into every engine, then open admission at ``version``."""
        t0 = time.perf_counter()
        ray.get(self.replay.stage_weights.remote(version, [weights]))
        for ref in [e.update_weights.remote(weights, version, self.cfg.refit.mode) for e in self.engines]:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                # The engine died or is restarting; it loads the staged weights before its next request.
                self.engines_unavailable_at_refit += 1
        ray.get(self.replay.set_weights_version.remote(version))
        return time.perf_counter() - t0

    def _start_refit(self) -> float:
        """Begin a refit to the current version in the background; returns seconds spent waiting
        for the previous one. The snapshot call is queued on the learner before its next step
        (actor calls from one caller run in order), so the learner's next step overlaps the
        engines' weight load instead of waiting for it; admission opens at the new version only
        once every engine serves it, so the staleness bound is unchanged."""
        waited = self._wait_refit()
        weights = self.learner.export_weights.remote()
        self._refit_future = self._refit_pool.submit(self._refit_engines, weights, self.version)
        return waited

    def _wait_refit(self) -> float:
        """Block until the background refit (if any) is done; re-raises its error."""
        t0 = time.perf_counter()
        future, self._refit_future = self._refit_future, None
        if future is not None:
            self._last_refit_s = future.result()
        return time.perf_counter() - t0

    def evaluate(self, label: str) -> dict[str, float]:
        ev = self.cfg.eval
        metrics = ray.get(self.rollouts[0].evaluate.remote(ev.num_episodes, ev.seed_offset, ev.temperature))
        return {k.replace("eval/", f"eval_{label}/"): v for k, v in metrics.items()}

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        self._wait_refit()  # the replay's weights version is saved: engines serve it by then
        path = self.ckpt_dir / f"step_{self.step:06d}"
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        ray.get(self.learner.save.remote(str(tmp / "learner")))
        with open(tmp / "replay.pkl", "wb") as f:
            pickle.dump(ray.get(self.replay.state_dict.remote()), f)
        (tmp / "trainer.json").write_text(json.dumps({"step": self.step, "version": self.version}))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)  # a crash mid-save never leaves a half checkpoint under the real name
        (self.ckpt_dir / "latest").write_text(path.name)
        return path

    def _restore(self) -> None:
        latest = self.ckpt_dir / "latest"
        if not latest.is_file():
            raise ConfigError(f"--resume: no checkpoint in {self.ckpt_dir} (train.checkpoint_dir)")
        path = self.ckpt_dir / latest.read_text().strip()
        meta = json.loads((path / "trainer.json").read_text())
        self.step, self.version = int(meta["step"]), int(meta["version"])
        ray.get(self.learner.load.remote(str(path / "learner")))
        with open(path / "replay.pkl", "rb") as f:
            ray.get(self.replay.load_state_dict.remote(pickle.load(f)))
        self.refit()

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        logger = MetricsLogger(self.run_dir)
        (self.run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
        summary: dict[str, Any] = {}
        try:
            if not self.actors_started:
                self.start()
            if cfg.eval.num_episodes and not self.resume:
                before = self.evaluate("before")
                logger.log(self.step, before)
                summary.update(before)
            runs = [r.run.remote() for r in self.rollouts]
            summary.update(self._loop(logger))
            for r in self.rollouts:
                r.stop.remote()
            if cfg.eval.num_episodes:
                after = self.evaluate("after")
                logger.log(self.step, after)
                summary.update(after)
            del runs
        finally:
            logger.close()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _loop(self, logger: MetricsLogger) -> dict[str, Any]:
        from agentrl.progress import TrainProgress

        cfg = self.cfg
        last: dict[str, Any] = {}
        t_start = time.perf_counter()
        with TrainProgress(cfg.train.num_steps, start=self.step, enabled=self.progress) as bar:
            while self.step < cfg.train.num_steps:
                if cfg.train.time_limit_s and time.perf_counter() - t_start > cfg.train.time_limit_s:
                    break
                t0 = time.perf_counter()
                groups = ray.get(self.replay.take.remote(cfg.replay.groups_per_step, self.version))
                t1 = time.perf_counter()
                metrics = ray.get(self.learner.train_step.remote(groups))
                t2 = time.perf_counter()
                self.version += 1
                self.step += 1
                refit_wait_s = self._start_refit() if self.version % cfg.refit.interval == 0 else 0.0
                trajs = [t for g in groups for t in g.trajectories]
                staleness = [self.version - 1 - t.min_version for t in trajs if t.num_sampled_tokens]
                versions = [v for t in trajs for v, m in zip(t.policy_versions, t.loss_mask) if m]
                metrics.update(summarize(trajs))
                metrics.update(ray.get(self.replay.metrics.remote()))
                metrics.update({
                    "replay/staleness_max": float(max(staleness, default=0)),
                    "replay/staleness_mean": sum(staleness) / max(len(staleness), 1),
                    "replay/token_version_min": float(min(versions, default=-1)),
                    "replay/token_version_max": float(max(versions, default=-1)),
                    "timing/waiting": t1 - t0,
                    "timing/learner_step": t2 - t1,
                    # the refit runs beside the next step: its last duration, and how long the loop
                    # waited for it before starting the following one
                    "timing/refit": self._last_refit_s,
                    "timing/refit_wait": refit_wait_s,
                    "refit/engines_unavailable": float(self.engines_unavailable_at_refit),
                    "timing/step": time.perf_counter() - t0,
                    "rollout/tokens_per_s": sum(t.num_sampled_tokens for t in trajs) / max(time.perf_counter() - t0, 1e-9),
                    "timing/elapsed": time.perf_counter() - t_start,
                })
                logger.log(self.step, metrics)
                bar.update(self.step, metrics)
                last = metrics
                ci = cfg.train.checkpoint_interval
                if ci and self.step % ci == 0:
                    self.save_checkpoint()
        self._wait_refit()
        if cfg.train.num_steps and (not cfg.train.checkpoint_interval or self.step % cfg.train.checkpoint_interval):
            self.save_checkpoint()
        return {f"final/{k}": v for k, v in last.items() if isinstance(v, (int, float))}

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):  # shutting down anyway; the loop raised what mattered
            self._wait_refit()
        self._refit_pool.shutdown(wait=True)
        if self.actors_started:
            for actor in [*getattr(self, "rollouts", []), *self.engines, *self.learner.actors, self.replay]:
                try:
                    ray.kill(actor)
                except Exception:
                    pass
            self.actors_started = False
