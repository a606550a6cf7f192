"""Cost of per-episode workspaces, side by side with the one-shot sandbox in one run.

Run: ``python bench/workspace.py`` (a few minutes on 2 CPU cores; ``--quick`` for a smoke run).

1. Create + destroy of a workspace holding a RepoFix-v0 package (p50/p95), interleaved run by run with a
   one-shot ``run_sandboxed("pass")`` (the sandbox this builds on), and the cost of the base-tree copy
   (an empty base, the package, a 4 MiB base).
2. ``bash`` calls in a live workspace (p50/p95): ``echo``, ``cat`` of a file, the package's visible tests,
   interleaved with the same work as a one-shot sandboxed run (what a call costs without a live shell).
3. Memory (PSS of the sandbox's processes and bwrap, plus the tmpfs pages) and host disk per workspace.
4. ``--concurrency`` workspaces at once (threads, as rollout actors drive envs): each created, ``--calls``
   calls (tests, an edit, tests), snapshot, destroyed; errors counted, calls/s, peak memory.

Goals: create < 50 ms, bash call p50 < 30 ms, 64 concurrent workspaces without errors.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from agentrl.envs import SandboxLimits, run_sandboxed
from agentrl.envs.repo_fix import TEST_COMMAND, make_task
from agentrl.envs.workspace import Workspace, WorkspaceLimits, make_tar

LIMITS = WorkspaceLimits(call_timeout_s=60.0, max_disk_bytes=16 << 20)
ONE_SHOT = SandboxLimits(cpu_time_s=10, wall_time_s=60.0)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(values: list[float]) -> str:
    return f"p50 {percentile(values, 0.5) * 1e3:7.1f} ms  p95 {percentile(values, 0.95) * 1e3:7.1f} ms"


def repo() -> tuple[bytes, object]:
    task = make_task(random.Random(0))
    return make_tar(task.files), task


def create_destroy(runs: int, base: bytes) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"create": [], "destroy": [], "one_shot": []}
    for i in range(runs):
        for what in ("ws", "one_shot") if i % 2 else ("one_shot", "ws"):
            start = time.perf_counter()
            if what == "one_shot":
                assert run_sandboxed("pass", ONE_SHOT).status == "ok"
                times["one_shot"].append(time.perf_counter() - start)
                continue
            ws = Workspace(base, LIMITS)
            created = time.perf_counter()
            ws.close()
            times["create"].append(created - start)
            times["destroy"].append(time.perf_counter() - created)
    return times


def base_copy_cost(runs: int, package: bytes) -> dict[str, float]:
    bases = {"empty": None, f"package ({len(package) // 1024} KiB tar)": package,
             "4 MiB tar": make_tar({f"blob{i}.bin": os.urandom(256 << 10) for i in range(16)})}
    out = {}
    for _ in range(2):  # the second pass is the one kept (warm caches)
        for name, base in bases.items():
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                Workspace(base, LIMITS).close()
                times.append(time.perf_counter() - start)
            out[name] = percentile(times, 0.5)
    return out


def _one_shot_tests(files: dict[str, str]) -> str:
    """A program that writes the package into a fresh sandbox and runs its tests there."""
    return (f"import os, sys, unittest\nfor path, text in {files!r}.items():\n"
            "    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)\n    open(path, 'w').write(text)\n"
            "sys.path.insert(0, os.getcwd())\n"
            "r = unittest.TextTestRunner(stream=open(os.devnull, 'w')).run("
            "unittest.defaultTestLoader.discover('tests', top_level_dir='.'))\nprint(len(r.failures))\n")


def calls(runs: int, base: bytes, task) -> dict[str, dict[str, list[float]]]:
    module = f"{task.package}/{task.bugged.module}.py"
    source = dict(task.files)[module]
    work = {  # name: (shell command, equivalent one-shot Python program)
        "echo": ("echo hi", "print('hi')"),
        "cat file": (f"cat {module}", f"print({source!r})"),
        "unit tests": (TEST_COMMAND + " >/dev/null 2>&1; echo done", _one_shot_tests(task.files)),
    }
    out: dict[str, dict[str, list[float]]] = {name: {"bash": [], "one_shot": []} for name in work}
    with Workspace(base, LIMITS) as ws:
        for i in range(runs):
            for name, (command, program) in work.items():
                for what in ("bash", "one_shot") if i % 2 else ("one_shot", "bash"):
                    start = time.perf_counter()
                    if what == "bash":
                        r = ws.bash(command)
                        assert r.status == "ok", r
                    else:
                        r = run_sandboxed(program, ONE_SHOT)
                        assert r.status == "ok", r.describe()
                    out[name][what].append(time.perf_counter() - start)
    return out


def _pss_kib(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def memory(count: int, base: bytes) -> dict[str, float]:
    spaces = [Workspace(base, LIMITS) for _ in range(count)]
    try:
        time.sleep(0.2)
        pss, tmpfs = [], []
        for ws in spaces:
            pids = ws.processes() + [ws._shell.bwrap.pid]
            pss.append(sum(_pss_kib(p) for p in pids))
            st = os.statvfs(f"/proc/{pids[0]}/root/workspace")
            tmpfs.append((st.f_blocks - st.f_bfree) * st.f_frsize / 1024)
        return {"pss_kib": statistics.mean(pss), "tmpfs_kib": statistics.mean(tmpfs), "host_disk_bytes": 0.0}
    finally:
        for ws in spaces:
            ws.close()


def concurrent(concurrency: int, num_calls: int, base: bytes, task) -> dict[str, float]:
    module = f"{task.package}/{task.bugged.module}.py"
    errors: list[str] = []
    latencies: list[float] = []
    pss: list[int] = []

    def episode(k: int) -> None:
        try:
            with Workspace(base, LIMITS) as ws:
                for j in range(num_calls):
                    start = time.perf_counter()
                    if j == num_calls // 2:
                        ws.str_replace(module, task.bugged.buggy, task.bugged.correct)
                    else:
                        r = ws.bash(TEST_COMMAND + " 2>&1 | tail -n 1")
                        if r.status != "ok" or not r.output.strip():
                            errors.append(f"{k}: {r.describe()[:200]}")
                    latencies.append(time.perf_counter() - start)
                pss.append(sum(_pss_kib(p) for p in ws.processes() + [ws._shell.bwrap.pid]))
                ws.snapshot()
        except Exception as exc:  # counted, not raised: the figure is how many failed
            errors.append(f"{k}: {type(exc).__name__}: {exc}")

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(episode, range(concurrency)))
    elapsed = time.perf_counter() - start
    return {"episodes": concurrency, "errors": len(errors), "wall_s": elapsed, "calls_per_s": len(latencies) / elapsed,
            "call_p50_ms": percentile(latencies, 0.5) * 1e3, "call_p95_ms": percentile(latencies, 0.95) * 1e3,
            "pss_mib": statistics.mean(pss) / 1024 if pss else 0.0, "first_errors": errors[:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.concurrency, args.calls = 6, 8, 3
    base, task = repo()
    Workspace(base, LIMITS).close()  # builds the root tree once
    run_sandboxed("pass", ONE_SHOT)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# bench/workspace.py  {platform.node()}  {os.cpu_count()} CPUs  load {os.getloadavg()[0]:.1f}  "
          f"commit {commit}  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")

    t = create_destroy(args.runs, base)
    print("\n## 1. create + destroy (RepoFix package as base)")
    print(f"workspace create       {ms(t['create'])}")
    print(f"workspace destroy      {ms(t['destroy'])}")
    print(f"one-shot run_sandboxed {ms(t['one_shot'])}   (create / one-shot p50: "
          f"{percentile(t['create'], 0.5) / percentile(t['one_shot'], 0.5):.2f}x)")
    print("base-tree copy (create + destroy p50 by base size):")
    for name, value in base_copy_cost(max(3, args.runs // 4), base).items():
        print(f"  {name:28s} {value * 1e3:7.1f} ms")

    print("\n## 2. calls in a live workspace vs a one-shot sandboxed run of the same work")
    for name, times in calls(args.runs, base, task).items():
        ratio = percentile(times["one_shot"], 0.5) / percentile(times["bash"], 0.5)
        print(f"{name:10s} bash {ms(times['bash'])} | one-shot {ms(times['one_shot'])} | one-shot/bash {ratio:.1f}x")

    m = memory(min(16, args.concurrency), base)
    print("\n## 3. memory and disk per workspace (idle, package as base)")
    print(f"PSS of init + shell + bwrap {m['pss_kib'] / 1024:.2f} MiB; tmpfs pages {m['tmpfs_kib']:.0f} KiB; "
          f"host disk {m['host_disk_bytes']:.0f} B (the workspace is a tmpfs inside the sandbox)")

    c = concurrent(args.concurrency, args.calls, base, task)
    print(f"\n## 4. {c['episodes']} concurrent workspaces ({args.calls} calls each: tests, str_replace, tests; "
          "snapshot; destroy)")
    print(f"errors {c['errors']}  wall {c['wall_s']:.1f} s  calls/s {c['calls_per_s']:.1f}  call p50 "
          f"{c['call_p50_ms']:.0f} ms  p95 {c['call_p95_ms']:.0f} ms  PSS per live workspace after its calls "
          f"{c['pss_mib']:.2f} MiB")
    if c["first_errors"]:
        print("first errors:", *c["first_errors"], sep="\n  ")
    print("\ngoals: create p50 < 50 ms: {}; bash echo p50 < 30 ms: see section 2; {} concurrent without errors: {}"
          .format("met" if percentile(t["create"], 0.5) < 0.05 else "NOT met", c["episodes"],
                  "met" if c["errors"] == 0 else "NOT met"))


if __name__ == "__main__":
    main()
