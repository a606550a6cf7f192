"""The agent endpoint through real HTTP and the real ``openai`` SDK: exact tokens for any
interleaving of requests (a hypothesis property), segments, streaming, and bad input at the door.

The engine here is a recording sampler (thousands of requests per property run); the tests in
tests/test_endpoint_e2e.py do the same against the real vLLM engine."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.rollout.chat import ChatRenderer
from agentrl.rollout.trajectory import TrajectoryGroup
from tests.endpoint_helpers import RecordingSampler, ServerThread, check_exact_tokens, make_endpoint, tool_results

MODEL = "agentrl-policy"
TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
SYSTEM = {"role": "system", "content": "Solve the problem."}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from transformers import AutoTokenizer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    sampler = RecordingSampler(renderer)
    server = ServerThread()
    endpoint = make_endpoint(renderer, sampler, ["rollout.max_turns=40", "rollout.max_new_tokens=64"])
    server.run(endpoint.start())
    yield endpoint, sampler, server
    server.run(endpoint.stop())
    server.close()


def client(ep, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, **kwargs)


ACTIONS = st.sampled_from(["continue", "continue", "continue", "user", "edit", "trim", "summarize", "retry",
                           "new_tools"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), steps=st.lists(st.tuples(st.integers(0, 2), ACTIONS), min_size=1, max_size=16))
def test_trained_tokens_equal_sampled_tokens_for_any_interleaving(served, seed, steps):
    """Three episodes, their requests interleaved at random; each request continues its episode
    (tool results, a user turn) or rewrites its history (edits the last response, trims or
    summarizes the context, retries, changes the tools). Then: every engine call is one sampled
    turn of one segment, token for token, with the prompt the engine saw equal to the segment's
    tokens before it; continuations never start a segment, rewrites always do; and the learner's
    samples (build_samples) are those tokens with the prompt and observations masked."""
    from agentrl.config import AdvantageConfig
    from agentrl.learner.common import build_samples

    endpoint, sampler, _ = served
    sampler.rng.seed(seed)
    episodes = [endpoint.open_episode(f"prop-{seed}-{i}-{len(sampler.calls)}", temperature=1.0) for i in range(3)]
    clients = [client(ep) for ep in episodes]
    state = [{"messages": [SYSTEM, {"role": "user", "content": f"Task {i}: what is 12 + 30?"}], "last": None,
              "tools": TOOLS, "segments": 0} for i in range(3)]
    for i, action in steps:
        s, ep = state[i], episodes[i]
        last = s["last"]
        rewrite = last is None or action in ("edit", "trim", "summarize", "retry", "new_tools")
        if last is not None:
            if action in ("continue", "user"):
                results = tool_results(last) if action == "continue" else []
                s["messages"] += [last, *(results or [{"role": "user", "content": "go on"}])]
            elif action == "edit":  # a framework that drops reasoning / rewrites the answer
                edited = {**last, "content": (last.get("content") or "") + " (edited)"}
                s["messages"] += [edited, {"role": "user", "content": "and then?"}]
            elif action == "trim":
                s["messages"] = [*s["messages"][1:], last, {"role": "user", "content": "next"}]  # system dropped
            elif action == "summarize":
                s["messages"] = [SYSTEM, {"role": "user", "content": f"Summary so far: {len(s['messages'])} turns."}]
            elif action == "new_tools":
                s["tools"] = [] if s["tools"] else TOOLS
                s["messages"] += [last, {"role": "user", "content": "tools changed"}]
        out = clients[i].chat.completions.create(model=MODEL, messages=s["messages"], tools=s["tools"] or None)
        s["last"] = out.choices[0].message.model_dump(exclude_none=True)
        s["segments"] += rewrite
        assert len(ep.recorder.segments) == s["segments"], f"action {action!r}"
    for c in clients:
        c.close()
    groups_trajs = []
    for i, ep in enumerate(episodes):
        endpoint.close_episode(ep)
        trajs = ep.recorder.trajectories(float(i), episode=ep.episode_id)
        check_exact_tokens(trajs, sampler.calls[ep.episode_id])
        groups_trajs += trajs
    samples = build_samples([TrajectoryGroup("prop", groups_trajs)], AdvantageConfig())
    trained = [t for t in groups_trajs if t.num_sampled_tokens]
    assert len(samples) == len(trained)
    for sample, traj in zip(samples, trained):
        assert (sample.token_ids, sample.loss_mask, sample.behavior_logprobs, sample.policy_versions) == (
            traj.token_ids, traj.loss_mask, traj.behavior_logprobs, traj.policy_versions)
        assert all(a == 0.0 for a, m in zip(sample.advantages, sample.loss_mask) if not m)


def test_response_shape_tool_calls_usage_and_models(served):
    endpoint, sampler, _ = served
    ep = endpoint.open_episode("shape", temperature=1.0)
    sampler.kinds = ("call",)
    try:
        with client(ep) as c:
            assert [m.id for m in c.models.list().data] == [MODEL]
            out = c.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "hi"}],
                                            tools=TOOLS, max_completion_tokens=200)
            msg, choice = out.choices[0].message, out.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert msg.tool_calls[0].function.name == "calculate"
            assert json.loads(msg.tool_calls[0].function.arguments) == {"expression": "12 + 30"}
            assert out.usage.prompt_tokens == len(sampler.calls["shape"][0].prompt_ids)
            assert out.usage.completion_tokens == len(sampler.calls["shape"][0].token_ids)
            # tool_choice none: the same text comes back as content, no calls
            none = c.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "hi"}],
                                             tools=TOOLS, tool_choice="none")
            assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content
    finally:
        sampler.kinds = ("call", "text", "cut")
        endpoint.close_episode(ep)


def test_streaming_matches_the_plain_response(served):
    endpoint, sampler, _ = served
    ep = endpoint.open_episode("stream", temperature=1.0)
    sampler.kinds = ("call",)
    try:
        with client(ep) as c:
            stream = c.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "hi"}],
                                               tools=TOOLS, stream=True, stream_options={"include_usage": True})
            chunks = list(stream)
        calls: dict[int, dict] = {}
        finish = usage = None
        for ch in chunks:
            usage = ch.usage or usage
            for choice in ch.choices:
                finish = choice.finish_reason or finish
                for tc in choice.delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
        assert finish == "tool_calls" and calls[0]["name"] == "calculate"
        assert json.loads(calls[0]["arguments"]) == {"expression": "12 + 30"}
        assert usage.completion_tokens == len(sampler.calls["stream"][0].token_ids)
    finally:
        sampler.kinds = ("call", "text", "cut")
        endpoint.close_episode(ep)


def test_stop_strings_cut_the_response_and_keep_the_tokens_up_to_it(served):
    endpoint, sampler, _ = served
    ep = endpoint.open_episode("stop", temperature=1.0)
    sampler.kinds = ("call",)
    try:
        with client(ep) as c:
            out = c.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "hi"}],
                                            tools=TOOLS, stop=["calculate"])
        assert out.choices[0].finish_reason == "stop"
        assert out.choices[0].message.content == '<tool_call>\n{"name": "'
        check_exact_tokens(ep.recorder.trajectories(1.0), sampler.calls["stop"])
        kept = ep.recorder.segments[0].turn_spans[0]
        assert 0 < kept[1] - kept[0] < len(sampler.calls["stop"][0].token_ids)
    finally:
        sampler.kinds = ("call", "text", "cut")
        endpoint.close_episode(ep)


def _raw(endpoint, key, body, method="POST", path="/chat/completions"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    return httpx.request(method, endpoint.base_url + path, content=body, headers={
        **headers, "Content-Type": "application/json"}, timeout=30)


GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body, status, needle", [
    ("{not json", 400, "not valid JSON"),
    ("[1, 2]", 400, "must be a JSON object"),
    ({**GOOD, "model": "gpt-4o"}, 404, "'gpt-4o' does not exist"),
    ({**GOOD, "n": 2}, 400, "n=2"),
    ({**GOOD, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ({**GOOD, "top_p": 0.5}, 400, "top_p"),
    ({**GOOD, "frobnicate": 1}, 400, "unsupported parameter: 'frobnicate'"),
    ({**GOOD, "tool_choice": "required"}, 400, "tool_choice"),
    ({**GOOD, "temperature": "hot"}, 400, "temperature"),
    ({**GOOD, "messages": []}, 400, "non-empty list"),
    ({**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, 400, "unsupported role"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "text parts"),
    ({**GOOD, "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400, "not valid JSON"),
    ({**GOOD, "tools": [{"type": "retrieval"}]}, 400, "tools[0]"),
    ({**GOOD, "max_tokens": 0}, 400, "max_tokens"),
])
def test_bad_requests_get_openai_errors_and_write_nothing(served, body, status, needle):
    endpoint, sampler, _ = served
    ep = endpoint.open_episode(f"bad-{uuid.uuid4().hex}", temperature=1.0)
    try:
        r = _raw(endpoint, ep.api_key, body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert needle in err["message"] and err["type"]
        assert not ep.recorder.segments and not sampler.calls[ep.episode_id]
        # and the episode goes on: a good request after it works
        assert _raw(endpoint, ep.api_key, GOOD).status_code == 200
    finally:
        endpoint.close_episode(ep)


def test_sdk_raises_typed_errors(served):
    endpoint, _, _ = served
    ep = endpoint.open_episode("sdk-errors", temperature=1.0)
    try:
        with client(ep) as c:
            with pytest.raises(openai.NotFoundError, match="does not exist"):
                c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
            with pytest.raises(openai.BadRequestError, match="n=3"):
                c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3)
    finally:
        endpoint.close_episode(ep)


def test_keys_are_per_episode_and_die_with_it(served):
    endpoint, sampler, _ = served
    a = endpoint.open_episode("key-a", temperature=1.0)
    b = endpoint.open_episode("key-b", temperature=1.0)
    assert _raw(endpoint, a.api_key, GOOD).status_code == 200
    assert _raw(endpoint, b.api_key, GOOD).status_code == 200
    assert len(sampler.calls["key-a"]) == 1 and len(sampler.calls["key-b"]) == 1  # each went to its own
    endpoint.close_episode(a)
    before = endpoint.num_refused
    for key in (a.api_key, "agentrl-made-up", ""):
        r = _raw(endpoint, key, GOOD)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert _raw(endpoint, a.api_key, b"", method="GET", path="/models").status_code == 401
    assert endpoint.num_refused == before + 4
    assert len(sampler.calls["key-a"]) == 1 and len(a.recorder.segments[0].turn_spans) == 1  # nothing written
    with pytest.raises(openai.AuthenticationError):
        client(a).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert _raw(endpoint, b.api_key, GOOD).status_code == 200
    # b's key through a's base URL (or a stale one) is refused, and writes nothing
    c = endpoint.open_episode("key-c", temperature=1.0)
    r = httpx.post(c.base_url + "/chat/completions", headers={"Authorization": f"Bearer {b.api_key}"}, json=GOOD)
    assert r.status_code == 401 and "another episode" in r.json()["error"]["message"]
    assert len(sampler.calls["key-b"]) == 2 and not sampler.calls["key-c"] and not c.recorder.segments
    endpoint.close_episode(b)
    endpoint.close_episode(c)


def test_prompt_over_the_budget_and_turn_limit(tiny_model_dir):
    from transformers import AutoTokenizer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    sampler = RecordingSampler(renderer, kinds=("text",))
    server = ServerThread()
    endpoint = make_endpoint(renderer, sampler, ["rollout.max_total_tokens=128", "rollout.max_turns=2"])
    try:
        server.run(endpoint.start())
        ep = endpoint.open_episode("long", temperature=1.0)
        r = _raw(endpoint, ep.api_key, {**GOOD, "messages": [{"role": "user", "content": "word " * 400}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "rollout.max_total_tokens" in r.json()["error"]["message"] and ep.truncated_by == "tokens"
        assert not sampler.calls["long"]
        ep2 = endpoint.open_episode("turns", temperature=1.0)
        assert _raw(endpoint, ep2.api_key, GOOD).status_code == 200
        assert _raw(endpoint, ep2.api_key, GOOD).status_code == 200
        r = _raw(endpoint, ep2.api_key, GOOD)
        assert r.status_code == 400 and r.json()["error"]["code"] == "turn_limit_exceeded"
        assert ep2.truncated_by == "turns" and len(sampler.calls["turns"]) == 2
    finally:
        server.run(endpoint.stop())
        server.close()


def test_concurrent_starts_serve_every_episode_from_the_one_server(tiny_model_dir):
    """A rollout worker's first groups all ask for its endpoint at once (the before-RL evaluation
    starts 32 episodes together): every caller must wait for the one server and get its URL. The
    old start() returned at once to every caller but the first, while the server was starting, with
    an empty base URL: those episodes' clients got a relative URL and their agents raised (31 of
    the 128 before-RL eval episodes of the fresh-clone calculator_agent run were `failed`)."""
    from transformers import AutoTokenizer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    sampler = RecordingSampler(renderer, kinds=("text",))
    server = ServerThread()
    endpoint = make_endpoint(renderer, sampler)

    async def first_groups():
        async def one(i):
            await endpoint.start()  # as RolloutWorker.endpoint() does for each group
            return await endpoint.start(), endpoint.open_episode(f"early-{i}", temperature=1.0)

        return await asyncio.gather(*[one(i) for i in range(16)])

    try:
        opened = server.run(first_groups())
        assert endpoint.base_url.startswith("http://")
        assert {url for url, _ in opened} == {endpoint.base_url}
        root = endpoint.base_url.removesuffix("/v1")
        assert all(ep.base_url.startswith(root + "/e/") for _, ep in opened), [ep.base_url for _, ep in opened]
        for _, ep in opened[:2] + opened[-2:]:
            r = client(ep).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert r.choices[0].message.content is not None
        assert len(sampler.calls) == 4
        server.run(endpoint.stop())
        with pytest.raises(RuntimeError, match="not serving"):  # no episode with a URL nothing serves
            endpoint.open_episode("after-stop", temperature=1.0)
    finally:
        server.run(endpoint.stop())
        server.close()


@pytest.mark.parametrize("stream", [False, True])
def test_model_call_and_sampled_token_budgets_hold_for_plain_and_streamed_requests(tiny_model_dir, stream):
    """rollout.max_episode_tokens caps what the engine may sample over the episode (the turn that
    reaches it is cut there) and rollout.max_model_calls the completions; past either a request
    gets a 400 with its own code, the engine is not called, and the episode is marked truncated."""
    from transformers import AutoTokenizer

    from tests.endpoint_helpers import StreamingSampler

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    sampler = StreamingSampler(renderer, kinds=("cut",))  # every turn samples all the tokens it may
    server = ServerThread()
    endpoint = make_endpoint(renderer, sampler, ["rollout.max_new_tokens=10", "rollout.max_episode_tokens=25"])
    body = {**GOOD, "stream": stream}
    try:
        server.run(endpoint.start())
        ep = endpoint.open_episode("tokens", temperature=1.0)
        for _ in range(2):
            assert _raw(endpoint, ep.api_key, body).status_code == 200
        assert ep.truncated_by is None
        r = _raw(endpoint, ep.api_key, body)
        assert r.status_code == 200 and (stream or r.json()["choices"][0]["finish_reason"] == "length")
        assert [len(c.token_ids) for c in sampler.calls["tokens"]] == [10, 10, 5]
        assert ep.num_sampled == 25 and ep.truncated_by == "sampled_tokens"
        r = _raw(endpoint, ep.api_key, body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "token_budget_exceeded", r.text
        assert "rollout.max_episode_tokens" in r.json()["error"]["message"] and len(sampler.calls["tokens"]) == 3
        endpoint.rollout.max_model_calls, endpoint.rollout.max_episode_tokens = 2, None
        ep2 = endpoint.open_episode("calls", temperature=1.0)
        assert [_raw(endpoint, ep2.api_key, body).status_code for _ in range(2)] == [200, 200]
        r = _raw(endpoint, ep2.api_key, body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_call_budget_exceeded", r.text
        assert ep2.truncated_by == "model_calls" and len(sampler.calls["calls"]) == 2
    finally:
        server.run(endpoint.stop())
        server.close()


@settings(deadline=None)
@given(ids=st.lists(st.integers(0, 4), max_size=14), stops=st.lists(st.text("abcde", min_size=1, max_size=3), max_size=3))
def test_cut_at_stop_finds_the_first_token_that_completes_a_stop_string(ids, stops):
    from agentrl.rollout.agent.endpoint import cut_at_stop

    def decode(xs):
        return "".join("abcde"[i] for i in xs)

    expected = None
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        if any(s in text for s in stops):
            expected = (k, text[:min(text.find(s) for s in stops if s in text)])
            break
    assert cut_at_stop(decode, ids, stops) == expected


def test_kept_alive_connections_do_not_wait_on_delayed_acks(served):
    """Every accepted connection has Nagle's algorithm off (TCP_NODELAY). Without it, a response's
    header and body writes waited on the client's delayed ACK: +40 ms on each request after the
    first on a kept-alive connection, which is how agent SDKs talk."""
    import socket

    endpoint, _, server = served
    ep = endpoint.open_episode("nodelay", temperature=1.0)
    try:
        with httpx.Client(headers={"Authorization": f"Bearer {ep.api_key}"}, timeout=30) as hc:
            for _ in range(2):
                assert hc.post(ep.base_url + "/chat/completions", json=GOOD).status_code == 200

            async def options() -> list[int]:
                conns = endpoint._server.server_state.connections
                return [c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                        for c in conns if c.transport is not None and not c.transport.is_closing()]

            flags = server.run(options())
        assert flags and all(flags), flags
    finally:
        endpoint.close_episode(ep)


@pytest.fixture(scope="module")
def streaming(tiny_model_dir):
    from transformers import AutoTokenizer

    from tests.endpoint_helpers import StreamingSampler

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    sampler = StreamingSampler(renderer)
    server = ServerThread()
    endpoint = make_endpoint(renderer, sampler, ["rollout.max_turns=40", "rollout.max_new_tokens=64"])
    server.run(endpoint.start())
    yield endpoint, sampler, server
    server.run(endpoint.stop())
    server.close()


def _collect(chunks):
    content, calls, finish = "", {}, None
    for ch in chunks:
        for choice in ch.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
    return content, calls, finish


def test_streaming_sends_text_while_the_engine_samples(streaming):
    """With an engine client that streams, the first words reach the client before the engine has
    sampled the rest of the turn (the sampler waits after its first token until the client has
    seen text); the streamed content equals the plain response's, and the tokens are recorded
    as sampled."""
    import threading

    endpoint, sampler, _ = streaming
    sampler.kinds, sampler.gate = ("text",), threading.Event()
    ep = endpoint.open_episode("live", temperature=1.0)
    try:
        with client(ep) as c:
            stream = c.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "hi"}],
                                               stream=True)
            chunks = []
            for ch in stream:
                chunks.append(ch)
                if any(choice.delta.content for choice in ch.choices):
                    sampler.gate.set()  # only now may the engine go on
        content, calls, finish = _collect(chunks)
        assert sampler.gate.is_set() and not calls and finish == "stop"
        assert sum(bool(ch.choices and ch.choices[0].delta.content) for ch in chunks) >= 2  # in pieces
        sampled = sampler.calls["live"][0]
        assert content == endpoint.renderer.decode(sampled.token_ids)
        check_exact_tokens(ep.recorder.trajectories(1.0), sampler.calls["live"])
    finally:
        sampler.gate = None
        sampler.kinds = ("call", "text", "cut")
        endpoint.close_episode(ep)


def test_streamed_tool_calls_and_stop_strings_never_leak_as_content(streaming):
    """Text that turns out to be a tool call, or a stop string, is held back while it is sampled:
    a call arrives as tool_calls only, the stop string never appears, and both streams say
    what the plain responses say."""
    endpoint, sampler, _ = streaming
    sampler.kinds = ("call",)
    try:
        for name, kwargs in (("s-call", {"tools": TOOLS}), ("s-stop", {"tools": TOOLS, "stop": ["calculate"]}),
                             ("s-none", {"tools": TOOLS, "tool_choice": "none", "stop": "12 +"})):
            ep = endpoint.open_episode(name, temperature=1.0)
            with client(ep) as c:
                content, calls, finish = _collect(list(c.chat.completions.create(
                    model=MODEL, messages=[SYSTEM, {"role": "user", "content": "hi"}], stream=True, **kwargs)))
            plain = endpoint.open_episode(name + "-plain", temperature=1.0)
            with client(plain) as c:
                ref = c.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "hi"}],
                                                **kwargs).choices[0]
            assert content == (ref.message.content or ""), name
            assert finish == ref.finish_reason, name
            assert [(x["name"], json.loads(x["arguments"])) for x in calls.values()] == [
                (t.function.name, json.loads(t.function.arguments)) for t in ref.message.tool_calls or []], name
            check_exact_tokens(ep.recorder.trajectories(1.0), sampler.calls[name])
            for e in (ep, plain):
                endpoint.close_episode(e)
        assert finish == "stop" and content == '<tool_call>\n{"name": "calculate", "arguments": {"expression": "'
    finally:
        sampler.kinds = ("call", "text", "cut")


def test_a_client_that_leaves_mid_stream_aborts_the_turn(streaming):
    """The engine's request is aborted, nothing is recorded, and the episode takes its next
    request (its lock was released)."""
    import threading

    endpoint, sampler, server = streaming
    sampler.kinds, sampler.gate = ("text",), threading.Event()
    ep = endpoint.open_episode("leave", temperature=1.0)
    try:
        with httpx.Client(timeout=30) as hc:
            with hc.stream("POST", ep.base_url + "/chat/completions", headers={"Authorization": f"Bearer {ep.api_key}"},
                           json={**GOOD, "stream": True}) as r:
                for line in r.iter_lines():
                    if '"content": "' in line and '"content": ""' not in line:
                        break  # text arrived; go away while the engine is held at its gate
        server.run(asyncio_sleep(0.3))
        sampler.gate.set()
        server.run(asyncio_sleep(0.3))
        assert sampler.aborted == ["leave"] and not ep.recorder.segments
        assert ep.num_sampled >= 1  # what was sampled counts against rollout.max_episode_tokens
        sampler.gate = None
        assert _raw(endpoint, ep.api_key, GOOD).status_code == 200
        assert len(ep.recorder.segments) == 1
    finally:
        sampler.gate = None
        sampler.kinds = ("call", "text", "cut")
        endpoint.close_episode(ep)


async def asyncio_sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)
