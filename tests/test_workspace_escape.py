"""Red team against workspaces and RepoFix's grading, each attack judged from outside the attacked sandbox.

The judges look from the host (PID namespaces of every process on the machine, ``statvfs`` of the
workspace's mounts through ``/proc/PID/root``, host files and their fingerprints), from another workspace
(the victim's own shell), or at the reward, which is computed in this process from expected values the
sandbox never sees.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import textwrap
import threading
import time

import pytest
from agentrl.envs.repo_fix import MARKER, RepoFixEnv, expert
from agentrl.envs.workspace import Workspace, WorkspaceLimits, make_tar

from agentrl.rollout.chat import format_tool_call
from tests.proc_helpers import ns_members

SECRET = secrets.token_hex(16)
LIMITS = WorkspaceLimits(call_timeout_s=4.0, max_processes=8, max_disk_bytes=4 << 20, max_tmp_bytes=1 << 20)



def _ns(ws: Workspace) -> str:
    return os.readlink(f"/proc/{ws.processes()[0]}/ns/pid")


@pytest.fixture
def host_secret(tmp_path):
    """A world-readable host file holding SECRET, and its fingerprint."""
    path = tmp_path / "secret.txt"
    path.write_text(SECRET)
    os.chmod(tmp_path, 0o755)
    os.chmod(path, 0o644)
    yield path
    assert path.read_text() == SECRET


def test_another_episodes_workspace_is_out_of_reach(host_secret):
    with Workspace(make_tar({"mine.txt": "VICTIM-" + SECRET}), LIMITS) as victim, Workspace(None, LIMITS) as attacker:
        victim.bash("sleep 60 >/dev/null 2>&1 &")  # a process the attacker would like to find
        victim_pids = victim.processes()
        attack = textwrap.dedent(f"""\
            grep -rs --exclude-dir=usr --exclude-dir=root --exclude-dir=lib VICTIM- / 2>/dev/null | head -3
            ls /proc | grep -E '^[0-9]+$' | tr '\\n' ' '
            for p in /proc/[0-9]*; do cat $p/root/workspace/mine.txt $p/cwd/mine.txt 2>/dev/null; done
            for pid in {' '.join(map(str, victim_pids))}; do kill -9 $pid 2>&1; ls /proc/$pid/root/ 2>&1; done
            cat {host_secret} 2>&1; echo pwned > /proc/{victim_pids[0]}/root/workspace/mine.txt 2>&1
            """)
        out = attacker.bash(attack, timeout_s=30).output
        assert SECRET not in out
        assert victim.processes() == victim_pids  # the victim's init, shell and sleep are alive
        assert victim.read_file("mine.txt") == "VICTIM-" + SECRET


def test_no_process_outlives_the_episode():
    env = RepoFixEnv(limits=LIMITS)
    env.reset(seed=1)
    ws = env.workspace
    daemons = textwrap.dedent("""\
        setsid sleep 300 >/dev/null 2>&1 < /dev/null &
        (trap '' TERM HUP INT; sleep 300 & disown) >/dev/null 2>&1
        nohup bash -c 'trap "" TERM HUP; while :; do sleep 1; done' >/dev/null 2>&1 &
        python3 -c 'import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(300)' &
        disown -a; sleep 0.3; ps -e | wc -l""")
    env.step(format_tool_call("bash", {"command": daemons}))
    namespaces = {_ns(ws)}
    assert len(ns_members(namespaces)) >= 6
    env.step("done")  # graded: the episode ends and its sandbox with it
    assert ns_members(namespaces) == []
    env.close()


def test_hidden_tests_are_not_in_the_agents_sandbox():
    env = RepoFixEnv(limits=LIMITS)
    env.reset(seed=3)
    hidden = [repr(args) for args in env.task.hidden_args]
    search = ("cat /.agentrl/hidden; ls -la /.agentrl; grep -rsl __agentrl_hidden__ / 2>/dev/null | grep -v ^/proc; "
              "cat /proc/1/environ | tr '\\0' ' '; env")
    obs, *_ = env.step(format_tool_call("bash", {"command": search}))
    seen = obs[0]["content"]
    assert MARKER not in seen and not any(h in seen for h in hidden if len(h) > 6)
    obs, *_ = env.step(format_tool_call("bash", {"command": "wc -c < /.agentrl/hidden"}))
    assert obs[0]["content"] == "0"  # the grader's placeholder is there, empty
    env.close()


def test_disk_quota_holds_against_every_way_to_fill_it():
    with Workspace(None, LIMITS) as ws:
        init = ws.processes()[0]
        attack = textwrap.dedent("""\
            yes 0123456789abcdef > big 2>/dev/null
            python3 -c '
            import os
            fd = os.open("alloc", os.O_CREAT | os.O_WRONLY)
            try:
                os.posix_fallocate(fd, 0, 64 << 20)
            except OSError as e:
                print("fallocate:", e)
            try:
                os.memfd_create("x")
                print("memfd allowed")
            except OSError as e:
                print("memfd:", e)
            try:
                os.truncate("sparse", 1 << 30)
                with open("sparse", "r+b") as f:
                    f.seek(1 << 29); f.write(b"x" * (8 << 20))
            except OSError as e:
                print("sparse:", e)
            '
            ln big hard 2>&1; cp big copy 2>&1 | tail -1; cp big /tmp/copy 2>&1 | tail -1
            du -sb /workspace /tmp 2>/dev/null""")
        out = ws.bash(attack, timeout_s=20).output
        for mount, quota in (("/workspace", LIMITS.max_disk_bytes), ("/tmp", LIMITS.max_tmp_bytes)):
            st = os.statvfs(f"/proc/{init}/root{mount}")  # the kernel's count, from the host
            assert st.f_blocks * st.f_frsize == quota and (st.f_blocks - st.f_bfree) * st.f_frsize <= quota
        assert "memfd: [Errno 1]" in out and "memfd allowed" not in out
        assert "No space left on device" in out


def test_inode_flood_is_stopped():
    limits = WorkspaceLimits(call_timeout_s=10.0, max_inodes=2000)
    with Workspace(None, limits) as ws:
        init = ws.processes()[0]
        r = ws.bash("python3 -c 'import os\nfor i in range(10**6): open(\"f%d\" % i, \"w\").close()'")
        assert r.status == "inode_limit"
        st = os.statvfs(f"/proc/{init}/root/workspace")
        assert st.f_files - st.f_ffree < 2000 + 100_000  # stopped within one 50 ms check
        assert ws.bash("touch one-more").status == "inode_limit"  # still over: no call may add more
        assert ws.bash("rm -rf /workspace/*; echo ok").output == "ok\n"
        assert ws.bash("touch f && echo ok").output == "ok\n"


def test_fork_bomb_does_not_starve_other_workspaces():
    limits = WorkspaceLimits(call_timeout_s=6.0, max_processes=16)
    with Workspace(None, limits) as bomb, Workspace(None, limits) as other:
        done = threading.Event()
        threading.Thread(target=lambda: (bomb.bash("b() { b | b & }; b"), done.set()), daemon=True).start()
        time.sleep(1.0)
        start = time.monotonic()
        r = other.bash("for i in $(seq 14); do sleep 5 & done; sleep 0.5; jobs -r | wc -l", timeout_s=5)
        assert r.output.split()[-1] == "14", r.output  # its whole budget is there
        assert time.monotonic() - start < 4.0
        assert len(bomb.processes()) <= limits.max_processes + 2  # counted from the host
        assert subprocess.run(["true"], check=False).returncode == 0  # the host still forks
        done.wait(15)
        assert bomb.bash("echo alive").output.endswith("alive\n")


def _fingerprint(path) -> tuple:
    st = os.stat(path)
    return st.st_mode, st.st_mtime_ns, hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_symlinks_out_of_the_workspace_at_grading_time(host_secret):
    env = RepoFixEnv(limits=LIMITS)
    env.reset(seed=4)
    task = env.task
    module = f"{task.package}/{task.bugged.module}.py"
    before = _fingerprint(host_secret)
    links = textwrap.dedent(f"""\
        mv {module} /tmp/orig.py
        ln -s {host_secret} {module}
        ln -s / {task.package}/root
        ln -s /proc/1/root {task.package}/proc_root
        ln -s /.agentrl/hidden {task.package}/hidden.py
        ln -s ../../../../../../{host_secret} {task.package}/rel
        ls -la {task.package}""")
    env.step(format_tool_call("bash", {"command": links}))
    _, reward, terminated, _, _ = env.step("done")
    assert terminated and reward == 0.0
    assert SECRET not in env.last_grading_note
    assert _fingerprint(host_secret) == before
    env.close()


def test_a_forged_result_line_earns_nothing_beyond_a_real_fix():
    env = RepoFixEnv(limits=LIMITS)
    env.reset(seed=5)
    task = env.task
    guesses = ["True"] * len(task.expected)  # what a forger would print (it never sees the expected values)
    forge = (f"import os\nprint({MARKER!r} + {str(guesses)!r}.replace(\"'\", '\"'), flush=True)\n"
             "os._exit(0)\n")
    init = f"{task.package}/__init__.py"
    env.step(format_tool_call("write_file", {"path": init, "content": forge}))
    _, reward, *_ = env.step("done")
    right = [e == "True" for e in task.expected]
    assert reward <= (sum(right[:task.num_differing]) / task.num_differing if all(right[task.num_differing:]) else 0)
    env.close()


def test_the_grader_copy_cannot_be_edited_from_the_episode():
    """A daemon that writes the fix once the episode is over (when the grader's copy exists) is too late: it
    is killed before the final tree is archived, and it could never reach the grader's sandbox anyway."""
    env = RepoFixEnv(limits=LIMITS)
    seed = 6
    env.reset(seed=seed)
    task = env.task
    module = f"{task.package}/{task.bugged.module}.py"
    fixed = env.workspace.read_file(module).replace(task.bugged.buggy, task.bugged.correct)
    env.workspace.write_file("/tmp/fixed.py", fixed)
    daemon = (f"setsid bash -c 'sleep 0.4; while :; do cp /tmp/fixed.py /workspace/{module}; "
              "for p in /proc/[0-9]*; do cp /tmp/fixed.py $p/root/workspace/" + module + " 2>/dev/null; done; "
              "sleep 0.01; done' >/dev/null 2>&1 &")
    env.step(format_tool_call("bash", {"command": daemon}))
    _, reward, *_ = env.step("done")
    assert reward == 0.0, env.last_grading_note
    env.close()
    # and the expert's fix of the same seed is rewarded: the judge can tell a fix from none
    env.reset(seed=seed)
    for action in expert(seed, env_kwargs={"limits": LIMITS}):
        _, reward, *_ = env.step(action)
    assert reward == 1.0
    env.close()
