"""The judge of the sandbox's red team (tests/test_sandbox_escape*.py): attack programs written
to get out of ``run_sandboxed``, each judged from outside the sandbox.

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

No attack reaches beyond loopback or the sockets and files this test creates. A test module imports
the ``judge_base`` and ``judge`` fixtures from here (module-scoped: one judge per module).
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
from agentrl.envs import SandboxLimits, _bwrap, run_sandboxed
from agentrl.envs._bwrap import SANDBOX_UID
from agentrl.envs._sandbox_root import CHILD_PATH, sandbox_root

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


class Attacks(dict):
    """name -> (attack body, limits, seconds after the run before judging), grouped by the class attacked."""

    def add(self, name: str, body: str, limits: SandboxLimits = KERNEL_ONLY, settle_s: float = 0.05) -> None:
        self[name] = (body, limits, settle_s)


def run_attack(judge: Judge, attacks: Attacks, name: str, tag: str) -> None:
    """Run attack ``name`` under the judge (its canary named ``tag`` and its index) and check it was contained."""
    body, limits, settle_s = attacks[name]
    canary = judge.canary(f"{tag}{list(attacks).index(name)}")
    start = time.monotonic()
    result = run_sandboxed(judge.prelude(canary) + body, limits)
    elapsed = time.monotonic() - start
    assert elapsed < limits.wall_time_s + 3.0, f"{name}: the run took {elapsed:.1f} s"
    judge.check(result.output, canary, settle_s=settle_s)
    assert os.getpid() and os.kill(os.getpid(), 0) is None  # this process is alive and can be signalled
