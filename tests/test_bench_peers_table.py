"""bench/peers/table.py: the table prints what the runs measured (ratios against agentrl, a failed
run's reason, the GPU of a run beside another) and --combine pools runs of one row honestly."""

from __future__ import annotations

import json

import pytest

from bench.peers.common import Result, write_result
from bench.peers.table import table


def test_table_prints_ratios_against_agentrl_and_the_reason_of_a_failed_run(tmp_path):
    out = tmp_path / "peers.json"
    mk = lambda system, setting, tput, **kw: Result(system=system, setting=setting, workload="multi",
                                                    steps=5, trained_tokens_per_s_per_gpu=tput,
                                                    reward_curve=[0.01, 0.05], **kw)
    for r in [mk("agentrl", "recommended", 3000.0), mk("agentrl", "like", 1500.0), mk("trl", "recommended", 1000.0),
              mk("trl", "like", None, status="oom", reason="CUDA out of memory. Tried to allocate 9 GiB")]:
        write_result(r, out)
    rows = json.loads(out.read_text())
    assert [r["system"] for r in rows] == ["agentrl", "agentrl", "trl", "trl"]
    text = table(rows)
    trl_row = next(line for line in text.splitlines() if line.startswith("multi") and " trl " in line and "ok" in line)
    assert "3.00×, 1.50×" in trl_row
    assert "oom: asked 9 GiB" in text  # CUDA's message: what was asked (and free), not its last words
    long = "OutOfMemoryError: CUDA out of memory. Tried to allocate 6.56 GiB. GPU 0 has a total capacity of 139.80 GiB " \
           "of which 6.07 GiB is free. See https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory"
    assert "oom: asked 6.56 GiB, 6.07 GiB free" in table([{**rows[3], "reason": long}])
    assert "error: exit 1: KeyError: 'x'" in table([{**rows[3], "status": "error", "reason": "log\nexit 1: KeyError: 'x'"}])
    md = table(rows, markdown=True)
    assert md.splitlines()[0].startswith("| workload |") and md.count("\n") == 5
    # a run on one GPU of a host of several (device.sh GPU=N) says which: another may have run beside it
    beside = mk("trl", "sleep", 800.0, extra={"gpu": {"nvml_index": 1, "host_gpus": 2}})
    from dataclasses import asdict

    line = next(ln for ln in table([*rows, asdict(beside)]).splitlines() if " sleep " in ln)
    assert "sleep (GPU 1 of 2)" in line and "3.75×, 1.88×" in line, line  # agentrl's settings over this row


def test_combine_pools_the_timed_steps_of_runs_of_one_row_and_refuses_other_devices():
    """table.py --combine: two runs of one system, setting and workload (3 and 2 timed steps, each
    after its own warm-up) become one row of 5 whose throughput is their tokens over their seconds,
    not the mean of their rates; a failed run and other rows pass through; other versions refuse."""
    from bench.peers.table import combine

    def run(steps, tok_s, walls, date, versions=None):
        tpp = 1000.0
        return {"system": "trl", "setting": "sleep", "workload": "long256k-g2p1", "status": "ok", "steps": steps,
                "trained_tokens_per_step": tpp, "trained_tokens_per_s_per_gpu": tok_s, "step_time_s": 10.0,
                "generated_tokens_per_s": 2.0, "weight_sync_s": 0.1 * steps, "peak_gpu_gib": 100.0 + steps,
                "reward_curve": [0.1] * (steps + 1), "device": "NVIDIA H200", "date": date,
                "versions": versions or {"trl": "1.16.0"}, "extra": {"step_walls_s": walls}}

    a = run(3, 100.0, [12.0, 10.0, 10.0, 10.0], "2026-11-30")  # 3,000 tokens in 30 s
    b = run(2, 50.0, [25.0, 20.0, 20.0], "2026-12-01")  # 2,000 tokens in 40 s
    failed = {**run(1, 1.0, [1.0], "2026-12-01"), "status": "oom", "steps": 0}
    mine = {**run(5, 300.0, [1.0] * 6, "2026-12-01"), "system": "agentrl", "setting": "recommended"}
    rows = combine([a, failed, b, mine])
    (pooled,) = [r for r in rows if r["system"] == "trl" and r["status"] == "ok"]
    assert pooled["steps"] == 5 and pooled["trained_tokens_per_s_per_gpu"] == pytest.approx(5000 / 70)
    assert pooled["step_time_s"] == 10.0  # the median of 10, 10, 10, 20, 20: the warm-ups left out
    assert pooled["weight_sync_s"] == pytest.approx((0.3 * 3 + 0.2 * 2) / 5) and pooled["peak_gpu_gib"] == 103.0
    assert pooled["date"] == "2026-11-30 / 2026-12-01" and len(pooled["extra"]["runs"]) == 2
    assert failed in rows and mine in rows and len(rows) == 3
    assert "5 (2 runs)" in table(rows) and "4.20×" in table(rows)  # 300 / (5000 / 70)
    with pytest.raises(ValueError, match="differ in versions"):
        combine([a, run(2, 50.0, [1.0] * 3, "2026-12-01", {"trl": "1.17.0"})])


