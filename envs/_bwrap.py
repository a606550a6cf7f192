"""The bubblewrap command line of one sandboxed run: namespaces, mounts, the unprivileged uid.

What the sandboxed program gets (the kernel enforces all of it, nothing here runs inside):

- a new user namespace with uid/gid 65534 and no capabilities, in which it cannot create further user
  namespaces (``--disable-userns``); when the caller is root, ``bwrap`` itself is started as host uid
  65534, so the program is an unprivileged host user too (``RLIMIT_NPROC`` applies, no ``/proc/<pid>/mem``
  of root's processes, no file of root's it could not read as "nobody");
- new PID, IPC, UTS, cgroup and network namespaces: it sees only its own processes, has only a
  loopback interface of its own, reaches no host Unix socket; ``--new-session`` (no terminal ioctls);
- a new mount namespace whose root is an empty read-only tmpfs holding: read-only binds of the Python
  interpreter, its standard library and the shared-library directories it loads from; a fresh ``/proc``
  and a minimal read-only ``/dev``; a size-limited private tmpfs ``/sandbox`` (also ``/tmp``) as the working directory.
  No host ``/etc``, ``/home``, ``/root`` contents, ``/usr/bin``, project files or environment variables.
- ``--die-with-parent`` and a PID-namespace init: when its init is killed, the kernel kills everything
  the program started, sessions and daemons included.

This module knows nothing of limits or results (``sandbox.py``) or of what runs inside (``_sandbox_child.py``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SANDBOX_UID", "WORKDIR", "BwrapUnavailableError", "bwrap_command", "check_bwrap", "spawn_identity"]

SANDBOX_UID = 65534  # "nobody", inside the sandbox and, when the caller is root, on the host too
WORKDIR = "/sandbox"
CHILD_PATH = "/.agentrl/child.py"
INSTALL_HINT = ("install it with `apt-get install bubblewrap` (scripts/setup_venv.sh does so when run as root), "
                "or choose backend='audit_hook' explicitly (an in-process hook: NOT a security boundary)")


class BwrapUnavailableError(RuntimeError):
    """bubblewrap is missing or cannot create its namespaces on this machine."""


@dataclass(frozen=True)
class _Bind:
    source: str  # host path readable by the sandbox uid
    dest: str  # where the sandbox sees it


def _world_readable(path: str) -> bool:
    """Whether a uid with no privileges can reach and read ``path`` (every ancestor searchable)."""
    p = Path(path)
    for ancestor in reversed(p.parents):
        if not os.stat(ancestor).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(p).st_mode
    return bool(mode & stat.S_IROTH) and (not stat.S_ISDIR(mode) or bool(mode & stat.S_IXOTH))


def _needed_library_dirs(executable: str, dynload: str) -> list[str]:
    """Directories of the shared libraries the interpreter and its extension modules load (``ldd``)."""
    objects = [executable, *(str(p) for p in Path(dynload).glob("*.so"))]
    dirs = {"/usr/lib", "/usr/lib64"} if shutil.which("ldd") is None else set()
    if not dirs:
        out = subprocess.run(["ldd", *objects], capture_output=True, text=True, timeout=60, check=False).stdout
        for line in out.splitlines():
            if not line[:1].isspace():  # "path/of/object:" headers, not libraries
                continue
            parts = line.split("=>")
            target = (parts[1] if len(parts) > 1 else parts[0]).strip().split(" (")[0].strip()
            if target.startswith("/"):
                dirs.add(os.path.dirname(os.path.realpath(target)))
                dirs.add(os.path.dirname(target))
    return sorted(d for d in dirs if os.path.isdir(d))


def _view(paths: list[str]) -> str:
    """A root-owned copy (hard links where possible) of ``paths`` that the sandbox uid can reach.

    Needed when the interpreter lives somewhere "nobody" cannot traverse (pyenv under ``/root``).
    Made once per interpreter and kept; the sandbox binds it read-only at the original paths.
    """
    exe = os.stat(os.path.realpath(sys.executable))
    what = hashlib.sha256("\n".join(paths).encode()).hexdigest()[:12]
    tag = f"{sys.implementation.cache_tag}-{exe.st_dev}-{exe.st_ino}-{int(exe.st_mtime)}-{what}"
    root = Path("/var/cache/agentrl-sandbox") / tag
    if (root / ".ready").exists():
        return str(root)
    tmp = root.with_name(f"{tag}.tmp{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)

    def place(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    for path in paths:
        dest = tmp / path.lstrip("/")
        if os.path.isdir(path):
            shutil.copytree(path, dest, symlinks=True, copy_function=place,
                            ignore=shutil.ignore_patterns("site-packages", "test", "idlelib", "turtledemo"))
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            place(path, str(dest))
    for dirpath, _, _ in os.walk(tmp):  # new directories only: a file's mode is its original's (hard link)
        os.chmod(dirpath, 0o755)
    (tmp / ".ready").touch()
    root.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(root.parent, 0o755)
    try:
        os.rename(tmp, root)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(root)


@functools.lru_cache(maxsize=1)
def _interpreter_binds() -> tuple[str, tuple[_Bind, ...]]:
    """(interpreter path inside the sandbox, read-only binds that make it run), computed once."""
    executable = os.path.realpath(sys.executable)
    # the base installation's paths: in a virtualenv the default ones point into the venv (site-packages)
    paths = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
                                      "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix})
    dynload = os.path.join(paths["platstdlib"], "lib-dynload")
    wanted = [executable, paths["stdlib"], paths["platstdlib"], *_needed_library_dirs(executable, dynload)]
    if os.path.isdir(dynload) and not os.path.realpath(dynload).startswith(os.path.realpath(paths["platstdlib"])):
        wanted.append(dynload)
    wanted = sorted({os.path.realpath(p) for p in wanted})
    wanted = [p for p in wanted if not any(p.startswith(q + os.sep) for q in wanted if q != p)]  # outermost only
    hidden = [p for p in wanted if not _world_readable(p)] if os.getuid() == 0 else []
    view = _view(hidden) if hidden else ""
    binds = tuple(_Bind(view + p if p in hidden else p, p) for p in wanted)
    return executable, binds


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


def bwrap_command(*, code_fd: int, child_fd: int, info_fd: int, disk_bytes: int, argv: list[str],
                  seccomp_fd: int | None = None) -> list[str]:
    """The ``bwrap`` command that runs ``python -I -S CHILD_PATH *argv`` with ``main.py`` from ``code_fd``.

    Args:
        code_fd: readable descriptor of the program's source; copied to ``/sandbox/main.py``.
        child_fd: readable descriptor of ``_sandbox_child.py``; bound read-only at ``CHILD_PATH``.
        info_fd: writable descriptor where bwrap reports the host PID of the sandbox's init.
        disk_bytes: size of the ``/sandbox`` tmpfs (all files the program writes, together).
        argv: arguments after the child script.
        seccomp_fd: readable descriptor of a BPF seccomp program applied to the program, or None.
    """
    executable, binds = _interpreter_binds()
    prefix, _ = spawn_identity()
    cmd = [*prefix, "bwrap", "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
           "--unshare-cgroup-try", "--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
           "--hostname", "sandbox", "--die-with-parent", "--new-session", "--info-fd", str(info_fd),
           "--clearenv", "--setenv", "PATH", "/nonexistent", "--setenv", "HOME", WORKDIR,
           "--setenv", "TMPDIR", WORKDIR, "--setenv", "LANG", "C.UTF-8"]
    for bind in binds:
        cmd += ["--ro-bind", bind.source, bind.dest]
    for link, target in (("/lib", "usr/lib"), ("/lib64", "usr/lib64"), ("/lib32", "usr/lib32")):
        if os.path.islink(link) and os.readlink(link) == target and os.path.isdir(os.path.join("/", target)):
            cmd += ["--symlink", target, link]  # merged-/usr: keep the loader's /lib64 path working
    cmd += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev", "--size", str(disk_bytes), "--tmpfs", WORKDIR]
    if seccomp_fd is not None:
        cmd += ["--seccomp", str(seccomp_fd)]
    cmd += ["--file", str(code_fd), f"{WORKDIR}/main.py", "--ro-bind-data", str(child_fd), CHILD_PATH,
            "--symlink", WORKDIR, "/tmp", "--chdir", WORKDIR, "--remount-ro", "/",
            executable, "-I", "-S", "-B", CHILD_PATH, *argv]
    return cmd


_CHECK_LOCK = threading.Lock()  # the first runs may start from many threads at once


def check_bwrap() -> None:
    """Check once that bwrap exists and can build the sandbox here; raise with the fix when not."""
    with _CHECK_LOCK:
        _check_once()


@functools.lru_cache(maxsize=1)
def _check_once() -> None:
    if shutil.which("bwrap") is None:
        raise BwrapUnavailableError(f"the sandbox needs bubblewrap (`bwrap`), which is not installed: {INSTALL_HINT}")
    code_r, child_r, (info_r, info_w) = os.memfd_create("code"), os.memfd_create("child"), os.pipe()
    try:
        os.write(code_r, b"")
        os.write(child_r, b"import sys\nprint('sandbox-ok')\n")
        os.lseek(code_r, 0, 0)
        os.lseek(child_r, 0, 0)
        cmd = bwrap_command(code_fd=code_r, child_fd=child_r, info_fd=info_w, disk_bytes=1 << 20, argv=[])
        proc = subprocess.run(cmd, pass_fds=(code_r, child_r, info_w), capture_output=True, text=True,
                              timeout=30, check=False, env={}, **spawn_identity()[1])
    finally:
        for fd in (code_r, child_r, info_r, info_w):
            os.close(fd)
    if proc.stdout.strip() != "sandbox-ok":
        raise BwrapUnavailableError(
            f"bubblewrap cannot build the sandbox on this machine (exit {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()[-500:]}. It needs unprivileged user namespaces "
            f"(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0, and no AppArmor "
            f"restriction on them); otherwise {INSTALL_HINT.split(', or ', 1)[1]}")
