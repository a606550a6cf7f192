"""replay.lag: what a fixed-lag run trains on is a function of its seed alone.

The driver's fixed-lag loop (agentrl.driver.fixed_lag.fixed_lag_loop) runs here against threads that
stand in for the actors (no Ray, no vLLM): a replay "actor" around the real FixedLagQueue, an
engine whose sampling is a deterministic function of (weights, request seed), a learner whose
weights are a hash chain of the batches it trained on, and rollout workers that admit, sample
turn by turn and put. Random delays (a slow engine, a slow learner, a slow env, slow refits) must
change nothing: the batches consumed (token ids and versions) and the weights after N steps are
bit-identical across delay schedules and numbers of rollout workers, and every token a step
consumes was made by version step - lag (the initial weights for the first lag steps)."""

from __future__ import annotations

import hashlib
import random
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.config import load_config
from agentrl.driver.fixed_lag import fixed_lag_loop
from agentrl.replay.fixed_lag import FixedLagQueue, Slot, batch_digest
from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

TIMEOUT_S = 20.0


class _Delays:
    """Sleeps of random length (seconds), up to each part's maximum; none with ``seed=None``."""

    def __init__(self, seed: int | None, engine: float = 0.0, learner: float = 0.0, env: float = 0.0,
                 refit: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.on = seed is not None
        self.max = {"engine": engine, "learner": learner, "env": env, "refit": refit}

    def __call__(self, part: str) -> None:
        if self.on and self.max[part]:
            with self.lock:
                s = self.rng.uniform(0.0, self.max[part])
            time.sleep(s)


class _Replay:
    """The replay actor's waiting (actors/replay.py) around the real queue, with threads."""

    def __init__(self, queue: FixedLagQueue) -> None:
        self.queue, self.cond, self.stopped = queue, threading.Condition(), False
        self.pool = ThreadPoolExecutor(max_workers=2)

    def admit(self) -> Slot | None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.stopped or self.queue.can_admit(), timeout=TIMEOUT_S):
                raise TimeoutError("admission stayed closed")
            return None if self.stopped else self.queue.admit()

    def put(self, group: TrajectoryGroup, slot: Slot) -> bool:
        with self.cond:
            ok = self.queue.put(group, slot)
            self.cond.notify_all()
            return ok

    def _take(self, n: int, version: int) -> list[TrajectoryGroup]:
        batch = None

        def ready() -> bool:
            nonlocal batch
            batch = self.queue.take(n, version)
            return batch is not None

        with self.cond:
            if not self.cond.wait_for(ready, timeout=TIMEOUT_S):
                raise TimeoutError(f"no batch for step {version}")
            self.cond.notify_all()
            return batch

    def set_weights_version(self, version: int) -> None:
        with self.cond:
            self.queue.set_weights_version(version)
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    class _Remote:
        def __init__(self, fn) -> None:
            self.remote = fn

    @property
    def take(self):
        return self._Remote(lambda n, v: self.pool.submit(self._take, n, v))

    @property
    def metrics(self):
        return self._Remote(lambda: self.pool.submit(self.queue.metrics))


def _sample(weights: bytes, seed: int, turn: int, n: int) -> list[int]:
    """The engine's tokens: a deterministic function of the weights and the request's seed."""
    digest = hashlib.sha256(weights + f":{seed}:{turn}".encode()).digest()
    return [b % 50 + 10 for b in digest[:n]]


class _Engine:
    def __init__(self, delays: _Delays) -> None:
        self.delays, self.lock = delays, threading.Lock()
        self.weights, self.version = b"init", 0

    def load(self, weights: bytes, version: int) -> None:
        self.delays("refit")
        with self.lock:
            self.weights, self.version = weights, version

    def generate(self, seed: int, turn: int, n: int) -> tuple[list[int], int]:
        with self.lock:
            weights, version = self.weights, self.version
        self.delays("engine")
        return _sample(weights, seed, turn, n), version


class _Learner:
    """Calls run in order on one thread (as an actor's do); the weights hash the batches trained."""

    def __init__(self, delays: _Delays) -> None:
        self.delays, self.weights = delays, b"init"
        self.pool = ThreadPoolExecutor(max_workers=1)

    def _step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        self.delays("learner")
        self.weights = hashlib.sha256(self.weights + batch_digest(groups).encode()).digest()
        return {"train/loss": 0.0}

    class _Remote:
        def __init__(self, fn) -> None:
            self.remote = fn

    @property
    def train_step(self):
        return self._Remote(lambda groups: self.pool.submit(self._step, groups))

    @property
    def export_for_refit(self):
        return self._Remote(lambda transport: self.pool.submit(lambda: self.weights))


