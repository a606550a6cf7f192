"""The agent endpoint in front of the real vLLM engine: the openai SDK and the OpenAI Agents SDK
over real HTTP, exact tokens against what vLLM sampled, engine-vs-learner logprob agreement on
endpoint trajectories, and three learner steps of a real run through the Agents SDK."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentrl.rollout.chat import ChatRenderer
from agentrl.config import load_config
from tests.endpoint_helpers import Sampled, check_exact_tokens, make_endpoint

pytestmark = pytest.mark.slow

REPO = str(Path(__file__).resolve().parents[1])


class RecordingEngine:
    """The real engine, with each call's prompt and sample kept per episode."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: dict[str, list[Sampled]] = {}

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id, stop=None):
        out = await self.engine.generate(list(prompt_ids), max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                         stop=stop)
        self.calls.setdefault(episode_id, []).append(
            Sampled(list(prompt_ids), list(out.token_ids), list(out.logprobs), list(out.versions), out.finish_reason))
        return out

    async def stream(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id, stop=None):
        """The engine's own stream (one item per engine step), recorded whole when it ends."""
        whole = Sampled(list(prompt_ids), [], [], [])
        self.num_stream_items = getattr(self, "num_stream_items", 0)
        async for delta in self.engine.generate_stream(list(prompt_ids), max_tokens=max_tokens,
                                                       temperature=temperature, top_p=top_p, stop=stop):
            whole.token_ids += delta.token_ids
            whole.logprobs += delta.logprobs
            whole.versions += delta.versions
            whole.finish_reason = delta.finish_reason
            self.num_stream_items += 1
            yield delta
        self.calls.setdefault(episode_id, []).append(whole)


@pytest.fixture(scope="module")
def real(tiny_model_dir, tiny_engine):
    from transformers import AutoTokenizer

    engine, server = tiny_engine
    recording = RecordingEngine(engine)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    endpoint = make_endpoint(renderer, recording, ["rollout.max_new_tokens=24", "rollout.max_turns=3",
                                                   "rollout.max_total_tokens=1024", "engine.max_model_len=1024"])
    server.run(endpoint.start())
    yield endpoint, recording, server, tiny_model_dir
    server.run(endpoint.stop())


def _agent(solve):
    from agentrl.rollout.agent.user import load_agent
    from agentrl.config import AgentConfig

    return load_agent(AgentConfig(solve=solve, tasks="examples.calculator_agent:tasks"))


def _group(real, solve, seed, n=4):
    from agentrl.rollout.agent.user import run_agent_group

    endpoint, _, server, _ = real
    rollout = load_config(None, ["rollout.max_turns=3", "rollout.max_new_tokens=24", "rollout.temperature=1.0"]).rollout
    return server.run(run_agent_group(_agent(solve), endpoint, seed=seed, rollout=rollout, group_id=seed,
                                      num_episodes=n), timeout=300)


def _check(real, group):
    _, recording, _, _ = real
    episodes = {t.info["episode"] for t in group.trajectories}
    for ep in episodes:
        check_exact_tokens([t for t in group.trajectories if t.info["episode"] == ep], recording.calls[ep])
    return episodes


def test_openai_sdk_agent_exact_tokens_and_logprob_agreement(real):
    """The plain openai-SDK Calculator agent on the real engine: every sampled token is trained as
    sampled, and the learner's logprobs of the endpoint trajectories equal the engine's."""
    from agentrl.learner.torch_learner import TorchLearner

    group = _group(real, "examples.calculator_agent:solve", seed=101)
    assert len(_check(real, group)) == 4 and all(t.status != "failed" for t in group.trajectories)
    cfg = load_config(None, [f"model.path={real[3]}", "rollout.temperature=1.0"])
    learner_lps = TorchLearner(cfg, model_path=real[3]).logprobs(group.trajectories)
    diffs = [abs(a - b) for traj, lps in zip(group.trajectories, learner_lps)
             for a, b, m in zip(lps, traj.behavior_logprobs, traj.loss_mask) if m]
    mean = sum(diffs) / len(diffs)
    print(f"endpoint trajectories: engine vs learner logprobs, mean |diff| = {mean:.2e} over {len(diffs)} tokens")
    assert diffs and mean < 1e-3


