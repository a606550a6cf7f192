"""Soak run: the quickstart's pipeline for an hour or more, with faults injected every few minutes.

Runs `agentrl train configs/quickstart.yaml` (the real CLI: SFT warm start from its cache, async
GRPO with a vLLM engine, held-out eval) with a time limit instead of a step count, and from
outside the run, every ``--sample-s`` seconds, samples every process of its tree (the driver, Ray's
own processes, each actor: RSS, open file descriptors, threads), the bytes under /dev/shm that its
processes made, the bytes in its private temp dir (TMPDIR and Ray's session dir) by kind (the run's
own output, Ray's worker logs, Ray's other logs, Ray's other files, the engines' private temp dirs,
compile caches: :func:`temp_kind`), and the number of processes that are not actors (sandboxes,
tool subprocesses). Every ``--fault-every-s``
seconds it injects the next fault of a cycle: SIGKILL the engine (Ray restarts it), SIGSTOP the
engine (the watchdog must find it frozen and restart it), SIGKILL a rollout actor (replaced).

At the end it checks that no process of the run is left and no file of it remains in /dev/shm
or the temp dir, and writes a JSON of every sample and a PNG plot.

    nice -n 19 .venv/bin/python bench/soak.py --minutes 60 --out docs/assets

It measures leaks, not speed: on a shared machine run it under ``nice -n 19``, not the learn lock.
A SIGTERM or SIGINT to it stops the run as Ctrl-C would (SIGINT to the training process, which
shuts its actors and Ray down), then it reports as usual.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
FAULTS = ("kill_engine", "stop_engine", "kill_rollout")
STOP_GRACE_S = 120.0  # after a SIGTERM/SIGINT to the soak: how long its run may take to shut down


def role(p: psutil.Process) -> str:
    """A stable name for a process of the run: the actor class, or Ray's process name."""
    try:
        name = p.name()  # the kernel's comm: 15 characters ("ray::EngineActo")
        cmd = p.cmdline()
    except psutil.Error:
        return "?"
    title = cmd[0] if cmd else name  # Ray's process title, whole: "ray::EngineActor.generate"
    if title.startswith("ray::"):
        return title.removeprefix("ray::").split(".")[0].split(" ")[0]
    if cmd and "agentrl.cli" in " ".join(cmd[:4]):
        return "driver"
    base = os.path.basename(cmd[0]) if cmd else name
    for known in ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "runtime_env", "bwrap"):
        if known in " ".join(cmd[:3]) or known in name:
            return known.removesuffix(".py")
    return base or name


def tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def temp_kind(rel: str) -> str:
    """The kind of a file of the soak's temp dir, by its path relative to it: the run's own output
    (``run/``: checkpoints, metrics), Ray's worker logs, Ray's other logs, Ray's spilled objects,
    the rest of Ray's session dir, an engine's private temp dir, a compile cache, or other."""
    parts = rel.split("/")
    if parts[0] == "run":
        return "run"
    if parts[0] == "ray":
        if "logs" in parts:
            return "ray_worker_logs" if parts[-1].startswith(("worker-", "python-core-worker-")) else "ray_other_logs"
        return "ray_spilled" if any("spill" in q for q in parts) else "ray_other"
    if parts[0].startswith("agentrl-engine-"):
        return "engine_tmp"
    if parts[0].startswith(("agentrl-compile-", "torchinductor_", "triton", "vllm", "inductor")) or "cache" in parts[0]:
        return "compile_cache"
    return "other"


def temp_bytes_by_kind(tmp: Path) -> dict[str, int]:
    """Bytes under ``tmp`` by :func:`temp_kind` (every kind present, even at 0)."""
    out = dict.fromkeys(("run", "ray_worker_logs", "ray_other_logs", "ray_spilled", "ray_other", "engine_tmp",
                         "compile_cache", "other"), 0)
    for dirpath, _, files in os.walk(tmp):
        rel_dir = os.path.relpath(dirpath, tmp)
        for f in files:
            try:
                size = os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                continue
            out[temp_kind(f if rel_dir == "." else f"{rel_dir}/{f}")] += size
    return out


def shm_entries(pids: set[int]) -> dict[str, int]:
    """/dev/shm entries that belong to the run: agentrl's staging folders are named by pid."""
    out = {}
    for e in Path("/dev/shm").glob("agentrl-*"):
        pid = e.name.removeprefix("agentrl-")
        if pid.isdigit() and int(pid) in pids:
            out[e.name] = dir_bytes(e) if e.is_dir() else e.stat().st_size
    return out


