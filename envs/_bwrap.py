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
- ``--die-with-parent`` and a PID-namespace init: when its init is killed, the kernel kills everything
  the program started, sessions and daemons included.

Each bind costs bwrap a mount and a parse of the mount table, so there are as few as the layout allows
(bench/RESULTS.md has the breakdown of a run's CPU time). This module knows nothing of limits or results
(``sandbox.py``) or of what runs inside (``_sandbox_child.py``).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import threading

from agentrl.envs._sandbox_root import CHILD_PATH, DEVICES, sandbox_root

__all__ = ["SANDBOX_UID", "WORKDIR", "BwrapUnavailableError", "bwrap_command", "check_bwrap", "spawn_identity"]

SANDBOX_UID = 65534  # "nobody", inside the sandbox and, when the caller is root, on the host too
WORKDIR = "/sandbox"
INSTALL_HINT = ("install it with `apt-get install bubblewrap` (scripts/setup_venv.sh does so when run as root), "
                "or choose backend='audit_hook' explicitly (an in-process hook: NOT a security boundary)")


class BwrapUnavailableError(RuntimeError):
    """bubblewrap is missing or cannot create its namespaces on this machine."""


def spawn_identity() -> tuple[list[str], dict]:
    """(command prefix, ``subprocess.Popen`` keyword arguments) that start ``bwrap`` as an unprivileged
    host user when the caller is root.

    ``setpriv`` (util-linux) drops the ids after a cheap ``vfork``; Popen's own ``user=``/``group=`` would
    make it copy the whole (large) parent process with ``fork`` instead, ~20 ms more per run.
    """
    if os.getuid() != 0:
        return [], {}
    if shutil.which("setpriv") is not None:
        return ["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups", "--"], {}
    return [], {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}


def bwrap_command(*, code_fd: int, info_fd: int, disk_bytes: int, argv: list[str],
                  seccomp_fd: int | None = None) -> list[str]:
    """The ``bwrap`` command that runs ``python -I -S CHILD_PATH *argv`` with ``main.py`` from ``code_fd``.

    Args:
        code_fd: readable descriptor of the program's source; copied to ``/sandbox/main.py``.
        info_fd: writable descriptor where bwrap reports the host PID of the sandbox's init.
        disk_bytes: size of the ``/sandbox`` tmpfs (all files the program writes, together).
        argv: arguments after the entry script.
        seccomp_fd: readable descriptor of a BPF seccomp program applied to the program, or None.
    """
    root = sandbox_root()
    prefix, _ = spawn_identity()
    cmd = [*prefix, "bwrap", "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
           "--unshare-cgroup-try", "--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
           "--hostname", "sandbox", "--die-with-parent", "--new-session", "--info-fd", str(info_fd),
           "--clearenv", "--setenv", "PATH", "/nonexistent", "--setenv", "HOME", WORKDIR,
           "--setenv", "TMPDIR", WORKDIR, "--setenv", "LANG", "C.UTF-8",
           "--ro-bind", root.path, "/", "--proc", "/proc"]
    for device in DEVICES:  # over the tree's placeholders: /dev stays the read-only tree's directory
        cmd += ["--dev-bind", device, device]
    cmd += ["--size", str(disk_bytes), "--tmpfs", WORKDIR]
    if seccomp_fd is not None:
        cmd += ["--seccomp", str(seccomp_fd)]
    cmd += ["--file", str(code_fd), f"{WORKDIR}/main.py", "--chdir", WORKDIR,
            root.executable, "-I", "-S", "-B", CHILD_PATH, *argv]
    return cmd


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
    code_r, (info_r, info_w) = os.memfd_create("code"), os.pipe()
    try:
        os.write(code_r, b"print('sandbox-ok')\n")
        os.lseek(code_r, 0, 0)
        cmd = bwrap_command(code_fd=code_r, info_fd=info_w, disk_bytes=1 << 20, argv=list(child_argv))
        proc = subprocess.run(cmd, pass_fds=(code_r, info_w), capture_output=True, text=True,
                              timeout=30, check=False, env={}, **spawn_identity()[1])
    finally:
        for fd in (code_r, info_r, info_w):
            os.close(fd)
    if proc.stdout.strip() != "sandbox-ok":
        raise BwrapUnavailableError(
            f"bubblewrap cannot build the sandbox on this machine (exit {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()[-500:]}. It needs unprivileged user namespaces "
            f"(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0, and no AppArmor "
            f"restriction on them); otherwise {INSTALL_HINT.split(', or ', 1)[1]}")
