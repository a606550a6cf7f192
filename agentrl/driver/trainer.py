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
import tempfile
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray

from agentrl.config import Config, ConfigError
from agentrl.driver.fixed_lag import fixed_lag_loop
from agentrl.driver.metrics import MetricsLogger, require_wandb
from agentrl.driver.supervision import Supervision
from agentrl.driver.watchdog import RunStalled, RunStopped
from agentrl.learner.distill import reverse_kl_summary
from agentrl.model.loading import resolve_model_path as _resolve_model_path, tokenizer_vocab_limit
from agentrl.rollout.episode import summarize
from agentrl.weights.sync import WeightSync
from agentrl.weights.transports import resolve_transport

__all__ = ["Trainer"]


def __getattr__(name: str):
    if name == "resolve_model_path":  # moved below the driver; the old path keeps working
        warnings.warn("agentrl.driver.trainer.resolve_model_path moved to agentrl.model.loading.resolve_model_path",
                      DeprecationWarning, stacklevel=2)
        return _resolve_model_path
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def ray_init_kwargs(address: str | None = None, num_cpus: int | None = None,
                    runtime_env: dict[str, Any] | None = None, max_task_events: int = 2_000,
                    worker_niceness: int | None = None) -> dict[str, Any]:
    """``ray.init``'s arguments when the trainer starts or joins Ray (the ``cluster`` config's
    fields; tools/ray_restart_diag.py starts Ray with them too). A cluster that is joined keeps its
    own system config: Ray refuses ``_system_config`` when it does not start the cluster."""
    system: dict[str, Any] = {"task_events_max_num_task_in_gcs": max_task_events}
    if worker_niceness is not None:
        system["worker_niceness"] = worker_niceness
    started = {} if address else {"_system_config": system}
    return started | {
        # None starts a local cluster, as cluster.address promises: Ray would otherwise join
        # whatever cluster `ray start` last left on this machine (RAY_ADDRESS included).
        "address": address or "local",
        "num_cpus": num_cpus if address is None else None,
        "include_dashboard": False,
        "log_to_driver": os.environ.get("AGENTRL_RAY_LOGS", "0") == "1",
        "configure_logging": False,
        "runtime_env": runtime_env or None,
    }


