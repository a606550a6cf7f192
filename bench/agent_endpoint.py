"""The agent endpoint's overhead, side by side in one run, on one vLLM engine in this process.

1. Round trip: the same greedy request (same prompt, same tokens out) made directly on the
   engine (token ids in, token ids out) and through the endpoint over HTTP (the openai SDK's
   AsyncOpenAI, and raw httpx), interleaved; p50 and p90 of each and the added milliseconds.
2. Throughput at equal work: Calculator groups through the env path (``run_group`` with
   CalculatorEnv) and through the endpoint path (``run_agent_group`` with the plain openai-SDK
   agent of examples/calculator_agent.py, the same problems by seed), alternating; trajectories/s,
   sampled tokens/s and the ratio.

    python bench/agent_endpoint.py [--model .cache/quickstart-sft] [--requests 200] [--groups 12]

The "before" row turns Nagle's algorithm back on for the endpoint's connections, as they were
until the endpoint's listening socket was made with proto=IPPROTO_TCP (asyncio sets TCP_NODELAY
only on such sockets' connections): the same endpoint, the fix off, in the same run.

The model defaults to the quickstart's SFT model when it exists (episodes then call the tool),
else a tiny random model is made.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class Direct:
    def __init__(self, engine):
        self.engine = engine

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id):
        return await self.engine.generate(prompt_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def nagle_on(endpoint, peer) -> int:
    """Turn Nagle's algorithm back on for the endpoint's connection from ``peer`` (a client's
    address): the endpoint as it was before TCP_NODELAY, for the "before" row. Returns how many
    connections it changed (1)."""
    import socket

    n = 0
    for conn in endpoint._server.server_state.connections:
        if conn.transport is not None and tuple(conn.transport.get_extra_info("peername") or ()) == tuple(peer):
            conn.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
            n += 1
    return n


ROWS = ("direct", "echo", "httpx", "httpx_cold", "sdk", "sdk_new", "nagle")
LABELS = {
    "direct": "direct engine call (token ids in and out)",
    "echo": "floor: the direct call inside a bare uvicorn ASGI app, raw httpx",
    "httpx": "endpoint, raw httpx, kept-alive connection",
    "httpx_cold": "endpoint, raw httpx, kept-alive, prompt not in the render cache",
    "sdk": "endpoint, openai SDK (AsyncOpenAI), kept-alive connection",
    "sdk_new": "endpoint, openai SDK, a new client (connection) per request",
    "nagle": "before: endpoint, raw httpx, kept-alive, Nagle on (no TCP_NODELAY)",
}


async def bare_echo(engine, ids) -> tuple[str, object]:
    """The floor of any HTTP endpoint here: a bare ASGI app on uvicorn (same socket options as the
    endpoint) that reads the body, makes the direct engine call on ``ids`` and answers a fixed
    small JSON object: HTTP parsing, the event loop hops and the loopback, no endpoint logic."""
    import contextlib
    import socket

    import uvicorn

    class Quiet(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        out = await engine.generate(ids, max_tokens=16, temperature=0.0, top_p=1.0)
        body = b'{"usage": {"completion_tokens": %d}}' % len(out.token_ids)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    server = Quiet(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", proxy_headers=False))
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", (server, task)


async def round_trips(endpoint, engine, renderer, n: int) -> dict:
    """The same greedy request made ``n`` times (after 10 warm-ups) each way, interleaved. Every
    endpoint request is a new segment (an agent's first call), whose prompt the renderer has
    cached from the untimed request before it (as a GRPO group's episodes share their first
    prompt), except in the "cold" row, where the cache is emptied first; the kept-alive clients
    reuse one connection, as an agent's client does across its calls."""
    import httpx
    import openai

    from examples.calculator_agent import SYSTEM, TOOLS, tasks

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": tasks(1)["question"]}]
    ids = renderer.prompt_ids(messages, TOOLS)
    body = {"model": "agentrl-policy", "messages": messages, "tools": TOOLS, "max_tokens": 16}
    times: dict[str, list[float]] = {k: [] for k in ROWS}
    # CPU seconds of this process (client, endpoint and vLLM's front end; the engine core is a
    # process of its own) per request: the endpoint's own cost, robust to a loaded machine.
    cpu: dict[str, list[float]] = {k: [] for k in ROWS}
    outs = set()

    async def timed(row, k, fn):
        c0, t0 = time.process_time(), time.perf_counter()
        out = await fn()
        c1, t1 = time.process_time(), time.perf_counter()
        if k >= 10:  # warm-up
            times[row].append(t1 - t0)
            cpu[row].append(c1 - c0)
        return out

    async def via_endpoint(row, k, call, *, after_another=True, cold=False):
        """One timed request of a new episode; on a kept-alive connection, right after an untimed
        one on the same connection (as an agent's next call follows its last): that is when a
        response's writes can wait on the client's delayed ACK (the "before" row)."""
        ep = endpoint.open_episode(f"{row}{k}", temperature=0.0)
        try:
            if after_another:
                await call(ep)
            if cold:
                endpoint.renderer._rendered.clear()
            return await timed(row, k, lambda: call(ep))
        finally:
            endpoint.close_episode(ep)

    echo_url, (echo, echo_task) = await bare_echo(engine, ids)
    sdk = openai.AsyncOpenAI(base_url="http://unused/v1", api_key="unused", max_retries=0)
    async with httpx.AsyncClient(timeout=300) as hx, httpx.AsyncClient(timeout=300) as slow:
        for k in range(n + 10):
            out = await timed("direct", k, lambda: engine.generate(ids, max_tokens=16, temperature=0.0, top_p=1.0))
            await hx.post(echo_url + "/chat/completions", json=body)  # as via_endpoint: after another request
            re_ = await timed("echo", k, lambda: hx.post(echo_url + "/chat/completions", json=body))
            r = await via_endpoint("httpx", k, lambda ep: hx.post(
                ep.base_url + "/chat/completions", headers={"Authorization": f"Bearer {ep.api_key}"}, json=body))
            assert r.status_code == 200, r.text
            rc = await via_endpoint("httpx_cold", k, lambda ep: hx.post(
                ep.base_url + "/chat/completions", headers={"Authorization": f"Bearer {ep.api_key}"}, json=body), cold=True)
            resp = await via_endpoint("sdk", k, lambda ep: sdk.with_options(
                base_url=ep.base_url, api_key=ep.api_key).chat.completions.create(**body))

            async def fresh(ep):
                async with openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0) as c:
                    return await c.chat.completions.create(**body)

            resp2 = await via_endpoint("sdk_new", k, fresh, after_another=False)
            r2 = await via_endpoint("nagle", k, lambda ep: slow.post(
                ep.base_url + "/chat/completions", headers={"Authorization": f"Bearer {ep.api_key}"}, json=body))
            assert nagle_on(endpoint, r2.extensions["network_stream"].get_extra_info("client_addr")) == 1
            outs.add((len(out.token_ids), re_.json()["usage"]["completion_tokens"], r.json()["usage"]["completion_tokens"], rc.json()["usage"]["completion_tokens"],
                      resp.usage.completion_tokens,
                      resp2.usage.completion_tokens, r2.json()["usage"]["completion_tokens"]))
            if k % 10 == 9:
                print(f"  round trip {k + 1}/{n + 10}: " + ", ".join(
                    f"{row} {1e3 * times[row][-1]:.1f} ms" for row in ROWS if times[row]), flush=True)
    await sdk.close()
    echo.should_exit = True
    await echo_task
    assert len(outs) == 1 and len(set(next(iter(outs)))) == 1, f"greedy outputs differ: not equal work {outs}"
    res = {k: (statistics.median(v) * 1e3, pct(v, 0.9) * 1e3) for k, v in times.items()}
    res["paired"] = {k: statistics.median(a - b for a, b in zip(times[k], times["direct"])) * 1e3 for k in ROWS}
    res["tokens"] = next(iter(outs))[0]
    res["cpu"] = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    return res


