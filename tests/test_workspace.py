"""Workspaces: state carried across calls, per-call limits, the quota, the exact process budget, cleanup.

Limits and leftovers are judged from outside the sandbox (host PIDs, PID namespaces, the host's files).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest
from agentrl.envs import SandboxLimits, run_sandboxed
from agentrl.envs.workspace import Workspace, WorkspaceDied, WorkspaceLimits, make_tar

from tests.proc_helpers import ns_members

FAST = WorkspaceLimits(call_timeout_s=2.0, max_processes=8, max_disk_bytes=4 << 20, max_tmp_bytes=1 << 20)


@pytest.fixture
def ws():
    with Workspace(make_tar({"README": "hello\n", "pkg/mod.py": "X = 1\n"}), FAST) as w:
        yield w



def test_files_cwd_and_exported_variables_carry_over(ws):
    assert ws.bash("cat README; ls pkg").output == "hello\nmod.py\n"
    assert ws.bash("mkdir -p a/b && cd a/b && export SECRET_SAUCE=42 && echo made > f").status == "ok"
    r = ws.bash("pwd; echo $SECRET_SAUCE; cat f")
    assert (r.output, r.cwd, r.exit_code) == ("/workspace/a/b\n42\nmade\n", "/workspace/a/b", 0)
    assert ws.bash("false").describe() == "[exit code 1]"
    assert ws.bash("cd /workspace && python3 -c 'import pkg.mod as m; print(m.X + 1)'").output == "2\n"


def test_file_tools(ws):
    assert ws.read_file("pkg/mod.py") == "X = 1\n"
    text = "it's \"quoted\" $HOME `x` \\n\nline 2\n"
    ws.write_file("new/deep/f.txt", text)
    assert ws.read_file("new/deep/f.txt") == text
    assert ws.bash("cat new/deep/f.txt").output == text
    assert "line 1" in ws.str_replace("pkg/mod.py", "X = 1", "X = 2")
    assert ws.read_file("/workspace/pkg/mod.py") == "X = 2\n"
    with pytest.raises(ValueError, match="not found"):
        ws.str_replace("pkg/mod.py", "X = 1", "X = 3")
    ws.write_file("twice.txt", "a\na\n")
    with pytest.raises(ValueError, match="found 2 times"):
        ws.str_replace("twice.txt", "a", "b")
    with pytest.raises(FileNotFoundError):
        ws.read_file("missing.py")
    with pytest.raises(IsADirectoryError):
        ws.read_file("pkg")
    assert ws.list_dir(".") .splitlines() == ["README", "new/", "new/deep/", "pkg/", "pkg/mod.py", "twice.txt"]
    ws.bash("cd pkg")
    assert ws.read_file("mod.py") == "X = 2\n"  # relative to the shell's directory, as bash sees it


def test_timeout_kills_the_command_and_keeps_the_shell(ws):
    ws.bash("cd pkg && export KEEP=yes")
    start = time.monotonic()
    r = ws.bash("sleep 30 & sleep 30")
    assert r.status == "timeout" and time.monotonic() - start < 5
    assert len(ws.processes()) == 2  # the init and the shell: both sleeps are gone
    # (bash may first note the killed background job: "line 1: 4 Killed  sleep 30")
    assert ws.bash("echo $KEEP; pwd").output.endswith("yes\n/workspace/pkg\n")


def test_a_stuck_shell_is_replaced_where_it_was(ws):
    ws.bash("cd pkg")
    r = ws.bash("while :; do :; done")
    assert r.status == "timeout" and r.restarted and "a new one was started in /workspace/pkg" in r.describe()
    assert ws.bash("pwd").output == "/workspace/pkg\n"
    r = ws.bash("exit 3")
    assert r.status == "shell_exited"
    assert ws.bash("pwd; cat mod.py").output == "/workspace/pkg\nX = 1\n"


def test_output_is_capped_and_a_flood_is_killed():
    limits = WorkspaceLimits(call_timeout_s=10.0, max_output_bytes=1000, kill_output_bytes=100_000)
    with Workspace(None, limits) as w:
        r = w.bash("seq 1 2000")
        assert len(r.output) == 1000 and r.omitted_bytes > 0 and "output truncated" in r.describe()
        start = time.monotonic()
        r = w.bash("yes")
        assert r.status == "output_limit" and time.monotonic() - start < 5
        assert w.bash("echo fine").output == "fine\n"


def test_disk_quota_is_exact(ws):
    r = ws.bash("head -c 3000000 /dev/zero > a; head -c 3000000 /dev/zero > b; echo $?; du -sb /workspace")
    assert "No space left on device" in r.output
    used = int(r.output.split()[-2])
    assert used <= FAST.max_disk_bytes
    r = ws.bash("head -c 2000000 /dev/zero > /tmp/t")
    assert "No space left on device" in r.output  # /tmp has a quota of its own
    ws.bash("rm -f a b /tmp/t")
    assert ws.bash("head -c 3000000 /dev/zero > a && echo ok").output == "ok\n"


FORKER = """import os, time
n = 0
for _ in range(64):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    n += 1
open("/tmp/n", "w").write(str(n))
time.sleep(30)
"""


@pytest.mark.parametrize("budget", [1, 5, 16])
def test_process_budget_is_exact(budget):
    """``max_processes`` programs at once besides the init and the shell, counted from the host."""
    with Workspace(None, WorkspaceLimits(max_processes=budget)) as w:
        w.write_file("/tmp/forker.py", FORKER)
        assert w.bash("python3 /tmp/forker.py >/dev/null 2>&1 &").status == "ok"
        deadline = time.monotonic() + 10
        while w.bash("test -s /tmp/n").status != "ok" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(w.processes()) == budget + 2, w.processes()  # init, shell, python and its children
        assert w.bash("read -r n < /tmp/n; echo $n").output == f"{budget - 1}\n"  # (builtins: no fork)
        assert "Resource temporarily unavailable" in w.bash("/usr/bin/true", timeout_s=1).output
        w.bash("kill %1 2>/dev/null; kill $(jobs -p) 2>/dev/null", timeout_s=1)


def test_run_sandboxed_budget_is_exact():
    code = ("import os, time\nn = 0\nfor _ in range(40):\n    try:\n        pid = os.fork()\n    except OSError:\n"
            "        break\n    if pid == 0:\n        time.sleep(2)\n        os._exit(0)\n    n += 1\nprint(n)\n")
    limits = SandboxLimits(max_processes=16, audit_hook_layer=False, wall_time_s=4, cpu_time_s=4)
    assert run_sandboxed(code, limits).output == "16\n"


def test_close_kills_everything_and_is_idempotent():
    w = Workspace(None, FAST)
    w.bash("setsid sleep 100 & (sleep 100 &); nohup sleep 100 >/dev/null 2>&1 & sleep 0.3")
    pids = w.processes()
    namespaces = {os.readlink(f"/proc/{pids[0]}/ns/pid")}
    assert len(pids) >= 5
    w.close()
    w.close()
    assert ns_members(namespaces) == []
    with pytest.raises(WorkspaceDied):
        w.bash("true")


def test_snapshot_is_the_final_tree_and_ends_the_agents_processes(ws):
    ws.write_file("pkg/mod.py", "X = 7\n")
    ws.bash("ln -s /etc/passwd pkg/link; (while :; do echo X = 9 > pkg/mod.py; sleep 0.01; done) >/dev/null 2>&1 &")
    time.sleep(0.1)
    data = ws.snapshot()
    assert len(ws.processes()) == 2  # the daemon is gone before the archive was made
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
        assert "./pkg/mod.py" in names and tar.getmember("./pkg/link").issym()
        assert tar.extractfile("./pkg/mod.py").read() == b"X = 9\n"
    after = ws.bash("sleep 0.2; cat pkg/mod.py").output
    assert after == "X = 9\n"  # nothing writes any more


WORKER = """
import os, sys, time
sys.path[:0] = [{path!r}]
from agentrl.envs.workspace import Workspace, WorkspaceLimits
spaces = [Workspace(None, WorkspaceLimits(max_processes=8)) for _ in range(3)]
for w in spaces:
    w.bash("setsid sleep 1000 & (sleep 1000 &); nohup sleep 1000 >/dev/null 2>&1 & echo x > f; sleep 0.3")
