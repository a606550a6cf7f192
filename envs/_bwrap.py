"""The bubblewrap command line of one sandboxed run: namespaces, mounts, the unprivileged uid.

What the sandboxed program gets (the kernel enforces all of it, nothing here runs inside):

- a new user namespace with uid/gid 65534 and no capabilities, in which it cannot create further user
  namespaces (``--disable-userns``); when the caller is root, ``bwrap`` itself is started as host uid
  65534, so the program is an unprivileged host user too (``RLIMIT_NPROC`` applies, no ``/proc/<pid>/mem``
  of root's processes, no file of root's it could not read as "nobody");
- new PID, IPC, UTS, cgroup and network namespaces: it sees only its own processes, has only a
  loopback interface of its own, reaches no host Unix socket; ``--new-session`` (no terminal ioctls);
- a new mount namespace whose root is one read-only bind of a prepared minimal tree (``_sandbox_root.py``:
  the interpreter, its standard library, the shared libraries it loads, the entry script as bytecode);
  a fresh ``/proc``; a read-only ``/dev`` holding only ``null``, ``zero`` and ``urandom`` (and the
  ``fd``/``stdin``/``stdout``/``stderr`` links); a size-limited private tmpfs ``/sandbox`` (also ``/tmp``) as the working directory.
  No host ``/etc``, ``/home``, ``/root`` contents, ``/usr/bin``, project files or environment variables.
- ``--die-with-parent``, and the program is the PID-namespace init itself (``--as-pid-1``: no reaper
  process in between, one process and one wake-up less per run): when it exits or is killed, the kernel
  kills everything it started, sessions and daemons included. As for any such init, a signal with the
  default action that it gets from inside its namespace (``os.kill(os.getpid(), SIGTERM)``) is ignored;
  faults and the kernel's limit signals still end it.

Each bind costs bwrap a mount and a parse of the mount table, so there are as few as the layout allows
(bench/history/sandbox.md has the breakdown of a run's CPU time). This module knows nothing of limits or results
(``sandbox.py``) or of what runs inside (``_sandbox_child.py``).
"""

from __future__ import annotations

import functools
import os
import select
import shutil
import sys
import threading

from agentrl.envs._launcher import Launcher, Spawned
from agentrl.envs._sandbox_root import CHILD_PATH, DEVICES, sandbox_root

__all__ = ["SANDBOX_UID", "WORKDIR", "BwrapUnavailableError", "bwrap_command", "check_bwrap", "spawn_bwrap"]

SANDBOX_UID = 65534  # "nobody", inside the sandbox and, when the caller is root, on the host too
WORKDIR = "/sandbox"
INSTALL_HINT = ("install it with `apt-get install bubblewrap` (scripts/setup_venv.sh does so when run as root), "
                "or choose backend='audit_hook' explicitly (an in-process hook: NOT a security boundary)")


class BwrapUnavailableError(RuntimeError):
    """bubblewrap is missing or cannot create its namespaces on this machine."""


@functools.lru_cache(maxsize=1)
def _bwrap_path() -> str:
    return shutil.which("bwrap") or "bwrap"


@functools.lru_cache(maxsize=1)
def _launcher() -> Launcher:
    return Launcher(os.path.realpath(sys.executable), _bwrap_path(), SANDBOX_UID)


def bwrap_command(*, disk_bytes: int, argv: list[str], seccomp: bool) -> list[str]:
    """The ``bwrap`` command that runs ``python -I -S CHILD_PATH *argv`` on ``main.py`` from descriptor 4.

    Descriptors as bwrap gets them: 3 where it reports (as JSON lines) the program's host PID and, at
    the end, its exit code; 4 the program's source (copied to ``/sandbox/main.py``); 5 the BPF seccomp
    program when ``seccomp``.

    Args:
        disk_bytes: size of the ``/sandbox`` tmpfs (all files the program writes, together).
        argv: arguments after the entry script.
        seccomp: apply the seccomp program of descriptor 5.
    """
    root = sandbox_root()
    cmd = [_bwrap_path(), "--as-pid-1", "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
           "--unshare-uts", "--unshare-cgroup-try", "--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
           "--hostname", "sandbox", "--die-with-parent", "--new-session", "--json-status-fd", "3",
           "--clearenv", "--setenv", "PATH", "/nonexistent", "--setenv", "HOME", WORKDIR,
           "--setenv", "TMPDIR", WORKDIR, "--setenv", "LANG", "C.UTF-8",
           "--ro-bind", root.path, "/", "--proc", "/proc"]
    for device in DEVICES:  # over the tree's placeholders: /dev stays the read-only tree's directory
        cmd += ["--dev-bind", device, device]
    cmd += ["--size", str(disk_bytes), "--tmpfs", WORKDIR]
    if seccomp:
        cmd += ["--seccomp", "5"]
    cmd += ["--file", "4", f"{WORKDIR}/main.py", "--chdir", WORKDIR,
            root.executable, "-I", "-S", "-B", CHILD_PATH, *argv]
    return cmd


