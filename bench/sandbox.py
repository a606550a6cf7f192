"""Cost of the bubblewrap sandbox against the old in-process one, side by side in one run.

Run: ``python bench/sandbox.py`` (about a minute on 2 CPU cores; ``--quick`` for a smoke run).

1. Latency of one sandboxed run of ``print(6 * 7)``: p50/p95 over ``--runs`` runs, the two backends
   interleaved run by run so that both see the same machine load.
2. Throughput of ``--concurrency`` concurrent runs (threads, as rollout actors call it), runs/s.
3. PythonSandbox-v0 episodes/s: reset, one ``run_python`` tool call, a final answer scored by the
   hidden tests (two sandboxed runs per episode), sequentially and with ``--concurrency`` envs at once.

``bwrap`` is the new boundary; ``audit_hook`` is the sandbox as it was before (in-process audit hook,
rlimits, ``unshare --net``), still selectable explicitly. Goals: bwrap p50 < 50 ms, episodes/s within 20 %.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from agentrl.envs import PythonSandboxEnv, SandboxLimits, run_sandboxed

from agentrl.rollout.chat import format_tool_call

BACKENDS = ("audit_hook", "bwrap")
LIMITS = SandboxLimits(cpu_time_s=2, wall_time_s=10.0)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency(runs: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {b: [] for b in BACKENDS}
    for i in range(runs):
        for backend in BACKENDS if i % 2 else BACKENDS[::-1]:
            start = time.perf_counter()
            result = run_sandboxed("print(6 * 7)", LIMITS, backend=backend)
            times[backend].append(time.perf_counter() - start)
            assert result.output == "42\n", result
    return times


def throughput(concurrency: int, rounds: int, backend: str) -> float:
    with ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        outputs = list(pool.map(lambda _: run_sandboxed("print(6 * 7)", LIMITS, backend=backend).output,
                                range(concurrency * rounds)))
        elapsed = time.perf_counter() - start
    assert outputs == ["42\n"] * len(outputs)
    return len(outputs) / elapsed


def episode(env: PythonSandboxEnv, seed: int) -> float:
    env.reset(seed=seed)
    table = {repr(args): env.reference(*args) for args in env.inputs}  # a correct (lookup-table) answer
    code = f"_t = {table!r}\ndef {env.function_name}(*args):\n    return _t[repr(args)]\n"
    obs, *_ = env.step(format_tool_call("run_python", {"code": code + "print('defined')"}))
    assert obs[0]["content"] == "defined", obs
    _, reward, terminated, _, _ = env.step(f"```python\n{code}```")
    assert terminated and reward == 1.0
    return reward


def episodes_per_s(num_episodes: int, concurrency: int, backend: str) -> float:
    envs = [PythonSandboxEnv(sandbox_backend=backend) for _ in range(concurrency)]

    def worker(k: int) -> None:  # one env per thread, as one rollout actor drives one env at a time
        for seed in range(k, num_episodes, concurrency):
            episode(envs[k], seed)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(worker, range(concurrency)))
    return num_episodes / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="20 runs, 8 concurrent, 8 episodes")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.concurrency, args.episodes = 20, 8, 8
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    load = os.getloadavg()[0]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {load:.1f}; "
          f"commit {commit}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    run_sandboxed("pass", LIMITS, backend="bwrap")  # the one-time check, root tree and launcher are not timed
    for backend in BACKENDS:  # nor the first tool call's import of the tool-call parser (it went to whichever ran first)
        episode(PythonSandboxEnv(sandbox_backend=backend), 0)
    times = latency(args.runs)
    rows = []
    for name, fn in (("p50 latency (ms)", lambda b: 1000 * percentile(times[b], 0.5)),
                     ("p95 latency (ms)", lambda b: 1000 * percentile(times[b], 0.95)),
                     ("mean latency (ms)", lambda b: 1000 * statistics.fmean(times[b]))):
        rows.append((name, fn("audit_hook"), fn("bwrap")))
    rounds = 3
    rows.append((f"runs/s, {args.concurrency} concurrent",
                 *(throughput(args.concurrency, rounds, b) for b in BACKENDS)))
    rows.append(("PythonSandbox-v0 episodes/s, sequential",
                 *(episodes_per_s(args.episodes, 1, b) for b in BACKENDS)))
    rows.append((f"PythonSandbox-v0 episodes/s, {min(8, args.concurrency)} envs",
                 *(episodes_per_s(args.episodes, min(8, args.concurrency), b) for b in BACKENDS)))
    print(f"load after: {os.getloadavg()[0]:.1f}")
    print(f"| {'measure':42s} | {'audit_hook (old)':>16s} | {'bwrap (new)':>11s} | {'new/old':>7s} |")
    print(f"| {'-' * 42} | {'-' * 16} | {'-' * 11} | {'-' * 7} |")
    for name, old, new in rows:
        print(f"| {name:42s} | {old:16.1f} | {new:11.1f} | {new / old:7.2f} |")


if __name__ == "__main__":
    main()
