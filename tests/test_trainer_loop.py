"""The driver loop with the real replay actor and stand-in engine, learner and rollout actors (no
vLLM, no model: seconds): the refit runs beside the learner's next step without loosening the
staleness bound. On-policy (max_staleness 0), no step may start before the engines serve the
weights of the step before; with max_staleness > 0, steps do overlap the engines' weight load.
With train.overlap_steps the next step is queued on the learner before the current one ends: the
same bounds hold, and the learner no longer waits for the driver between steps."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
import ray

from agentrl.config import load_config
from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

REFIT_S = 0.3  # how long a stand-in engine takes to load weights
STEP_S = 0.1  # how long a stand-in learner step takes


@ray.remote
class _Engine:
    def __init__(self) -> None:
        self.version = 0
        self.loads: list[tuple[int, float, float]] = []  # (version, start, end)

    async def update_weights(self, weights: dict, version: int, mode: str) -> float:
        assert weights["version"] == version, "the snapshot is not the one taken after that step"
        t0 = time.time()
        await asyncio.sleep(REFIT_S)
        self.version = version
        self.loads.append((version, t0, time.time()))
        return REFIT_S

    def get_version(self) -> int:
        return self.version

    def ping(self) -> dict:  # what the driver asks an engine while it waits more than 2 s for a batch
        return {"pid": os.getpid(), "started": True, "version": self.version}

    def get_loads(self) -> list:
        return self.loads


@ray.remote
class _Learner:
    def __init__(self) -> None:
        self.version = 0
        self.steps: list[tuple[int, float]] = []  # (version after the step, start)
        self.gaps: list[float] = []  # idle time before each step since the learner's last call ended
        self.last_end: float | None = None

    def train_step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        assert isinstance(groups, list) and all(isinstance(g, TrajectoryGroup) for g in groups)
        start = time.time()
        if self.last_end is not None:
            self.gaps.append(start - self.last_end)
        self.steps.append((self.version + 1, start))
        time.sleep(STEP_S)
        self.version += 1
        self.last_end = time.time()
        return {"train/loss": 0.0, "train/num_sequences_trained": 0.0}

    def export_for_refit(self, transport: str) -> dict:
        assert transport == "object_store"  # CPU engines
        self.last_end = time.time()
        return {"version": self.version}

    def get_gaps(self) -> list:
        return self.gaps

    def save(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "version.json").write_text(json.dumps(self.version))  # what the learner held

    def get_steps(self) -> list:
        return self.steps


class _Group:
    """What the trainer expects of a LearnerGroup: calls go to the one actor; ``actors`` lists it."""

    def __init__(self, actor) -> None:
        self.actors = [actor]
        self._actor = actor

    def __getattr__(self, name: str):
        return getattr(self._actor, name)


@ray.remote
class _Rollout:
    """Admits a group, samples it at the version its engine serves, puts it."""

    def __init__(self, replay, engine) -> None:
        self.replay, self.engine, self.stop_ = replay, engine, False

    async def _worker(self) -> None:
        while not self.stop_:
            ticket = await self.replay.admit.remote()
            version = await self.engine.get_version.remote()
            await asyncio.sleep(0.02)
            traj = Trajectory(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], behavior_logprobs=[0.0, -1.0, -1.0],
                              policy_versions=[-1, version, version], turn_spans=[(1, 3)], turn_rewards=[1.0])
            await self.replay.put.remote(TrajectoryGroup(task_id="t", trajectories=[traj]), ticket)

    async def run(self) -> None:
        await asyncio.gather(*[self._worker() for _ in range(4)])

    def stop(self) -> None:
        self.stop_ = True


def _run(tmp_path: Path, max_staleness: int, steps: int = 6, overlap: bool = False,
         driver_delay_s: float = 0.0, checkpoint_interval: int = 0,
         lag: int | None = None) -> tuple[list, list, list[dict], list[float]]:
    from agentrl.actors.replay import ReplayActor
    from agentrl.actors.weights import WeightStoreActor
    from agentrl.driver.state import RunActors
    from agentrl.driver.trainer import Trainer

    cfg = load_config(None, [
        f"run_dir={tmp_path / f'run{max_staleness}-{overlap}'}", f"replay.max_staleness={max_staleness}",
        "replay.groups_per_step=2", "replay.capacity=16", f"train.num_steps={steps}",
        f"train.checkpoint_interval={checkpoint_interval}", "eval.num_episodes=0",
        f"train.overlap_steps={str(overlap).lower()}", *([f"replay.lag={lag}"] if lag is not None else []),
    ])
    trainer = Trainer(cfg, model_path="unused", progress=False)
    replay = ReplayActor.remote(cfg.replay.capacity, max_staleness, cfg.replay.groups_per_step, lag=lag)
    engine, store = _Engine.remote(), WeightStoreActor.remote()
    ray.get(store.node_id.remote())  # up before the first refit, as a run's is (its engines read it as they start)
    trainer.use_actors(RunActors(replay=replay, learner=_Group(_Learner.remote()), engines=[engine],
                                 rollouts=[_Rollout.remote(replay, engine)], weight_store=store))
    trainer.actors_started = True
    assert trainer.overlap_steps() is overlap
    if driver_delay_s:  # a slow driver (logging, metrics): the learner should not wait for it
        import agentrl.driver.loop as loop_module  # the per-step metrics are the loop's

        summarize = loop_module.summarize

        def slow_summarize(trajs):
            time.sleep(driver_delay_s)
            return summarize(trajs)

        loop_module.summarize = slow_summarize
    try:
        trainer.run()
        loads, learner_steps = ray.get(engine.get_loads.remote()), ray.get(trainer.learner.get_steps.remote())
        gaps = ray.get(trainer.learner.get_gaps.remote())
    finally:
        if driver_delay_s:
            loop_module.summarize = summarize
        trainer.shutdown()
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    return loads, learner_steps, [r for r in rows if "train/loss" in r], gaps


@pytest.mark.parametrize("overlap", [False, True])
def test_on_policy_steps_wait_for_the_refit(tmp_path, ray_local_2cpu, overlap):
    loads, steps, rows, _ = _run(tmp_path, max_staleness=0, overlap=overlap)
    assert [v for v, _, _ in loads] == [1, 2, 3, 4, 5, 6]  # every version, in order, the last one too
    assert [v for v, _ in steps] == [1, 2, 3, 4, 5, 6]  # no step beyond train.num_steps
    done = {v: end for v, _, end in loads}
    for version, start in steps[1:]:
        assert start >= done[version - 1], f"step to version {version} started before the engines served {version - 1}"
    for r in rows:
        assert r["replay/staleness_max"] == 0 and r["replay/token_version_min"] == r["step"] - 1
    # admission opened only once the engines served the new version: nothing was made stale
    assert rows[-1]["replay/dropped_stale"] == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_off_policy_steps_overlap_the_refit_within_the_bound(tmp_path, ray_local_2cpu, overlap):
    loads, steps, rows, _ = _run(tmp_path, max_staleness=2, steps=8, overlap=overlap)
    assert [v for v, _, _ in loads] == list(range(1, 9))
    load_of = {v: (start, end) for v, start, end in loads}
    # the step after version v starts before the engines have loaded v (queued ahead, it may even
    # start before the load does)
    overlapped = [v for v, start in steps[1:] if start < load_of[v - 1][1]]
    assert len(overlapped) >= len(steps) // 2, f"steps did not overlap the refit: {steps} {loads}"
    assert all(r["replay/staleness_max"] <= 2 for r in rows) and rows[-1]["replay/dropped_stale"] == 0
    assert max(r["timing/refit_wait"] for r in rows) < 2 * REFIT_S


@pytest.mark.parametrize("overlap", [False, True])
def test_overlapped_steps_do_not_wait_for_a_slow_driver(tmp_path, ray_local_2cpu, overlap):
    """The driver spends 0.3 s per step after each one (a stand-in for logging and metrics). Queued
    ahead, the learner's next step starts as soon as its batch is there; otherwise it waits for
    the driver every step (the control)."""
    delay = 0.3
    _, steps, rows, gaps = _run(tmp_path, max_staleness=2, steps=8, overlap=overlap, driver_delay_s=delay)
    assert [v for v, _ in steps] == list(range(1, 9))
    assert all(r["replay/staleness_max"] <= 2 for r in rows)
    waited = sorted(gaps)[len(gaps) // 2]  # median idle time of the learner between steps
    if overlap:
        assert waited < delay / 2, f"the learner waited for the driver between steps: {gaps}"
    else:
        assert waited >= delay * 0.9, f"control: the sequential loop should wait for the driver: {gaps}"


@pytest.mark.parametrize("overlap", [False, True])
def test_checkpoints_see_the_learner_right_after_their_step(tmp_path, ray_local_2cpu, overlap):
    """Every step runs with checkpoints on, and none is queued past a checkpoint: the learner holds
    exactly the checkpoint's version when it saves."""
    _, steps, rows, _ = _run(tmp_path, max_staleness=2, steps=6, overlap=overlap, checkpoint_interval=2)
    assert [v for v, _ in steps] == list(range(1, 7)) and [r["step"] for r in rows] == list(range(1, 7))
    ckpts = tmp_path / f"run2-{overlap}" / "checkpoints"
    saved = sorted(p.name for p in ckpts.iterdir() if p.is_dir())
    assert saved == ["step_000002", "step_000004", "step_000006"]
    for name in saved:
        meta = json.loads((ckpts / name / "trainer.json").read_text())
        assert meta["version"] == meta["step"] == int(name[-6:])
        assert json.loads((ckpts / name / "learner" / "version.json").read_text()) == meta["version"]