def spawn_bwrap(*, stdout_fd: int, status_fd: int, code_fd: int, seccomp_fd: int | None, disk_bytes: int,
                argv: list[str]) -> Spawned:
    """Start the sandbox (``bwrap_command``) as the unprivileged host uid, through the launcher.

    Args:
        stdout_fd: write end of the pipe that gets the program's stdout and stderr.
        status_fd: write end of the pipe where bwrap reports the program's host PID and the exit code.
        code_fd: readable descriptor of the program's source.
        seccomp_fd: readable descriptor of the BPF seccomp program, or None for none.
        disk_bytes: size of the ``/sandbox`` tmpfs.
        argv: arguments after the entry script.

    The caller keeps and closes the descriptors it passed.
    """
    cmd = bwrap_command(disk_bytes=disk_bytes, argv=argv, seccomp=seccomp_fd is not None)
    fds = [status_fd, code_fd] + ([] if seccomp_fd is None else [seccomp_fd])
    return _launcher().spawn(cmd, stdout_fd, fds)


_CHECK_LOCK = threading.Lock()  # the first runs may start from many threads at once


def check_bwrap(child_argv: tuple[str, ...]) -> None:
    """Check once that bwrap exists and can build the sandbox here; raise with the fix when not.

    Args:
        child_argv: arguments of the entry script for a run of ``print('sandbox-ok')``.
    """
    with _CHECK_LOCK:
        _check_once(child_argv)


@functools.lru_cache(maxsize=1)
def _check_once(child_argv: tuple[str, ...]) -> None:
    if shutil.which("bwrap") is None:
        raise BwrapUnavailableError(f"the sandbox needs bubblewrap (`bwrap`), which is not installed: {INSTALL_HINT}")
    try:
        sandbox_root()
    except OSError as exc:
        raise BwrapUnavailableError(f"cannot prepare the sandbox's root file system: {exc}") from exc
    code, (status_r, status_w), (out_r, out_w) = os.memfd_create("code"), os.pipe(), os.pipe()
    output, status = b"", b""
    try:
        os.write(code, b"print('sandbox-ok')\n")
        os.lseek(code, 0, 0)
        try:
            spawned = spawn_bwrap(stdout_fd=out_w, status_fd=status_w, code_fd=code, seccomp_fd=None,
                                  disk_bytes=1 << 20, argv=list(child_argv))
        finally:
            for fd in (code, status_w, out_w):
                os.close(fd)
        try:
            while select.select([out_r], [], [], 30)[0] and (chunk := os.read(out_r, 65536)):
                output += chunk
            if not spawned.wait_exit(5.0):
                spawned.kill()
            while select.select([status_r], [], [], 0)[0] and (chunk := os.read(status_r, 4096)):
                status += chunk
        finally:
            spawned.close()
    except OSError as exc:
        output = str(exc).encode()
    finally:
        os.close(status_r)
        os.close(out_r)
    if output.decode(errors="replace").strip() != "sandbox-ok":
        raise BwrapUnavailableError(
            f"bubblewrap cannot build the sandbox on this machine ({status.decode(errors='replace').strip() or 'no status'}): "
            f"{output.decode(errors='replace').strip()[-500:]}. It needs unprivileged user namespaces "
            f"(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0, and no AppArmor "
            f"restriction on them); otherwise {INSTALL_HINT.split(', or ', 1)[1]}")
