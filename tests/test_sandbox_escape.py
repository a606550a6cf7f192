"""Red team, in-process and kernel: attacks on the audit hook, on blocked modules and privileged
system calls, and on the sandbox's prepared root (the judge, and what it checks: tests/sandbox_judge.py;
the launcher, cleanup, resource exhaustion and the grader: tests/test_sandbox_escape_host.py)."""

from __future__ import annotations

import pytest

from tests.sandbox_judge import WITH_HOOK, Attacks, judge, judge_base, run_attack  # noqa: F401 (fixtures)

ATTACKS = Attacks()
attack = ATTACKS.add


# --- the audit hook: in-process, trusting objects the attacker controls (hook layer ON) ---
attack("hook: PathLike whose __fspath__ changes after the hook's check (shutil.rmtree)", '''
class Flip:
    n = 0
    def __fspath__(self):
        Flip.n += 1
        return "inside" if Flip.n == 1 else KEEP_DIR
os.mkdir("inside")
try:
    import shutil
    shutil.rmtree(Flip())
except OSError as e:
    print("no", e)
win("fspath")
''', WITH_HOOK)
attack("hook: str subclass whose methods lie to posixpath.realpath", '''
class Liar(str):
    def startswith(self, *a):
        return False
    def partition(self, sep):
        return ("inside.txt", "", "")
try:
    open(Liar(CANARY), "w").write("escaped")
except OSError as e:
    print("no", e)
''', WITH_HOOK)
attack("hook: monkeypatched posixpath internals", '''
import posixpath
posixpath._joinrealpath = lambda path, rest, strict, seen: (os.getcwd() + "/x", True)
posixpath.realpath = lambda p, strict=False: os.getcwd() + "/x"
win("monkeypatch")
''', WITH_HOOK)
attack("hook: the hook's own traceback frame hands over its closure cells", '''
try:
    open("/nonexistent/x", "w")
except PermissionError as e:
    tb = e.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            for cell in getattr(value, "__closure__", None) or ():
                if cell.cell_contents is os.path.realpath:
                    cell.cell_contents = lambda p: os.getcwd()
        tb = tb.tb_next
win("frames")
''', WITH_HOOK)
attack("hook: blocked _posixsubprocess loaded under another name spawns an unhooked python", '''
import importlib.machinery, importlib.util, glob, time
so = glob.glob(os.path.join(os.path.dirname(os.__file__), "lib-dynload", "_posixsubprocess*.so"))[0]
loader = importlib.machinery.ExtensionFileLoader("evil._posixsubprocess", so)
mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("evil._posixsubprocess", loader))
loader.exec_module(mod)
code = open("main.py").read().split("# --end of prelude--")[0] + "\\nwin('spawned')\\n"
r, w = os.pipe()
args = [[sys.executable, "-I", "-S", "-c", code], [os.fsencode(sys.executable)], True, (), None, None,
        -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None]
for extra in ([], [False]):  # Python 3.11 added allow_vfork
    try:
        print("spawned", mod.fork_exec(*args, *extra)); break
    except TypeError as e:
        print("signature", e)
os.close(w)
time.sleep(0.5)
''', WITH_HOOK)
attack("hook: an unhooked setsid daemon through the aliased module outlives the run", '''
import importlib.machinery, importlib.util, glob
so = glob.glob(os.path.join(os.path.dirname(os.__file__), "lib-dynload", "_posixsubprocess*.so"))[0]
loader = importlib.machinery.ExtensionFileLoader("x._posixsubprocess", so)
mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("x._posixsubprocess", loader))
loader.exec_module(mod)
code = (open("main.py").read().split("# --end of prelude--")[0]
        + "\\nimport time\\nos.close(1)\\nos.close(2)\\ntime.sleep(0.8)\\nfor _ in range(20):\\n    win('daemon')\\n    time.sleep(0.1)\\n")
r, w = os.pipe()
args = [[sys.executable, "-I", "-S", "-c", code], [os.fsencode(sys.executable)], True, (), None, None,
        -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, None, -1, None]
for extra in ([], [False]):
    try:
        print("daemon", mod.fork_exec(*args, *extra)); break
    except TypeError:
        pass
''', WITH_HOOK, settle_s=1.5)
attack("hook: dir_fd read resolved against the wrong directory (/proc/self/root)", '''
fd = os.open("/proc/%d" % os.getpid(), os.O_RDONLY)
for rel in ("root" + SECRET_FILE, "root/proc/%d/environ" % HOST_PID, "root/proc/%d/environ" % VICTIM_PID):
    try:
        print(os.read(os.open(rel, os.O_RDONLY, dir_fd=fd), 4096))
    except OSError as e:
        print("no", e)
''', WITH_HOOK)
attack("hook: check-then-use race swapping a directory for a symlink", '''
import threading
target = os.path.dirname(CANARY)
stop = False
def flip():
    while not stop:
        try:
            os.mkdir("d")
        except OSError:
            pass
        try:
            os.rmdir("d"); os.symlink(target, "d")
        except OSError:
            pass
        try:
            os.remove("d")
        except OSError:
            pass
t = threading.Thread(target=flip); t.start()
hits = 0
for _ in range(5000):
    try:
        open("d/" + os.path.basename(CANARY), "w").write("raced"); hits += 1
    except OSError:
        pass
stop = True; t.join()
print("writes", hits)
''', WITH_HOOK)