print(" ".join(os.readlink(f"/proc/{{w.processes()[0]}}/ns/pid") for w in spaces), flush=True)
time.sleep(1000)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_worker_death_leaves_no_process_or_directory(tmp_path, sig):
    """A worker killed with ``kill -9`` (or terminated) takes its workspaces' processes with it; nothing
    was ever on the host's disk (counted in its TMPDIR, /dev/shm and the sandbox cache)."""
    from agentrl.envs._sandbox_root import _cache_dir
    # The sandbox's root trees are a cache built on first use (keyed by the interpreter and the
    # sandbox's own code): build them here, so that only what the worker leaves is compared.
    # (in a process started like the worker: the cache key depends on the interpreter's paths)
    warm = ("import sys; sys.path[:0] = [{path!r}]; from agentrl.envs.workspace import Workspace, WorkspaceLimits; "
            "Workspace(None, WorkspaceLimits(max_processes=8)).close()")
    subprocess.run([sys.executable, "-c", warm.format(path=os.path.dirname(os.path.dirname(__file__)))],
                   check=True, timeout=300)
    watched = [tmp_path, _cache_dir()]  # (/dev/shm is shared with other users: only the worker's own names)
    before = {str(d): sorted(os.listdir(d)) for d in watched}
    mounts = open("/proc/mounts").read()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    worker = subprocess.Popen([sys.executable, "-c", WORKER.format(path=os.path.dirname(os.path.dirname(__file__)))],
                              stdout=subprocess.PIPE, text=True, env=env)
    line = worker.stdout.readline()
    namespaces = set(line.split())
    assert len(namespaces) == 3 and ns_members(namespaces)
    worker.send_signal(sig)
    worker.wait(10)
    deadline = time.monotonic() + 10
    while ns_members(namespaces) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ns_members(namespaces) == []
    assert {str(d): sorted(os.listdir(d)) for d in watched} == before
    assert [n for n in os.listdir("/dev/shm") if str(worker.pid) in n] == []
    assert open("/proc/mounts").read() == mounts


def test_an_episode_that_crashes_leaves_nothing():
    """An env whose episode raises is closed by the rollout's ``finally``; one that is merely dropped is
    closed by the workspace's finalizer when it is collected."""
    import gc

    from agentrl.envs.repo_fix import RepoFixEnv

    env = RepoFixEnv()
    env.reset(seed=0)
    namespaces = {os.readlink(f"/proc/{env.workspace.processes()[0]}/ns/pid")}
    try:
        raise RuntimeError("the episode crashed")
    except RuntimeError:
        env.close()
    assert ns_members(namespaces) == []
    env = RepoFixEnv()
    env.reset(seed=1)
    namespaces = {os.readlink(f"/proc/{env.workspace.processes()[0]}/ns/pid")}
    del env
    gc.collect()
    assert ns_members(namespaces) == []
