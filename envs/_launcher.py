"""Start ``bwrap`` through a long-lived launcher process that already runs as the sandbox's host uid.

Started once per process (it drops root itself; see ``_launcher_server.py``), the launcher makes a run
cost one ``posix_spawn`` of ``bwrap`` from a small process, where starting it from here as another uid would
cost an ``exec`` of ``setpriv`` as well (``Popen(user=...)`` is dearer still: it copies this whole process
with ``fork``). Nothing of one run is shared with another: every request carries its own descriptors and gets
a reply socket of its own. If the launcher dies, the runs it started end (``bwrap --die-with-parent``) and
the next request starts a new one. Knows nothing of bwrap's options or of results.
"""

from __future__ import annotations

import array
import atexit
import os
import select
import signal
import socket
import struct
import subprocess
import threading
from pathlib import Path

__all__ = ["Launcher", "LauncherDied", "Spawned"]

_SERVER = Path(__file__).with_name("_launcher_server.py")


class LauncherDied(OSError):
    """The launcher exited before it answered a request: that bwrap never ran, the request can be sent again."""


class Spawned:
    """A ``bwrap`` started by the launcher: its PID and a pidfd, read from the launcher's reply on first use
    (by then it is usually there, so the caller does not wake up once more just for it).

    Raises (on every use of ``pid`` or ``pidfd`` after a failure):
        LauncherDied: the launcher exited before it answered.
        OSError: the launcher could not start bwrap.
    """

    def __init__(self, reply: socket.socket) -> None:
        self._reply: socket.socket | None = reply
        self._pid = -1
        self._pidfd = -1
        self._error: OSError | None = None

    def _receive(self) -> None:
        if self._error is not None:
            raise self._error
        if self._reply is None:
            return
        reply, self._reply = self._reply, None
        with reply:
            fds = array.array("i")
            msg, ancdata, _, _ = reply.recvmsg(4096, socket.CMSG_SPACE(fds.itemsize))
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        if len(msg) < 4 or struct.unpack("i", msg[:4])[0] < 0 or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            if len(msg) < 4:
                self._error = LauncherDied("the sandbox launcher exited before it started bwrap")
            else:
                self._error = OSError(f"the sandbox launcher could not start bwrap: {msg[4:].decode(errors='replace')}")
            raise self._error
        self._pid, self._pidfd = struct.unpack("i", msg[:4])[0], fds[0]

    @property
    def pid(self) -> int:
        self._receive()
        return self._pid

    @property
    def pidfd(self) -> int:
        self._receive()
        return self._pidfd

    def wait_exit(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for bwrap to exit; whether it has (reaped or not)."""
        return bool(select.select([self.pidfd], [], [], max(0.0, timeout))[0])

    def kill(self) -> None:
        """SIGKILL to bwrap (through its pidfd: never another process)."""
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        if self._reply is not None:
            self._reply.close()
            self._reply = None
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


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
        self._atexit = False
        self._forked_from: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        """PID of the launcher process, or None before the first run."""
        return None if self._proc is None else self._proc.pid

    def _requests(self, restart: bool) -> socket.socket:
        with self._lock:
            if restart or self._sock is None or self._owner != os.getpid() or self._proc.poll() is not None:
                self._start()
            return self._sock

    def _start(self) -> None:
        self._stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:  # its stdout/stderr stay ours, so that a crash there is seen
            self._proc = subprocess.Popen([*self._command, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                          stdin=subprocess.DEVNULL, env={}, start_new_session=True)
        finally:
            theirs.close()
        self._sock, self._owner = ours, os.getpid()
        if not self._atexit:
            atexit.register(self.close)
            self._atexit = True

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()  # the launcher sees EOF and exits (a forked child only drops its copy)
        if self._proc is not None and self._owner == os.getpid():
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        elif self._proc is not None:
            self._forked_from = self._proc  # the parent's, not ours to wait for (nor to warn about when freed)
        self._sock = self._proc = None

    def close(self) -> None:
        """Stop the launcher (a later ``spawn`` starts a new one). Runs it started end with it."""
        with self._lock:
            self._stop()

    def spawn(self, argv: list[str], stdout_w: int, fds: list[int]) -> Spawned:
        """Start ``argv`` with ``stdout_w`` as its stdout and stderr and ``fds`` as descriptors 3, 4, ...

        The caller keeps (and closes) ``stdout_w`` and ``fds``, and closes the result.

        Raises:
            OSError: the request could not be sent, even to a newly started launcher.
        """
        message = "\0".join(argv).encode()
        for attempt in range(2):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self._requests(restart=attempt > 0).sendmsg(
                    [message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [theirs.fileno(), stdout_w, *fds]))])
            except OSError:
                ours.close()
                if attempt:
                    raise
                continue  # the launcher died since its last request: start a new one
            finally:
                theirs.close()
            return Spawned(ours)
        raise AssertionError("unreachable")
