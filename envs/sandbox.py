"""Run untrusted Python in a separate, limited process.

Layers, each a backstop for the others:

- a fresh ``python -I -S`` process (isolated mode, standard library only, minimal environment) in a
  throwaway working directory that is deleted afterwards;
- resource limits set in the child before any user code runs: ``RLIMIT_CPU``, ``RLIMIT_AS``,
  ``RLIMIT_FSIZE``, ``RLIMIT_CORE`` and ``RLIMIT_NPROC`` (Linux exempts uid 0 from the last one);
- an audit hook (PEP 578) that refuses process creation, signals, sockets, writes outside the
  working directory, reads outside it and the Python installation (no credentials, no other
  processes' ``/proc`` entries, no hidden tests), and imports of ``blocked_modules``;
- a network namespace (``unshare --net``) where the machine allows it;
- a wall-clock deadline and an output cap, read incrementally, after which the whole process group
  is killed.

This contains what a policy writes by accident or by reward hacking; it is not a boundary against a
determined attacker. Run training in a container or VM as well.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["DEFAULT_BLOCKED_MODULES", "SandboxLimits", "SandboxResult", "run_sandboxed"]

DEFAULT_BLOCKED_MODULES = (
    "socket", "_socket", "ssl", "_ssl", "subprocess", "_posixsubprocess", "multiprocessing",
    "_multiprocessing", "ctypes", "_ctypes", "pty", "resource", "asyncio", "urllib.request", "http.client",
)
_CHILD = str(Path(__file__).with_name("_sandbox_child.py"))


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    Args:
        cpu_time_s: CPU seconds before the kernel kills the process.
        wall_time_s: wall-clock seconds before the process group is killed.
        memory_mb: address-space limit (allocations beyond it raise MemoryError).
        max_output_bytes: stdout+stderr kept; the process is killed when it writes more.
        max_file_bytes: largest file the code may write.
        max_processes: processes/threads the code may add (RLIMIT_NPROC headroom).
        blocked_modules: modules whose import is refused.
    """

    cpu_time_s: int = 2
    wall_time_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = 16_384
    max_file_bytes: int = 1 << 20
    max_processes: int = 16
    blocked_modules: tuple[str, ...] = field(default=DEFAULT_BLOCKED_MODULES)


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run. ``status`` is one of ok, error, timeout, cpu_limit, output_limit, crashed."""

    output: str
    status: str
    exit_code: int | None
    limits: SandboxLimits

    def describe(self) -> str:
        """The text a model sees: the output and, unless the run succeeded, what went wrong."""
        note = {
            "ok": "",
            "error": f"[exit code {self.exit_code}]",
            "timeout": f"[killed: wall-clock limit of {self.limits.wall_time_s:g} s exceeded]",
            "cpu_limit": f"[killed: CPU time limit of {self.limits.cpu_time_s} s exceeded]",
            "output_limit": f"[killed: output exceeded {self.limits.max_output_bytes} bytes; truncated]",
        }.get(self.status)
        if note is None:
            note = f"[crashed: {_signal_name(-(self.exit_code or 0))}]"
        text = self.output if self.output.strip() else ("(no output)" if not note else "")
        return "\n".join(part for part in (text.rstrip("\n"), note) if part)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@functools.lru_cache(maxsize=1)
def _unshare_prefix() -> tuple[str, ...]:
    """A command prefix that gives the child its own empty network namespace, if allowed here."""
    if shutil.which("unshare") is None:
        return ()
    for prefix in (("unshare", "--net"), ("unshare", "--user", "--map-root-user", "--net")):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.SubprocessError):
            pass
    return ()


def _user_task_count(uid: int) -> int:
    """Tasks (processes and threads) of ``uid``: RLIMIT_NPROC counts them all, system-wide."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = dict(line.split(":", 1) for line in Path(entry.path, "status").read_text().splitlines()
                              if line.startswith(("Uid:", "Threads:")))
                if int(fields["Uid"].split()[0]) == uid:
                    count += int(fields["Threads"])
            except (OSError, KeyError, ValueError):
                continue
    return count


def _collect(proc: subprocess.Popen, limits: SandboxLimits) -> tuple[bytes, str | None]:
    """Read output until EOF, the deadline or the cap; returns (output, reason it was killed)."""
    deadline = time.monotonic() + limits.wall_time_s
    fd = proc.stdout.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    buf = bytearray()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return bytes(buf), "timeout"
        if not poller.poll(remaining * 1000):
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        room = limits.max_output_bytes - len(buf)
        buf += chunk[:room]
        if len(chunk) > room:
            return bytes(buf), "output_limit"
    while True:  # EOF: wait for exit without reaping, so the group id cannot have been reused
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return bytes(buf), None
        if time.monotonic() > deadline:
            return bytes(buf), "timeout"
        time.sleep(0.002)


def run_sandboxed(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandboxed interpreter and return what happened.

    Example:
        >>> run_sandboxed("print(6 * 7)").describe()
        '42'
    """
    limits = limits or SandboxLimits()
    nproc = None if os.getuid() == 0 else _user_task_count(os.getuid()) + limits.max_processes
    config = {**asdict(limits), "nproc": nproc}
    workdir = tempfile.mkdtemp(prefix="agentrl-sandbox-")
    try:
        Path(workdir, "main.py").write_text(code, encoding="utf-8", errors="replace")
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        cmd = [*_unshare_prefix(), sys.executable, "-I", "-S", _CHILD, json.dumps(config)]
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, killed = _collect(proc, limits)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # leftovers too; the leader is not reaped yet
            except (ProcessLookupError, PermissionError):
                pass
            exit_code = proc.wait()
            proc.stdout.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if killed is None:
        cpu_signals = (-signal.SIGKILL, -signal.SIGXCPU)
        killed = "ok" if exit_code == 0 else "cpu_limit" if exit_code in cpu_signals else (
            "crashed" if exit_code < 0 else "error")
    return SandboxResult(output.decode("utf-8", errors="replace"), killed, exit_code, limits)
