"""Run untrusted Python in a separate, limited process: ``run_sandboxed``.

Two backends, chosen explicitly:

- ``"bwrap"`` (the default, and the only security boundary): the program runs under bubblewrap in its
  own user, PID, mount, network, IPC and UTS namespaces as an unprivileged uid, on a read-only view of
  the interpreter with a size-limited private tmpfs as working directory (see ``_bwrap.py``), with
  ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NPROC`` and ``RLIMIT_CORE`` set before any user
  code runs. The PEP 578 audit hook of ``_sandbox_child.py`` runs inside as a second layer only (it
  turns common mistakes into clear messages); nothing depends on it. A missing or unusable ``bwrap``
  is an error that says how to install it, never a silent downgrade.
- ``"audit_hook"``: the older in-process layers (``python -I -S`` in a throwaway host directory, the
  audit hook, rlimits, ``unshare --net`` where allowed). NOT a security boundary: a program that wants
  out gets out. For machines without user namespaces, on trusted code only.

Both: a wall-clock deadline and an output cap, read incrementally, after which everything the program
started is killed. This module knows nothing of environments or scoring.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.envs._bwrap import BwrapUnavailableError, check_bwrap, spawn_bwrap
from agentrl.envs._launcher import LauncherDied, Spawned
from agentrl.envs._seccomp import seccomp_bpf

__all__ = ["BACKENDS", "DEFAULT_BLOCKED_MODULES", "BwrapUnavailableError", "SandboxLimits", "SandboxResult",
           "run_sandboxed"]

BACKENDS = ("bwrap", "audit_hook")

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
        wall_time_s: wall-clock seconds before everything the program started is killed.
        memory_mb: address-space limit (allocations beyond it raise MemoryError).
        max_output_bytes: stdout+stderr kept; the process is killed when it writes more.
        max_file_bytes: largest file the code may write.
        max_processes: processes/threads the code may add (RLIMIT_NPROC headroom).
        max_disk_bytes: size of the private tmpfs working directory: all files together (bwrap backend).
        max_open_files: file descriptors per process (RLIMIT_NOFILE).
        blocked_modules: modules whose import the audit hook refuses.
        audit_hook_layer: bwrap backend: also install the audit hook inside, as a second layer that gives
            clear messages for common mistakes (the audit_hook backend always installs it).
    """

    cpu_time_s: int = 2
    wall_time_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = 16_384
    max_file_bytes: int = 1 << 20
    max_processes: int = 16
    max_disk_bytes: int = 32 << 20
    max_open_files: int = 256
    blocked_modules: tuple[str, ...] = field(default=DEFAULT_BLOCKED_MODULES)
    audit_hook_layer: bool = True


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
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10, check=False).returncode == 0:
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


def _collect(fd: int, wait_exit: Callable[[float], bool], limits: SandboxLimits) -> tuple[bytes, str | None]:
    """Read output from ``fd`` until EOF, the deadline or the cap, then wait (until the deadline) for the
    process to exit (``wait_exit(timeout)``, without reaping it); returns (output, reason it was killed)."""
    deadline = time.monotonic() + limits.wall_time_s
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
    return bytes(buf), None if wait_exit(deadline - time.monotonic()) else "timeout"


