"""The driver: builds the actors from a config and runs the asynchronous training loop.

Rollout actors generate groups continuously into the replay queue (admission-controlled by the
staleness bound); the driver takes batches, has the learner step, refits the engines every
``refit.interval`` steps, logs, and checkpoints. The :class:`Trainer` composes the parts: the
run's actors (:class:`agentrl.driver.state.RunActors`), their supervisor (fault handling,
:mod:`agentrl.driver.supervision`), the weights service (refits and staged weights,
:mod:`agentrl.weights.sync`) and the loop's mode (:mod:`agentrl.driver.loop`,
:mod:`agentrl.driver.fixed_lag`). Nothing imports this module but the pipeline.
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
from pathlib import Path
from typing import Any

import ray

from agentrl.config import Config, ConfigError
from agentrl.driver.fixed_lag import fixed_lag_loop
from agentrl.driver.loop import mode_for, overlap_steps, run_loop, sleeping_engines
from agentrl.driver.metrics import MetricsLogger, require_wandb
from agentrl.driver.state import RunActors
from agentrl.driver.supervision import SigtermAsInterrupt, Supervisor
from agentrl.driver.watchdog import RunStopped
from agentrl.model.loading import resolve_model_path as _resolve_model_path, tokenizer_vocab_limit
from agentrl.weights.sync import WeightService
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


class Trainer:
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
        self.resume = resume
        self.progress = progress
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_dir = Path(cfg.train.checkpoint_dir or self.run_dir / "checkpoints")
        self.step = self.version = 0  # steps done; the learner's weights version
        self.actors = RunActors()
        self.supervisor: Supervisor | None = None  # once the actors are up (use_actors)
        self.weights: WeightService | None = None  # ditto
        self.actors_started = False
        self.compile_cache_dir: str | None = None  # the engines' torch-inductor cache (start() makes it)
        self.placement_group: Any = None  # colocated: one bundle per GPU (agentrl.actors.placement)
        self.gpu_memory: dict[str, Any] = {}
        self.engine_start_s: float | None = None  # how long the engines took to start (a restart's grace)
        self.engines_up_at: float | None = None  # time.time() then
        self.start_s: dict[str, float] = {}  # start(): seconds each part of the start-up took
        self._sigterm = SigtermAsInterrupt()

    # The actors, read by name (tests, benchmarks and tools look at them).
    engines = property(lambda self: self.actors.engines)
    rollouts = property(lambda self: self.actors.rollouts)
    replay = property(lambda self: self.actors.replay)
    learner = property(lambda self: self.actors.learner)
    teachers = property(lambda self: self.actors.teachers)
    watchdog = property(lambda self: self.actors.watchdog)

    def use_actors(self, actors: RunActors) -> None:
        """Run with ``actors`` (start() builds them; a test may bring its own stand-ins): their
        supervisor and the weights service are built over them."""
        cfg = self.cfg
        self.actors = actors
        transport = resolve_transport(cfg.refit.transport, engine_on_gpu=cfg.engine.num_gpus > 0,
                                      same_gpu=cfg.colocate.enabled and cfg.engine.num_gpus > 0)
        self.supervisor = Supervisor(cfg, actors, make_rollout=self._make_rollout, ckpt_dir=self.ckpt_dir,
                                     overlap=self.overlap_steps(), engine_start_s=self.engine_start_s)
        self.weights = WeightService(cfg, learner=actors.learner, engines=actors.engines, replay=actors.replay,
                                     store=actors.weight_store, transport=transport, waits=self.supervisor)
        self.supervisor.weights = self.weights  # its catch-ups of restarted engines, and their versions

    # -- actors -----------------------------------------------------------------------------------
    def start(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from agentrl.actors.engine import EngineActor
        from agentrl.actors.learner import LearnerGroup
        from agentrl.actors.replay import ReplayActor
        from agentrl.actors.weights import WeightStoreActor

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
        self._sigterm.take()
        took("ray")
        a = self.actors = RunActors()
        # The replay queue and the staged weights live on the driver's node: they hold the run's
        # in-flight state, and a node that holds an engine may go away (tests/test_cluster.py).
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        a.replay = ReplayActor.options(num_cpus=0, scheduling_strategy=here).remote(
            cfg.replay.capacity, cfg.replay.max_staleness, cfg.replay.groups_per_step,
            wait_for_stragglers=cfg.replay.wait_for_stragglers, task_order=cfg.train.deterministic,
            dynamic_sampling=cfg.replay.dynamic_sampling,
            dynamic_sampling_max_dropped=cfg.replay.dynamic_sampling_max_dropped,
            lag=cfg.replay.lag, seed_offset=cfg.rollout.seed_offset,
        )
        store_name = f"agentrl-weights-{uuid.uuid4().hex[:12]}"  # engines find it by name (actors/engine.py)
        a.weight_store = WeightStoreActor.options(num_cpus=0, scheduling_strategy=here, name=store_name).remote()
        co = cfg.colocate
        sleeping = sleeping_engines(cfg)
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
        a.engines = [
            EngineActor.options(**engine_opts[i], max_restarts=-1, max_task_retries=0).remote(self.model_path, cfg.engine, dtype=cfg.model.dtype, seed=cfg.seed + i, weight_source=store_name,
                     enable_sleep_mode=sleeping, lora=cfg.learner.lora if cfg.learner.lora.serves_adapter else None,
                     compile_cache_dir=self.compile_cache_dir,
                     vocab_limit=tokenizer_vocab_limit(self.model_path, cfg.model.tokenizer_vocab_only))
            for i in range(cfg.engine.num_engines)
        ]
        # Rollout actors need no GPU and nothing the engines or learner make: their start (a process,
        # tokenizer, tool parser, env check: 18 s at 384k) overlaps the engines'. Distillation: later.
        a.rollout_generation = [0] * cfg.rollout.num_actors
        a.rollouts = [] if cfg.distill.enabled else [self._make_rollout(i) for i in range(cfg.rollout.num_actors)]
        took("replay_and_placement")
        if co.enabled:
            # vLLM sizes its KV cache from the memory it sees at start: engines first, then the
            # learner (while sleeping engines hold only their CUDA context), then the engines wake.
            t_engines = time.perf_counter()
            ray.get([e.start.remote() for e in a.engines])
            # a restart's grace (else watchdog.first_s); when they were up
            self.engine_start_s, self.engines_up_at = time.perf_counter() - t_engines, time.time()
            took("engines")
            if sleeping:
                ray.get([e.sleep.remote(1) for e in a.engines])
                took("engines_sleep")
            a.learner = LearnerGroup(cfg, self.model_path, placement=(self.placement, self.placement_group))
            self.gpu_memory["learner_built"] = ray.get(a.learner.free_memory.remote())
            took("learner")
            if sleeping:
                ray.get([e.wake_up.remote() for e in a.engines])
                took("engines_wake")
        else:
            a.learner = LearnerGroup(cfg, self.model_path)
            t_engines = time.perf_counter()
            self._start_engines()
            self.engine_start_s, self.engines_up_at = time.perf_counter() - t_engines, time.time()
            took("engines")  # the learner builds meanwhile, in its own processes
        if cfg.distill.enabled:
            a.teachers = self._start_teachers(EngineActor)
            took("teachers")
        self.use_actors(a)
        if self.weights.transport == "nccl":
            self.weights.init_group()
            took("weight_group")
        if self.resume:
            self._restore()
            took("restore")
        elif cfg.learner.lora.serves_adapter:
            # Every request runs on the policy's adapter from the start (a fresh one equals the base):
            # an in-flight request never switches from the base to an adapter at a later refit.
            # (Served merged, the engines start on the base, which a fresh adapter merges to.)
            self.weights.refit(self.version)
            took("refit")
        a.rollouts = a.rollouts or [self._make_rollout(i) for i in range(cfg.rollout.num_actors)]  # teachers'
        ray.get([r.node_id.remote() for r in a.rollouts])  # constructed (tokenizer, env checked)
        took("rollouts")  # what is left of their start once the engines and the learner are up
        self.actors_started = True
        from agentrl.actors.watchdog import Watchdog

        a.watchdog = Watchdog(cfg.watchdog, a.named, self.run_dir / "watchdog")
        a.watchdog.learn_pids()  # a frozen actor's stacks are read by pid

    def _start_engines(self) -> None:
        """Start every engine; one that dies while it starts (Ray restarts it) is asked again."""
        engines = self.actors.engines
        refs = [e.start.remote() for e in engines]
        for i, ref in enumerate(refs):
            for attempt in range(3):
                try:
                    ray.get(ref)
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                    if attempt == 2:
                        raise
                    time.sleep(1.0)
                    ref = engines[i].start.remote()

    def _make_rollout(self, i: int) -> Any:
        from agentrl.actors.rollout import RolloutActor

        a = self.actors
        gen = a.rollout_generation[i]
        # A replacement starts its task seeds far past its predecessor's: no task is generated twice.
        return RolloutActor.options(num_cpus=0, resources=self.cfg.rollout.resources).remote(
            self.cfg, a.engines, a.replay, i, self.model_path, a.teachers,
            owner=f"rollout{i}.{gen}", first_task=gen * 1_000_000)

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
        ev, sup = self.cfg.eval, self.supervisor
        metrics = sup.get("eval", self.actors.rollouts[0].evaluate.remote(ev.num_episodes, ev.seed_offset, ev.temperature),
                          f"the {label} evaluation ({ev.num_episodes} episodes)", focus=self.actors.engine_names(),
                          progress=sup.sampling_progress)  # a slow machine's long evaluation is not a stall
        return {k.replace("eval/", f"eval_{label}/"): v for k, v in metrics.items()}

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        self.weights.wait()  # the replay's weights version is saved: engines serve it by then
        sup, a = self.supervisor, self.actors
        path = self.ckpt_dir / f"step_{self.step:06d}"
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        sup.get("checkpoint", a.learner.save.remote(str(tmp / "learner")), f"the learner's save of step {self.step}",
                recover=False, focus=a.learner_names())
        with open(tmp / "replay.pkl", "wb") as f:
            pickle.dump(sup.get("checkpoint", a.replay.state_dict.remote(), "the replay queue's state",
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
        ray.get(self.actors.learner.load.remote(str(path / "learner")))
        with open(path / "replay.pkl", "rb") as f:
            ray.get(self.actors.replay.load_state_dict.remote(pickle.load(f)))
        self.weights.refit(self.version)

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
            self.actors.runs = [r.run.remote() for r in self.actors.rollouts]
            try:
                summary.update(self._loop(logger))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                # the learner or the replay queue (state that cannot be rebuilt) died outside a step
                text = str(exc)
                who = ("the learner" if "LearnerActor" in text else "the replay queue" if "ReplayActor" in text
                       else "an actor the run cannot replace")
                raise RunStopped(f"{who} died after step {self.step} ({type(exc).__name__}: {text[:500]})\n"
                                 + self.supervisor.resume_hint(self.step)) from exc
            for r in self.actors.rollouts:
                r.stop.remote()
            if cfg.eval.num_episodes:
                after = self.evaluate("after")
                logger.log(self.step, after)
                summary.update(after)
            self.actors.runs = []
            logger.summary(summary)
        finally:
            logger.close()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def overlap_steps(self) -> bool:
        """Whether the loop queues step N+1 on the learner before step N ends (train.overlap_steps)."""
        return overlap_steps(self.cfg)

    def _loop(self, logger: Any) -> dict[str, Any]:
        """The steps of the run, in the mode its config asks for (agentrl.driver.loop); the actors
        are up (start(), or use_actors())."""
        if self.cfg.replay.lag is not None:
            return fixed_lag_loop(self, logger)
        return run_loop(self, logger, mode_for(self))

    def shutdown(self) -> None:
        if self.weights is not None:
            with contextlib.suppress(Exception):  # shutting down anyway; the loop raised what mattered
                self.weights.wait()
            self.weights.shutdown()
        a = self.actors
        if self.actors_started:
            learners = a.learner.actors if a.learner is not None else []
            for actor in [*a.rollouts, *a.engines, *a.teachers, *learners, a.replay, a.weight_store]:
                if actor is None:
                    continue
                try:
                    ray.kill(actor)
                except Exception:
                    pass
            self.actors_started = False
            from agentrl.engine.vllm_engine import sweep_dead_engine_files

            engine_pids = [pid for name, pid in (a.watchdog.pids if a.watchdog else {}).items()
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
        self._sigterm.give_back()
