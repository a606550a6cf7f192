"""Red team, around the sandbox: attacks on the launcher (the process outside every sandbox that starts
bwrap), what a run leaves behind, resource exhaustion, other runs' requests, and the grader of
PythonSandbox-v0 (the judge, and what it checks: tests/sandbox_judge.py; the audit hook, the kernel and
the prepared root: tests/test_sandbox_escape.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from agentrl.envs import PythonSandboxEnv, run_sandboxed
from agentrl.envs.python_sandbox import MARKER
from tests.sandbox_judge import KERNEL_ONLY, SECRET, Attacks, judge, judge_base, run_attack  # noqa: F401 (fixtures)

ATTACKS = Attacks()
attack = ATTACKS.add


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
    run_attack(judge, ATTACKS, name, tag="host")


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
