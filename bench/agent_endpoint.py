"""The agent endpoint's overhead, side by side in one run, on one vLLM engine in this process.

1. Round trip: the same greedy request (same prompt, same tokens out) made directly on the
   engine (token ids in, token ids out) and through the endpoint over HTTP (the openai SDK's
   AsyncOpenAI, and raw httpx), interleaved; p50 and p90 of each and the added milliseconds.
2. Throughput at equal work: Calculator groups through the env path (``run_group`` with
   CalculatorEnv) and through the endpoint path (``run_agent_group`` with the plain openai-SDK
   agent of examples/calculator_agent.py, the same problems by seed), alternating; trajectories/s,
   sampled tokens/s and the ratio.

    python bench/agent_endpoint.py [--model .cache/quickstart-sft] [--requests 200] [--groups 12]

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


async def round_trips(endpoint, engine, renderer, n: int) -> dict:
    import httpx
    import openai

    from examples.calculator_agent import SYSTEM, TOOLS, tasks

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": tasks(1)["question"]}]
    ids = renderer.prompt_ids(messages, TOOLS)
    times: dict[str, list[float]] = {"direct": [], "sdk": [], "httpx": []}
    # CPU seconds of this process (client, endpoint and vLLM's front end; the engine core is a
    # process of its own) per request: the endpoint's own cost, robust to a loaded machine.
    cpu: dict[str, list[float]] = {"direct": [], "sdk": [], "httpx": []}
    clock = time.process_time
    outs = set()
    async with httpx.AsyncClient(timeout=300) as hx:
        for k in range(n + 10):
            ep = endpoint.open_episode(f"rt{k}", temperature=0.0)
            c0, t0 = clock(), time.perf_counter()
            out = await engine.generate(ids, max_tokens=16, temperature=0.0, top_p=1.0)
            c1, t1 = clock(), time.perf_counter()
            client = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0,
                                        http_client=openai.DefaultAsyncHttpxClient())
            c2, t2 = clock(), time.perf_counter()
            resp = await client.chat.completions.create(model="agentrl-policy", messages=messages, tools=TOOLS,
                                                        max_tokens=16)
            c3, t3 = clock(), time.perf_counter()
            endpoint.close_episode(ep)
            ep2 = endpoint.open_episode(f"rh{k}", temperature=0.0)
            c4, t4 = clock(), time.perf_counter()
            r = await hx.post(ep2.base_url + "/chat/completions", headers={"Authorization": f"Bearer {ep2.api_key}"},
                              json={"model": "agentrl-policy", "messages": messages, "tools": TOOLS, "max_tokens": 16})
            c5, t5 = clock(), time.perf_counter()
            endpoint.close_episode(ep2)
            await client.close()
            assert r.status_code == 200, r.text
            outs.add((tuple(out.token_ids), resp.usage.completion_tokens, r.json()["usage"]["completion_tokens"]))
            if k % 10 == 9:
                print(f"  round trip {k + 1}/{n + 10}: direct {1e3 * (t1 - t0):.1f} ms, sdk {1e3 * (t3 - t2):.1f} ms, "
                      f"httpx {1e3 * (t5 - t4):.1f} ms", flush=True)
            if k >= 10:  # warm-up
                times["direct"].append(t1 - t0)
                times["sdk"].append(t3 - t2)
                times["httpx"].append(t5 - t4)
                cpu["direct"].append(c1 - c0)
                cpu["sdk"].append(c3 - c2)
                cpu["httpx"].append(c5 - c4)
    assert len({(len(o[0]), o[1], o[2]) for o in outs}) == 1, "greedy outputs differ: not equal work"
    res = {k: (statistics.median(v) * 1e3, pct(v, 0.9) * 1e3) for k, v in times.items()}
    res["tokens"] = len(next(iter(outs))[0])
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
    print(f"\nround trip, same greedy request ({rt['tokens']} tokens out), p50 / p90 ms:")
    for k in ("direct", "httpx", "sdk"):
        print(f"  {k:8s} {rt[k][0]:7.2f} / {rt[k][1]:7.2f}")
    print("  CPU ms of this process per request (p50): " + ", ".join(f"{k} {v:.2f}" for k, v in rt["cpu"].items()))
    print(f"  endpoint adds (p50 wall): httpx {rt['httpx'][0] - rt['direct'][0]:+.2f} ms, "
          f"openai SDK {rt['sdk'][0] - rt['direct'][0]:+.2f} ms")
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