def sample(root: psutil.Process, tmp: Path, seen: set[int], t0: float) -> dict:
    procs = {}
    for p in tree(root):
        try:
            with p.oneshot():
                info = {"role": role(p), "rss_mib": p.memory_info().rss / 2**20, "fds": p.num_fds(),
                        "threads": p.num_threads()}
        except psutil.Error:
            continue
        seen.add(p.pid)
        procs[str(p.pid)] = info
    shm = shm_entries(seen)
    kinds = temp_bytes_by_kind(tmp)
    return {
        "t_s": time.time() - t0,
        "procs": procs,
        "shm_bytes": sum(shm.values()),
        "shm_entries": len(shm),
        "tmp_bytes": sum(kinds.values()),
        "tmp_bytes_by_kind": kinds,
        "other_procs": sum(1 for v in procs.values() if v["role"] in ("bwrap", "python", "sh", "bash")),
    }


def find(root: psutil.Process, actor: str) -> list[psutil.Process]:
    return [p for p in tree(root) if role(p) == actor]


def inject(root: psutil.Process, fault: str, log) -> str:
    if fault in ("kill_engine", "stop_engine"):
        engines = find(root, "EngineActor")
        if not engines:
            return "no engine process (restarting?)"
        pid = engines[0].pid
        os.kill(pid, signal.SIGKILL if fault == "kill_engine" else signal.SIGSTOP)
        return f"{fault} pid {pid}"
    rollouts = find(root, "RolloutActor")
    if not rollouts:
        return "no rollout process"
    os.kill(rollouts[0].pid, signal.SIGKILL)
    return f"kill_rollout pid {rollouts[0].pid}"


