"""The launcher process: starts ``bwrap`` on request (see ``_launcher.py`` for the parent's side).

Run as ``python -I -S -c SOURCE BWRAP UID FD``; it lives as long as the process that uses the sandbox.
Started as root, it drops to the sandbox's host uid right after its imports (groups cleared; the kernel
then clears every capability), so each run costs one ``posix_spawn`` of ``bwrap`` from a small
unprivileged process instead of an ``exec`` of ``setpriv`` as well.

Requests come on descriptor FD, a ``SOCK_SEQPACKET`` socket held only by the parent (and never passed
on): the argument vector (NUL-separated) with descriptors [reply socket, stdout, then those that bwrap
gets as 3, 4, ...]. On the reply socket it sends the PID and a pidfd of ``bwrap`` (or -1 and why not),
and reaps bwrap when it exits (bwrap reports its exit code itself, on its ``--json-status-fd``). It exits
when the parent's end closes (the parent died); ``bwrap --die-with-parent`` then takes every sandbox
with it. Standard library only; knows nothing of bwrap's options.
"""

import array
import fcntl
import os
import select
import socket
import struct
import sys

_MAX_FDS = 8
_HIGH = 64  # received descriptors are moved above the targets (0..n) so that no dup2 clobbers another


def _spawn(argv: list[bytes], fds: list[int], devnull: int) -> int:
    stdout, passed = fds[0], fds[1:]
    actions = [(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, stdout, 1), (os.POSIX_SPAWN_DUP2, stdout, 2)]
    actions += [(os.POSIX_SPAWN_DUP2, fd, 3 + i) for i, fd in enumerate(passed)]
    return os.posix_spawn(argv[0], argv, {}, file_actions=actions, setsid=True)


def _drop_privileges(uid: int) -> None:
    if os.getuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # from root to non-root in all three: the kernel clears every capability
    if os.getuid() == 0 or os.geteuid() == 0:
        sys.exit("launcher: could not drop root")


def main() -> None:
    _drop_privileges(int(sys.argv[2]))
    requests = socket.socket(fileno=int(sys.argv[3]))
    # inherited from the parent, hence inheritable: a bwrap (and the sandbox in it) must never get it,
    # or a sandboxed program could take other runs' requests (their programs, output pipes and replies)
    requests.set_inheritable(False)
    devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    poller = select.poll()
    poller.register(requests, select.POLLIN)
    running: set[int] = set()  # pidfds of the bwraps started
    while True:
        for fd, _ in poller.poll():
            if fd in running:  # bwrap has exited: reap it
                running.remove(fd)
                poller.unregister(fd)
                os.waitid(os.P_PIDFD, fd, os.WEXITED)
                os.close(fd)
                continue
            try:
                msg, ancdata, _, _ = requests.recvmsg(1 << 20, socket.CMSG_SPACE(_MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC)
            except OSError:
                msg = b""
            if not msg:
                sys.exit(0)  # the parent's end is closed: it has exited
            received = array.array("i")
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received.frombytes(data[:len(data) - len(data) % received.itemsize])
            high = [fcntl.fcntl(f, fcntl.F_DUPFD_CLOEXEC, _HIGH) for f in received]
            for f in received:
                os.close(f)
            if len(high) < 2:  # not a request of ours: nothing to answer on
                for f in high:
                    os.close(f)
                continue
            reply = socket.socket(fileno=high[0])
            try:
                pid = _spawn(msg.split(b"\0"), high[1:], devnull)
                pidfd = os.pidfd_open(pid)
            except OSError as exc:
                reply.send(struct.pack("i", -1) + f"{type(exc).__name__}: {exc}".encode())
                reply.close()
                continue
            finally:
                for f in high[1:]:
                    os.close(f)
            try:
                reply.sendmsg([struct.pack("i", pid)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [pidfd]))])
            except OSError:
                pass  # the parent gave up; bwrap is still reaped below
            reply.close()
            running.add(pidfd)
            poller.register(pidfd, select.POLLIN)


if __name__ == "__main__":
    main()
