"""The seccomp filter of the bwrap sandbox: kernel interfaces a standard-library program has no use for.

The namespaces and the unprivileged uid are the boundary (``_bwrap.py``); this filter shrinks the kernel
surface the program can reach, so that a kernel bug in one of these interfaces is not reachable from the
sandbox. Refused calls fail with ``EPERM``; system calls of other ABIs (32-bit ``int 0x80``, x32) kill the
process (libseccomp's default for architectures not in the filter). Built once with libseccomp
(``pyseccomp``) and handed to bwrap as BPF. Knows nothing of bwrap's other options.
"""

from __future__ import annotations

import errno
import functools
import os

__all__ = ["DENIED_SYSCALLS", "seccomp_bpf"]

DENIED_SYSCALLS = (
    # other processes' memory and kernel objects
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "keyctl", "add_key", "request_key",
    # large, exploit-prone kernel interfaces
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    # memory-backed files outside every quota (a tmpfs has a size; a memfd is limited by RLIMIT_FSIZE only)
    "memfd_create", "memfd_secret",
    # namespaces and mounts (also refused for lack of privilege; this is the second lock)
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    # the machine itself
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "syslog", "quotactl", "lookup_dcookie", "fanotify_init", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex",
)  # fmt: skip
TIOCSTI = 0x5412  # push characters into a terminal's input


@functools.lru_cache(maxsize=1)
def seccomp_bpf() -> bytes:
    """The compiled filter (BPF program bytes, as ``bwrap --seccomp FD`` reads them).

    Raises:
        ImportError: pyseccomp or libseccomp is missing.
    """
    import pyseccomp

    filt = pyseccomp.SyscallFilter(defaction=pyseccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            filt.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError, OSError):  # unknown on this architecture
            continue
    filt.add_rule(pyseccomp.ERRNO(errno.EPERM), "ioctl", pyseccomp.Arg(1, pyseccomp.MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
    fd = os.memfd_create("seccomp")
    try:
        with os.fdopen(fd, "w+b", closefd=False) as out:
            filt.export_bpf(out)
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