async def throughput(endpoint, engine, renderer, tool_parser, cfg, groups: int) -> dict:
    import gymnasium as gym

    import agentrl.envs  # noqa: F401
    from agentrl.agents import load_agent, run_agent_group
    from agentrl.envs.base import set_tool_parser
    from agentrl.rollout import run_group, widen_env_threads

    widen_env_threads(64)
    agent = load_agent(cfg.agent)

    def make_env():
        env = gym.make("agentrl/Calculator-v0")
        set_tool_parser(env, tool_parser)
        return env

    client = Direct(engine)
    res = {"env": [0.0, 0, 0], "endpoint": [0.0, 0, 0]}  # seconds, trajectories, sampled tokens
    for rep in range(2):
        for path in ("env", "endpoint") if rep == 0 else ("endpoint", "env"):
            t0 = time.perf_counter()

            async def one(seed):
                if path == "env":
                    return await run_group(make_env, renderer, client, seed=seed, cfg=cfg.rollout, group_id=seed,
                                           max_model_len=cfg.engine.max_model_len)
                return await run_agent_group(agent, endpoint, seed=seed, rollout=cfg.rollout, group_id=seed)

            done = await asyncio.gather(*[one(10_000 + rep * 1000 + g) for g in range(groups)])
            res[path][0] += time.perf_counter() - t0
            trajs = [t for g in done for t in g.trajectories]
            res[path][1] += len(trajs)
            res[path][2] += sum(t.num_sampled_tokens for t in trajs)
            assert not [t for t in trajs if t.status == "failed"], [t.info for t in trajs if t.status == "failed"][:3]
    return res