# --- blocked modules and privileged system calls, with the kernel alone ---
attack("ctypes: setuid(0), setgroups, then write the canary", '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(libc.setuid(0), libc.setgid(0), libc.setgroups(0, None), ctypes.get_errno())
win("setuid")
''')
attack("ctypes: unshare a user namespace and mount the host root", '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
print("unshare", libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), ctypes.get_errno())
os.makedirs("host", exist_ok=True)
print("mount", libc.mount(b"/dev/vda", b"host", b"ext4", 0, None), ctypes.get_errno())
print(os.listdir("host"))
win("userns")
''')
attack("ctypes: setns into every network namespace visible in /proc", '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for pid in [p for p in os.listdir("/proc") if p.isdigit()] + [str(HOST_PID), "1"]:
    for ns in ("net", "mnt", "user", "pid"):
        try:
            fd = os.open("/proc/%s/ns/%s" % (pid, ns), os.O_RDONLY)
            print(pid, ns, libc.setns(fd, 0), ctypes.get_errno())
        except OSError as e:
            print(pid, ns, e)
win("setns")
''')
attack("nsenter and host binaries from a subprocess", '''
import subprocess
for cmd in (["nsenter", "-t", "1", "-n", "-m", "--", "sh", "-c", "echo escaped > " + CANARY],
            ["/usr/bin/nsenter", "-t", str(HOST_PID), "-a", "true"], ["/bin/sh", "-c", "id"], ["unshare", "-r", "id"]):
    try:
        print(subprocess.run(cmd, capture_output=True, timeout=1))
    except Exception as e:
        print("no", e)
win("nsenter")
''')
attack("ptrace the sandbox's init and every visible process", '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()] + [HOST_PID]:
    print(pid, libc.ptrace(16, pid, None, None), ctypes.get_errno())  # PTRACE_ATTACH
win("ptrace")
''')
attack("raw and packet sockets", '''
import socket
for args in ((socket.AF_PACKET, socket.SOCK_RAW, 0x0300), (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP),
             (socket.AF_NETLINK, socket.SOCK_RAW, 0)):
    try:
        s = socket.socket(*args); print("opened", args, s)
    except OSError as e:
        print("no", e)
print(socket.if_nameindex())
win("raw")
''')
attack("loopback TCP, Unix path and abstract sockets of the host", '''
import socket
for family, address in ((socket.AF_INET, ("127.0.0.1", PORT)), (socket.AF_INET6, ("::1", PORT)),
                        (socket.AF_UNIX, UNIX), (socket.AF_UNIX, "\\0" + ABSTRACT)):
    try:
        s = socket.socket(family, socket.SOCK_STREAM); s.settimeout(0.5); s.connect(address); s.send(b"x")
        print("connected", address)
    except OSError as e:
        print("no", address, e)
''')
attack("UDP to the host's loopback port", '''
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(10):
    try:
        s.sendto(b"escaped", ("127.0.0.1", PORT))
    except OSError as e:
        print("no", e)
win("udp")
''')
attack("mknod device nodes for the host disks and read them", '''
import stat
parts = [line.split() for line in open("/proc/partitions").read().splitlines()[2:] if line.strip()]
for major, minor, _, name in parts[:8]:
    try:
        os.mknod("dev-" + name, stat.S_IFBLK | 0o600, os.makedev(int(major), int(minor)))
        data = open("dev-" + name, "rb").read(1 << 20)
        i = data.find(b"AGENTRL_ESCAPE_SECRET=")
        print(name, data[i:i + 60] if i >= 0 else "no secret")
    except OSError as e:
        print("no", name, e)
try:
    os.mknod("mem", stat.S_IFCHR | 0o600, os.makedev(1, 1)); print(open("mem", "rb").read(16))
except OSError as e:
    print("no /dev/mem", e)
''')
attack("mkfifo and mknod at the canary path and in /dev", '''
for path in (CANARY, "/dev/fifo", "/canary-fifo"):
    try:
        os.mkfifo(path); print("fifo", path)
    except OSError as e:
        print("no", path, e)
win("fifo")
''')
attack("pidfd_open sweep signalling every PID", '''
import signal
killed = 0
for pid in range(2, 70000):
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        continue
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL); killed += 1
    except OSError:
        pass
    os.close(fd)
print("killed", killed)
''')
attack("kill(-1) and direct kills of host PIDs", '''
import signal
for pid in (HOST_PID, VICTIM_PID, -1):
    try:
        os.kill(pid, signal.SIGKILL); print("sent", pid)
    except OSError as e:
        print("no", pid, e)
''')
attack("/proc/<host pid>/mem: read the parent's memory and write into it", '''
for pid in (HOST_PID, os.getppid(), 1):
    try:
        with open("/proc/%d/mem" % pid, "r+b") as f:
            maps = open("/proc/%d/maps" % pid).read().splitlines()
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if "rw" in line.split()[1] and hi - lo < 1 << 24:
                    f.seek(lo); data = f.read(hi - lo)
                    i = data.find(b"AGENTRL_ESCAPE_SECRET=")
                    if i >= 0:
                        print(data[i:i + 60]); f.seek(lo + i); f.write(b"X" * 22)
    except OSError as e:
        print("no", pid, e)
''')
attack("environ and cmdline of every visible process", '''
for pid in [p for p in os.listdir("/proc") if p.isdigit()] + [str(HOST_PID), str(VICTIM_PID)]:
    for name in ("environ", "cmdline", "cwd/" + os.path.basename(SECRET_FILE)):
        try:
            print(pid, name, open("/proc/%s/%s" % (pid, name), "rb").read()[:2000])
        except OSError as e:
            print("no", pid, name, e)
''')
attack("host files: the secret, /etc, /root, home, project sources", '''
import glob
for pattern in (SECRET_FILE, "/etc/shadow", "/etc/passwd", "/root/.*", "/root/*", "/home/*/.*", "/work/*/*.md",
                "/work/*/envs/*.py", "/tmp/*", "/var/*", "/run/*"):
    for path in glob.glob(pattern) or [pattern]:
        try:
            print(path, open(path, "rb").read()[:500])
        except OSError as e:
            print("no", path, e)
''')
attack("directory listings of the host", '''
for d in ("/", "/tmp", "/root", "/home", "/etc", "/var", "/run", "/usr", "/usr/bin", "/proc/1/root", "/proc/1/cwd",
          "/proc/self/root/tmp"):
    try:
        print(d, os.listdir(d))
    except OSError as e:
        print("no", d, e)
for root, dirs, files in os.walk("/"):
    if root.startswith("/proc"):
        continue
    print(root, dirs[:20], files[:20])
''')
attack("symlinks and /proc/*/root paths to the host /tmp", '''
for path in ("/proc/1/root" + CANARY, "/proc/%d/root%s" % (HOST_PID, CANARY), "/proc/self/cwd/../.." + CANARY):
    try:
        open(path, "w").write("escaped"); print("wrote", path)
    except OSError as e:
        print("no", path, e)
try:
    os.symlink(os.path.dirname(CANARY), "up"); open("up/" + os.path.basename(CANARY), "w").write("escaped")
except OSError as e:
    print("no", e)
win("symlink")
''')
attack("writes to the read-only root, /dev, /usr and the interpreter", '''
for path in ("/evil", "/dev/evil", "/dev/shm/evil", "/usr/lib/evil", os.path.join(os.path.dirname(os.__file__), "os.py"),
             sys.executable, "/proc/sys/kernel/core_pattern", "/proc/sys/kernel/hostname"):
    try:
        with open(path, "a") as f:
            f.write("|/sandbox/evil")
        print("wrote", path)
    except OSError as e:
        print("no", path, e)
win("ro")
''')
attack("remount, pivot and chroot to get the host back", '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print("remount", libc.mount(None, b"/", None, 32 | 0x1000000, None), ctypes.get_errno())  # MS_REMOUNT|MS_BIND
print("proc", libc.mount(b"proc", b"/sandbox", b"proc", 0, None), ctypes.get_errno())
print("chroot", libc.chroot(b"/proc/1/root"), ctypes.get_errno())
try:
    os.chdir("/proc/1/cwd"); print(os.listdir("."))
except OSError as e:
    print("no", e)
win("mount")
''')
attack("keyctl, bpf, userfaultfd, perf_event_open and io_uring", '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
for name, nr, args in (("keyctl", 250, (0, 0, 0)), ("bpf", 321, (0, 0, 0)), ("userfaultfd", 323, (0,)),
                       ("perf_event_open", 298, (0, 0, 0)), ("kexec_load", 246, (0, 0, 0)), ("init_module", 175, (0, 0, 0)),
                       ("io_uring_setup", 425, (8, 0))):
    print(name, libc.syscall(nr, *args), ctypes.get_errno())
win("syscalls")
''')
attack("a new session with a terminal ioctl (TIOCSTI) into the host's tty", '''
import fcntl, termios
for path in ("/dev/tty", "/proc/%d/fd/0" % HOST_PID, "/dev/console", "/dev/pts/0"):
    try:
        fd = os.open(path, os.O_RDWR)
        for ch in b"touch " + CANARY.encode() + b"\\n":
            fcntl.ioctl(fd, termios.TIOCSTI, bytes([ch]))
        print("injected", path)
    except OSError as e:
        print("no", path, e)
''')

