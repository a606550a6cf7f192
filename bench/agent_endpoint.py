"""The agent endpoint's overhead, side by side in one run, on one vLLM engine in this process.

1. Round trip: the same greedy request (same prompt, same tokens out) made directly on the
   engine (token ids in, token ids out) and through the endpoint over HTTP (the openai SDK's
   AsyncOpenAI, and raw httpx), interleaved; p50 and p90 of each and the added milliseconds.
2. Throughput at equal work: Calculator groups through the env path (``run_group`` with
   CalculatorEnv) and through the endpoint path (``run_agent_group`` with the plain openai-SDK
   agent of examples/calculator_agent.py, the same problems by seed), alternating; trajectories/s,
   sampled tokens/s and the ratio.

    python bench/agent_endpoint.py [--model .cache/quickstart-sft] [--requests 200] [--groups 12] [--agent-workers 0,2]

   ``--agent-workers 0,N`` runs the endpoint path once per value of ``agent.workers``: 0, the
   agent in this process (as a rollout worker runs it by default), and N, the agent in N worker
   processes (the endpoint and the engine client staying here); each is compared with the env
   path, all paths alternating in a rotating order. ``--replay-ms X`` (throughput only) answers
   every request with the engine's greedy answer to that prompt, computed in an untimed pass and
   replayed after X ms of sleep: an engine that costs this machine no CPU, as a GPU's, so a
   2-core machine shows what limits the rollout side's process.

3. With ``--shape 0.5b`` (or ``1.5b``; ``cpu`` is a small stand-in that runs on a CPU) the model is
   a Qwen2.5-shaped checkpoint with random weights and the tiny tokenizer, made on the spot (on the
   GPU when there is one: sampling then costs what it does for users of that size), and the
   throughput part runs ``--work turns``: every episode makes ``--turns`` requests of
   ``--max-tokens`` tokens (a random model never calls a tool, so the Calculator's episodes would
   make one request each), the env path through ``TurnsEnv``, the endpoint path through
   ``turns_solve`` (a plain openai-SDK loop), with the same messages by seed (bench/agent_endpoint_work.py). Then the torch
   learner's logprobs of both paths' trajectories are compared with the engine's (mean |delta|).
   ``--out`` writes every figure as JSON.

    python bench/agent_endpoint.py --shape 0.5b --out $OUT/endpoint.json     # GPU: bench/device_endpoint.sh
    python bench/agent_endpoint.py --shape cpu --requests 3 --warmup 1 --group-size 2 --turns 2 --max-tokens 8 \
        --sweep 1x8,2x4 --out /tmp/endpoint_cpu.json                                 # its logic, on CPU

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

from bench.agent_endpoint_work import TURNS, Direct, Instant, Replay, turns_env  # noqa: E402


SHAPES = {  # Qwen2.5 shapes (tied embeddings, 151,936-token vocabulary); "cpu" is a small stand-in
    "cpu": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2},
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2},
}


def make_shape_model(out: Path, shape: str) -> str:
    """Random Qwen2.5-``shape`` weights with the tiny tokenizer, in HF format (bf16 on a GPU,
    float32 on CPU). The sampled ids past the tokenizer's 749 decode to nothing: text the
    endpoint returns is short, the tokens are all recorded and trained as sampled."""
    import json

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentrl.model.tiny import bootstrap_tiny

    key = json.dumps(SHAPES[shape], sort_keys=True)
    if (out / "shape.json").is_file() and (out / "shape.json").read_text() == key:
        return str(out)
    bootstrap_tiny(out)  # tokenizer + chat template; the model files are replaced below
    cuda = torch.cuda.is_available()
    config = Qwen2Config(vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0,
                         tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
                         pad_token_id=0, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16 if cuda else torch.float32)
    for f in out.glob("model*.safetensors"):
        f.unlink()
    model.save_pretrained(out, safe_serialization=True)
    (out / "shape.json").write_text(key)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return str(out)


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


async def bare_echo(engine, ids, tokens: int = 16) -> tuple[str, object]:
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
        out = await engine.generate(ids, max_tokens=tokens, temperature=0.0, top_p=1.0)
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


async def round_trips(endpoint, engine, renderer, n: int, warmup: int = 10, tokens: int = 16) -> dict:
    """The same greedy request (``tokens`` out) made ``n`` times (after ``warmup`` untimed ones) each
    way, interleaved. Every endpoint request is a new segment (an agent's first call), whose prompt
    the renderer has cached from the untimed request before it (as a GRPO group's episodes share
    their first prompt), except in the "cold" row, where the cache is emptied first; the kept-alive clients
    reuse one connection, as an agent's client does across its calls."""
    import httpx
    import openai

    from examples.calculator_agent import SYSTEM, TOOLS, tasks

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": tasks(1)["question"]}]
    ids = renderer.prompt_ids(messages, TOOLS)
    body = {"model": "agentrl-policy", "messages": messages, "tools": TOOLS, "max_tokens": tokens}
    times: dict[str, list[float]] = {k: [] for k in ROWS}
    # CPU seconds of this process (client, endpoint and vLLM's front end; the engine core is a
    # process of its own) per request: the endpoint's own cost, robust to a loaded machine.
    cpu: dict[str, list[float]] = {k: [] for k in ROWS}
    outs = set()

    async def timed(row, k, fn):
        c0, t0 = time.process_time(), time.perf_counter()
        out = await fn()
        c1, t1 = time.process_time(), time.perf_counter()
        if k >= warmup:
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

    echo_url, (echo, echo_task) = await bare_echo(engine, ids, tokens)
    sdk = openai.AsyncOpenAI(base_url="http://unused/v1", api_key="unused", max_retries=0)
    async with httpx.AsyncClient(timeout=300) as hx, httpx.AsyncClient(timeout=300) as slow:
        for k in range(n + warmup):
            out = await timed("direct", k, lambda: engine.generate(ids, max_tokens=tokens, temperature=0.0, top_p=1.0))
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
                print(f"  round trip {k + 1}/{n + warmup}: " + ", ".join(
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


def path_name(spec: str) -> str:
    """The endpoint path's name in the throughput figures: ``endpoint`` (``0``: the agent in this
    process), ``endpoint_w4`` (``4``: agent.workers=4, in 4 worker processes), ``endpoint_w4_asyncio``
    (``4:asyncio``: the same with asyncio's own event loop in the workers instead of uvloop)."""
    workers, _, loop = spec.partition(":")
    return "endpoint" if int(workers) == 0 else f"endpoint_w{workers}" + (f"_{loop}" if loop else "")


async def throughput(endpoint, engine, renderer, tool_parser, cfg, groups: int, *, work: str = "calculator",
                     reps: int = 2, keep: list | None = None, agent_workers: tuple[str, ...] = ("0",)) -> dict:
    """The env path and the endpoint path (once per ``agent_workers`` value) on the same tasks by
    seed, in an order that rotates each rep, ``reps`` times each. ``keep``: a list that gets
    (path, trajectory) pairs (for the logprob agreement)."""
    import agentrl.envs  # noqa: F401
    import gymnasium as gym
    from agentrl.envs.base import set_tool_parser

    from agentrl.rollout.agent.user import load_agent, run_agent_group
    from agentrl.rollout.episode import run_group, widen_env_threads

    widen_env_threads(64)
    import os

    agents = {path_name(w): load_agent(cfg.agent.model_copy(update={"workers": int(w.partition(":")[0])}))
              for w in agent_workers}
    for spec, (name, agent) in zip(agent_workers, agents.items()):  # untimed: start the workers, import the agent
        if agent.cfg.workers:
            t0 = time.perf_counter()
            os.environ["AGENTRL_AGENT_WORKER_LOOP"] = spec.partition(":")[2] or "uvloop"  # read at the workers' start
            await asyncio.gather(*[run_agent_group(agent, endpoint, seed=5_000 + g, rollout=cfg.rollout, group_id=-g - 1)
                                   for g in range(max(1, agent.cfg.workers // cfg.rollout.group_size + 1))])
            import psutil

            rss = [psutil.Process(pid).memory_info().rss / 2**20 for pid in agent.pool.pids()]
            print(f"  {name}: {agent.cfg.workers} agent worker processes started and warmed in "
                  f"{time.perf_counter() - t0:.1f} s (RSS {min(rss):.0f}-{max(rss):.0f} MiB each)", flush=True)

    def make_env():
        if work == "turns":
            return turns_env(TURNS["n"])
        env = gym.make("agentrl/Calculator-v0")
        set_tool_parser(env, tool_parser)
        return env

    client = Direct(engine)
    if isinstance(engine, Replay):  # untimed: the real engine's answers to every prompt of the timed passes
        for rep in range(reps):
            await asyncio.gather(*[run_group(make_env, renderer, client, seed=10_000 + rep * 1000 + g, cfg=cfg.rollout,
                                             group_id=10_000 + rep * 1000 + g, max_model_len=cfg.engine.max_model_len)
                                   for g in range(groups)])
        engine.misses = 0
    paths = ["env", *agents]
    res = {p: [0.0, 0, 0, 0] for p in paths}  # seconds, trajectories, sampled tokens, requests
    cpu = {p: {"bench": 0.0, "engine": 0.0, "workers": 0.0} for p in paths}  # CPU seconds by process
    for rep in range(reps):
        for path in paths[rep % len(paths):] + paths[:rep % len(paths)]:
            c0 = cpu_by_process(agents)
            t0 = time.perf_counter()

            async def one(seed, path=path):
                if path == "env":
                    return await run_group(make_env, renderer, client, seed=seed, cfg=cfg.rollout, group_id=seed,
                                           max_model_len=cfg.engine.max_model_len)
                return await run_agent_group(agents[path], endpoint, seed=seed, rollout=cfg.rollout, group_id=seed)

            done = await asyncio.gather(*[one(10_000 + rep * 1000 + g) for g in range(groups)])
            res[path][0] += time.perf_counter() - t0
            for k, v in cpu_by_process(agents).items():
                cpu[path][k] += v - c0[k]
            trajs = [t for g in done for t in g.trajectories]
            res[path][1] += len(trajs)
            res[path][2] += sum(t.num_sampled_tokens for t in trajs)
            res[path][3] += sum(len(t.turn_spans) for t in trajs)
            assert not [t for t in trajs if t.status == "failed"], [t.info for t in trajs if t.status == "failed"][:3]
            if keep is not None and rep == 0:
                keep += [(path, t) for t in trajs]
    for agent in agents.values():
        await agent.close()
    return res, cpu


def cpu_by_process(agents: dict) -> dict[str, float]:
    """CPU seconds so far (user + system) of this process (the endpoint, the engine's client,
    the env path's envs, in-process agents), of its other descendants (vLLM's engine core), and
    of the agent worker processes."""
    import psutil

    workers = {pid for a in agents.values() if a.pool is not None for pid in a.pool.pids()}
    out = {"bench": 0.0, "engine": 0.0, "workers": 0.0}
    me = psutil.Process()
    t = me.cpu_times()
    out["bench"] = t.user + t.system
    for child in me.children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:
            continue
        out["workers" if child.pid in workers else "engine"] += t.user + t.system
    return out


def agreement(model: str, dtype: str, kept: list, per_path: int = 32) -> dict:
    """The torch learner's logprob of every sampled token of ``per_path`` trajectories of each path
    (Hugging Face forward, the learner's padded_token_logprobs) against the engine's: mean and max |delta|."""
    import torch

    from agentrl.learner.hf_forward import padded_token_logprobs
    from agentrl.model.loading import load_hf_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    net = load_hf_model(model, dtype, device).eval()
    out = {}
    for path in dict.fromkeys(p for p, _ in kept):
        trajs = [t for p, t in kept if p == path][:per_path]
        diffs = []
        for k in range(0, len(trajs), 8):
            batch = trajs[k:k + 8]
            with torch.no_grad():
                lp = padded_token_logprobs(net, [t.token_ids for t in batch]).float().cpu()
            for row, t in zip(lp, batch):
                diffs += [abs(b - float(row[i])) for i, (m, b) in enumerate(zip(t.loss_mask, t.behavior_logprobs)) if m]
        out[path] = {"trajectories": len(trajs), "tokens": len(diffs), "mean_abs": statistics.fmean(diffs),
                     "max_abs": max(diffs)}
    del net
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def show(title: str, rt: dict) -> None:
    print(f"\n{title}:")
    print(f"  {'':68s} p50 ms   p90 ms   +p50 ms  paired +ms  CPU ms")
    for k in ROWS:
        print(f"  {LABELS[k]:68s} {rt[k][0]:7.2f}  {rt[k][1]:7.2f}  {rt[k][0] - rt['direct'][0]:+7.2f}  "
              f"{rt['paired'][k]:+9.2f}  {rt['cpu'][k]:6.2f}")
    print("  (+p50: p50 minus the direct call's p50; paired: median over requests of the difference to the direct "
          "call made just before it; CPU: this process's CPU time per request, p50)")


async def main(args) -> dict:
    import json
    import platform

    import torch
    from transformers import AutoTokenizer

    from agentrl.rollout.chat import ChatRenderer
    from agentrl.config import load_config
    from agentrl.rollout.agent.endpoint import AgentEndpoint
    from agentrl.engine.vllm_engine import VLLMEngine
    from agentrl.rollout.tool_calls import build_tool_parser

    cuda = torch.cuda.is_available()
    t_start = time.perf_counter()
    model = args.model
    if args.shape:
        model = make_shape_model(Path(args.workdir) / f"qwen2.5-{args.shape}-shape", args.shape)
    elif not (Path(model) / "config.json").is_file():
        from agentrl.model.tiny import bootstrap_tiny

        model = str(bootstrap_tiny(Path("/tmp/agentrl-bench-tiny")))
    work = args.work or ("turns" if args.shape else "calculator")
    dtype = "bfloat16" if cuda else "float32"
    # train.deterministic off (configs/quickstart.yaml sets it): its per-request sampling seeds would
    # reach the env path's engine calls and not the endpoint's, which takes no seed
    overrides = [f"model.path={model}", "agent.solve=examples.calculator_agent:solve",
                 "agent.tasks=examples.calculator_agent:tasks", "train.deterministic=false"]
    if work == "turns":
        # the agent is loaded by name (agent.solve): the module's copy of TURNS is the one it reads
        TURNS.update(n=args.turns, max_tokens=args.max_tokens)
        overrides = [f"model.path={model}", "train.deterministic=false", "agent.solve=bench.agent_endpoint_work:turns_solve",
                     "agent.tasks=bench.agent_endpoint_work:turns_tasks", f"rollout.max_turns={args.turns}",
                     f"rollout.max_new_tokens={args.max_tokens}", f"rollout.temperature={args.temperature}",
                     f"rollout.group_size={args.group_size}", "rollout.max_total_tokens=4096",
                     "engine.max_model_len=4096", "agent.timeout_s=600", "agent.request_timeout_s=600"]
    if cuda:
        overrides += ["engine.num_gpus=1", f"engine.gpu_memory_utilization={args.gpu_memory_utilization}",
                      "engine.max_num_seqs=256", f"engine.enforce_eager={str(args.eager).lower()}"]
    cfg = load_config(REPO / "configs" / "quickstart.yaml", overrides)
    tok = AutoTokenizer.from_pretrained(model)
    renderer = ChatRenderer(tok)
    parser = build_tool_parser(cfg.rollout.tool_parser, model, tok)
    engine = VLLMEngine(model, cfg.engine, seed=0, dtype=dtype)
    t0 = time.perf_counter()
    await engine.start()
    report: dict = {"model": model, "shape": args.shape, "work": work, "dtype": dtype,
                    "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
                    "enforce_eager": cfg.engine.enforce_eager, "engine_start_s": time.perf_counter() - t0,
                    "setup_s": time.perf_counter() - t_start, "requests": args.requests}
    endpoint = AgentEndpoint(renderer, parser, Direct(engine), rollout=cfg.rollout, agent=cfg.agent,
                             max_model_len=cfg.engine.max_model_len)
    await endpoint.start()
    print(f"model {model} ({dtype}, engine start {report['engine_start_s']:.0f} s); {args.requests} round trips, "
          f"throughput ({work}) at {args.sweep or args.groups} groups x {cfg.rollout.group_size}", flush=True)

    def as_json(rt):
        return {"p50_ms": {k: rt[k][0] for k in ROWS}, "p90_ms": {k: rt[k][1] for k in ROWS},
                "added_p50_ms": {k: rt[k][0] - rt["direct"][0] for k in ROWS}, "paired_ms": rt["paired"],
                "cpu_ms": rt["cpu"], "tokens": rt["tokens"]}

    rt_tokens = min(16, cfg.rollout.max_new_tokens)  # the round trips' greedy request
    if args.requests:
        rt = await round_trips(endpoint, engine, renderer, args.requests, args.warmup, rt_tokens)
        show(f"round trip, same greedy request ({rt['tokens']} tokens out), {args.requests} each, interleaved", rt)
        report["round_trip"] = as_json(rt)
        # The endpoint alone: an engine that answers at once with the tokens the real one sampled.
        from examples.calculator_agent import SYSTEM, TOOLS, tasks

        ids = renderer.prompt_ids([{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": tasks(1)["question"]}], TOOLS)
        instant = Instant(await engine.generate(ids, max_tokens=rt_tokens, temperature=0.0, top_p=1.0))
        alone = AgentEndpoint(renderer, parser, instant, rollout=cfg.rollout, agent=cfg.agent,
                              max_model_len=cfg.engine.max_model_len)
        await alone.start()
        rt = await round_trips(alone, instant, renderer, args.requests, args.warmup, rt_tokens)
        show("the endpoint alone: the same request, an engine that answers at once", rt)
        report["round_trip_instant_engine"] = as_json(rt)
        await alone.stop()
    kept: list = []
    agent_workers = tuple(args.agent_workers.split(","))
    if not all(w.partition(":")[0].isdigit() and w.partition(":")[2] in ("", "uvloop", "asyncio")
               for w in agent_workers) or len(set(agent_workers)) != len(agent_workers):
        raise SystemExit(f"--agent-workers: distinct counts >= 0, each optionally :asyncio (e.g. 0,4,4:asyncio), "
                         f"got {args.agent_workers!r}")
    # --sweep GROUPSxTOKENS,...: the throughput part at several loads (concurrent episodes) and
    # request lengths, on the same engine; default one point, --groups x --max-tokens.
    points = [tuple(int(x) for x in p.split("x")) for p in args.sweep.split(",")] if args.sweep else \
        [(args.groups, args.max_tokens)]
    if work != "turns":
        points = [(args.groups, cfg.rollout.max_new_tokens)]
    report["throughput"] = []
    tp_endpoint, tp_engine = endpoint, engine
    if args.replay_ms is not None:
        tp_engine = Replay(engine, args.replay_ms / 1e3)
        tp_endpoint = AgentEndpoint(renderer, parser, Direct(tp_engine), rollout=cfg.rollout, agent=cfg.agent,
                                    max_model_len=cfg.engine.max_model_len)
        await tp_endpoint.start()
        report["replay_ms"] = args.replay_ms
    for groups, max_tokens in points:
        if work == "turns":
            cfg.rollout.max_new_tokens = max_tokens  # the env path's cap and the endpoint's (same object)
            TURNS.update(max_tokens=max_tokens)
        tp, cpu = await throughput(tp_endpoint, tp_engine, renderer, parser, cfg, groups, work=work, reps=args.reps,
                                   keep=kept if not kept else None, agent_workers=agent_workers)
        print(f"\nthroughput at equal work ({work}: {groups} groups x {cfg.rollout.group_size} episodes"
              + (f" x {args.turns} requests x {max_tokens} tokens" if work == "turns" else "")
              + (f", same seeds, the engine's greedy answers replayed after {args.replay_ms:g} ms (misses in the "
                 f"timed passes: {tp_engine.misses})" if args.replay_ms is not None else
                 f", same seeds, temperature {cfg.rollout.temperature}") + f", {args.reps} reps alternating):")
        for k, (secs, n, toks, reqs) in tp.items():
            c = cpu[k]
            print(f"  {k:12s} {n} trajectories, {reqs} requests, {toks} sampled tokens in {secs:.1f} s: "
                  f"{n / secs:.2f} traj/s, {toks / secs:.0f} tok/s; CPU ms per request: bench process "
                  f"{1e3 * c['bench'] / reqs:.2f}, engine {1e3 * c['engine'] / reqs:.2f}, agent workers "
                  f"{1e3 * c['workers'] / reqs:.2f}; cores busy {sum(c.values()) / secs:.2f}")
        e = tp["env"]
        point = {k: {"seconds": secs, "trajectories": n, "sampled_tokens": toks, "requests": reqs,
                     "trajectories_per_s": n / secs, "sampled_tokens_per_s": toks / secs, "cpu_s": cpu[k]}
                 for k, (secs, n, toks, reqs) in tp.items()}
        for path, a in tp.items():
            if path == "env":
                continue
            ratio = {"trajectories_per_s": (a[1] / a[0]) / (e[1] / e[0]),
                     "sampled_tokens_per_s": (a[2] / a[0]) / (e[2] / e[0])}
            print(f"  {path} / env: {ratio['trajectories_per_s']:.3f} (trajectories/s), "
                  f"{ratio['sampled_tokens_per_s']:.3f} (sampled tokens/s)", flush=True)
            point[f"{path}_over_env"] = ratio
        if args.replay_ms is not None:
            point["replay_misses"] = tp_engine.misses
        point.update(groups=groups, group_size=cfg.rollout.group_size, reps=args.reps, agent_workers=list(agent_workers),
                     concurrent_episodes=groups * cfg.rollout.group_size, temperature=cfg.rollout.temperature,
                     turns=args.turns if work == "turns" else None, max_tokens=max_tokens)
        report["throughput"].append(point)
    if tp_endpoint is not endpoint:
        await tp_endpoint.stop()
    await endpoint.stop()
    engine.shutdown()
    if args.agreement and cfg.rollout.temperature == 1.0 and args.replay_ms is None:
        ag = agreement(model, dtype, kept)
        for path, r in ag.items():
            print(f"  engine vs torch learner logprobs, {path} path: {r['tokens']} tokens of {r['trajectories']} "
                  f"trajectories, mean |delta| {r['mean_abs']:.5f}, max {r['max_abs']:.4f}", flush=True)
        report["agreement"] = ag
    elif args.agreement:
        print("  (no logprob agreement: the engine's logprobs are tempered unless rollout.temperature is 1.0)")
    report["wall_s"] = time.perf_counter() - t_start
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO / ".cache" / "quickstart-sft"))
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="a Qwen2.5-shaped model with random weights, made on the spot (ignores --model)")
    p.add_argument("--workdir", default="/tmp/agentrl-bench-endpoint", help="where --shape's model is written")
    p.add_argument("--work", choices=("calculator", "turns"), default=None,
                   help="throughput workload (default: turns with --shape, else calculator)")
    p.add_argument("--requests", type=int, default=200, help="round trips per row (0: skip the round trips)")
    p.add_argument("--warmup", type=int, default=10, help="untimed round trips before the timed ones")
    p.add_argument("--groups", type=int, default=12)
    p.add_argument("--group-size", type=int, default=8, help="--work turns: episodes per group")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--turns", type=int, default=4, help="--work turns: requests per episode")
    p.add_argument("--max-tokens", type=int, default=64, help="--work turns: tokens per request")
    p.add_argument("--sweep", default=None,
                   help="--work turns: throughput at several points GROUPSxTOKENS,... (e.g. 16x128,32x64)")
    p.add_argument("--temperature", type=float, default=1.0, help="--work turns: sampling temperature")
    p.add_argument("--replay-ms", type=float, default=None,
                   help="throughput: replay the engine's greedy answers after this many ms (no CPU) instead of "
                        "sampling: what limits the rollout side when the engine is fast and elsewhere (a GPU's)")
    p.add_argument("--agent-workers", default="0",
                   help="throughput: the endpoint path once per agent.workers value, e.g. 0,4 (0: the agent in "
                        "this process; N: in N agent worker processes; N:asyncio: the same on asyncio's loop "
                        "instead of uvloop), alternating with the env path")
    p.add_argument("--agreement", action=argparse.BooleanOptionalAction, default=True,
                   help="compare the engine's logprobs with the torch learner's (temperature 1.0 only)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--eager", action="store_true", help="GPU: vLLM without torch.compile and CUDA graphs")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    asyncio.run(main(p.parse_args()))