def test_agents_sdk_over_the_endpoint(real):
    """The OpenAI Agents SDK (Chat Completions model), plain and streamed."""
    for seed, solve in ((7, "tests.e2e_agents:solve"), (8, "tests.e2e_agents:solve_streamed")):
        group = _group(real, solve, seed=seed, n=3)
        errors = [t.info.get("error") for t in group.trajectories if t.status == "failed"]
        # The random tiny policy may write a malformed call the SDK gives up on (MaxTurnsExceeded);
        # what reached the engine is still recorded exactly.
        assert all("MaxTurnsExceeded" in e for e in errors), errors
        _check(real, group)


def test_stop_strings_stop_the_engine_and_the_tokens_stay_exact(real):
    """``stop`` goes to vLLM (SamplingParams.stop): sampling ends with the token that completes
    the string, the trajectory holds exactly the tokens vLLM sampled (none dropped, none added),
    and the content is the text before the stop string, which is not included (as OpenAI's API
    documents), streamed or not."""
    import openai

    endpoint, recording, _, _ = real
    renderer = endpoint.renderer
    stops = ["e", "a", "o", " "]  # common enough that a 24-token sample of the random tiny model holds one
    for stream in (False, True):
        for attempt in range(8):
            name = f"stop-{stream}-{attempt}"
            ep = endpoint.open_episode(name, temperature=1.0)
            with openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0) as c:
                out = c.chat.completions.create(model="agentrl-policy", messages=[
                    {"role": "user", "content": "Say something"}], max_tokens=24, stop=stops, stream=stream)
                if stream:
                    chunks = [ch for ch in out if ch.choices]
                    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
                    finish = chunks[-1].choices[0].finish_reason
                else:
                    content, finish = out.choices[0].message.content, out.choices[0].finish_reason
            endpoint.close_episode(ep)
            sampled = recording.calls[name][0].token_ids
            text = renderer.decode(sampled)
            if any(s in text for s in stops):
                break
        else:
            raise AssertionError("no sample held a stop string")
        # vLLM stopped at the token that completes the first stop string: no earlier, no later
        assert not any(s in renderer.decode(sampled[:-1]) for s in stops), "vLLM sampled past the stop string"
        traj = ep.recorder.trajectories(1.0)
        check_exact_tokens(traj, recording.calls[name])
        start, end = traj[0].turn_spans[0]
        assert traj[0].token_ids[start:end] == sampled  # all of them, not a prefix
        first = min(text.find(s) for s in stops if s in text)
        assert finish == "stop" and content == text[:first], (content, text)


def test_streaming_on_the_real_engine_sends_each_step(real):
    """stream=true against vLLM: several content events for one turn (one per engine step), which
    join to the plain response's text for the same greedy request."""
    import openai

    endpoint, recording, _, _ = real
    messages = [{"role": "user", "content": "Tell me a story"}]
    texts = []
    for stream in (False, True):
        ep = endpoint.open_episode(f"story-{stream}", temperature=0.0)
        with openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0) as c:
            out = c.chat.completions.create(model="agentrl-policy", messages=messages, max_tokens=16, stream=stream)
            if stream:
                before = getattr(recording, "num_stream_items", 0)
                pieces = [ch.choices[0].delta.content for ch in out if ch.choices and ch.choices[0].delta.content]
                texts.append("".join(pieces))
                assert recording.num_stream_items - before >= 8 and len(pieces) >= 2, pieces
            else:
                texts.append(out.choices[0].message.content)
        endpoint.close_episode(ep)
        check_exact_tokens(ep.recorder.trajectories(1.0), recording.calls[f"story-{stream}"])
    assert texts[0] == texts[1]