# the prepared root's files are hard links to the host's: a change there would be a change on the host
attack("the prepared root: rewrite, rename, unlink, chmod or link interpreter, libc, os.py, entry script", '''
import shutil
targets = [sys.executable, "/.agentrl/child.pyc", os.__file__, "/usr/lib/x86_64-linux-gnu/libc.so.6",
           "/usr/lib64/ld-linux-x86-64.so.2"]
for path in targets:
    for name, how in (("append", lambda p: open(p, "ab").write(b"evil")),
                      ("truncate", lambda p: os.truncate(p, 0)),
                      ("open O_TRUNC", lambda p: os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))),
                      ("chmod", lambda p: os.chmod(p, 0o777)),
                      ("utime", lambda p: os.utime(p, (0, 0))),
                      ("link", lambda p: os.link(p, "linked")),
                      ("rename", lambda p: os.rename(p, p + ".moved")),
                      ("unlink", lambda p: os.unlink(p)),
                      ("copy over", lambda p: shutil.copyfile("/.agentrl/child.pyc", p))):
        try:
            how(path); print("did", name, path)
        except OSError as e:
            print("no", name, path, e.errno)
    try:
        with open(path, "r+b") as f:
            f.write(b"\\x00" * 16); print("overwrote", path)
    except OSError as e:
        print("no r+b", path, e.errno)
win("tree")
''')



@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_contained(judge, name):
    run_attack(judge, ATTACKS, name, tag="")


def test_the_suite_covers_every_class():
    from tests.test_sandbox_escape_host import ATTACKS as HOST_ATTACKS  # the other families

    assert not set(ATTACKS) & set(HOST_ATTACKS)
    attacks = {**ATTACKS, **HOST_ATTACKS}
    assert len(attacks) >= 40
    prefixes = ("hook:", "ctypes", "mknod", "mkfifo", "pidfd", "/proc/<host pid>/mem", "a setsid", "fork bomb",
                "thread bomb", "memory:", "infinite output", "CPU spin", "disk filling", "deep recursion", "launcher:",
                "the prepared root")
    assert all(any(name.startswith(p) for name in attacks) for p in prefixes)