class Instant:
    """An engine that answers every request at once with one fixed sample."""

    def __init__(self, out):
        self.out = out

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id=None, **_):
        return self.out


def show(title: str, rt: dict) -> None:
    print(f"\n{title}:")
    print(f"  {'':68s} p50 ms   p90 ms   +p50 ms  paired +ms  CPU ms")
    for k in ROWS:
        print(f"  {LABELS[k]:68s} {rt[k][0]:7.2f}  {rt[k][1]:7.2f}  {rt[k][0] - rt['direct'][0]:+7.2f}  "
              f"{rt['paired'][k]:+9.2f}  {rt['cpu'][k]:6.2f}")
    print("  (+p50: p50 minus the direct call's p50; paired: median over requests of the difference to the direct "
          "call made just before it; CPU: this process's CPU time per request, p50)")


async def main(args) -> None:
    from transformers import AutoTokenizer

    from agentrl.chat import ChatRenderer
    from agentrl.config import load_config
    from agentrl.endpoint import AgentEndpoint
    from agentrl.engines.vllm_engine import VLLMEngine
    from agentrl.tool_calls import build_tool_parser

    model = args.model
    if not (Path(model) / "config.json").is_file():
        from agentrl.tiny import bootstrap_tiny

        model = str(bootstrap_tiny(Path("/tmp/agentrl-bench-tiny")))
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        f"model.path={model}", "agent.solve=examples.calculator_agent:solve",
        "agent.tasks=examples.calculator_agent:tasks"])
    tok = AutoTokenizer.from_pretrained(model)
    renderer = ChatRenderer(tok)
    parser = build_tool_parser(cfg.rollout.tool_parser, model, tok)
    engine = VLLMEngine(model, cfg.engine, seed=0)
    await engine.start()
    endpoint = AgentEndpoint(renderer, parser, Direct(engine), rollout=cfg.rollout, agent=cfg.agent,
                             max_model_len=cfg.engine.max_model_len)
    await endpoint.start()
    print(f"model {model}; {args.requests} round trips, {args.groups} groups x {cfg.rollout.group_size} per path per rep")
    rt = await round_trips(endpoint, engine, renderer, args.requests)
    show(f"round trip, same greedy request ({rt['tokens']} tokens out), {args.requests} each, interleaved", rt)
    # The endpoint alone: an engine that answers at once with the tokens the real one sampled.
    from examples.calculator_agent import SYSTEM, TOOLS, tasks

    ids = renderer.prompt_ids([{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": tasks(1)["question"]}], TOOLS)
    instant = Instant(await engine.generate(ids, max_tokens=16, temperature=0.0, top_p=1.0))
    alone = AgentEndpoint(renderer, parser, instant, rollout=cfg.rollout, agent=cfg.agent,
                          max_model_len=cfg.engine.max_model_len)
    await alone.start()
    rt = await round_trips(alone, instant, renderer, args.requests)
    show("the endpoint alone: the same request, an engine that answers at once", rt)
    await alone.stop()
    tp = await throughput(endpoint, engine, renderer, parser, cfg, args.groups)
    print("\nthroughput at equal work (Calculator, same seeds, temperature "
          f"{cfg.rollout.temperature}, 2 reps alternating):")
    for k, (s, n, toks) in tp.items():
        print(f"  {k:9s} {n} trajectories, {toks} sampled tokens in {s:.1f} s: {n / s:.2f} traj/s, {toks / s:.0f} tok/s")
    e, a = tp["env"], tp["endpoint"]
    print(f"  endpoint / env: {(a[1] / a[0]) / (e[1] / e[0]):.3f} (trajectories/s), "
          f"{(a[2] / a[0]) / (e[2] / e[0]):.3f} (sampled tokens/s)")
    await endpoint.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO / ".cache" / "quickstart-sft"))
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--groups", type=int, default=12)
    asyncio.run(main(p.parse_args()))
