"""Per-episode workspaces for coding agents: a sandboxed directory tree and a shell that live for an episode.

A :class:`Workspace` is one bubblewrap sandbox (the boundary of :mod:`agentrl.envs.sandbox`: its own user,
PID, mount, network, IPC and UTS namespaces, uid 65534, no capabilities, the seccomp filter, rlimits) that
stays up from ``reset`` to the end of the episode. In it:

- ``/workspace``: a tmpfs of ``max_disk_bytes`` (the disk quota, enforced by the kernel), filled at the
  start from a base tree (a tar archive: the task's "image"), writable, kept across calls;
- a persistent ``bash``: the working directory and exported variables carry over between calls;
- a read-only root holding the shell, coreutils, grep/sed/find/diff/patch/tar and Python's standard
  library, and nothing of the host's ``/etc``, ``/home`` or project files; no network.

Each call has a wall-clock limit and an output cap; past either, every process the call left is killed
(the shell itself survives, with its state). Processes are budgeted exactly (``max_processes`` at once,
besides the init and the shell) by ``RLIMIT_NPROC``, which the kernel counts per user namespace, so one
workspace's fork bomb does not take another's budget. ``close()``, a crash of the caller, or ``kill -9``
of the worker ends the sandbox and everything in it; the workspace never exists on the host's disk.

The file tools (``read_file``, ``write_file``, ``str_replace``, ``list_dir``) run inside the same shell, so
paths resolve as the agent's commands see them and no host code ever follows a path the agent made.
This module knows nothing of environments or rewards.
"""

from __future__ import annotations

import base64
import io
import tarfile
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

from agentrl.envs._bwrap import check_bwrap
from agentrl.envs._workspace_sandbox import (
    HIDDEN_PATH,
    WORKSPACE,
    Shell,
    ShellReply,
    WorkspaceDied,
    _quote,
)

__all__ = ["HIDDEN_PATH", "WORKSPACE", "CommandResult", "Workspace", "WorkspaceDied", "WorkspaceLimits",
           "make_tar"]