def _rollout_worker(replay: _Replay, engine: _Engine, delays: _Delays) -> None:
    """Admit a slot, run its episodes turn by turn (turn count from the seed), put the group."""
    while True:
        slot = replay.admit()
        if slot is None:
            return
        trajs = []
        for e in range(2):
            ids, mask, versions = [1, 2], [0, 0], [-1, -1]
            for turn in range(1 + (slot.seed + e) % 3):
                toks, version = engine.generate(slot.seed * 10 + e, turn, 3)
                ids += toks
                mask += [1] * len(toks)
                versions += [version] * len(toks)
                delays("env")
                ids.append(5)
                mask.append(0)
                versions.append(-1)
            reward = float(ids[3] % 2)
            trajs.append(Trajectory(ids, mask, [0.0] * len(ids), versions, turn_rewards=[reward]))
        replay.put(TrajectoryGroup(task_id=f"t#{slot.seed}", trajectories=trajs, group_id=slot.seed), slot)


class _Logger:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, Any]]] = []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.rows.append((step, metrics))


class _Weights:
    """What fixed_lag_loop asks of the weights service (agentrl.weights.sync.WeightService)."""

    def __init__(self, replay: _Replay, engine: _Engine, learner: _Learner) -> None:
        self.replay, self.engine, self.learner = replay, engine, learner
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._future: Future | None = None
        self.last_refit_s, self.engines_unavailable, self.engines_version = 0.0, 0, 0

    def export(self) -> Future:
        return self.learner.export_for_refit.remote("object_store")

    def refit_engines(self, payload: Future, version: int) -> float:
        self.engine.load(payload.result(timeout=TIMEOUT_S), version)
        self.replay.set_weights_version(version)
        self.engines_version = version
        return 0.0

    def submit(self, payload: Future, version: int) -> None:
        self._future = self._pool.submit(self.refit_engines, payload, version)

    def wait(self) -> float:
        future, self._future = self._future, None
        if future is not None:
            self.last_refit_s = future.result(timeout=TIMEOUT_S)
        return 0.0

    def refit(self, version: int) -> float:
        self.wait()
        self.refit_engines(self.export(), version)
        return 0.0


class _Supervisor:
    """What fixed_lag_loop asks of the supervisor (agentrl.driver.supervision.Supervisor)."""

    def __init__(self) -> None:
        self.consumed: list[list[TrajectoryGroup]] = []

    def take(self, ref: Future, **kw) -> list[TrajectoryGroup]:
        batch = ref.result(timeout=TIMEOUT_S)
        self.consumed.append(batch)
        return batch

    def learner_step(self, ref: Future, groups, **kw) -> dict[str, float]:
        return ref.result(timeout=TIMEOUT_S)

    def get(self, kind: str, ref: Future, what: str, **kw) -> Any:
        return ref.result(timeout=TIMEOUT_S)

    def check_rollouts(self) -> None:
        pass

    def fault_metrics(self) -> dict[str, float]:
        return {}


class _Driver:
    """What fixed_lag_loop asks of the Trainer, over the stand-ins above."""

    def __init__(self, cfg, delays: _Delays, num_workers: int) -> None:
        self.cfg, self.step, self.version, self.progress = cfg, 0, 0, False
        self.run_dir = Path(tempfile.mkdtemp(prefix="fixed-lag-"))  # the loop's progress.log goes here
        self.queue = FixedLagQueue(cfg.replay.capacity, cfg.replay.lag, cfg.replay.groups_per_step, seed_offset=7)
        self.replay, self.engine, self.learner = _Replay(self.queue), _Engine(delays), _Learner(delays)
        self.actors = SimpleNamespace(replay=self.replay, learner=self.learner, watchdog=None)
        self.weights, self.supervisor = _Weights(self.replay, self.engine, self.learner), _Supervisor()
        self.workers = [threading.Thread(target=_rollout_worker, args=(self.replay, self.engine, delays), daemon=True)
                        for _ in range(num_workers)]

    def save_checkpoint(self) -> None:
        pass

    def run(self) -> tuple[list[list[TrajectoryGroup]], bytes, list]:
        for w in self.workers:
            w.start()
        logger = _Logger()
        try:
            fixed_lag_loop(self, logger)
        finally:
            self.replay.stop()
            for w in self.workers:
                w.join(timeout=TIMEOUT_S)
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return self.supervisor.consumed, self.learner.weights, logger.rows


def _fingerprint(batches: list[list[TrajectoryGroup]]) -> list:
    return [[(g.group_id, [(tuple(t.token_ids), tuple(t.policy_versions)) for t in g.trajectories]) for g in b]
            for b in batches]


def _run(lag: int, groups: int, steps: int, workers: int, delays: _Delays):
    cfg = load_config(None, [f"replay.lag={lag}", f"replay.groups_per_step={groups}", f"replay.capacity={4 * groups}",
                             f"train.num_steps={steps}", "eval.num_episodes=0", "train.checkpoint_interval=0"])
    return _Driver(cfg, delays, workers).run()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lag=st.integers(0, 2), groups=st.integers(1, 3), steps=st.integers(3, 5), workers=st.integers(1, 4),
       delay_seed=st.integers(0, 2**16), slow=st.sampled_from(["engine", "learner", "env", "refit", "all"]))
