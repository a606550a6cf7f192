"""bench/peers/device.sh on this machine: its steps run against a stand-in runner (no GPU, nothing
carried, none of this machine's Ray processes touched): fit probes, run steps with their own batch and
steps, the attention and tests steps, and the detached queue (bg, wait, stop)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _device_sh(tmp_path, runner_extra=""):
    """A copy of bench/peers/device.sh's scripts with a stand-in run_agentrl.py (OOM from 32k on) and
    the environment to run them in: no GPU, nothing carried, no Ray process of this machine touched."""
    import os
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    work = tmp_path / "repo"  # a copy of the scripts: device_env.sh links agentrl/envs in its cwd
    for rel in ("bench/device_env.sh", "bench/peers/device.sh", "bench/peers/table.py", "bench/attention.py"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / rel, work / rel)
    (work / "agentrl").mkdir()
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    runners = tmp_path / "runners"
    runners.mkdir()
    (runners / "run_agentrl.py").write_text(
        "import argparse, json, time\n"
        "p = argparse.ArgumentParser(); p.add_argument('--workload'); p.add_argument('--settings')\n"
        "p.add_argument('--out'); p.add_argument('--workdir'); p.add_argument('--steps', type=int)\n"
        "p.add_argument('--warmup', type=int, default=1); p.add_argument('--group-size', type=int, default=8)\n"
        "p.add_argument('--prompts-per-step', type=int, default=2)\n"
        "p.add_argument('--tool-latency', type=float, default=None)\n"
        "a = p.parse_args()\n"
        "n = int(a.workload[4:-1])\n"
        + runner_extra +
        "status = 'ok' if n < 32 else 'oom'\n"
        "print('RESULT ' + json.dumps({'workload': a.workload, 'status': status, 'steps': a.steps,\n"
        "                              'batch': [a.warmup, a.group_size, a.prompts_per_step], 'lat': a.tool_latency}))\n"
        "raise SystemExit(0 if status == 'ok' else 1)\n")
    env = {**os.environ, "DEVICE_SITE": str(tmp_path / "site"), "PEERS_RUNNERS": str(runners),
           "OUT": str(tmp_path / "out"), "SETTLE_S": "0", "PEER_ARGS": "",
           "PEERS_BG_DIR": str(tmp_path / "bg"), "PEERS_QUEUE_DIR": str(tmp_path / "q"),
           "PEERS_KILL_LEFTOVERS": "0"}  # never kill this machine's Ray processes: the suite's own cluster
    return work, env


def test_device_fit_step_runs_longer_episodes_until_one_does_not_fit(tmp_path):
    """device.sh fit:SYSTEM:SETTINGS:N1,N2,...: longNk in the order given, one timed step each,
    stopping at the first run whose result is not "ok" (here a stand-in runner that OOMs at 32k), or,
    with the lengths longest first, at the first that is."""
    import subprocess

    work, env = _device_sh(tmp_path)
    proc = subprocess.run(["bash", "bench/peers/device.sh", "fit:agentrl:recommended:16,24,32,48"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert "fit: agentrl (recommended) fits long16k" in out and "fits long24k" in out, out + proc.stderr
    assert 'does not fit long32k: "status": "oom"' in out, out
    assert "long48k" not in out and proc.returncode == 0, out  # stopped there; a fit probe's OOM is its answer
    assert '"steps": 1, "batch": [1, 8, 2]' in (tmp_path / "out" / "agentrl-long16k.log").read_text()

    # longest first: probe down until one fits (an OOM ends a run early; a fit costs whole steps);
    # FIT_PROBE=1: each run one step of 4 episodes, no warm-up
    out_down = tmp_path / "out_down"
    proc = subprocess.run(["bash", "bench/peers/device.sh", "fit:agentrl:recommended:64,48,24,16"], cwd=work,
                          env={**env, "OUT": str(out_down), "FIT_PROBE": "1"}, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout
    assert 'does not fit long64k: "status": "oom"' in out and 'does not fit long48k' in out, out + proc.stderr
    assert "fit: agentrl (recommended) fits long24k" in out, out
    assert "long16k" not in out and proc.returncode == 0, out  # the longest that fits ends the probe
    assert not (out_down / "agentrl-long16k.log").exists()
    assert '"steps": 1, "batch": [0, 4, 1]' in (out_down / "agentrl-long24k.log").read_text()
    # FIT_GROUP: the probe's group size (2 episodes a step: the longest lengths' steps take minutes)
    proc = subprocess.run(["bash", "bench/peers/device.sh", "fit:agentrl:recommended:24"], cwd=work,
                          env={**env, "OUT": str(out_down), "FIT_PROBE": "1", "FIT_GROUP": "2"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and '"steps": 1, "batch": [0, 2, 1]' in proc.stdout, proc.stdout + proc.stderr

    # a run step with a batch of its own (the probe batch as a row: warm-up and timed steps as usual)
    out_row = tmp_path / "out_row"
    proc = subprocess.run(["bash", "bench/peers/device.sh", "agentrl:long16k:recommended:g4p1"], cwd=work,
                          env={**env, "OUT": str(out_row)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and '"batch": [1, 4, 1]' in proc.stdout, proc.stdout + proc.stderr
    # ... and warm-up and timed steps of its own, which win over PEER_ARGS' (a fit's --steps 1 there)
    proc = subprocess.run(["bash", "bench/peers/device.sh", "agentrl:long16k:recommended:g4p1w2s5"], cwd=work,
                          env={**env, "OUT": str(out_row), "PEER_ARGS": "--steps 1"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and '"steps": 5, "batch": [2, 4, 1]' in proc.stdout, proc.stdout + proc.stderr
    proc = subprocess.run(["bash", "bench/peers/device.sh", "agentrl:long16k:recommended:4x1"], cwd=work,
                          env={**env, "OUT": str(out_row)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "is not a batch" in proc.stdout, proc.stdout

    # the attention step: bench/attention.py's rows in $OUT/attention.json (--cpu: its dry run here)
    proc = subprocess.run(["bash", "bench/peers/device.sh", "attention"], cwd=work, timeout=300, capture_output=True,
                          text=True, env={**env, "OUT": str(out_row), "ATT_LENGTHS": "128", "ATT_ARGS": "--cpu",
                                          # this interpreter as the script's python3 (torch, agentrl)
                                          "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"})
    rows = json.loads((out_row / "attention.json").read_text())["rows"]
    assert proc.returncode == 0 and {r["length"] for r in rows} == {128}, proc.stdout + proc.stderr
    assert "sdpa-default" in proc.stdout

    # the tests step: pytest on the named files, its summary printed, a failure in the step's status
    (work / "tests").mkdir()
    (work / "tests" / "test_here.py").write_text("def test_ok():\n    assert True\n")
    (work / "tests" / "test_bad.py").write_text("def test_no():\n    assert 1 == 2\n")
    py_env = {**env, "OUT": str(out_row), "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}
    proc = subprocess.run(["bash", "bench/peers/device.sh", "tests:tests/test_here.py"], cwd=work, env=py_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout + proc.stderr
    proc = subprocess.run(["bash", "bench/peers/device.sh", "tests:tests/test_here.py,tests/test_bad.py"], cwd=work,
                          env=py_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "1 failed, 1 passed" in proc.stdout and "tests exited 1" in proc.stdout, proc.stdout
    assert "assert 1 == 2" in (out_row / "tests.log").read_text()





def test_device_bg_queues_steps_detached_and_wait_hands_over_their_results(tmp_path):
    """device.sh bg STEP...: the steps after `bg` run detached in order (the call returns at once);
    `wait` waits, copies the queue's logs and results to $OUT, prints what is new, and says when the
    queue is done (exit 0) or still runs (exit 4); `stop` ends a queue and its runs."""
    import subprocess
    import time

    work, env = _device_sh(tmp_path, runner_extra="time.sleep(1.5 if n < 64 else 600)\n")
    sh = ["bash", "bench/peers/device.sh"]
    t0 = time.monotonic()
    proc = subprocess.run([*sh, "bg", "fit:agentrl:recommended:16,24,32,48"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "detached: fit:agentrl:recommended:16,24,32,48" in proc.stdout, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 20  # returned while the runs go on
    busy = subprocess.run([*sh, "bg", "fit:agentrl:recommended:16"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=60)
    assert busy.returncode == 2 and "a detached run is on" in busy.stdout  # one queue at a time
    first = subprocess.run([*sh, "wait"], cwd=work, env={**env, "WAIT_S": "0"}, capture_output=True, text=True, timeout=60)
    assert first.returncode == 4 and "the queue still runs" in first.stdout, first.stdout + first.stderr
    done = subprocess.run([*sh, "wait"], cwd=work, env={**env, "WAIT_S": "60"}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "the queue is done" in done.stdout, done.stdout + done.stderr
    seen = first.stdout + done.stdout
    assert "fits long24k" in seen and 'does not fit long32k: "status": "oom"' in seen and "long48k" not in seen, seen
    assert seen.count("fits long16k") == 1  # each line once over the waits
    out = tmp_path / "out"
    assert '"status": "oom"' in (out / "agentrl-long32k.log").read_text() and (out / "agentrl-long16k.log").is_file()

    # stop: a queue whose run would take 10 minutes ends at once, its runner with it
    proc = subprocess.run([*sh, "bg", "fit:agentrl:recommended:64"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    time.sleep(2)
    runner = subprocess.run(["pgrep", "-f", f"{tmp_path}/runners/run_agentrl.py"], capture_output=True, text=True)
    assert runner.stdout.strip(), "the queued runner did not start"
    stop = subprocess.run([*sh, "stop"], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert "stopped fit:agentrl:recommended:64" in stop.stdout, stop.stdout + stop.stderr
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", f"{tmp_path}/runners/run_agentrl.py"], capture_output=True, text=True)
    assert not left.stdout.strip(), f"runner left: {left.stdout}"


def test_device_gpu_queues_run_side_by_side_and_wait_merges_their_results(tmp_path):
    """GPU=N bash device.sh bg ...: one queue a GPU (a host of several), each run seeing its GPU alone
    (CUDA_VISIBLE_DEVICES); a second queue on another GPU starts while the first runs, one on the same
    GPU does not; `wait` waits for both, hands over their logs as gpuN-*.log and one peers.json of
    both queues' results, and tags each queue's lines."""
    import subprocess

    extra = ("import os\n"
             "time.sleep(3)\n"
             "rows = json.load(open(a.out)) if os.path.exists(a.out) else []\n"
             "rows.append({'system': 'agentrl', 'setting': a.settings, 'workload': a.workload, 'status': 'ok',\n"
             "             'gpu_seen': os.environ.get('CUDA_VISIBLE_DEVICES')})\n"
             "json.dump(rows, open(a.out, 'w'))\n")
    work, env = _device_sh(tmp_path, runner_extra=extra)
    sh = ["bash", "bench/peers/device.sh"]
    p0 = subprocess.run([*sh, "bg", "agentrl:long16k:recommended"], cwd=work, env={**env, "GPU": "0"},
                        capture_output=True, text=True, timeout=60)
    assert p0.returncode == 0 and "on GPU 0, detached" in p0.stdout, p0.stdout + p0.stderr
    p1 = subprocess.run([*sh, "bg", "agentrl:long24k:like"], cwd=work, env={**env, "GPU": "1"},
                        capture_output=True, text=True, timeout=60)
    assert p1.returncode == 0 and "on GPU 1, detached" in p1.stdout, p1.stdout + p1.stderr  # beside GPU 0's
    same = subprocess.run([*sh, "bg", "agentrl:long16k:like"], cwd=work, env={**env, "GPU": "1"},
                          capture_output=True, text=True, timeout=60)
    assert same.returncode == 2 and "a detached run is on" in same.stdout  # one queue a GPU
    every = subprocess.run([*sh, "bg", "agentrl:long16k:like"], cwd=work, env=env, capture_output=True, text=True,
                           timeout=60)
    assert every.returncode == 2 and "a detached run is on" in every.stdout  # an all-GPU queue waits for both
    bad = subprocess.run([*sh, "bg", "agentrl:long16k:like"], cwd=work, env={**env, "GPU": "one"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "is not a GPU's index" in bad.stdout

    done = subprocess.run([*sh, "wait"], cwd=work, env={**env, "WAIT_S": "60"}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[gpu0] peers: the queue is done: agentrl:long16k:recommended" in done.stdout, done.stdout
    assert "[gpu1] peers: the queue is done: agentrl:long24k:like" in done.stdout, done.stdout
    assert "[gpu1] RESULT" in done.stdout
    out = tmp_path / "out"
    assert (out / "gpu0-agentrl-long16k.log").is_file() and (out / "gpu1-agentrl-long24k.log").is_file()
    rows = json.loads((out / "peers.json").read_text())
    assert sorted((r["workload"], r["gpu_seen"]) for r in rows) == [("long16k", "0"), ("long24k", "1")]


def test_device_gpu_queue_ends_only_the_leftovers_its_own_runs_started(tmp_path):
    """A GPU's queue kills the Ray and vLLM processes a run left behind only where they carry its tag
    (PEERS_TAG=gpuN, inherited from the run): the other GPU's run, and this machine's own Ray
    processes (no tag), live on."""
    import os
    import subprocess
    import time

    work, env = _device_sh(tmp_path)
    # stand-ins named as Ray's daemons are (pkill -f matches the command line): one a GPU, one untagged
    procs = {tag: subprocess.Popen(["bash", "-c", f"exec -a peers_test_raylet_{tag or 'none'} sleep 120"],
                                   env={**os.environ, **({"PEERS_TAG": tag} if tag else {})})
             for tag in ("gpu0", "gpu1", "")}
    try:
        time.sleep(0.5)
        proc = subprocess.run(["bash", "bench/peers/device.sh", "agentrl:long16k:recommended"], cwd=work,
                              env={**env, "GPU": "1", "PEERS_KILL_LEFTOVERS": "1"}, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        time.sleep(0.5)
        assert procs["gpu1"].poll() is not None  # its own leftover: gone
        assert procs["gpu0"].poll() is None and procs[""].poll() is None  # the other GPU's, the machine's: alive
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_device_run_steps_carry_a_tool_latency_and_a_repeated_step_keeps_every_log(tmp_path):
    """SYSTEM:WORKLOAD:SETTINGS[:gGpP][wWsS][:latS]: a step's own tool latency and warm-up/timed steps
    go to its runner after PEER_ARGS (so they win); an interleaved repeat of one pair in one queue
    (A B A B) writes a log a run (-2 for the second), none overwriting an earlier one."""
    import subprocess

    work, env = _device_sh(tmp_path)
    steps = ["agentrl:long16k:like:lat0", "agentrl:long24k:like:w2s4:lat0.5", "agentrl:long16k:like:lat0",
             "agentrl:long24k:like:w2s4:lat0.5"]
    proc = subprocess.run(["bash", "bench/peers/device.sh", *steps], cwd=work, timeout=120, capture_output=True, check=False,
                          text=True, env={**env, "PEER_ARGS": "--steps 1 --tool-latency 0.1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    logs = sorted(f.name for f in out.glob("*.log"))
    assert logs == ["agentrl-long16k-lat0-2.log", "agentrl-long16k-lat0.log", "agentrl-long24k-lat0.5-2.log",
                    "agentrl-long24k-lat0.5.log"], logs
    for name in ("agentrl-long16k-lat0.log", "agentrl-long16k-lat0-2.log"):
        assert '"steps": 1, "batch": [1, 8, 2], "lat": 0.0' in (out / name).read_text()  # PEER_ARGS' steps
    assert '"steps": 4, "batch": [2, 8, 2], "lat": 0.5' in (out / "agentrl-long24k-lat0.5-2.log").read_text()
    assert proc.stdout.count("== agentrl:long16k:like-lat0 ") == 2
    bad = subprocess.run(["bash", "bench/peers/device.sh", "agentrl:long16k:like:latency0"], cwd=work, timeout=60,
                         capture_output=True, text=True, env=env, check=False)
    assert bad.returncode == 2 and "'latency0' in 'agentrl:long16k:like:latency0' is not" in bad.stdout, bad.stdout