def growth(samples: list[dict], key) -> dict:
    """Mean of a series over the last quarter of the run relative to the quarter after warm-up
    (the first quarter), per role: 1.0 is flat."""
    n = len(samples)
    if n < 8:
        return {}
    early, late = samples[n // 4: n // 2], samples[3 * n // 4:]
    out = {}
    for label, fn in key.items():
        a = sum(fn(s) for s in early) / len(early)
        b = sum(fn(s) for s in late) / len(late)
        out[label] = {"early": a, "late": b, "ratio": b / a if a else (1.0 if not b else float("inf"))}
    return out


def by_role(s: dict, field: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for v in s["procs"].values():
        out[v["role"]] = out.get(v["role"], 0.0) + v[field]
    return out


def plot(samples: list[dict], faults: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] / 60 for s in samples]
    roles = sorted({r for s in samples for r in by_role(s, "rss_mib")})
    fig, axes = plt.subplots(2, 3, figsize=(16, 8), sharex=True)
    panels = [("RSS (MiB) by process role", "rss_mib"), ("open file descriptors", "fds"), ("threads", "threads")]
    for ax, (title, field) in zip(axes[0], panels):
        for r in roles:
            ax.plot(t, [by_role(s, field).get(r, float("nan")) for s in samples], label=r, lw=1)
        ax.set_title(title)
    axes[0][0].legend(fontsize=7, ncol=2)
    axes[1][0].plot(t, [s["shm_bytes"] / 2**20 for s in samples], label="/dev/shm MiB (the run's)")
    axes[1][0].plot(t, [s["shm_entries"] for s in samples], label="/dev/shm entries")
    axes[1][0].set_title("/dev/shm")
    axes[1][0].legend(fontsize=7)
    axes[1][1].plot(t, [s["tmp_bytes"] / 2**20 for s in samples], label="all", color="black")
    for kind in sorted({k for s in samples for k, v in s.get("tmp_bytes_by_kind", {}).items() if v}):
        axes[1][1].plot(t, [s["tmp_bytes_by_kind"].get(kind, 0) / 2**20 for s in samples], label=kind, lw=1)
    axes[1][1].set_title("temp dir MiB (TMPDIR, Ray session) by kind")
    axes[1][1].legend(fontsize=7)
    axes[1][2].plot(t, [len(s["procs"]) for s in samples], label="processes in the run's tree")
    axes[1][2].plot(t, [s["other_procs"] for s in samples], label="non-actor children (sandboxes, tools)")
    axes[1][2].set_title("processes")
    axes[1][2].legend(fontsize=7)
    for row in axes:
        for ax in row:
            for f in faults:
                ax.axvline(f["t_s"] / 60, color="red", alpha=0.25, lw=0.8)
            ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("minutes (red: a fault injected)")
    fig.suptitle("agentrl soak: the quickstart pipeline with faults every few minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="training wall time (train.time_limit_s)")
    ap.add_argument("--fault-every-s", type=float, default=300.0)
    ap.add_argument("--sample-s", type=float, default=20.0)
    ap.add_argument("--out", default=str(REPO / "docs" / "assets"), help="where soak.json and soak.png go")
    ap.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"))
    ap.add_argument("overrides", nargs="*", help="extra dotted overrides for the run")
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
    run_dir = tmp / "run"
    env = dict(os.environ, TMPDIR=str(tmp), RAY_TMPDIR=str(tmp), PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "agentrl.cli", "train", args.config,
           f"run_dir={run_dir}", "train.num_steps=1000000", f"train.time_limit_s={args.minutes * 60:g}",
           "train.checkpoint_interval=50", "eval.num_episodes=32",
           # faults every few minutes: a frozen engine is found within a minute or two
           "watchdog.floor_s=60", "watchdog.first_s=600", *args.overrides, "--no-progress"]
    log = open(tmp / "train.log", "w")  # noqa: SIM115
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    root = psutil.Process(proc.pid)
    stopped: list[int] = []

    def stop(signum, _frame):  # a SIGTERM or SIGINT to the soak stops its run too, which shuts down as on Ctrl-C
        stopped.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    samples: list[dict] = []
    faults: list[dict] = []
    seen: set[int] = set()
    next_fault = t0 + args.fault_every_s
    k = 0
    trained = False
    print(f"soak: pid {proc.pid}, temp dir {tmp}, log {tmp / 'train.log'}", flush=True)
    while proc.poll() is None:
        samples.append(sample(root, tmp, seen, t0))
        if stopped:
            break
        # faults only once it trains: not during start-up, nor during the final eval (below)
        trained = trained or ((run_dir / "metrics.jsonl").is_file()
                              and '"train/loss"' in (run_dir / "metrics.jsonl").read_text())
        if trained and time.time() >= next_fault and time.time() - t0 < args.minutes * 60 - 120:
            what = inject(root, FAULTS[k % len(FAULTS)], log)
            faults.append({"t_s": time.time() - t0, "fault": FAULTS[k % len(FAULTS)], "what": what})
            print(f"soak: {time.time() - t0:7.0f}s {what}", flush=True)
            k += 1
            next_fault = time.time() + args.fault_every_s
        time.sleep(args.sample_s)
    try:
        rc = proc.wait(timeout=STOP_GRACE_S if stopped else None)
    except subprocess.TimeoutExpired:  # stopped, and the run did not shut down in time: its tree goes
        for p in reversed(tree(root)):
            with contextlib.suppress(psutil.Error):
                p.kill()
        rc = proc.wait()
    log.close()
    time.sleep(10)  # Ray's processes exit after the driver
    left = []
    for pid in sorted(seen):
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append({"pid": pid, "name": p.name(), "cmd": " ".join(p.cmdline()[:3])})
        except psutil.Error:
            pass
    shm_left = shm_entries(seen)
    # Ray keeps its session folder (logs, by design) after the cluster stops: counted apart
    kept = [p for p in tmp.rglob("*") if p.is_file() and not p.is_relative_to(run_dir) and p.name != "train.log"]
    ray_logs = [p for p in kept if p.is_relative_to(tmp / "ray")]
    tmp_left = [str(p.relative_to(tmp)) for p in kept if not p.is_relative_to(tmp / "ray")]
    ray_left = [str(p.relative_to(tmp)) for p in ray_logs
                if "/logs/" not in f"/{p.relative_to(tmp)}" and not p.name.endswith((".log", ".out", ".err"))]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").is_file() else []
    steps = [r for r in rows if "train/loss" in r]
    roles = sorted({r for s in samples for r in by_role(s, "rss_mib")})
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                 text=True).stdout.strip(),
        "command": " ".join(cmd),
        "exit_code": rc,
        "wall_s": time.time() - t0,
        "steps": len(steps),
        "faults": faults,
        "fault_metrics": {k: v for k, v in (steps[-1] if steps else {}).items() if k.startswith("faults/")},
        "replay": {k: v for k, v in (steps[-1] if steps else {}).items() if k.startswith("replay/")},
        "eval": {k: v for r in rows for k, v in r.items() if k.startswith("eval_")},
        "growth_rss": growth(samples, {r: (lambda s, r=r: by_role(s, "rss_mib").get(r, 0.0)) for r in roles}),
        "growth_fds": growth(samples, {r: (lambda s, r=r: by_role(s, "fds").get(r, 0.0)) for r in roles}),
        "growth_threads": growth(samples, {r: (lambda s, r=r: by_role(s, "threads").get(r, 0.0)) for r in roles}),
        "growth_other": growth(samples, {"shm_bytes": lambda s: s["shm_bytes"], "tmp_bytes": lambda s: s["tmp_bytes"],
                                         "processes": lambda s: len(s["procs"])}),
        "growth_tmp_by_kind": growth(samples, {k: (lambda s, k=k: s["tmp_bytes_by_kind"][k])
                                               for k in (samples[0]["tmp_bytes_by_kind"] if samples else {})}),
        "tmp_bytes_by_kind_left": temp_bytes_by_kind(tmp),
        "leaked_processes": left,
        "leaked_shm": shm_left,
        "leaked_tmp_files": tmp_left[:50],
        "num_leaked_tmp_files": len(tmp_left),
        "ray_session_files_kept": len(ray_logs),
        "ray_session_non_log_files": ray_left[:50],
        "samples": samples,
    }
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(samples, faults, out / "soak.png")
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "growth_fds", "growth_threads")},
                     indent=1))
    for pid in [p["pid"] for p in left]:  # leave the machine clean for the others
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(tmp, ignore_errors=True) if rc == 0 and not left else None
    return 0 if rc == 0 and not left and not shm_left else 1


if __name__ == "__main__":
    sys.exit(main())