class Trainer(Supervision, WeightSync):
    """Owns the actors of one run.

    Args:
        cfg: validated run config.
        model_path: start from this model instead of ``cfg.model.path`` (e.g. the SFT warm start).
        resume: continue from the last checkpoint in the checkpoint directory.
    """

    def __init__(self, cfg: Config, *, model_path: str | None = None, resume: bool = False, progress: bool = True) -> None:
        from agentrl.actors.runtime_env import build_runtime_env
        from agentrl.env.ids import check_env
        from agentrl.config.registry import check_components

        self.cfg = cfg
        if cfg.agent.solve is not None:  # the agent, its scorer and tasks import: before Ray
            from agentrl.rollout.agent.user import load_agent

            load_agent(cfg.agent)
            for key in ("tasks", "eval_tasks"):  # a task file is read by the rollout actors, elsewhere
                spec = getattr(cfg.agent, key)
                if spec and Path(spec).is_file():
                    setattr(cfg.agent, key, str(Path(spec).resolve()))
        if cfg.agent.solve is None or cfg.sft.enabled:  # (SFT learns from the env's expert)
            check_env(cfg.env.id, cfg.env.kwargs)  # an unknown id, a module that fails, bad kwargs: before Ray
        check_components(cfg)  # a user's loss, estimator or learner backend imports: before Ray
        if cfg.metrics.wandb.enabled:
            require_wandb()
        self.runtime_env = build_runtime_env(cfg)
        self.model_path = model_path or _resolve_model_path(cfg)
        if cfg.distill.enabled:
            from agentrl.learner.distill import check_teacher

            check_teacher(cfg.distill.teacher, self.model_path)  # before Ray: a wrong path or tokenizer
        self.teachers: list[Any] = []
        self.resume = resume
        self.progress = progress
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = Path(cfg.train.checkpoint_dir or self.run_dir / "checkpoints")
        self.step = self.version = 0
        self.actors_started = False
        self.engines_unavailable_at_refit = 0
        self._refit_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentrl-refit")
        self._refit_future: Future[float] | None = None
        self._last_refit_s = 0.0
        self._release_ref: Any = None  # the learner's release of its last refit buffer (GPU transports)
        self._checked_release: Any = None  # overlapped steps: the release before that one
        self.compile_cache_dir: str | None = None  # the engines' torch-inductor cache (start() makes it)
        self.placement_group: Any = None  # colocated: one bundle per GPU (agentrl.actors.placement)
        self.transport = "object_store"
        self.sleeping_engines = False
        self.gpu_memory: dict[str, Any] = {}
        self.watchdog: Any = None  # agentrl.actors.watchdog.Watchdog, once the actors are up
        self.rollouts: list[Any] = []
        self.runs: list[Any] = []  # each rollout actor's run() call
        self.rollout_generation: list[int] = []  # replacements of each rollout actor so far
        self.num_rollout_restarts = self.num_engine_restarts = self.num_refit_retries = self.num_abandoned_groups = 0
        self.num_engine_catch_ups = 0  # restarted engines given the current weights by the driver
        self.engines_version = 0  # the weights version every engine serves (the last refit's)
        self._engine_pings: dict[int, tuple[Any, int]] = {}  # _check_engines: (ping, engines_version when sent)
        self._progress_counts: tuple[float, float] | None = None  # _progress: (put, dropped stale) last look
        self._fresh_looks = 0
        self.engine_start_s: float | None = None  # how long the engines took to start (a restart's grace)
        self.engines_up_at: float | None = None  # time.time() then
        self.start_s: dict[str, float] = {}  # start(): seconds each part of the start-up took

    # -- actors -----------------------------------------------------------------------------------
    def start(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from agentrl.actors.engine import EngineActor
        from agentrl.actors.learner import LearnerGroup
        from agentrl.actors.replay import ReplayActor

        cfg = self.cfg
        clock = [time.perf_counter()]

        def took(name: str) -> None:  # start_s[name]: the seconds since the last part ended
            now = time.perf_counter()
            self.start_s[name] = round(now - clock[0], 2)
            clock[0] = now

        if not ray.is_initialized():
            ray.init(**ray_init_kwargs(cfg.cluster.address, cfg.cluster.num_cpus, self.runtime_env,
                                       cfg.cluster.max_task_events, cfg.cluster.worker_niceness))
        elif cfg.cluster.runtime_env:  # Ray takes local paths at the job level only: ray.init's
            warnings.warn("cluster.runtime_env has no effect: Ray was initialized before the Trainer started; "
                          "pass runtime_env=trainer.runtime_env to ray.init instead", stacklevel=2)
        self._take_sigterm()
        took("ray")
        # The replay queue (and the staged weights) lives on the driver's node: it holds the run's
        # in-flight state, and a node that holds an engine may go away (tests/test_cluster.py).
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        replay_name = f"agentrl-replay-{uuid.uuid4().hex[:12]}"  # engines find it by name (actors/engine.py)
        self.replay = ReplayActor.options(num_cpus=0, scheduling_strategy=here, name=replay_name).remote(
            cfg.replay.capacity, cfg.replay.max_staleness, cfg.replay.groups_per_step,
            wait_for_stragglers=cfg.replay.wait_for_stragglers, task_order=cfg.train.deterministic,
            dynamic_sampling=cfg.replay.dynamic_sampling,
            dynamic_sampling_max_dropped=cfg.replay.dynamic_sampling_max_dropped,
            lag=cfg.replay.lag, seed_offset=cfg.rollout.seed_offset,
        )
        co = cfg.colocate
        self.transport = resolve_transport(cfg.refit.transport, engine_on_gpu=cfg.engine.num_gpus > 0,
                                           same_gpu=co.enabled and cfg.engine.num_gpus > 0)
        self.sleeping_engines = co.enabled and co.engine_sleep
        engine_opts = [dict(num_cpus=cfg.engine.num_cpus, num_gpus=cfg.engine.num_gpus, resources=cfg.engine.resources)
                       for _ in range(cfg.engine.num_engines)]
        if co.enabled:
            # One bundle per GPU: learner rank i and the engines dealt to GPU i share that device.
            from agentrl.actors.placement import colocated_plan

            self.placement = colocated_plan(cfg)
            self.placement_group = self.placement.reserve(timeout_s=cfg.cluster.placement_timeout_s)
            engine_opts = [self.placement.engine_options(cfg, self.placement_group, i)
                           for i in range(cfg.engine.num_engines)]
        # The engines' compile cache, kept across their restarts and removed at shutdown (an engine
        # on another node makes the folder there, and that one stays).
        self.compile_cache_dir = tempfile.mkdtemp(prefix="agentrl-compile-")
        self.engines = [
            EngineActor.options(**engine_opts[i], max_restarts=-1, max_task_retries=0).remote(self.model_path, cfg.engine, dtype=cfg.model.dtype, seed=cfg.seed + i, weight_source=replay_name,
                     enable_sleep_mode=self.sleeping_engines, lora=cfg.learner.lora if cfg.learner.lora.serves_adapter else None,
                     compile_cache_dir=self.compile_cache_dir,
                     vocab_limit=tokenizer_vocab_limit(self.model_path, cfg.model.tokenizer_vocab_only))
            for i in range(cfg.engine.num_engines)
        ]
        # Rollout actors need no GPU and nothing the engines or learner make: their start (a process,
        # tokenizer, tool parser, env check: 18 s at 384k) overlaps the engines'. Distillation: later.
        self.rollout_generation = [0] * cfg.rollout.num_actors
        self.rollouts = [] if cfg.distill.enabled else [self._make_rollout(i) for i in range(cfg.rollout.num_actors)]
        took("replay_and_placement")
        if co.enabled:
            # vLLM sizes its KV cache from the memory it sees at start: engines first, then the
            # learner (while sleeping engines hold only their CUDA context), then the engines wake.
            t_engines = time.perf_counter()
            ray.get([e.start.remote() for e in self.engines])
            # a restart's grace (else watchdog.first_s); when they were up
            self.engine_start_s, self.engines_up_at = time.perf_counter() - t_engines, time.time()
            took("engines")
            if self.sleeping_engines:
                ray.get([e.sleep.remote(1) for e in self.engines])
                took("engines_sleep")
            self.learner = LearnerGroup(cfg, self.model_path, placement=(self.placement, self.placement_group))
            self.gpu_memory["learner_built"] = ray.get(self.learner.free_memory.remote())
            took("learner")
            if self.sleeping_engines:
                ray.get([e.wake_up.remote() for e in self.engines])
                took("engines_wake")
        else:
            self.learner = LearnerGroup(cfg, self.model_path)
            t_engines = time.perf_counter()
            self._start_engines()
            self.engine_start_s, self.engines_up_at = time.perf_counter() - t_engines, time.time()
            took("engines")  # the learner builds meanwhile, in its own processes
        if cfg.distill.enabled:
            self.teachers = self._start_teachers(EngineActor)
            took("teachers")
        if self.transport == "nccl":
            self._init_weight_group()
            took("weight_group")
        if self.resume:
            self._restore()
            took("restore")
        elif cfg.learner.lora.serves_adapter:
            # Every request runs on the policy's adapter from the start (a fresh one equals the base):
            # an in-flight request never switches from the base to an adapter at a later refit.
            # (Served merged, the engines start on the base, which a fresh adapter merges to.)
            self.refit()
            took("refit")
        self.rollouts = self.rollouts or [self._make_rollout(i) for i in range(cfg.rollout.num_actors)]  # teachers'
        ray.get([r.node_id.remote() for r in self.rollouts])  # constructed (tokenizer, env checked)
        took("rollouts")  # what is left of their start once the engines and the learner are up
        self.actors_started = True
        from agentrl.actors.watchdog import Watchdog

        self.watchdog = Watchdog(cfg.watchdog, self.named_actors, self.run_dir / "watchdog")
        self.watchdog.learn_pids()  # a frozen actor's stacks are read by pid

    def _start_engines(self) -> None:
        """Start every engine; one that dies while it starts (Ray restarts it) is asked again."""
        refs = [e.start.remote() for e in self.engines]
        for i, ref in enumerate(refs):
            for attempt in range(3):
                try:
                    ray.get(ref)
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                    if attempt == 2:
                        raise
                    time.sleep(1.0)
                    ref = self.engines[i].start.remote()

    def _make_rollout(self, i: int) -> Any:
        from agentrl.actors.rollout import RolloutActor

        gen = self.rollout_generation[i]
        # A replacement starts its task seeds far past its predecessor's: no task is generated twice.
        return RolloutActor.options(num_cpus=0, resources=self.cfg.rollout.resources).remote(
            self.cfg, self.engines, self.replay, i, self.model_path, self.teachers,
            owner=f"rollout{i}.{gen}", first_task=gen * 1_000_000)

    def named_actors(self) -> dict[str, Any]:
        """Every actor of the run by name (what the watchdog pings)."""
        named = {"replay": self.replay}
        named.update({f"learner{i}": a for i, a in enumerate(self.learner.actors)})
        named.update({f"engine{i}": e for i, e in enumerate(self.engines)})
        named.update({f"rollout{i}": r for i, r in enumerate(self.rollouts)})
        named.update({f"teacher{i}": t for i, t in enumerate(self.teachers)})
        return named

    def _start_teachers(self, engine_actor: Any) -> list[Any]:
        """On-policy distillation: the teacher's engines, never refit. They score whole
        trajectories (prompt logprobs), one token longer than the student's engines generate."""
        cfg, dc = self.cfg, self.cfg.distill
        teacher_engine = cfg.engine.model_copy(update={
            "max_model_len": cfg.engine.max_model_len + 1, "kv_cache_gib": dc.kv_cache_gib or cfg.engine.kv_cache_gib})
        teachers = [
            engine_actor.options(num_cpus=dc.num_cpus, num_gpus=dc.num_gpus, max_restarts=-1, max_task_retries=0)
            .remote(dc.teacher, teacher_engine, dtype=cfg.model.dtype, seed=cfg.seed + 1000 + i,
                    compile_cache_dir=self.compile_cache_dir,
                    vocab_limit=tokenizer_vocab_limit(dc.teacher, cfg.model.tokenizer_vocab_only))
            for i in range(dc.num_engines)
        ]
        ray.get([t.start.remote() for t in teachers])
        return teachers

    def evaluate(self, label: str) -> dict[str, float]:
        ev = self.cfg.eval
        metrics = self._get("eval", self.rollouts[0].evaluate.remote(ev.num_episodes, ev.seed_offset, ev.temperature),
                            f"the {label} evaluation ({ev.num_episodes} episodes)", focus=self._engine_names(),
                            progress=self._sampling_progress)  # a slow machine's long evaluation is not a stall
        return {k.replace("eval/", f"eval_{label}/"): v for k, v in metrics.items()}

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        self._wait_refit()  # the replay's weights version is saved: engines serve it by then
        path = self.ckpt_dir / f"step_{self.step:06d}"
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self._get("checkpoint", self.learner.save.remote(str(tmp / "learner")), f"the learner's save of step {self.step}",
                  recover=False, focus=self._learner_names())
        with open(tmp / "replay.pkl", "wb") as f:
            pickle.dump(self._get("checkpoint", self.replay.state_dict.remote(), "the replay queue's state",
                                  recover=False, focus=("replay",)), f)
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
        logger = MetricsLogger(self.run_dir, tensorboard=cfg.metrics.tensorboard, wandb=cfg.metrics.wandb,
                               config=cfg.model_dump(mode="json"), resume=self.resume)
        (self.run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
        summary: dict[str, Any] = {}
        try:
            if not self.actors_started:
                self.start()
            if cfg.eval.num_episodes and not self.resume:
                before = self.evaluate("before")
                logger.log(self.step, before)
                summary.update(before)
            self.runs = [r.run.remote() for r in self.rollouts]
            try:
                summary.update(self._loop(logger) if cfg.replay.lag is None else fixed_lag_loop(self, logger))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                # the learner or the replay queue (state that cannot be rebuilt) died outside a step
                text = str(exc)
                who = ("the learner" if "LearnerActor" in text else "the replay queue" if "ReplayActor" in text
                       else "an actor the run cannot replace")
                raise RunStopped(f"{who} died after step {self.step} ({type(exc).__name__}: {text[:500]})\n"
                                 + self._resume_hint()) from exc
            for r in self.rollouts:
                r.stop.remote()
            if cfg.eval.num_episodes:
                after = self.evaluate("after")
                logger.log(self.step, after)
                summary.update(after)
            self.runs = []
            logger.summary(summary)
        finally:
            logger.close()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def overlap_steps(self) -> bool:
        """Whether the loop queues step N+1 on the learner before step N ends (train.overlap_steps)."""
        ov = self.cfg.train.overlap_steps
        if self.sleeping_engines:
            return False  # the engines sleep before each step (the config refuses an explicit true)
        return self.cfg.learner.num_gpus > 0 if ov == "auto" else bool(ov)

    def _loop(self, logger: MetricsLogger) -> dict[str, Any]:
        from agentrl.driver.progress import TrainProgress

        cfg = self.cfg
        last: dict[str, Any] = {}
        t_start = time.perf_counter()
        overlap = self.overlap_steps()
        k = cfg.replay.groups_per_step

        def may_start(done: int) -> bool:  # may another step start once `done` steps are done?
            return done < cfg.train.num_steps and not (
                cfg.train.time_limit_s and time.perf_counter() - t_start > cfg.train.time_limit_s)

        def checkpoint_after(done: int) -> bool:  # the learner's state after step `done` is saved
            ci = cfg.train.checkpoint_interval
            return bool(ci) and done % ci == 0

        # A step in flight: (its batch, its learner call or None, when it was asked for).
        pending: tuple[Any, Any, float] | None = None
        prev_end = t_start
        # a bar on a terminal; plain lines with --no-progress or when output goes to a file or a pipe
        with TrainProgress(cfg.train.num_steps, start=self.step, mode="auto" if self.progress else "lines",
                           log_file=self.run_dir / "progress.log") as bar:
            while True:
                self._stop_if_signalled()
                if pending is None:
                    if not may_start(self.step):
                        break
                    take = self.replay.take.remote(k, self.version)
                    pending = (take, self.learner.train_step.remote(take) if overlap else None, time.perf_counter())
                take, step_ref, t0 = pending
                self._check_rollouts()
                groups = self._take(take, save=not overlap)
                t1 = time.perf_counter()
                refit_due = (self.version + 1) % cfg.refit.interval == 0
                sleep_s = refit_wait_s = 0.0
                if overlap:
                    # Queue behind this step, in order: the refit's export of the weights it makes,
                    # then the next step, on a batch taken for the version the learner will hold.
                    refit_wait_s, payload = (self._wait_refit(), self._export(overlapped=True)) if refit_due else (0.0, None)
                    pending = None
                    # Not past a checkpoint: the save must see the learner right after this step.
                    if may_start(self.step + 1) and not checkpoint_after(self.step + 1):
                        nxt = self.replay.take.remote(k, self.version + 1)
                        pending = (nxt, self.learner.train_step.remote(nxt), time.perf_counter())
                    metrics = self._learner_step(step_ref, groups)
                    t2 = time.perf_counter()
                    self.version += 1
                    self.step += 1
                    if refit_due:
                        self._refit_future = self._refit_pool.submit(self._refit_engines, payload, self.version)
                    step_s, learner_s = t2 - prev_end, metrics.get("timing/learner_busy", t2 - t1)
                    waiting_s = metrics.get("timing/learner_idle", 0.0)
                else:
                    pending = None
                    # Level 2 drops the weights, which a full refit replaces (full fine-tuning, LoRA
                    # served merged); an adapter refit keeps the base (level 1).
                    level = 2 if refit_due and not cfg.learner.lora.serves_adapter else 1
                    sleep_s = self._sleep_engines(level=level) if self.sleeping_engines else 0.0
                    t1b = time.perf_counter()
                    metrics = self._learner_step(self.learner.train_step.remote(groups), groups)
                    t2 = time.perf_counter()
                    self.version += 1
                    self.step += 1
                    if self.sleeping_engines:
                        # Colocated: nothing generates while the learner steps; wake with new weights.
                        # What the learner still holds when the engines wake (its step's cache returned).
                        mem = self._get("engine_wake", self.learner.free_memory.remote(), "the learner's free_memory",
                                        recover=False)
                        metrics.update({f"memory/learner_{k}": v for k, v in mem.items()})
                        try:
                            self._last_refit_s = self.refit() if refit_due else self._wake_engines()
                        except Exception as exc:
                            raise self._wake_failure(exc, mem) from exc
                        metrics["timing/engine_sleep"] = sleep_s
                    else:
                        refit_wait_s = self._start_refit() if refit_due else 0.0
                    step_s, learner_s, waiting_s = None, t2 - t1b, t1 - t0
                prev_end = t2
                trajs = [t for g in groups for t in g.trajectories]
                staleness = [self.version - 1 - t.min_version for t in trajs if t.num_sampled_tokens]
                versions = [v for t in trajs for v, m in zip(t.policy_versions, t.loss_mask) if m]
                metrics.update(summarize(trajs))
                if cfg.distill.enabled:
                    metrics.update(reverse_kl_summary(groups))
                metrics.update(self._get("batch", self.replay.metrics.remote(), "the replay queue's metrics",
                                         recover=False))
                metrics.update(self._fault_metrics())
                step_s = time.perf_counter() - t0 if step_s is None else step_s
                metrics.update({
                    "replay/staleness_max": float(max(staleness, default=0)),
                    "replay/staleness_mean": sum(staleness) / max(len(staleness), 1),
                    "replay/token_version_min": float(min(versions, default=-1)),
                    "replay/token_version_max": float(max(versions, default=-1)),
                    # the learner's wait for this step's batch (overlapped: its idle time before the step)
                    "timing/waiting": waiting_s,
                    "timing/learner_step": learner_s,
                    # the refit runs beside the next step: its last duration, and how long the loop
                    # waited for it before starting the following one
                    "timing/refit": self._last_refit_s,
                    "timing/refit_wait": refit_wait_s,
                    "refit/engines_unavailable": float(self.engines_unavailable_at_refit),
                    # overlapped: from the previous step's end to this one's (steps follow back to back)
                    "timing/step": step_s,
                    "rollout/tokens_per_s": sum(t.num_sampled_tokens for t in trajs) / max(step_s, 1e-9),
                    "timing/elapsed": time.perf_counter() - t_start,
                })
                logger.log(self.step, metrics)
                bar.update(self.step, metrics)
                if self.watchdog is not None:
                    self.watchdog.refresh_pids()  # restarted actors' pids, for a later diagnosis
                last = metrics
                ei = cfg.eval.interval
                if ei and cfg.eval.num_episodes and self.step % ei == 0 and may_start(self.step):
                    # A held-out curve: the engines serve this step's weights once the refit is in.
                    self._wait_refit()
                    logger.log(self.step, self.evaluate("step"))
                ci = cfg.train.checkpoint_interval
                if ci and self.step % ci == 0:
                    self.save_checkpoint()
        self._wait_refit()
        if cfg.train.num_steps and (not cfg.train.checkpoint_interval or self.step % cfg.train.checkpoint_interval):
            self.save_checkpoint()
        return {f"final/{k}": v for k, v in last.items() if isinstance(v, (int, float))}

    def _take(self, take: Any, *, save: bool = True) -> list[Any]:
        """The next batch, under the watchdog: no group arriving for too long is diagnosed, frozen
        engines are restarted and lost rollout actors replaced; a dead rollout actor is noticed
        (and replaced) without waiting for the deadline."""
        from agentrl.actors.watchdog import Watchdog

        if self.watchdog is None or not self.cfg.watchdog.enabled:
            while not ray.wait([take], timeout=2.0)[0]:
                if not self.overlap_steps():
                    self._check_engines()
            return ray.get(take)
        wd: Watchdog = self.watchdog
        k = self.cfg.replay.groups_per_step

        def done(timeout: float) -> bool:
            end = time.perf_counter() + timeout
            while True:
                if ray.wait([take], timeout=min(2.0, max(0.0, end - time.perf_counter())))[0]:
                    return True
                self._check_rollouts()
                if not self.overlap_steps():  # (overlapped: a step waits on the learner for this batch)
                    self._check_engines()
                if time.perf_counter() >= end:
                    return False

        try:
            wd.wait("batch", done, what=f"a batch of {k} groups for step {self.step + 1} (replay.take)",
                    recover=self._recover, focus=(*self._engine_names(), *(f"rollout{i}" for i in range(len(self.rollouts)))),
                    progress=self._progress)
        except RunStalled as exc:
            if not save:  # a step is queued on the learner behind this batch: a save would wait for it
                raise
            try:
                path = self.save_checkpoint()
            except Exception as err:  # noqa: BLE001 (the stall is the error to report)
                raise RunStalled(f"{exc}\n(no checkpoint could be saved: {type(err).__name__}: {err})") from exc
            raise RunStalled(f"{exc}\nthe learner's state after step {self.step} was saved to {path}; "
                             "`agentrl train CONFIG --resume` continues from it") from exc
        return ray.get(take)

    def _learner_step(self, ref: Any, groups: list[Any]) -> dict[str, Any]:
        """A learner step under the watchdog. The learner's state cannot be rebuilt elsewhere: if
        it dies or freezes the run stops, naming the cause, and --resume continues from the last
        checkpoint."""
        try:
            if self.watchdog is None:
                return ray.get(ref)
            # A CPU learner that keeps burning CPU is slow, not stuck (a loaded machine); on a GPU a
            # hung collective spins the CPU too, so there the deadline alone decides.
            progress = self._learner_cpu if self.cfg.learner.num_gpus == 0 else None
            return self.watchdog.get("learner_step", ref, what=f"learner step {self.step + 1}",
                                     focus=self._learner_names(), progress=progress)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, RunStalled) as exc:
            n = sum(len(g.trajectories) for g in groups)
            cause = (f"the learner died during step {self.step + 1} ({type(exc).__name__}: {str(exc)[:500]})"
                     if not isinstance(exc, RunStalled) else str(exc))
            raise RunStopped(f"{cause}\n{self._resume_hint()} The {len(groups)} groups ({n} trajectories) of the "
                             "unfinished step were consumed and not trained on.") from exc

    def _learner_cpu(self) -> Any:
        """CPU seconds the learner processes have used, to a tenth (None if not on this host): a
        learner starved on a loaded machine still moves it; one blocked for good does not."""
        import psutil

        total = 0.0
        for name in self._learner_names():
            pid = self.watchdog.pids.get(name)
            try:
                t = psutil.Process(pid).cpu_times() if pid and self.watchdog.is_same_process(name, pid) else None
            except psutil.Error:
                t = None
            if t is None:
                return None
            total += t.user + t.system
        return round(total, 1)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):  # shutting down anyway; the loop raised what mattered
            self._wait_refit()
        self._refit_pool.shutdown(wait=True)
        if self.actors_started:
            for actor in [*getattr(self, "rollouts", []), *self.engines, *self.teachers, *self.learner.actors,
                          self.replay]:
                try:
                    ray.kill(actor)
                except Exception:
                    pass
            self.actors_started = False
            from agentrl.engine.vllm_engine import sweep_dead_engine_files

            engine_pids = [pid for name, pid in (self.watchdog.pids if self.watchdog else {}).items()
                           if name.startswith(("engine", "teacher"))]
            with contextlib.suppress(Exception):  # what the killed engines left in /dev/shm and the temp dir
                sweep_dead_engine_files(engine_pids, wait_s=10.0)
        if self.compile_cache_dir is not None:
            shutil.rmtree(self.compile_cache_dir, ignore_errors=True)
            self.compile_cache_dir = None
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
        self._give_back_sigterm()
