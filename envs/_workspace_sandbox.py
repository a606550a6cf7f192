"""One workspace's sandbox process: the bwrap command, its start, the shell protocol and the kills.

The sandbox is the one of ``_bwrap.py`` (user, PID, mount, network, IPC, UTS and cgroup namespaces, host
and sandbox uid 65534, no capabilities, ``--disable-userns``, the seccomp filter, ``--die-with-parent``,
started by the same unprivileged launcher), with a root tree that also holds a shell and tools
(``_workspace_root.py``), and it lives for a whole episode: its init (``_workspace_init.sh``) keeps a bash
reading commands from a pipe. The workspace is a size-limited tmpfs inside the sandbox's own mount
namespace, so nothing of it exists on the host: when the init dies (episode end, a crash, the worker
killed with ``kill -9``: the launcher exits, then bwrap and its sandbox with it) the kernel frees it.

Nothing here is trusted for a reward: what the shell reports (exit codes, the working directory) is as
good as the program that runs in it. Knows nothing of tools or envs (``workspace.py``).
"""

from __future__ import annotations

import os
import re
import select
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from agentrl.envs._bwrap import SANDBOX_UID, _bwrap_path, _launcher
from agentrl.envs._launcher import Spawned
from agentrl.envs._sandbox_root import DEVICES
from agentrl.envs._workspace_root import INIT_PATH, PLACEHOLDERS, workspace_root

__all__ = ["BASE_TAR", "HIDDEN_PATH", "WORKSPACE", "Shell", "ShellReply", "WorkspaceDied"]

WORKSPACE = "/workspace"
BASE_TAR, HIDDEN_PATH = PLACEHOLDERS  # files of the root tree, bound over per sandbox
_ENV = {"PATH": "/usr/bin:/bin", "HOME": WORKSPACE, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "TERM": "dumb",
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}


class WorkspaceDied(RuntimeError):
    """The workspace's sandbox is gone (closed, or killed from outside): its files are gone with it."""


@dataclass
class ShellReply:
    """What one command gave: its output (stdout and stderr, as written, up to the cap), the exit code
    the shell reported (None when it did not report one), and why the host stepped in, if it did:
    ``timeout``, ``output_limit``, ``inode_limit`` or ``shell_exited``."""

    output: bytes
    exit_code: int | None
    killed: str | None
    omitted_bytes: int
    cwd: str
    restarted: bool = False