@dataclass(frozen=True)
class WorkspaceLimits:
    """Limits of one workspace (per call, and for the whole episode).

    Args:
        call_timeout_s: wall-clock seconds of one command; then the processes it left are killed.
        max_output_bytes: output of one call the caller gets (the rest is counted, not kept).
        kill_output_bytes: output of one call after which its processes are killed (``yes`` and the like).
        max_disk_bytes: size of ``/workspace`` (the base tree included): the episode's disk quota.
        max_tmp_bytes: size of ``/tmp``.
        max_processes: processes and threads the agent's commands may run at once (the init and the
            shell are not counted); exact: the next ``fork`` fails with EAGAIN.
        memory_mb: address-space limit of each process.
        max_file_bytes: largest file a process may write.
        max_open_files: file descriptors per process.
        max_file_tool_bytes: largest file ``read_file``/``str_replace`` read, and ``write_file`` writes.
        max_inodes: files and directories in ``/workspace`` and ``/tmp`` together (a tmpfs's size does not
            bound them, and each costs kernel memory); checked every 50 ms during a call, which is killed
            past it.
    """

    call_timeout_s: float = 10.0
    max_output_bytes: int = 16_384
    kill_output_bytes: int = 4 << 20
    max_disk_bytes: int = 64 << 20
    max_tmp_bytes: int = 16 << 20
    max_processes: int = 32
    memory_mb: int = 1024
    max_file_bytes: int = 32 << 20
    max_open_files: int = 256
    max_file_tool_bytes: int = 1 << 20
    max_inodes: int = 50_000

    def __post_init__(self) -> None:
        for name in ("call_timeout_s", "max_output_bytes", "kill_output_bytes", "max_disk_bytes", "max_tmp_bytes",
                     "memory_mb", "max_file_bytes", "max_open_files", "max_file_tool_bytes", "max_inodes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WorkspaceLimits.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_processes < 1:
            raise ValueError(f"WorkspaceLimits.max_processes must be >= 1, got {self.max_processes}")


@dataclass(frozen=True)
class CommandResult:
    """One ``bash`` call: ``output`` (text, stdout and stderr as written), ``exit_code`` (None when the call
    was killed before the shell reported one), ``status`` (ok, error, timeout, output_limit, inode_limit,
    shell_exited),
    ``omitted_bytes`` (output past the cap) and the shell's working directory afterwards."""

    output: str
    exit_code: int | None
    status: str
    omitted_bytes: int
    cwd: str
    limits: WorkspaceLimits
    restarted: bool = False

    def describe(self) -> str:
        """The text a model sees: the output and, unless the command succeeded, what happened."""
        notes = []
        if self.omitted_bytes:
            notes.append(f"[output truncated: {self.omitted_bytes} more bytes not shown]")
        notes.append({
            "ok": "",
            "error": f"[exit code {self.exit_code}]",
            "timeout": f"[killed: time limit of {self.limits.call_timeout_s:g} s exceeded]",
            "output_limit": f"[killed: more than {self.limits.kill_output_bytes} bytes of output]",
            "inode_limit": f"[killed: more than {self.limits.max_inodes} files and directories; remove some]",
            "shell_exited": f"[the shell exited; a new one was started in {self.cwd} (exported variables are lost)]",
        }[self.status])
        if self.restarted and self.status != "shell_exited":
            notes.append(f"[the shell did not stop either: a new one was started in {self.cwd} "
                         "(exported variables are lost)]")
        text = self.output.rstrip("\n")
        body = "\n".join(p for p in (text, *notes) if p)
        return body or "(no output)"


def make_tar(files: Mapping[str, str | bytes]) -> bytes:
    """A tar archive of ``files`` (relative path -> content), as a workspace's base tree.

    Example:
        >>> len(make_tar({"pkg/__init__.py": ""})) > 0
        True
    """
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        for path, content in sorted(files.items()):
            data = content.encode() if isinstance(content, str) else bytes(content)
            if path.startswith("/") or ".." in path.split("/"):
                raise ValueError(f"make_tar: {path!r} is not a relative path inside the tree")
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Workspace:
    """One episode's sandboxed directory tree and shell. Use as a context manager, or call ``close()``.

    Args:
        base: the base tree: a tar archive (``make_tar``) unpacked into ``/workspace``, or None (empty).
        limits: per-call and per-episode limits; ``WorkspaceLimits()`` when None.
        hidden: bytes readable, read-only, at ``/.agentrl/hidden`` (a grader's harness; never give an
            agent's workspace what it must not see).

    Raises:
        BwrapUnavailableError: bubblewrap is missing or cannot build a sandbox here.
        WorkspaceDied: the sandbox did not start (e.g. the base tree does not fit the quota).

    Example:
        >>> with Workspace(make_tar({"a.txt": "hi\\n"})) as ws:
        ...     _ = ws.bash("cd sub 2>/dev/null || mkdir sub && cd sub && export X=1")
        ...     ws.bash("pwd; echo $X; cat ../a.txt").output
        '/workspace/sub\\n1\\nhi\\n'
    """

    def __init__(self, base: bytes | None = None, limits: WorkspaceLimits | None = None, *,
                 hidden: bytes | None = None) -> None:
        from agentrl.envs.sandbox import SandboxLimits, _seccomp_filter, encode_config

        check_bwrap((encode_config(SandboxLimits(), None, False),))
        self.limits = limits or WorkspaceLimits()
        lim = self.limits
        limits_argv = [str(lim.max_processes + 2), str(lim.max_open_files), str(max(1, lim.max_file_bytes >> 10)),
                       str(lim.memory_mb << 10)]
        self._lock = threading.Lock()
        self._shell: Shell | None = Shell(disk_bytes=lim.max_disk_bytes, tmp_bytes=lim.max_tmp_bytes,
                                          limits_argv=limits_argv, seccomp=_seccomp_filter(), base=base, hidden=hidden)
        self._finalizer = weakref.finalize(self, Shell.close, self._shell)

    # -- the shell --------------------------------------------------------------------------------
    def bash(self, command: str, *, timeout_s: float | None = None) -> CommandResult:
        """Run ``command`` in the workspace's persistent shell (stdin is ``/dev/null``).

        Raises:
            ValueError: the command holds a NUL byte.
            WorkspaceDied: the workspace was closed or its sandbox was killed.
        """
        reply = self._run(command, timeout_s)
        status = reply.killed or ("ok" if reply.exit_code == 0 else "error")
        return CommandResult(reply.output.decode("utf-8", errors="replace"), reply.exit_code, status,
                             reply.omitted_bytes, reply.cwd, self.limits, reply.restarted)

    def _run(self, command: str, timeout_s: float | None = None, max_output_bytes: int | None = None) -> ShellReply:
        if "\0" in command:
            raise ValueError("the command holds a NUL byte")
        if len(command) > MAX_COMMAND_CHARS:
            raise ValueError(f"the command is longer than {MAX_COMMAND_CHARS} characters; write a script with "
                             "write_file and run that")
        with self._lock:
            if self._shell is None:
                raise WorkspaceDied("the workspace is closed")
            cap = max_output_bytes or self.limits.max_output_bytes
            return self._shell.run(command, timeout_s=timeout_s or self.limits.call_timeout_s,
                                   max_output_bytes=cap, kill_output_bytes=max(cap, self.limits.kill_output_bytes),
                                   max_inodes=self.limits.max_inodes)

    # -- file tools -------------------------------------------------------------------------------
    def read_file(self, path: str) -> str:
        """The text of ``path`` (relative to the shell's working directory, or absolute).

        Raises:
            FileNotFoundError / IsADirectoryError / ValueError: as the shell found it, or too large.
        """
        return self._read_bytes(path).decode("utf-8", errors="replace")

    def _read_bytes(self, path: str) -> bytes:
        _check_path(path)
        cap = self.limits.max_file_tool_bytes
        p = _quote(path)
        reply = self._run(f"if [ -d {p} ]; then (exit 21); elif [ ! -e {p} ]; then (exit 2); "
                          f"elif [ \"$(command /usr/bin/stat -L -c %s -- {p})\" -gt {cap} ]; then (exit 27); "
                          f"else command /usr/bin/base64 -w0 -- {p}; fi",
                          max_output_bytes=cap * 4 // 3 + 1024)
        if reply.exit_code == 2:
            raise FileNotFoundError(f"no such file: {path}")
        if reply.exit_code == 27:
            raise ValueError(f"{path} is larger than {cap} bytes; read parts of it with bash (head, sed -n)")
        if reply.exit_code == 21:
            raise IsADirectoryError(f"{path} is a directory; use list_dir")
        if reply.exit_code != 0 or reply.killed:
            detail = reply.output.decode(errors="replace").strip()[-300:]
            raise OSError(f"cannot read {path}: {detail or reply.killed or reply.exit_code}")
        try:
            return base64.b64decode(reply.output, validate=True)
        except ValueError as exc:
            raise OSError(f"cannot read {path}: the shell's output was not the file ({exc})") from exc

    def write_file(self, path: str, content: str) -> str:
        """Write ``content`` to ``path`` (parent directories are made); returns a one-line summary.

        Raises:
            ValueError: the content holds a NUL byte.
            OSError: the shell could not write it (no space left: the quota; a directory there; ...).
        """
        _check_path(path)
        if "\0" in content:
            raise ValueError("the content holds a NUL byte")
        if len(content) > self.limits.max_file_tool_bytes:
            raise ValueError(f"the content is longer than {self.limits.max_file_tool_bytes} characters")
        data = content.encode("utf-8", errors="replace")
        p = _quote(path)
        reply = self._run(f"command /usr/bin/mkdir -p -- \"$(command /usr/bin/dirname -- {p})\" && "
                          f"{{ builtin printf '%s' {_quote(content)} > {p}; }}")
        if reply.exit_code != 0 or reply.killed:
            raise OSError(f"cannot write {path}: {reply.output.decode(errors='replace').strip()[-300:] or reply.killed}")
        return f"wrote {len(data)} bytes to {path}"

    def str_replace(self, path: str, old: str, new: str) -> str:
        """Replace the one occurrence of ``old`` in ``path`` with ``new``.

        Raises:
            ValueError: ``old`` is empty, absent, or occurs more than once (the count is given).
        """
        if not old:
            raise ValueError("old must not be empty")
        text = self._read_bytes(path).decode("utf-8", errors="surrogateescape")
        count = text.count(old)
        if count != 1:
            where = "not found" if count == 0 else f"found {count} times; add context to make it unique"
            raise ValueError(f"old text {where} in {path}")
        start = text.index(old)
        line = text.count("\n", 0, start) + 1
        updated = text.replace(old, new, 1)
        self.write_file(path, updated.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace"))
        return f"replaced 1 occurrence in {path} (line {line})"

    def list_dir(self, path: str = ".", depth: int = 2) -> str:
        """Files and directories under ``path`` down to ``depth`` levels (directories end in ``/``)."""
        _check_path(path)
        depth = max(1, min(int(depth), 8))
        p = _quote(path)
        reply = self._run(f"command /usr/bin/find {p} -mindepth 1 -maxdepth {depth} "
                          r"\( -type d -printf '%P/\n' \) -o -printf '%P\n' | command /usr/bin/sort")
        if reply.killed or reply.exit_code != 0:
            raise OSError(f"cannot list {path}: {reply.output.decode(errors='replace').strip()[-300:]}")
        return reply.output.decode(errors="replace") or "(empty)"

    # -- the end ----------------------------------------------------------------------------------
    def snapshot(self) -> bytes:
        """The workspace as a tar archive, after killing every process the agent left (the shell too:
        a fresh shell makes the archive, inside the sandbox, so no host code follows the agent's links).

        Use it at the episode's end: the agent's shell state is gone afterwards.
        """
        with self._lock:
            if self._shell is None:
                raise WorkspaceDied("the workspace is closed")
            self._shell.restart()
            self._shell._drain_output()
            cap = 2 * self.limits.max_disk_bytes + (1 << 20)
            reply = self._shell.run("command /usr/bin/tar -C /workspace -cf - .", timeout_s=60.0,
                                    max_output_bytes=cap, kill_output_bytes=cap)
        if reply.exit_code != 0 or reply.killed:
            raise WorkspaceDied(f"could not archive the workspace ({reply.killed or reply.exit_code})")
        return reply.output

    def processes(self) -> list[int]:
        """Host PIDs of the workspace's processes (the init first); empty once closed."""
        with self._lock:
            return [] if self._shell is None else self._shell.processes()

    @property
    def alive(self) -> bool:
        return self._shell is not None and self._shell.alive()

    def close(self) -> None:
        """End the sandbox: every process in it is killed and the workspace is freed. Safe to call twice."""
        with self._lock:
            shell, self._shell = self._shell, None
        if shell is not None:
            self._finalizer.detach()
            shell.close()

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


MAX_COMMAND_CHARS = 1 << 17
MAX_PATH_CHARS = 4096


def _check_path(path: str) -> None:
    if not isinstance(path, str) or not path or "\0" in path or len(path) > MAX_PATH_CHARS:
        raise ValueError(f"invalid path {path[:100]!r}" + (" (too long)" if len(path) > MAX_PATH_CHARS else ""))
