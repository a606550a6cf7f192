"""Start ``bwrap`` through a long-lived launcher process that already runs as the sandbox's host uid.

Started once per process (it drops root itself; see ``_launcher_server.py``), the launcher makes a run
cost one ``posix_spawn`` of ``bwrap`` from a small process, where starting it from here as another uid would
cost an ``exec`` of ``setpriv`` as well (``Popen(user=...)`` is dearer still: it copies this whole process
with ``fork``). Nothing of one run is shared with another: every request carries its own descriptors and gets a
reply socket of its own. If the launcher dies, the runs it started end (``bwrap --die-with-parent``) and the
next request starts a new one. Knows nothing of bwrap's options or of results.
"""

from __future__ import annotations

import array
import os
import select
import signal
import socket
import struct
import subprocess
import threading
from pathlib import Path

__all__ = ["Launcher", "Spawned"]

_SERVER = Path(__file__).with_name("_launcher_server.py")


class Spawned:
    """A ``bwrap`` started by the launcher: its PID, a pidfd, and its return code once reported."""

    def __init__(self, pid: int, pidfd: int, reply: socket.socket) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self._reply = reply
        self.returncode: int | None = None

    def exited(self) -> bool:
        """Whether bwrap has exited (it may not have been reaped yet)."""
        return bool(select.select([self.pidfd], [], [], 0)[0])

    def kill(self) -> None:
        """SIGKILL to bwrap (through its pidfd: never another process)."""
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        """Block until the launcher reports the return code (``-N``: killed by signal N); close everything."""
        if self.returncode is None:
            data = self._reply.recv(64)
            # no report: the launcher died; bwrap, whose parent it was, died with it
            self.returncode = struct.unpack("i", data[:4])[0] if len(data) >= 4 else -signal.SIGKILL
            self._reply.close()
            os.close(self.pidfd)
        return self.returncode


class Launcher:
    """The launcher process of this process (one per PID: a forked child starts its own).

    Args:
        executable: the interpreter that runs the launcher (``python -I -S -c SOURCE``).
        bwrap: absolute path of ``bwrap``.
        uid: the host uid (and gid) it drops to when started as root.
    """

    def __init__(self, executable: str, bwrap: str, uid: int) -> None:
        self._command = [executable, "-I", "-S", "-c", _SERVER.read_text(), bwrap, str(uid)]
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None
        self._owner = 0

    @property
    def pid(self) -> int | None:
        """PID of the launcher process, or None before the first run."""
        return None if self._proc is None else self._proc.pid

    def _requests(self) -> socket.socket:
        with self._lock:
            if self._sock is None or self._owner != os.getpid() or self._proc.poll() is not None:
                self._start()
            return self._sock

    def _start(self) -> None:
        if self._proc is not None and self._owner == os.getpid():
            self._close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # its stdout/stderr stay ours so that a crash there is seen
            self._proc = subprocess.Popen([*self._command, str(theirs.fileno())], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                          env={}, start_new_session=True)
        finally:
            theirs.close()
        self._sock, self._owner = ours, os.getpid()

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()  # the launcher sees EOF and exits
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._sock = self._proc = None

    def spawn(self, argv: list[str], stdout_w: int, fds: list[int]) -> Spawned:
        """Start ``argv`` with ``stdout_w`` as its stdout and stderr and ``fds`` as descriptors 3, 4, ...

        The caller keeps (and closes) ``stdout_w`` and ``fds``.

        Raises:
            OSError: the launcher could not start ``argv``.
        """
        message = "\0".join(argv).encode()
        for attempt in range(2):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                try:
                    self._requests().sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                          array.array("i", [theirs.fileno(), stdout_w, *fds]))])
                except OSError:
                    if attempt:
                        raise
                    continue  # the launcher died since: start a new one
            finally:
                theirs.close()
            fds_out = array.array("i")
            msg, ancdata, _, _ = ours.recvmsg(4096, socket.CMSG_SPACE(4))
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds_out.frombytes(data[:len(data) - len(data) % fds_out.itemsize])
            if len(msg) < 4 or (pid := struct.unpack("i", msg[:4])[0]) < 0 or not fds_out:
                ours.close()
                for fd in fds_out:
                    os.close(fd)
                if len(msg) >= 4 or attempt:
                    raise OSError(f"the sandbox launcher could not start bwrap: {msg[4:].decode(errors='replace')}")
                continue  # no answer: the launcher died since
            return Spawned(pid, fds_out[0], ours)
        raise AssertionError("unreachable")