def _bwrap_command(*, disk_bytes: int, tmp_bytes: int, limits_argv: list[str], seccomp: bool, base: bool,
                   hidden: bool) -> list[str]:
    """Descriptors as bwrap gets them: 3 its JSON status; 4 the commands (read end), 5 the reports (write
    end); then the seccomp program, the base tar and the hidden file, each when present, in that order."""
    root = workspace_root()
    cmd = [_bwrap_path(), "--as-pid-1", "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
           "--unshare-uts", "--unshare-cgroup-try", "--disable-userns", "--uid", str(SANDBOX_UID), "--gid",
           str(SANDBOX_UID), "--hostname", "workspace", "--die-with-parent", "--new-session",
           "--json-status-fd", "3", "--clearenv"]
    for name, value in _ENV.items():
        cmd += ["--setenv", name, value]
    cmd += ["--ro-bind", root.path, "/", "--proc", "/proc"]
    for device in DEVICES:
        cmd += ["--dev-bind", device, device]
    cmd += ["--size", str(disk_bytes), "--tmpfs", WORKSPACE, "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    fd = 6
    if seccomp:
        cmd += ["--seccomp", str(fd)]
        fd += 1
    if base:
        cmd += ["--ro-bind-data", str(fd), BASE_TAR]
        fd += 1
    if hidden:
        cmd += ["--ro-bind-data", str(fd), HIDDEN_PATH]
    return cmd + ["--chdir", WORKSPACE, "/usr/bin/bash", "--noprofile", "--norc", INIT_PATH, *limits_argv]


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


class Shell:
    """The sandbox of one workspace and the bash in it. Not thread-safe: one call at a time.

    Args:
        disk_bytes / tmp_bytes: sizes of the ``/workspace`` and ``/tmp`` tmpfs mounts.
        nproc: RLIMIT_NPROC (tasks of the sandbox's uid in its own user namespace, threads included).
        limits_argv: the init's other limits (see ``_workspace_init.sh``).
        seccomp: the BPF program, or None.
        base: a tar archive unpacked into ``/workspace`` at the start, or None.
        hidden: bytes readable (read-only) at ``/.agentrl/hidden``, or None.
        start_timeout_s: how long the start may take.

    Raises:
        WorkspaceDied: the sandbox did not start.
    """

    def __init__(self, *, disk_bytes: int, tmp_bytes: int, limits_argv: list[str], seccomp: bytes | None,
                 base: bytes | None, hidden: bytes | None, start_timeout_s: float = 30.0) -> None:
        self._fds: list[int] = []
        self.bwrap: Spawned | None = None
        self.init_pidfd = -1
        self.shell_pid = -1  # host PID of the current shell, once known
        self._shell_pidfd = -1
        self._reports = b""
        self.cwd = WORKSPACE
        self.shell_restarts = 0
        cmd = _bwrap_command(disk_bytes=disk_bytes, tmp_bytes=tmp_bytes, limits_argv=limits_argv,
                             seccomp=seccomp is not None, base=base is not None, hidden=hidden is not None)
        status_r, status_w = os.pipe()
        cmd_r, self.cmd_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self._fds = [status_r, self.cmd_w, self.rep_r, self.out_r]
        for fd in (self.cmd_w, self.rep_r, self.out_r):
            os.set_blocking(fd, False)
        passed = [status_w, cmd_r, rep_w]
        extra = [_memfd(name, data) for name, data in (("seccomp", seccomp), ("base", base), ("hidden", hidden))
                 if data is not None]
        try:
            self.bwrap = _launcher().spawn(cmd, out_w, passed + extra)
            deadline = time.monotonic() + start_timeout_s
            pid = self._child_pid(status_r, deadline)
            self.init_pidfd = os.pidfd_open(pid) if pid is not None else -1
            if self.init_pidfd < 0 or self.bwrap.wait_exit(0):
                raise WorkspaceDied(f"the workspace sandbox did not start: {self._startup_error()}")
            self.ns = os.readlink(f"/proc/{pid}/ns/pid")
            self.init_pid = pid
            if self._report(deadline) != b"ready":
                raise WorkspaceDied(f"the workspace sandbox did not start: {self._drain_output()[-500:]!r}")
            self._await_shell(deadline)
        except BaseException:
            self.close()
            raise
        finally:
            for fd in (status_w, cmd_r, rep_w, out_w, *extra):
                os.close(fd)

    # -- start-up ---------------------------------------------------------------------------------
    @staticmethod
    def _child_pid(status_r: int, deadline: float) -> int | None:
        data = b""
        while (found := re.search(rb'"child-pid":\s*(\d+)', data)) is None:
            if not select.select([status_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            chunk = os.read(status_r, 4096)
            if not chunk:
                return None
            data += chunk
        return int(found.group(1))

    def _startup_error(self) -> str:
        out = self._drain_output()
        return out.decode(errors="replace").strip()[-500:] or "no output"

    # -- reports from the sandbox -----------------------------------------------------------------
    def _report(self, deadline: float, out: bytearray | None = None) -> bytes | None:
        """The next NUL-terminated report (reading output into ``out`` meanwhile), or None at the deadline.

        Raises:
            WorkspaceDied: the init exited.
        """
        while b"\0" not in self._reports:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready = select.select([self.rep_r, self.out_r, self.init_pidfd], [], [], remaining)[0]
            if self.out_r in ready and out is not None:
                self._read_output(out)
            if self.rep_r in ready:
                chunk = self._read(self.rep_r)
                if chunk:
                    self._reports += chunk
                    continue
            if self.init_pidfd in ready and self.rep_r not in ready:
                raise WorkspaceDied("the workspace's sandbox is gone (its init exited or was killed)")
            if out is None and self.out_r in ready:
                self._drain_output()
        report, _, self._reports = self._reports.partition(b"\0")
        return report

    @staticmethod
    def _read(fd: int) -> bytes:
        try:
            return os.read(fd, 1 << 16)
        except BlockingIOError:
            return b""

    def _read_output(self, out: bytearray) -> int:
        """Append what the output pipe holds now to ``out``; returns how many bytes were read."""
        total = 0
        while chunk := self._read(self.out_r):
            out += chunk
            total += len(chunk)
        return total

    def _drain_output(self) -> bytes:
        buf = bytearray()
        self._read_output(buf)
        return bytes(buf)

    def _await_shell(self, deadline: float, out: bytearray | None = None) -> None:
        """Wait for the init's report of a new shell that is alive, skipping exits and shells already gone.

        When the process budget was full as the init forked, bash retries with sleeps of up to 16 s; a
        SIGCHLD every half second wakes it (it then gives up that fork, reports, and forks again).
        """
        while True:
            report = self._report(min(deadline, time.monotonic() + 0.5), out)
            if report is None:
                if time.monotonic() >= deadline:
                    raise WorkspaceDied("the workspace's shell did not start")
                try:
                    signal.pidfd_send_signal(self.init_pidfd, signal.SIGCHLD)
                except ProcessLookupError as exc:
                    raise WorkspaceDied("the workspace's sandbox is gone") from exc
                continue
            if report.startswith(b"shell ") and self._set_shell(int(report.split()[1])):
                break
        if self.cwd != WORKSPACE:  # a new shell after `exit` or a kill: where the last one was
            self._write(f"cd -- {_quote(self.cwd)} </dev/null >/dev/null 2>&1\n".encode(), deadline)

    def _set_shell(self, nspid: int) -> bool:
        """Take the init's child ``nspid`` (PID inside) as the shell; False when it is not there (gone)."""
        if self._shell_pidfd >= 0:
            os.close(self._shell_pidfd)
        self._shell_pidfd, self.shell_pid = -1, -1
        for pid in _children(self.init_pid):
            fd = self._pidfd_in_sandbox(pid)
            if fd is None:
                continue
            if _nspid(pid) == nspid and not _zombie(pid):
                self._shell_pidfd, self.shell_pid = fd, pid
                return True
            os.close(fd)
        return False

    # -- commands ---------------------------------------------------------------------------------
    def _write(self, data: bytes, deadline: float, out: bytearray | None = None) -> bool:
        view = memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            ready_w = select.select([self.out_r] if out is not None else [], [self.cmd_w], [], remaining)
            if out is not None and ready_w[0]:
                self._read_output(out)
            if ready_w[1]:
                try:
                    view = view[os.write(self.cmd_w, view):]
                except BlockingIOError:
                    continue
                except BrokenPipeError as exc:
                    raise WorkspaceDied("the workspace's sandbox is gone") from exc
        return True

    def inodes_used(self) -> int:
        """Files and directories in the workspace's tmpfs mounts (a tmpfs's size does not bound them)."""
        used = 0
        for mount in (WORKSPACE, "/tmp"):
            try:
                st = os.statvfs(f"/proc/{self.init_pid}/root{mount}")
            except OSError:
                continue
            used += st.f_files - st.f_ffree
        return used

    def run(self, command: str, *, timeout_s: float, max_output_bytes: int, kill_output_bytes: int,
            max_inodes: int | None = None) -> ShellReply:
        """Run ``command`` in the shell (stdin ``/dev/null``); see ``ShellReply``.

        Past ``timeout_s`` or ``kill_output_bytes`` of output, every process of the sandbox but its init
        and the shell is killed (the shell keeps its working directory and variables); if the shell itself
        does not come back within a second, it is killed too and a new one starts where it was.
        """
        nonce = os.urandom(8).hex()
        script = (f"builtin eval {_quote(command)} </dev/null 4<&- 5>&-\n"
                  f"builtin printf '%s %d %s\\0' {nonce} \"$?\" \"$PWD\" >&5\n").encode()
        out, killed, restarted = bytearray(), None, False
        stale = self._drain_output()  # what background processes wrote since the last call
        if stale:
            out += b"[output of background processes since the last call]\n" + stale
            if not stale.endswith(b"\n"):
                out += b"\n"
            out += b"[this command's output]\n"
        inode_cap = None if max_inodes is None else max(max_inodes, self.inodes_used())  # (rm must still work)
        deadline = time.monotonic() + timeout_s
        reply = None
        if not self._write(script, deadline, out):
            killed = "timeout"
        while killed is None:
            report = self._report(min(deadline, time.monotonic() + 0.05), out)
            if len(out) > kill_output_bytes:
                killed = "output_limit"
            elif inode_cap is not None and self.inodes_used() > inode_cap:
                killed = "inode_limit"
            elif report is None:
                if time.monotonic() >= deadline:
                    killed = "timeout"
            elif report.startswith(nonce.encode() + b" "):
                reply = report
                break
            elif report.startswith(b"exited "):
                killed, restarted = "shell_exited", True
                self.shell_restarts += 1
                self._await_shell(time.monotonic() + 30.0, out)
        if killed in ("timeout", "output_limit", "inode_limit"):
            self.kill_all(keep_shell=True)
            reply = self._report(time.monotonic() + 2.0, out)
            if reply is None or not reply.startswith(nonce.encode()):  # the shell itself is stuck
                self.restart(out)
                reply, restarted = None, True
        self._read_output(out)
        exit_code = None
        if reply is not None:
            _, code, cwd = reply.decode(errors="replace").split(" ", 2)
            exit_code, self.cwd = int(code), cwd
        omitted = max(0, len(out) - max_output_bytes)
        return ShellReply(bytes(out[:max_output_bytes]), exit_code, killed, omitted, self.cwd, restarted)

    def restart(self, out: bytearray | None = None) -> None:
        """Kill every process but the init (the shell too) and wait for the init's new shell."""
        self.kill_all(keep_shell=False)
        self.shell_restarts += 1
        self._await_shell(time.monotonic() + 30.0, out)

    # -- processes --------------------------------------------------------------------------------
    def _pidfd_in_sandbox(self, pid: int) -> int | None:
        """A pidfd of ``pid`` if it is (still) a process of this sandbox's PID namespace, else None."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return None
        try:
            same = os.readlink(f"/proc/{pid}/ns/pid") == self.ns
        except OSError:
            same = False
        if not same or select.select([fd], [], [], 0)[0]:  # another process now, or already gone
            os.close(fd)
            return None
        return fd

    def processes(self) -> list[int]:
        """Host PIDs of the sandbox's live processes (zombies left out), the init first."""
        return [p for p in (self.init_pid, *_descendants(self.init_pid)) if not _zombie(p)]

    def kill_all(self, *, keep_shell: bool) -> None:
        """SIGKILL every process of the sandbox but its init (and the shell when ``keep_shell``), until
        none is left. The init is stopped meanwhile, so it starts no new shell; a fork bomb's children are
        reparented to it and found on the next pass."""
        keep = {self.init_pid} | ({self.shell_pid} if keep_shell else set())
        signal.pidfd_send_signal(self.init_pidfd, signal.SIGSTOP)
        try:
            for _ in range(1000):
                victims = [p for p in _descendants(self.init_pid) if p not in keep]
                fds = [fd for fd in (self._pidfd_in_sandbox(p) for p in victims) if fd is not None]
                if not fds:  # (a zombie is dead already: the init reaps it once it runs again)
                    return
                for fd in fds:
                    try:
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                for fd in fds:
                    select.select([fd], [], [], 1.0)
                    os.close(fd)
            raise WorkspaceDied("could not kill the workspace's processes")
        finally:
            try:
                signal.pidfd_send_signal(self.init_pidfd, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def alive(self) -> bool:
        return self.init_pidfd >= 0 and not select.select([self.init_pidfd], [], [], 0)[0]

    def close(self) -> None:
        """Kill the sandbox (the kernel kills everything in it and frees its tmpfs); safe to call twice."""
        if self.init_pidfd >= 0:
            try:
                signal.pidfd_send_signal(self.init_pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            select.select([self.init_pidfd], [], [], 5.0)
            os.close(self.init_pidfd)
            self.init_pidfd = -1
        if self._shell_pidfd >= 0:
            os.close(self._shell_pidfd)
            self._shell_pidfd = -1
        if self.bwrap is not None:
            try:
                if not self.bwrap.wait_exit(2.0):
                    self.bwrap.kill()
            except OSError:
                pass
            self.bwrap.close()
            self.bwrap = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _children(pid: int) -> list[int]:
    pids: list[int] = []
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            try:
                pids += [int(p) for p in Path(task.path, "children").read_text().split()]
            except OSError:
                continue
    except OSError:
        pass
    return pids


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in "ZX"
    except (OSError, IndexError):
        return True


def _nspid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None
