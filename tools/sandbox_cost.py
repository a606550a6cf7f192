"""Question: where does a sandboxed run's CPU time go?
CPU per run of ``print(6 * 7)``, old and new backend, and the
new one with one part taken out (or put back) at a time, interleaved in rounds so that all see the same load.

CPU is read from a cgroup-v1 ``cpuacct`` group that this process and everything it starts belong to (the
sandbox's processes are not this process's waited-for children, so ``getrusage`` would miss them); kernel
work done in worker threads (network-namespace teardown) is not in it. Needs root and
``/sys/fs/cgroup/cpuacct``. A diagnostic, not a benchmark: the side-by-side ratios are bench/sandbox.py's.

    python tools/sandbox_cost.py --runs 200
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import statistics
import subprocess
import sys
import time

from agentrl.envs import _bwrap
from agentrl.envs._sandbox_root import sandbox_root
from agentrl.envs.sandbox import SandboxLimits, encode_config, run_sandboxed

CGROUP = "/sys/fs/cgroup/cpuacct/agentrl-sandbox-cost"
LIMITS = SandboxLimits()


class _PopenSpawned:
    """What the launcher returns, for a bwrap started here with ``setpriv`` (the way before the launcher)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.pid, self.pidfd = proc, proc.pid, os.pidfd_open(proc.pid)

    def wait_exit(self, timeout: float) -> bool:
        return bool(select.select([self.pidfd], [], [], max(0.0, timeout))[0])

    def kill(self) -> None:
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self.proc.wait()
        os.close(self.pidfd)


class _SetprivLauncher:
    def spawn(self, argv: list[str], stdout_w: int, fds: list[int]) -> _PopenSpawned:
        argv = list(argv)
        for flag, fd in zip(("--json-status-fd", "--file", "--seccomp"), fds):
            argv[argv.index(flag) + 1] = str(fd)
        prefix = ["setpriv", f"--reuid={_bwrap.SANDBOX_UID}", f"--regid={_bwrap.SANDBOX_UID}", "--clear-groups", "--"]
        return _PopenSpawned(subprocess.Popen(prefix + argv, pass_fds=fds, env={}, stdin=subprocess.DEVNULL,
                                              stdout=stdout_w, stderr=stdout_w, start_new_session=True))


def _without(*flags: str, extra: int = 0):
    """A bwrap command builder that drops ``flags`` (and the ``extra`` arguments after each)."""
    def build(**kwargs) -> list[str]:
        cmd = _BUILD(**kwargs)
        for flag in flags:
            while flag in cmd:
                i = cmd.index(flag)
                del cmd[i:i + 1 + extra]
        return cmd
    return build


def _with_reaper(**kwargs) -> list[str]:
    cmd = _BUILD(**kwargs)
    cmd.remove("--as-pid-1")
    return cmd


_BUILD = _bwrap.bwrap_command
_LAUNCHER = _bwrap._launcher


def variants() -> dict[str, tuple]:
    """name -> (bwrap command builder, launcher factory), or a callable that runs once."""
    python = os.path.realpath(sys.executable)
    root = sandbox_root()
    child = root.path + "/.agentrl/child.pyc"
    config = encode_config(LIMITS, None, True)
    workdir = "/tmp/agentrl-sandbox-cost"
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "main.py"), "w") as f:
        f.write("print(6 * 7)\n")
    return {
        "host: python -I -S -c pass": lambda: subprocess.run([python, "-I", "-S", "-c", "pass"], check=True),
        "host: entry script + print(6*7), no sandbox": lambda: subprocess.run(
            [python, "-I", "-S", "-B", child, config], cwd=workdir, check=True, stdout=subprocess.DEVNULL),
        "old backend (audit_hook)": lambda: run_sandboxed("print(6 * 7)", LIMITS, backend="audit_hook"),
        "new backend (bwrap), as shipped": (_BUILD, _LAUNCHER),
        "  with setpriv per run instead of the launcher": (_BUILD, _SetprivLauncher),
        "  with bwrap's reaper init (no --as-pid-1)": (_with_reaper, _LAUNCHER),
        "  without --unshare-net": (_without("--unshare-net"), _LAUNCHER),
        "  without --unshare-ipc": (_without("--unshare-ipc"), _LAUNCHER),
        "  without --seccomp": (_without("--seccomp", extra=1), _LAUNCHER),
        "  without --proc": (_without("--proc", extra=1), _LAUNCHER),
        "  without the /dev binds": (_without("--dev-bind", extra=2), _LAUNCHER),
        "  without --disable-userns": (_without("--disable-userns"), _LAUNCHER),
    }


def run_once(variant) -> None:
    if callable(variant):
        variant()
        return
    _bwrap.bwrap_command, factory = variant[0], variant[1]
    launcher = factory()
    _bwrap._launcher = lambda: launcher
    try:
        result = run_sandboxed("print(6 * 7)", LIMITS)
        assert result.output == "42\n", result
    finally:
        _bwrap.bwrap_command, _bwrap._launcher = _BUILD, _LAUNCHER


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    os.makedirs(CGROUP, exist_ok=True)
    with open(f"{CGROUP}/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))

    def cpu_s() -> float:
        with open(f"{CGROUP}/cpuacct.usage") as f:
            return int(f.read()) / 1e9

    table = variants()
    for variant in table.values():
        run_once(variant)  # one-time costs (root tree, launcher, imports) are not counted
    cpu = {name: 0.0 for name in table}
    wall: dict[str, list[float]] = {name: [] for name in table}
    rounds = max(1, args.runs // 10)
    for i in range(rounds):
        for name in (list(table) if i % 2 else list(table)[::-1]):
            start_cpu, start = cpu_s(), time.perf_counter()
            for _ in range(10):
                run_once(table[name])
            wall[name].append((time.perf_counter() - start) / 10)
            cpu[name] += cpu_s() - start_cpu
    _LAUNCHER().close()  # leave the group empty, then remove it
    with open(os.path.join(os.path.dirname(CGROUP), "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    try:
        os.rmdir(CGROUP)
    except OSError:
        pass
    print(f"load {os.getloadavg()[0]:.1f}; {rounds * 10} runs each, in rounds of 10")
    print(f"| {'variant':48s} | CPU ms/run | wall ms/run (median of rounds) |")
    print(f"| {'-' * 48} | ---------- | ------------------------------ |")
    for name in table:
        print(f"| {name:48s} | {1000 * cpu[name] / (rounds * 10):10.2f} | {1000 * statistics.median(wall[name]):30.2f} |")


if __name__ == "__main__":
    main()
