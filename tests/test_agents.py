"""The user's side of the agent endpoint: agents as functions (async, sync in a thread, with a
scorer), task sources, and agents that fail: counted, never trained on, their keys dead."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from agentrl.rollout.chat import ChatRenderer
from agentrl.config import AgentConfig, ConfigError, load_config
from tests.endpoint_helpers import calculate_loop, check_exact_tokens, serving

MODEL = "agentrl-policy"


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with serving(tiny_model_dir) as started:
        yield started


# Agents, as a user writes them (looked up by module:function from this test module).
async def loop_agent(client, task):
    return float(task["answer"]) if await calculate_loop(client, task["question"], model=MODEL) else 0.5


def sync_agent(client, task):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": task["question"]}])
    return out.choices[0].message.content


def length_score(task, result):
    return float(len(result) > 0)


async def raising_agent(client, task):
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    raise RuntimeError("the agent's own bug")


LEAKED = {}


async def hanging_agent(client, task):
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    LEAKED["key"] = client.api_key
    await asyncio.sleep(3600)


async def wordy_agent(client, task):
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    return "a lot"


async def idle_agent(client, task):
    return 1.0


def tasks(seed):
    return {"question": f"what is {seed} + 1?", "answer": seed % 2}


def agent_of(overrides):
    from agentrl.rollout.agent.user import load_agent

    return load_agent(AgentConfig(**{"tasks": "tests.test_agents:tasks", **overrides}))


def run_group(served, agent, seed=3, n=4, rollout=None):
    from agentrl.rollout.agent.user import run_agent_group

    endpoint, _, server = served
    rollout = rollout or load_config(None, ["rollout.max_turns=8"]).rollout
    return server.run(run_agent_group(agent, endpoint, seed=seed, rollout=rollout, group_id=seed, num_episodes=n))


def test_async_agent_group_records_every_episode_exactly(served):
    _, sampler, _ = served
    group = run_group(served, agent_of({"solve": "tests.test_agents:loop_agent"}), seed=7)
    episodes = {t.info["episode"] for t in group.trajectories}
    assert len(episodes) == 4 and all(t.status == "ok" for t in group.trajectories)
    for ep in episodes:
        check_exact_tokens([t for t in group.trajectories if t.info["episode"] == ep], sampler.calls[ep])
    assert {t.reward for t in group.trajectories} <= {1.0, 0.5}


def test_episodes_share_one_http_client_and_its_connections(served):
    """Each episode gets its own openai client (its own key and base URL), all on one HTTP client
    per event loop: building a client with a pool of its own costs ~36 ms of CPU per episode,
    and the shared pool keeps connections alive from one episode to the next."""
    endpoint, _, server = served

    async def peers() -> set:
        return {c.transport.get_extra_info("peername") for c in endpoint._server.server_state.connections}

    before = server.run(peers())
    agent = agent_of({"solve": "tests.test_agents:loop_agent"})
    for seed in (21, 22):
        assert all(t.status == "ok" for t in run_group(served, agent, seed=seed).trajectories)
    assert len(agent.http_clients) == 1
    assert not next(iter(agent.http_clients.values())).is_closed
    # 8 episodes of 4 at a time, a dozen requests: at most one new connection per concurrent episode
    assert len(server.run(peers()) - before) <= 4


def test_sync_agent_runs_in_a_thread_with_a_scorer(served):
    group = run_group(served, agent_of({"solve": "tests.test_agents:sync_agent",
                                        "score": "tests.test_agents:length_score"}), seed=11)
    assert [t.status for t in group.trajectories] == ["ok"] * 4
    assert all(t.reward == 1.0 and t.num_turns == 1 for t in group.trajectories)


@pytest.mark.parametrize("solve, error", [
    ("raising_agent", "RuntimeError: the agent's own bug"),
    ("wordy_agent", "reward must be a finite number"),
    ("idle_agent", "no completion request"),
])
def test_failing_agents_are_counted_and_never_trained_on(served, solve, error):
    from agentrl.rollout.episode import summarize

    group = run_group(served, agent_of({"solve": f"tests.test_agents:{solve}"}), n=2)
    assert [t.status for t in group.trajectories] == ["failed"] * 2
    assert all(error in t.info["error"] for t in group.trajectories)
    assert not group.trainable()
    assert summarize(group.trajectories)["rollout/failed_frac"] == 1.0


def test_an_agent_that_never_returns_times_out_and_its_key_dies(served):
    endpoint, sampler, _ = served
    t0 = time.perf_counter()
    group = run_group(served, agent_of({"solve": "tests.test_agents:hanging_agent", "timeout_s": 1.0}), n=1, seed=5)
    assert time.perf_counter() - t0 < 10
    (traj,) = group.trajectories
    assert traj.status == "failed" and "did not return within 1 s" in traj.info["error"]
    r = httpx.post(endpoint.base_url + "/chat/completions", headers={"Authorization": f"Bearer {LEAKED['key']}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "late"}]})
    assert r.status_code == 401
    assert len(sampler.calls["g5-e0"]) == 1  # the late request reached no engine and no trajectory


def test_overlong_episode_is_truncated_as_rollout_overlong_says(served):
    from agentrl.rollout.agent.user import run_agent_group

    endpoint, _, server = served

    for overlong, reward, excluded in (("zero_reward", 0.0, False), ("mask", 1.0, True)):
        rollout = load_config(None, ["rollout.max_total_tokens=64", f"rollout.overlong={overlong}"]).rollout
        ep_limit = endpoint.limit
        endpoint.limit = 64
        try:
            group = server.run(run_agent_group(agent_of({"solve": "tests.test_agents:overlong_agent"}), endpoint,
                                               seed=1, rollout=rollout, num_episodes=1))
        finally:
            endpoint.limit = ep_limit
        (traj,) = group.trajectories
        assert traj.status == "truncated" and traj.info["truncated_by"] == "tokens"
        assert traj.reward == reward and traj.info.get("loss_excluded", False) == excluded


async def overlong_agent(client, task):
    import openai

    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    try:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 200}])
    except openai.BadRequestError as exc:
        assert exc.code == "context_length_exceeded"
    return 1.0


def test_tasks_from_jsonl_and_functions(tmp_path):
    from agentrl.rollout.agent.user import TaskSource

    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps({"q": i}) for i in range(3)) + "\n")
    src = TaskSource(str(path))
    assert [src.get(k)["q"] for k in range(5)] == [0, 1, 2, 0, 1]
    assert TaskSource("tests.test_agents:tasks").get(4) == tasks(4)
    path.write_text('{"q": 1}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        TaskSource(str(path))
    with pytest.raises(ConfigError, match="no such file"):
        TaskSource(str(tmp_path / "missing.jsonl"))


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="agent.solve"):
        load_config(None, ["agent.solve=not a function"])
    with pytest.raises(ConfigError, match="agent.tasks"):
        load_config(None, ["agent.solve=m:f"])
    with pytest.raises(ConfigError, match="Did you mean 'loop_agent'"):
        agent_of({"solve": "tests.test_agents:loop_agnet"})
    with pytest.raises(ConfigError, match="agent.solve: module 'no_such_module_x'"):
        agent_of({"solve": "no_such_module_x:solve"})


def test_segments_of_one_episode_count_once_in_the_baseline():
    from agentrl.learner.advantages import trajectory_token_advantages
    from agentrl.config import AdvantageConfig
    from agentrl.rollout.episode import summarize
    from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

    def seg(episode, k, n, reward):
        return Trajectory([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, 0, 0], turn_spans=[(1, 3)],
                          turn_rewards=[reward], info={"episode": episode, "segment": k, "num_segments": n})

    group = TrajectoryGroup("t", [seg("a", 0, 2, 1.0), seg("a", 1, 2, 1.0), seg("b", 0, 1, 0.0)])
    adv = trajectory_token_advantages(group, AdvantageConfig(eps=1e-12))
    # episode returns [1, 0]: mean 0.5, std 0.5 -> +1 for both segments of a, -1 for b
    assert [a[1] for a in adv] == pytest.approx([1.0, 1.0, -1.0])
    metrics = summarize(group.trajectories)
    assert metrics["rollout/trajectories"] == 2.0 and metrics["rollout/segments"] == 1.5
    assert metrics["rollout/reward"] == 0.5


def test_agent_modules_are_shipped_to_cluster_nodes_like_env_modules(tmp_path):
    from agentrl.actors.runtime_env import build_runtime_env
    from agentrl.rollout.agent.user import load_agent

    cfg = load_config(None, ["agent.solve=examples.calculator_agent:solve", "agent.tasks=tests.test_agents:tasks"])
    load_agent(cfg.agent)
    shipped = build_runtime_env(cfg)["py_modules"]
    assert any(p.endswith("/examples") for p in shipped) and any(p.endswith("/tests") for p in shipped), shipped
    (tmp_path / "t.jsonl").write_text('{"q": 1}\n')
    cfg = load_config(None, ["agent.solve=examples.calculator_agent:solve", f"agent.tasks={tmp_path / 't.jsonl'}"])
    assert not any("t.jsonl" in p for p in build_runtime_env(cfg)["py_modules"])  # a file path is no module


def test_calculator_agent_requests_render_to_the_env_paths_tokens(tiny_model_dir):
    """examples/calculator_agent.py's requests give the engine the same token ids as the
    Calculator env's episodes: the prompt, and the delta after a tool call (so the two paths
    train the same policy on the same problems)."""
    from transformers import AutoTokenizer

    from agentrl.envs.calculator import CalculatorEnv
    from agentrl.rollout.agent.recorder import EpisodeRecorder
    from examples.calculator_agent import SYSTEM, TOOLS, run_tool
    from examples.calculator_agent import tasks as agent_tasks

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 + 30"}}\n</tool_call>'
    for seed in range(8):
        env = CalculatorEnv()
        obs, info = env.reset(seed=seed)
        env_ids = renderer.prompt_ids(obs, info["tools"])
        task = agent_tasks(seed)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
        rec = EpisodeRecorder(renderer)
        prep = rec.prepare(messages, TOOLS)
        assert prep.prompt_ids == env_ids
        sampled = renderer.encode(call) + [renderer.end_of_turn_id]
        response = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "12 + 30"}'}}]}
        rec.record(prep, sampled, [0.0] * len(sampled), [0] * len(sampled), response, closed=True)
        obs2, *_ = env.step(call)
        tool_msg = {"role": "tool", "tool_call_id": "call_1", "content": run_tool("calculate", '{"expression": "12 + 30"}')}
        nxt = rec.prepare([*messages, response, tool_msg], TOOLS)
        assert not nxt.new_segment
        assert nxt.prompt_ids == env_ids + sampled + renderer.observation_delta_ids(obs2)


def test_a_langgraph_agent_continues_its_segments_exactly(served):
    """LangGraph (a model node and its ToolNode, ChatOpenAI from langchain-openai) through real HTTP:
    every request is recorded exactly, and its re-sent history (LangChain re-serializes the
    assistant's tool calls) continues the episode's segment rather than starting a new one."""
    _, sampler, _ = served
    group = run_group(served, agent_of({"solve": "tests.langgraph_agents:solve"}), seed=31, n=4,
                      rollout=load_config(None, ["rollout.max_turns=12"]).rollout)
    ok = [t for t in group.trajectories if t.status == "ok"]
    assert ok, [t.info.get("error") for t in group.trajectories]
    for ep in {t.info["episode"] for t in group.trajectories}:
        check_exact_tokens([t for t in group.trajectories if t.info["episode"] == ep], sampler.calls[ep])
    assert all(t.info["num_segments"] == 1 for t in ok)
    assert any(t.num_turns > 1 for t in ok), "no episode called the tool and went on"