def test_combine_takes_the_whole_timed_steps_of_a_run_cut_by_its_limit():
    """A run stopped by its limit after 4 of 6 steps (1 warm-up, 3 timed) brings those 3 to the pool
    and a later run of 2 the rest: one row of 5 marked with each run's status; a cut run alone stays
    cut, and a cut run that timed no step is not pooled."""
    from bench.peers.table import combine

    def run(status, steps, walls, date):
        done = sum(walls[1:])  # 1,000 tokens a timed step
        return {"system": "trl", "setting": "sleep", "workload": "long256k-g2p1", "status": status,
                "reason": "stopped by signal SIGTERM after 4 of 6 steps" if status == "cut" else "",
                "steps": steps, "trained_tokens_per_step": 1000.0 if steps else None,
                "trained_tokens_per_s_per_gpu": 1000.0 * steps / done if steps else None,
                "step_time_s": 10.0, "weight_sync_s": None, "peak_gpu_gib": 100.0, "reward_curve": [0.1] * len(walls),
                "device": "NVIDIA H200", "date": date, "versions": {"trl": "1.16.0"}, "extra": {"step_walls_s": walls}}

    cut = run("cut", 3, [30.0, 20.0, 20.0, 20.0], "2026-11-30")  # 3,000 tokens in 60 s
    rest = run("ok", 2, [30.0, 25.0, 25.0], "2026-12-01")  # 2,000 tokens in 50 s
    (pooled,) = combine([cut, rest])
    assert pooled["status"] == "ok" and pooled["reason"] == "" and pooled["steps"] == 5
    assert pooled["trained_tokens_per_s_per_gpu"] == pytest.approx(5000 / 110)
    assert [r["status"] for r in pooled["extra"]["runs"]] == ["cut", "ok"]
    assert combine([cut]) == [cut]  # alone it is what it was: cut
    empty = run("cut", 0, [30.0], "2026-12-01")
    assert combine([empty, rest]) == [empty, rest]  # nothing timed: nothing to pool


def test_combine_keeps_runs_with_other_overrides_and_probes_apart():
    """A run given a config override (``--set``) is another configuration: pooled only with runs of
    the same overrides, and its row names them; a run without a warm-up step (a probe) is never
    pooled; agentrl's rec column reads the run without overrides, its best column any finished row."""
    from bench.peers.table import combine

    def run(system, tok_s, walls, steps, sets=()):
        return {"system": system, "setting": "recommended", "workload": "long256k-g2p1", "status": "ok",
                "steps": steps, "trained_tokens_per_step": 1000.0, "trained_tokens_per_s_per_gpu": tok_s,
                "step_time_s": 10.0, "weight_sync_s": 0.3, "peak_gpu_gib": 100.0, "reward_curve": [0.5],
                "device": "NVIDIA H200", "date": "2026-11-29", "versions": {"torch": "2.11.0"},
                "extra": {"step_walls_s": walls, "config": {"set": list(sets)}}}

    plain = run("agentrl", 400.0, [3.0] + [2.5] * 5, 5)
    kept = ["learner.megatron.recompute_keeps_attention=true"]
    probe = run("agentrl", 300.0, [3.3], 1, kept)  # its one step is its first: no warm-up
    kept_a, kept_b = run("agentrl", 500.0, [3.0, 2.0, 2.0], 2, kept), run("agentrl", 500.0, [3.0, 2.0], 1, kept)
    peer = run("trl", 200.0, [6.0, 5.0, 5.0], 2)
    rows = combine([plain, probe, kept_a, peer, kept_b])
    assert plain in rows and probe in rows and peer in rows and len(rows) == 4
    (pooled,) = [r for r in rows if r.get("extra", {}).get("runs")]
    assert pooled["steps"] == 3 and pooled["extra"]["set"] == kept
    text = table(rows)
    assert text.count("recommended +learner.megatron.recompute_keeps_attention=true") == 2
    trl_line = next(ln for ln in text.splitlines() if " trl " in ln)
    assert "2.00×, –×, 2.50×" in trl_line, trl_line  # rec: the plain run (400); best: the kept runs (500)


def test_a_pooled_row_names_the_gpus_its_runs_had():
    """Two runs side by side on one host of two GPUs (device.sh GPU=0 and GPU=1) pool into a row
    whose setting says so: each may have slowed the other through the shared cores and memory."""
    from bench.peers.table import combine

    def run(gpu):
        return {"system": "trl", "setting": "sleep", "workload": "long256k-g2p1", "status": "ok", "steps": 2,
                "trained_tokens_per_step": 1000.0, "trained_tokens_per_s_per_gpu": 100.0, "step_time_s": 10.0,
                "device": "NVIDIA H200", "date": "2026-11-29", "versions": {"trl": "1.16.0"},
                "extra": {"step_walls_s": [10.0] * 3, "gpu": {"nvml_index": gpu, "host_gpus": 2}}}

    (pooled,) = combine([run(0), run(1)])
    assert "sleep (GPU 0, 1 of 2)" in table([pooled])
