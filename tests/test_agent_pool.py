"""Agents in worker processes (``agent.workers`` > 0): real processes, real HTTP, the real openai
client. The agent runs in another process than the endpoint's, its requests are recorded exactly,
failures and timeouts behave as in-process, a worker that dies fails its episodes and is replaced,
and no worker outlives its pool or its parent."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from agentrl.config import AgentConfig, ConfigError, load_config
from tests.endpoint_helpers import calculate_loop, check_exact_tokens, serving

MODEL = "agentrl-policy"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with serving(tiny_model_dir) as started:
        yield started


# Agents, as a user writes them (a worker imports them by module:function).
async def pid_agent(client, task):
    """A tool loop that returns the pid it ran in as its reward."""
    await calculate_loop(client, task["question"], model=MODEL)
    print("a print from the agent: it must not reach the protocol")  # noqa: T201
    return float(os.getpid())


def sync_pid_agent(client, task):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": task["question"]}])
    return {"pid": os.getpid(), "content": out.choices[0].message.content}


def pid_score(task, result):
    assert isinstance(result["content"], str)
    return float(result["pid"])


async def raising_agent(client, task):
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    raise RuntimeError("the agent's own bug")


async def wordy_agent(client, task):
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    return "a lot"


async def idle_agent(client, task):
    return 1.0


def _write_marker(path: str, text: str) -> None:
    # whole or absent: the test polls for the file and reads it at once (a plain write_text was
    # once seen empty there, the suite's JSONDecodeError of 2026-11-28)
    tmp = f"{path}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


async def hanging_agent(client, task):
    """One request, then waits forever; writes its pid and key to task["marker"] when cancelled."""
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        _write_marker(task["marker"], json.dumps({"pid": os.getpid(), "key": client.api_key}))
        raise


async def crashing_agent(client, task):
    """One request, then by the task: ``exit`` -> os._exit(3), ``kill`` -> SIGKILL itself, else
    returns its pid."""
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    if task["crash"]:
        await asyncio.sleep(0.5)  # the group's other episode is in flight in this process too
        if task["crash"] == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    return float(os.getpid())


def sync_hang(client, task):
    _write_marker(task["marker"], str(os.getpid()))
    time.sleep(3600)


async def blocking_async_agent(client, task):
    """Blocks its worker's event loop (a user's bug): only the parent-death signal can stop it."""
    _write_marker(task["marker"], str(os.getpid()))
    time.sleep(3600)


def tasks(seed):
    return {"question": f"what is {seed} + 1?", "answer": seed % 2,
            "marker": f"{tempfile.gettempdir()}/agentrl-test-pool-{os.getpid()}-{seed}",
            "crash": {1: "exit", 2: "kill"}.get(seed % 10)}


def agent_of(overrides):
    from agentrl.rollout.agent.user import load_agent

    return load_agent(AgentConfig(**{"tasks": "tests.test_agent_pool:tasks", "workers": 2, **overrides}))


def run_group(served, agent, seed=3, n=4, rollout=None):
    from agentrl.rollout.agent.user import run_agent_group

    endpoint, _, server = served
    rollout = rollout or load_config(None, ["rollout.max_turns=8"]).rollout
    return server.run(run_agent_group(agent, endpoint, seed=seed, rollout=rollout, group_id=seed, num_episodes=n))


def close(served, agent):
    served[2].run(agent.close())


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_agents_run_in_worker_processes_and_are_recorded_exactly(served):
    _, sampler, _ = served
    agent = agent_of({"solve": "tests.test_agent_pool:pid_agent"})
    try:
        group = run_group(served, agent, seed=7)
        pids = set(agent.pool.pids())
        assert len(pids) == 2 and os.getpid() not in pids
        assert all(psutil.Process(pid).ppid() == os.getpid() for pid in pids)
        assert all(t.status == "ok" for t in group.trajectories), [t.info for t in group.trajectories]
        # the reward is the pid the agent ran in: a worker's, both workers used (least-loaded)
        assert {int(t.reward) for t in group.trajectories} == pids
        episodes = {t.info["episode"] for t in group.trajectories}
        assert len(episodes) == 4
        for ep in episodes:
            check_exact_tokens([t for t in group.trajectories if t.info["episode"] == ep], sampler.calls[ep])
        assert any(t.num_turns > 1 for t in group.trajectories), "no episode called the tool and went on"
        # the same processes serve the next group; nothing died
        group = run_group(served, agent, seed=8)
        assert {int(t.reward) for t in group.trajectories} == pids
        assert agent.stats() == {"rollout/agent_worker_starts": 2.0, "rollout/agent_worker_deaths": 0.0}
    finally:
        close(served, agent)


def test_sync_agent_and_scorer_run_in_a_worker(served):
    agent = agent_of({"solve": "tests.test_agent_pool:sync_pid_agent", "score": "tests.test_agent_pool:pid_score",
                      "workers": 1})
    try:
        group = run_group(served, agent, seed=11)
        assert [t.status for t in group.trajectories] == ["ok"] * 4, [t.info for t in group.trajectories]
        (pid,) = agent.pool.pids()
        assert pid != os.getpid() and {t.reward for t in group.trajectories} == {float(pid)}
    finally:
        close(served, agent)


@pytest.mark.parametrize("solve, error", [
    ("raising_agent", "the agent raised RuntimeError: the agent's own bug"),
    ("wordy_agent", "the agent raised TypeError: the reward must be a finite number, got 'a lot'"),
    ("idle_agent", "no completion request"),
])
def test_failing_agents_in_workers_are_counted_and_never_trained_on(served, solve, error):
    from agentrl.rollout.episode import summarize

    agent = agent_of({"solve": f"tests.test_agent_pool:{solve}"})
    try:
        group = run_group(served, agent, n=2)
        assert agent.pool.num_started >= 1  # it ran in a worker
        assert [t.status for t in group.trajectories] == ["failed"] * 2
        assert all(error in t.info["error"] for t in group.trajectories), [t.info for t in group.trajectories]
        assert not group.trainable()
        assert summarize(group.trajectories)["rollout/failed_frac"] == 1.0
        assert agent.pool.num_died == 0
    finally:
        close(served, agent)


def test_a_hanging_agent_times_out_and_its_worker_cancels_it(served):
    endpoint, sampler, _ = served
    for seed, overrides, status in ((5, {"timeout_s": 1.0}, "failed"), (15, {"timeout_s": 60.0}, "truncated")):
        marker = Path(tasks(seed)["marker"])
        marker.unlink(missing_ok=True)
        agent = agent_of({"solve": "tests.test_agent_pool:hanging_agent", "workers": 1, **overrides})
        rollout = load_config(None, ["rollout.max_turns=8", "rollout.max_episode_s=1"]).rollout if seed == 15 else None
        try:
            # the worker started and this module imported (seconds under load) before the 1-s clock runs
            assert served[2].run(agent.worker_pool().run("tests.test_agent_pool:idle_agent", None, {},
                                                         base_url=endpoint.base_url, api_key="k",
                                                         request_timeout_s=1)) == 1.0
            t0 = time.perf_counter()
            group = run_group(served, agent, n=1, seed=seed, rollout=rollout)
            assert time.perf_counter() - t0 < 10
            (traj,) = group.trajectories
            assert traj.status == status
            if status == "failed":
                assert "did not return within 1 s" in traj.info["error"]
            else:  # rollout.max_episode_s: keeps what it recorded
                assert traj.info["truncated_by"] == "wall_time" and traj.num_turns == 1
            # the worker was told: the agent saw its cancellation, in the worker's process
            for _ in range(100):
                if marker.exists():
                    break
                time.sleep(0.1)
            seen = json.loads(marker.read_text())
            assert seen["pid"] in agent.pool.pids() and seen["pid"] != os.getpid()
            r = httpx.post(endpoint.base_url + "/chat/completions", headers={"Authorization": f"Bearer {seen['key']}"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "late"}]})
            assert r.status_code == 401
            assert len(sampler.calls[f"g{seed}-e0"]) == 1
            assert agent.pool.num_died == 0
        finally:
            close(served, agent)
            marker.unlink(missing_ok=True)


@pytest.mark.parametrize("seed, how", [(1, "exited with status 3"), (2, "was killed by signal 9 (SIGKILL)")])
def test_a_worker_that_dies_fails_its_episodes_and_is_replaced(served, seed, how):
    agent = agent_of({"solve": "tests.test_agent_pool:crashing_agent", "workers": 1})
    try:
        (first,) = {t.reward for t in run_group(served, agent, seed=10, n=2).trajectories}  # crash None: ok
        assert agent.pool.pids() == [int(first)]
        group = run_group(served, agent, seed=seed, n=2)  # both episodes in the one worker
        assert [t.status for t in group.trajectories] == ["failed"] * 2
        for t in group.trajectories:
            assert f"(pid {int(first)}, agent.workers slot 0) {how}" in t.info["error"], t.info["error"]
        assert not group.trainable()
        assert gone(int(first))
        assert agent.stats()["rollout/agent_worker_deaths"] == 1.0
        group = run_group(served, agent, seed=20, n=2)  # a new worker
        assert [t.status for t in group.trajectories] == ["ok"] * 2
        (second,) = {t.reward for t in group.trajectories}
        assert int(second) != int(first) and agent.pool.pids() == [int(second)]
        assert agent.stats() == {"rollout/agent_worker_starts": 2.0, "rollout/agent_worker_deaths": 1.0}
    finally:
        close(served, agent)


def test_close_leaves_no_worker_process(served):
    """Even one whose agent is stuck in a thread: its stdin closes, it exits (or is killed)."""
    endpoint, _, server = served
    agent = agent_of({"solve": "tests.test_agent_pool:pid_agent"})
    group = run_group(served, agent, seed=30)
    pids = agent.pool.pids()
    assert len(pids) == 2 and all(not gone(p) for p in pids)
    assert {int(t.reward) for t in group.trajectories} == set(pids)
    pool = agent.pool
    task = tasks(31)
    Path(task["marker"]).unlink(missing_ok=True)
    stuck = asyncio.run_coroutine_threadsafe(pool.run("tests.test_agent_pool:sync_hang", None, task,
                                                      base_url=endpoint.base_url, api_key="k", request_timeout_s=5),
                                             server.loop)
    for _ in range(100):
        if Path(task["marker"]).exists():
            break
        time.sleep(0.1)
    assert int(Path(task["marker"]).read_text()) in pids
    t0 = time.perf_counter()
    close(served, agent)
    assert time.perf_counter() - t0 < 5  # the stuck thread did not hold its worker up
    assert all(gone(p) for p in pids) and pool.pids() == []
    assert [c for c in psutil.Process().children(recursive=True) if c.pid in pids] == []
    from agentrl.rollout.agent.pool import AgentWorkerDied

    with pytest.raises(AgentWorkerDied):
        stuck.result(10)
    assert pool.num_died == 0  # closed, not died
    close(served, agent)  # twice is fine
    Path(task["marker"]).unlink(missing_ok=True)


SCRIPT = """
import asyncio, json, sys
sys.path.insert(0, {repo!r})
from agentrl.rollout.agent.pool import AgentWorkerPool
from pathlib import Path