def test_batches_and_weights_do_not_depend_on_delays(lag, groups, steps, workers, delay_seed, slow):
    quick_batches, quick_weights, _ = _run(lag, groups, steps, 1, _Delays(None))
    parts = ("engine", "learner", "env", "refit") if slow == "all" else (slow,)
    delays = _Delays(delay_seed, **{p: 0.004 if p in ("engine", "env") else 0.02 for p in parts})
    batches, weights, rows = _run(lag, groups, steps, workers, delays)
    assert _fingerprint(batches) == _fingerprint(quick_batches)
    assert weights == quick_weights
    assert len(batches) == steps
    for k, batch in enumerate(batches):
        assert [g.group_id for g in batch] == [7 + k * groups + i for i in range(groups)]  # slot order, not arrival
        versions = {v for g in batch for t in g.trajectories for v in t.policy_versions if v >= 0}
        assert versions == {max(k - lag, 0)}
    assert [r["replay/batch_sha"] for _, r in rows] == [batch_digest(b) for b in quick_batches]


def test_lag_one_generates_the_next_batch_while_the_learner_steps():
    """With lag 1 a slow learner and a slow engine overlap: the run takes about the longer of the
    two per step, not their sum (lag 0)."""
    times = {}
    for lag in (0, 1):
        delays = _Delays(0, learner=0.06, engine=0.0)
        delays.rng = type("Fixed", (), {"uniform": staticmethod(lambda a, b: b)})()  # every sleep its maximum
        delays.max["env"] = 0.02  # three turns at most per episode: ~0.06 s a group, groups in parallel
        t0 = time.perf_counter()
        _run(lag, 2, 8, 2, delays)
        times[lag] = time.perf_counter() - t0
    assert times[1] < 0.8 * times[0], times


def test_the_queue_admits_only_the_steps_of_the_version_the_engines_serve():
    q = FixedLagQueue(capacity=8, lag=1, groups_per_step=2, seed_offset=100)
    slots = [q.admit() for _ in range(4)]  # steps 0 and 1 (both made by the initial weights)
    assert slots == [Slot(0, 0, 100), Slot(0, 1, 101), Slot(1, 0, 102), Slot(1, 1, 103)]
    assert not q.can_admit()  # step 2 needs version 1
    q.set_weights_version(1)
    assert q.admit() == Slot(2, 0, 104)

    def group(slot: Slot, version: int) -> TrajectoryGroup:
        t = Trajectory([1, 2], [0, 1], [0.0, -1.0], [-1, version], turn_rewards=[1.0])
        return TrajectoryGroup(task_id="t", trajectories=[t], group_id=slot.seed)

    assert not q.put(group(slots[1], 1), slots[1])  # step 0 needs version 0: generated again
    assert q.metrics()["replay/version_mismatch"] == 1
    q.release(slots[0])  # a failed group: generated again too
    assert q.take(2, 0) is None
    q2 = FixedLagQueue(capacity=8, lag=1, groups_per_step=2)
    a, b = q2.admit(), q2.admit()
    assert q2.put(group(b, 0), b) and q2.take(2, 0) is None  # a batch is never taken half-made
    assert q2.put(group(a, 0), a)
    assert [g.group_id for g in q2.take(2, 0)] == [0, 1]  # slot order, whatever the order of arrival
    with pytest.raises(RuntimeError, match="step 1 next"):
        q2.take(2, 3)


def test_a_resumed_queue_starts_its_schedule_at_the_checkpoint():
    q = FixedLagQueue(capacity=8, lag=2, groups_per_step=1)
    q.load_state_dict(FixedLagQueue(capacity=8, lag=2, groups_per_step=1).state_dict() | {"next_step": 5})
    q.set_weights_version(5)
    assert [q.admit().step for _ in range(3)] == [5, 6, 7] and not q.can_admit()  # all made by version 5
    assert q.version_for(8) == 6
    with pytest.raises(ValueError, match="without replay.lag"):
        q.load_state_dict({"queue": [], "weights_version": 0, "stats": {}})


def test_lag_config_checks():
    cfg = load_config(None, ["replay.lag=1", "train.deterministic=true", "rollout.num_actors=3", "seed=4"])
    # async and deterministic: the lag stays, several rollout actors, a seed per request
    assert (cfg.replay.max_staleness, cfg.rollout.num_actors, cfg.rollout.sampling_seed) == (1, 3, 4)
    with pytest.raises(ValueError, match=r"replay.lag=1 cannot run with replay.max_staleness=0 .*refit.interval=2"):
        load_config(None, ["replay.lag=1", "replay.max_staleness=0", "refit.interval=2"])
    with pytest.raises(ValueError, match="replay.dynamic_sampling"):
        load_config(None, ["replay.lag=0", "replay.dynamic_sampling=true"])
    with pytest.raises(ValueError, match="train.overlap_steps"):
        load_config(None, ["replay.lag=1", "train.overlap_steps=true"])
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        load_config(None, ["replay.lag=-1"])
    with pytest.raises(ValueError, match="resolves to nccl"):
        load_config(None, ["replay.lag=2", "engine.num_gpus=1", "learner.num_gpus=1"])
    assert load_config(None, ["replay.lag=2", "replay.max_staleness=3"]).replay.max_staleness == 2