def test_rewritten_history_starts_segments_on_the_real_engine(real):
    """A summarizing agent: its second request replaces the history, its third continues it."""
    group = _group(real, "tests.test_endpoint_e2e:summarizing_agent", seed=3, n=2)
    _check(real, group)
    for ep in {t.info["episode"] for t in group.trajectories}:
        segs = [t for t in group.trajectories if t.info["episode"] == ep]
        assert [t.num_turns for t in segs] == [1, 2] and all(t.info["num_segments"] == 2 for t in segs)


async def summarizing_agent(client, task):
    messages = [{"role": "user", "content": task["question"]}]
    first = await client.chat.completions.create(model="agentrl-policy", messages=messages)
    summary = [{"role": "user", "content": f"So far you said {len(first.choices[0].message.content or '')} chars."}]
    second = await client.chat.completions.create(model="agentrl-policy", messages=summary)
    summary += [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    await client.chat.completions.create(model="agentrl-policy", messages=summary)
    return 1.0


# workers=2: the agent worker processes are tested against an endpoint in test_agent_pool
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.full)])
def test_train_three_steps_through_the_agents_sdk(tiny_model_dir, tmp_path, workers):
    """`Trainer` with agent.solve: rollout actors serve the endpoint, the Agents SDK agent makes
    the requests (streamed on some tasks: the engine actor's streaming generator through Ray),
    three learner steps with refits consume the recorded trajectories. With agent.workers=2 the
    agents run in worker processes of the rollout actors, and none is left after shutdown."""
    import time

    import psutil
    import ray

    from agentrl.driver.trainer import Trainer
    from tests.test_pipeline_e2e import e2e_overrides, read_rows

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": REPO}})
    run_dir = tmp_path / "run"
    cfg = load_config(None, e2e_overrides(tiny_model_dir, run_dir, "agent.solve=tests.e2e_agents:solve_mixed",
                                          "agent.tasks=tests.e2e_agents:tasks", "rollout.max_turns=3",
                                          "agent.timeout_s=60", f"agent.workers={workers}"))
    trainer = Trainer(cfg, progress=False)
    t0 = time.time()

    def agent_workers() -> list[psutil.Process]:  # this run's, children of its rollout actors
        return [p for p in psutil.process_iter(["cmdline", "create_time"]) if p.info["create_time"] >= t0 - 1
                and "agentrl.rollout.agent.worker" in (p.info["cmdline"] or [])]

    try:
        trainer.run()
        stats = ray.get(trainer.rollouts[0].stats.remote())
        running = agent_workers()
        parents = {p.ppid() for p in running}
    finally:
        trainer.shutdown()
        if started:  # the next test module starts a Ray of its own
            ray.shutdown()
    if workers:
        assert stats["rollout/agent_worker_starts"] >= 1 and stats["rollout/agent_worker_deaths"] == 0, stats
        assert running and os.getpid() not in parents  # in the rollout actors, not here
        _, alive = psutil.wait_procs(running, timeout=15)
        assert not alive, f"agent workers left after shutdown: {alive}"
    else:
        assert "rollout/agent_worker_starts" not in stats and not running
    steps = [r for r in read_rows(run_dir) if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["rollout/failed_frac"] < 1.0 and r["rollout/segments"] >= 1.0 for r in steps)
    assert steps[-1]["replay/token_version_max"] >= 1, "no token was sampled with refit weights"
    assert stats["rollout/endpoint_refused"] == 0.0
    assert stats["rollout/endpoint_streamed"] > 0 and stats["rollout/endpoint_requests"] > stats[
        "rollout/endpoint_streamed"], stats
    assert json.loads((run_dir / "config.json").read_text())["agent"]["solve"] == "tests.e2e_agents:solve_mixed"