def _wait_exit_unreaped(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the child ``pid`` to exit, leaving it unreaped (its id stays ours)."""
    deadline = time.monotonic() + timeout
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True


def run_sandboxed(code: str, limits: SandboxLimits | None = None, *, backend: str = "bwrap") -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandboxed interpreter and return what happened.

    Args:
        code: the program's source.
        limits: resource limits; ``SandboxLimits()`` when None.
        backend: ``"bwrap"`` (OS isolation, the default) or ``"audit_hook"`` (in-process layers only,
            not a security boundary; only when chosen explicitly).

    Raises:
        ValueError: unknown ``backend``.
        BwrapUnavailableError: ``backend="bwrap"`` and bubblewrap is missing or cannot run here.

    Example:
        >>> run_sandboxed("print(6 * 7)").describe()
        '42'
    """
    limits = limits or SandboxLimits()
    if backend == "bwrap":
        check_bwrap((encode_config(SandboxLimits(), None, False),))
        return _run_bwrap(code, limits)
    if backend == "audit_hook":
        return _run_audit_hook(code, limits)
    close = difflib.get_close_matches(str(backend), BACKENDS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown sandbox backend {backend!r}{hint}; expected one of {', '.join(BACKENDS)}")


def encode_config(limits: SandboxLimits, nproc: int | None, hook: bool) -> str:
    """The child's one argument: ``name=value`` pairs joined by ``;`` (cheaper to parse there than JSON)."""
    values = {"cpu_time_s": limits.cpu_time_s, "memory_mb": limits.memory_mb, "max_file_bytes": limits.max_file_bytes,
              "max_open_files": limits.max_open_files, "nproc": nproc, "hook": int(hook),
              "blocked_modules": ",".join(limits.blocked_modules)}
    return ";".join(f"{k}={'' if v is None else v}" for k, v in values.items())


@functools.lru_cache(maxsize=1)
def _seccomp_filter() -> bytes | None:
    try:
        return seccomp_bpf()
    except (ImportError, OSError, RuntimeError) as exc:  # an extra layer: its absence is said, not fatal
        warnings.warn(f"agentrl sandbox: no seccomp filter ({exc}); install pyseccomp and libseccomp2 for it. "
                      "The namespaces and the unprivileged uid still hold.", RuntimeWarning, stacklevel=3)
        return None


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class _Status:
    """bwrap's ``--json-status-fd`` reports, read as they come: the program's host PID, then the exit code."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.data = b""

    def find(self, key: str, deadline: float) -> int | None:
        """The integer value of ``key`` once reported (waiting until ``deadline``), or None."""
        pattern = re.compile(rb'"' + key.encode() + rb'":\s*(-?\d+)\s*[,}\n]')
        while (found := pattern.search(self.data)) is None:
            if not select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            chunk = os.read(self.fd, 4096)  # bwrap writes its reports in pieces
            if not chunk:
                return None
            self.data += chunk
        return int(found.group(1))


def _init_pidfd(bwrap: Spawned, status: _Status, deadline: float) -> int | None:
    """A pidfd of the sandbox's PID-namespace init (the program), from bwrap's status report, or None.

    A pidfd names one process for good, so killing through it later cannot hit a reused PID; the PID is
    checked to be bwrap's child while bwrap is alive (so neither PID can have been reused yet).
    """
    pid = status.find("child-pid", deadline)
    return None if pid is None else _child_pidfd(bwrap, pid)


def _child_pidfd(bwrap: Spawned, pid: int) -> int | None:
    """A pidfd of ``pid`` if it is a child of ``bwrap``, checked while bwrap is alive, else None."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        ppid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:"))
    except (OSError, StopIteration, ValueError):
        ppid = None
    if ppid != bwrap.pid or bwrap.wait_exit(0):
        os.close(pidfd)
        return None
    return pidfd


def _children_pidfds(bwrap: Spawned) -> list[int]:
    """pidfds of the children of bwrap (the init), found through /proc when its report did not come."""
    pids: set[int] = set()
    try:
        for task in os.scandir(f"/proc/{bwrap.pid}/task"):
            pids.update(int(p) for p in Path(task.path, "children").read_text().split())
    except OSError:
        pass
    return [fd for fd in (_child_pidfd(bwrap, pid) for pid in pids) if fd is not None]