def test_fixed_lag_steps_train_on_exactly_the_lagged_version(tmp_path, ray_local_2cpu):
    """replay.lag=1 through the real replay actor and refits: step s (counted from 1) trains on
    tokens of version s - 2 only (the first two steps on the initial weights); each version is
    loaded into the engines while the learner takes the next step."""
    loads, steps, rows, _ = _run(tmp_path, max_staleness=1, steps=6, lag=1)
    assert [v for v, _ in steps] == list(range(1, 7)) and [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:
        assert r["replay/token_version_min"] == r["replay/token_version_max"] == max(r["step"] - 2, 0), r
        assert r["replay/version_mismatch"] == 0
    assert [v for v, _, _ in loads] == list(range(1, 7))  # every version in order; the last for the final eval
    step_start = dict(steps)
    overlapped = [v for v, start, _ in loads[:-1] if start < step_start[v + 1] + STEP_S]
    assert len(overlapped) >= 3, f"the refits did not overlap the learner's steps: {steps} {loads}"


def test_a_colocated_engine_that_cannot_wake_gets_a_diagnosis() -> None:
    """vLLM's raw 'CUDA Error: out of memory' on wake becomes a message that names the engine's share,
    what the learner holds, and the settings that make room; any other failure passes through."""
    from agentrl.driver.loop import wake_failure

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/gpu_1x.yaml", ["engine.gpu_memory_utilization=0.5"])
    oom = Exception("Call to wake_up method failed: CUDA Error: out of memory at cumem_allocator.cpp:163")
    err = wake_failure(cfg, oom, {"reserved_gib": 31.5})
    assert isinstance(err, RuntimeError)
    assert "engine.gpu_memory_utilization=0.5" in str(err) and "31.5 GiB" in str(err)
    assert "activation_checkpointing" in str(err)
    other = ValueError("engine died")
    assert wake_failure(cfg, other, {}) is other
    # an engine Ray restarted while the learner holds the GPU fails vLLM's start-up check instead
    start = ValueError("Free memory on device cuda:0 (20.1/79.2 GiB) on startup is less than desired GPU memory "
                       "utilization (0.5, 39.6 GiB). Decrease GPU memory utilization or reduce GPU memory used by "
                       "other processes.")
    err = wake_failure(cfg, start, {"reserved_gib": 31.5})
    assert isinstance(err, RuntimeError) and "a restarted engine could not start" in str(err) and "31.5 GiB" in str(err)
    # the watchdog's stop keeps its report and its exit status (3), whatever stacks it quotes
    from agentrl.driver.watchdog import RunStalled

    stalled = RunStalled("waiting for engine0.wake_up ... stacks: _alloc (torch out of memory handler)")
    assert wake_failure(cfg, stalled, {"reserved_gib": 31.5}) is stalled