async def main():
    pool = AgentWorkerPool(2)
    markers = {markers!r}
    jobs = [asyncio.ensure_future(pool.run("tests.test_agent_pool:" + fn, None, {{"marker": m}},
                                           base_url="http://127.0.0.1:9/v1", api_key="k", request_timeout_s=1))
            for fn, m in zip(("sync_hang", "blocking_async_agent"), markers)]
    while not all(Path(m).exists() for m in markers):
        await asyncio.sleep(0.05)
    print(json.dumps(pool.pids()), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_workers_exit_when_their_parent_is_killed(tmp_path):
    """A rollout actor killed by Ray (SIGKILL) leaves no agent worker behind: one stuck in a sync
    agent's thread exits at its stdin's EOF, one whose event loop is blocked by the parent-death
    signal."""
    markers = [str(tmp_path / "sync"), str(tmp_path / "blocked")]
    parent = subprocess.Popen([sys.executable, "-c", SCRIPT.format(repo=str(REPO), markers=markers)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 2 and {int(Path(m).read_text()) for m in markers} == set(pids)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(gone(p) for p in pids):
            time.sleep(0.1)
        assert all(gone(p) for p in pids), [psutil.Process(p).cmdline() for p in pids if not gone(p)]
    finally:
        parent.kill()
        for p in pids:
            if not gone(p):
                os.kill(p, signal.SIGKILL)


def test_worker_imports_what_the_parent_can(served, tmp_path):
    """A module found only through a sys.path entry of the parent (a Ray runtime_env's directory,
    here one added at run time) imports in the worker too."""
    (tmp_path / "agent_pool_user_mod.py").write_text(
        "import os\n\nasync def solve(client, task):\n"
        "    await client.chat.completions.create(model='agentrl-policy', messages=[{'role': 'user', 'content': 'q'}])\n"
        "    return float(os.getpid())\n")
    sys.path.insert(0, str(tmp_path))
    try:
        agent = agent_of({"solve": "agent_pool_user_mod:solve", "workers": 1})
        try:
            group = run_group(served, agent, seed=40, n=2)
            assert [t.status for t in group.trajectories] == ["ok"] * 2, [t.info for t in group.trajectories]
            assert {t.reward for t in group.trajectories} == {float(agent.pool.pids()[0])}
        finally:
            close(served, agent)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("agent_pool_user_mod", None)


def test_workers_config_is_checked():
    assert load_config(None, []).agent.workers == 0
    assert load_config(None, ["agent.workers=4"]).agent.workers == 4
    with pytest.raises(ConfigError, match="agent.workers"):
        load_config(None, ["agent.workers=-1"])
    from agentrl.rollout.agent.pool import AgentWorkerPool

    with pytest.raises(ValueError, match="at least 1 worker"):
        AgentWorkerPool(0)


def test_a_task_that_does_not_pickle_fails_its_episode_with_a_clear_error(served):
    from agentrl.rollout.agent.user import run_agent_episode

    endpoint, _, server = served
    agent = agent_of({"solve": "tests.test_agent_pool:idle_agent", "workers": 1})
    try:
        trajs = server.run(run_agent_episode(agent, endpoint, {"f": lambda: 1}, episode_id="pickle-0", seed=0,
                                             rollout=load_config(None, []).rollout, temperature=1.0))
        assert trajs[0].status == "failed" and "cannot be sent to an agent worker process" in trajs[0].info["error"]
    finally:
        close(served, agent)