def _kill_sandbox(bwrap: Spawned, init_pidfd: int | None) -> None:
    """Kill the sandbox's init (the program) and wait until it has exited, which the kernel allows only
    once every other process of its PID namespace is gone; then make sure bwrap (which reaps the init
    and exits with its status) is gone too.
    """
    extra = [] if init_pidfd is not None or bwrap.wait_exit(0) else _children_pidfds(bwrap)
    pidfds = ([init_pidfd] if init_pidfd is not None else []) + extra
    for pidfd in pidfds:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pidfd in pidfds:
        select.select([pidfd], [], [], 5.0)  # readable once the init has exited
    for pidfd in extra:
        os.close(pidfd)
    if not bwrap.wait_exit(2.0 if pidfds else 0.0):
        bwrap.kill()  # --die-with-parent takes the sandbox with bwrap


def _run_bwrap(code: str, limits: SandboxLimits) -> SandboxResult:
    try:
        return _run_bwrap_once(code, limits)
    except LauncherDied:  # that bwrap never ran (the launcher was killed): once more, with a new launcher
        return _run_bwrap_once(code, limits)


def _run_bwrap_once(code: str, limits: SandboxLimits) -> SandboxResult:
    config = encode_config(limits, limits.max_processes + 1, limits.audit_hook_layer)  # + the program itself: exact
    code_fd = _memfd("main.py", code.encode("utf-8", errors="replace"))
    bpf = _seccomp_filter()
    seccomp_fd = None if bpf is None else _memfd("seccomp", bpf)
    (status_r, status_w), (out_r, out_w) = os.pipe(), os.pipe()
    try:
        bwrap = spawn_bwrap(stdout_fd=out_w, status_fd=status_w, code_fd=code_fd, seccomp_fd=seccomp_fd,
                            disk_bytes=limits.max_disk_bytes, argv=[config])
    except BaseException:
        for fd in (status_r, out_r):
            os.close(fd)
        raise
    finally:
        for fd in (code_fd, status_w, out_w, seccomp_fd):
            if fd is not None:
                os.close(fd)
    init_pidfd, status = None, _Status(status_r)
    try:
        try:
            init_pidfd = _init_pidfd(bwrap, status, time.monotonic() + limits.wall_time_s)
            output, killed = _collect(out_r, bwrap.wait_exit, limits)
        finally:
            _kill_sandbox(bwrap, init_pidfd)
        exit_code = status.find("exit-code", time.monotonic())  # written before bwrap exits, or never
    finally:
        bwrap.close()
        for fd in (status_r, out_r, init_pidfd):
            if fd is not None:
                os.close(fd)
    if exit_code is None:  # bwrap itself was killed: the deadline, or its launcher died
        exit_code, killed = -signal.SIGKILL, killed or "crashed"
    elif exit_code > 128:  # bwrap reports a child killed by signal N as 128 + N
        exit_code = -(exit_code - 128)
    return _result(output, killed, exit_code, limits)


def _result(output: bytes, killed: str | None, exit_code: int, limits: SandboxLimits) -> SandboxResult:
    if killed is None:
        cpu_signals = (-signal.SIGKILL, -signal.SIGXCPU)
        killed = "ok" if exit_code == 0 else "cpu_limit" if exit_code in cpu_signals else (
            "crashed" if exit_code < 0 else "error")
    return SandboxResult(output.decode("utf-8", errors="replace"), killed, exit_code, limits)


def _run_audit_hook(code: str, limits: SandboxLimits) -> SandboxResult:
    nproc = None if os.getuid() == 0 else _user_task_count(os.getuid()) + limits.max_processes
    config = encode_config(limits, nproc, True)
    workdir = tempfile.mkdtemp(prefix="agentrl-sandbox-")
    try:
        Path(workdir, "main.py").write_text(code, encoding="utf-8", errors="replace")
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        cmd = [*_unshare_prefix(), sys.executable, "-I", "-S", _CHILD, config]
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, killed = _collect(proc.stdout.fileno(), functools.partial(_wait_exit_unreaped, proc.pid), limits)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # leftovers too; the leader is not reaped yet
            except (ProcessLookupError, PermissionError):
                pass
            exit_code = proc.wait()
            proc.stdout.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _result(output, killed, exit_code, limits)
