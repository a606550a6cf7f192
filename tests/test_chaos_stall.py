"""Chaos: a frozen process under an actor that still answers, judged from outside the run.

`agentrl train configs/quickstart.yaml` (SFT off, a few steps, a small batch, --no-progress) in a
subprocess. Its vLLM engine core (``VLLM::EngineCore``, the child process of the engine actor that
samples) is frozen with SIGSTOP, as a hung kernel or a stuck collective would leave it: the engine
actor keeps answering its ping, and only its sampled tokens tell that nothing moves. The run must
find the stall, name the core process and its state, restart the engine, finish all its steps
with exit 0, leave no engine core behind and account for every group. A second run has its
learner's process frozen: the learner's state cannot be rebuilt elsewhere, so the run stops with
a diagnosis naming it (exit 3) and says how ``--resume`` continues.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.test_pipeline_e2e import REPO, _agentrl, read_rows

pytestmark = pytest.mark.slow

QUICKSTART = str(Path(REPO) / "configs" / "quickstart.yaml")


def _overrides(model_dir, run_dir, steps: int, *extra: str) -> list[str]:
    return [f"model.path={model_dir}", "model.bootstrap_tiny=false", "sft.enabled=false", f"run_dir={run_dir}",
            f"train.num_steps={steps}", "train.checkpoint_interval=0", "replay.groups_per_step=2",
            "rollout.group_size=4", "eval.num_episodes=0", *extra, "--no-progress"]


def _steps(run_dir) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    return max((r.get("step", 0) for r in read_rows(run_dir) if "train/loss" in r), default=0)


def _descendants(pid: int, match) -> list[psutil.Process]:
    out = []
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            if match(" ".join(p.cmdline()) or p.name()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _is_core(cmd: str) -> bool:
    return "EngineCore" in cmd


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for(cond, timeout: float, what: str, proc, log) -> float:
    t0 = time.perf_counter()
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        if time.perf_counter() - t0 > timeout:
            raise AssertionError(f"{what} did not happen within {timeout:.0f}s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    return time.perf_counter() - t0


def test_a_frozen_engine_core_is_found_by_its_progress_and_restarted(tiny_model_dir, tmp_path):
    run_dir, log, steps = tmp_path / "run", tmp_path / "train.log", 12
    proc = _agentrl("train", QUICKSTART, *_overrides(tiny_model_dir, run_dir, steps), log=log)
    cores: set[int] = set()  # every engine core the run had: none may be left running
    try:
        # past the warm-up and three timed batches: the deadlines come from the run's timings
        _wait_for(lambda: _steps(run_dir) >= 5, 900, "step 5", proc, log)
        [core] = _descendants(proc.pid, _is_core)
        cores.add(core.pid)
        core.send_signal(signal.SIGSTOP)
        t_stop, at = time.perf_counter(), _steps(run_dir)
        detect_s = _wait_for(lambda: "stalled" in log.read_text() and f"pid {core.pid}" in log.read_text(),
                             600, "the stall's diagnosis", proc, log)
        for _ in range(3000):  # the restarted engine's core, while the run goes on
            cores.update(p.pid for p in _descendants(proc.pid, _is_core))
            if _steps(run_dir) > at or proc.poll() is not None:
                break
            time.sleep(0.2)
        recover_s = time.perf_counter() - t_stop
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    threshold = re.search(r"no token for (\d+)s is stalled", text)
    print(f"\nstall found {detect_s:.1f}s after the SIGSTOP, a step {recover_s:.1f}s after; stall threshold "
          f"{threshold.group(1) if threshold else '?'}s")
    assert rc == 0, text[-4000:]
    rows = [r for r in read_rows(run_dir) if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # the log names the stall: the engine, its core process, its pid and its state from /proc
    assert re.search(rf"engine0 +stalled .*VLLM::EngineCore pid {core.pid} state T \(stopped\)", text), text[-4000:]
    assert f"process {core.pid} VLLM::EngineCore: state T (stopped)" in text
    assert "agentrl: engine0 stalled" in text and "none left" in text
    assert threshold and int(threshold.group(1)) < 300  # from the run's own batch timings, not the old 300 s floor
    assert detect_s < 180  # the threshold (30 s floor on this quick workload) + a ping, on a loaded machine
    assert rows[-1]["faults/engine_restarts"] >= 1
    assert len(cores) >= 2, "no restarted engine core was seen"
    assert all(_gone(pid) for pid in cores), [pid for pid in cores if not _gone(pid)]
    last = rows[-1]
    assert last["replay/admitted"] == (last["replay/consumed"] + last["replay/dropped_stale"] + last["replay/released"]
                                       + last["replay/size"] + last["replay/in_flight"])
    assert last["replay/consumed"] == steps * 2


@pytest.mark.full  # a learner that stops the run: test_chaos's learner death (full too); resume: test_pipeline_e2e
def test_a_frozen_learner_stops_the_run_with_its_diagnosis(tiny_model_dir, tmp_path):
    """The learner's state (weights, optimizer) lives in its process only: a frozen learner is
    diagnosed (unresponsive, its process stopped) and the run stops (exit 3), saying what
    ``--resume`` continues from; nothing of the run is left running."""
    run_dir, log, steps = tmp_path / "run", tmp_path / "train.log", 40
    proc = _agentrl("train", QUICKSTART, *_overrides(tiny_model_dir, run_dir, steps, "train.checkpoint_interval=2"),
                    log=log)
    try:
        _wait_for(lambda: _steps(run_dir) >= 5, 900, "step 5", proc, log)
        [learner] = _descendants(proc.pid, lambda cmd: "LearnerActor" in cmd)
        learner.send_signal(signal.SIGSTOP)
        t_stop = time.perf_counter()
        rc = proc.wait(timeout=900)
        stop_s = time.perf_counter() - t_stop
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    print(f"\nthe run stopped {stop_s:.1f}s after the learner's SIGSTOP")
    assert rc == 3, text[-4000:]
    assert re.search(rf"learner0 +unresponsive +pid={learner.pid} .*process {learner.pid} is stopped", text), text[-4000:]
    assert "--resume" in text
    assert stop_s < 240  # a CPU learner's deadline floor is 30 s (its CPU time is its progress)
    assert _gone(learner.pid), "the frozen learner was left behind"
    assert _steps(run_dir) < steps
