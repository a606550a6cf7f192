"""bench/peers/table.py: the table prints what the runs measured (ratios against agentrl, a failed
run's reason, the GPU of a run beside another) and --combine pools runs of one row honestly."""

from __future__ import annotations

import json

import pytest

from bench.peers.common import Result, tool_latency, write_result
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
    # agentrl's async recommended over TRL's recommended, and agentrl's on-policy like over it: each
    # ratio named by both settings and both modes
    assert "rec/rec (async s≤2 / on-policy): 3.00×; like/rec (on-policy / on-policy): 1.50×" in trl_row, trl_row
    assert "oom: asked 9 GiB" in text  # CUDA's message: what was asked (and free), not its last words
    long = "OutOfMemoryError: CUDA out of memory. Tried to allocate 6.56 GiB. GPU 0 has a total capacity of 139.80 GiB " \
           "of which 6.07 GiB is free. See https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory"
    assert "oom: asked 6.56 GiB, 6.07 GiB free" in table([{**rows[3], "reason": long}])
    assert "error: exit 1: KeyError: 'x'" in table([{**rows[3], "status": "error", "reason": "log\nexit 1: KeyError: 'x'"}])
    md = table(rows, markdown=True)
    assert md.splitlines()[0].startswith("| workload |") and md.count("\n") == 5, md
    # a run on one GPU of a host of several (device.sh GPU=N) says which: another may have run beside it
    beside = mk("trl", "sleep", 800.0, extra={"gpu": {"nvml_index": 1, "host_gpus": 2}}, device=rows[0]["device"])
    from dataclasses import asdict

    line = next(ln for ln in table([*rows, asdict(beside)]).splitlines() if " sleep " in ln)
    # TRL's sleep setting has no agentrl namesake: agentrl's like (on-policy, as TRL is) over it
    assert "sleep (GPU 1 of 2)" in line and "like/sleep (on-policy / on-policy): 1.88×" in line, line


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
    # rec: the plain run (400); best: the kept runs (500)
    assert "rec/rec (async s≤2 / on-policy): 2.00×" in trl_line and "best recommended/recommended: 2.50×" in trl_line, trl_line


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


def _row(system, setting, tput, latency=0.5, device="NVIDIA H100 80GB HBM3", versions=None, **kw):
    """A finished multi-turn result as the runners write it (workload_spec carries the tool latency)."""
    return {"system": system, "setting": setting, "workload": "multi", "status": "ok", "steps": 8,
            "trained_tokens_per_step": 35_000.0, "trained_tokens_per_s_per_gpu": tput, "step_time_s": 35_000.0 / tput,
            "reward_curve": [0.5], "device": device, "date": "2026-12-07",
            "versions": versions or {"trl": "1.16.0"}, "episode_tokens": 1100.0,
            "workload_spec": {"name": "multi", "tool_calls": 3, "tool_latency_s": latency}, "extra": {}, **kw}


def _line(text, *words):
    return next(ln for ln in text.splitlines() if all(w in ln for w in words))


def test_rows_pair_only_within_one_tool_latency_device_and_file():
    """agentrl at tool latency 0 is never divided by TRL at 0.5 (TRL runs a completion's tool calls one
    after another: its speed depends on the latency), nor a run on an H200 by one on an H100, nor a
    row of one device call by one of another unless --combine made them one set; the setting cell
    names the latency."""
    fast = _row("agentrl", "like", 9000.0, latency=0.0)
    slow_trl = _row("trl", "like", 700.0, latency=0.5)
    text = table([fast, slow_trl])
    assert "like, tool 0 s" in text and "like, tool 0.5 s" in text
    assert "like/like" not in text  # no pair: different latencies
    trl_fast = _row("trl", "like", 6000.0, latency=0.0)
    assert "like/like (on-policy / on-policy): 1.50×" in _line(table([fast, slow_trl, trl_fast]), " trl ", "tool 0 s")
    assert "like/like" not in table([fast, _row("trl", "like", 6000.0, latency=0.0, device="NVIDIA H200")])
    # two result files (two calls): rows pair within each; --combine's one set pairs across them
    assert "like/like" not in table([{**fast, "_set": "a.json"}, {**trl_fast, "_set": "b.json"}])
    assert "like/like" in table([{**fast, "_set": "combined"}, {**trl_fast, "_set": "combined"}])


def test_load_tags_rows_with_their_file(tmp_path):
    from bench.peers.table import load

    (tmp_path / "a.json").write_text(json.dumps([_row("agentrl", "like", 9000.0)]))
    (tmp_path / "b.json").write_text(json.dumps([_row("trl", "like", 6000.0)]))
    rows = load([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert [r["_set"] for r in rows] == [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    assert "like/like" not in table(rows)


def test_like_is_divided_by_like_and_recommended_by_recommended_with_both_modes_named():
    """On TRL's like row agentrl's like over it (on-policy over on-policy), on its recommended row
    agentrl's recommended (async, max_staleness 2) over it, each ratio named by both settings and modes;
    verl's rows say its trainer is sync."""
    rows = [_row("agentrl", "recommended", 12_000.0, extra={"config": {"max_staleness": 2}}),
            _row("agentrl", "like", 6000.0, extra={"config": {"max_staleness": 0}}),
            _row("trl", "recommended", 1000.0), _row("trl", "like", 1200.0), _row("verl", "recommended", 2000.0)]
    text = table(rows)
    trl_like = _line(text, " trl ", " like, tool")
    assert "like/like (on-policy / on-policy): 5.00×" in trl_like and "rec/" not in trl_like, trl_like
    trl_rec = _line(text, " trl ", " recommended, tool")
    assert "rec/rec (async s≤2 / on-policy): 12.00×" in trl_rec and "like/rec (on-policy / on-policy): 6.00×" in trl_rec
    verl = _line(text, " verl ")
    assert "on-policy (sync)" in verl and "rec/rec (async s≤2 / on-policy (sync)): 6.00×" in verl, verl
    assert _line(text, " agentrl ", " recommended, tool").count("async s≤2") == 1


def test_repeated_runs_of_a_pair_are_matched_in_order_and_give_their_spread():
    """An interleaved queue (agentrl, TRL, agentrl, TRL, agentrl, TRL) in one file: every run is
    printed (none replaces an earlier one), each TRL run is divided by the agentrl run of its place,
    and the block below gives min / median / max of the three ratios; a spread across 1.0 is a tie."""
    a = [_row("agentrl", "like", t) for t in (3000.0, 3300.0, 2700.0)]
    b = [_row("trl", "like", t) for t in (1000.0, 1500.0, 900.0)]
    rows = [a[0], b[0], a[1], b[1], a[2], b[2]]
    text = table(rows)
    table_rows = [ln for ln in text.splitlines() if ln.startswith("multi ")]
    assert sum(" agentrl " in ln for ln in table_rows) == 3 and sum(" trl " in ln for ln in table_rows) == 3
    assert "like/like (on-policy / on-policy): 2.20×" in _line(text, " trl ", "1,500")  # 3300 / 1500
    assert "3 pairs: 2.20/3.00/3.00× (min/med/max of 3)" in text, text
    close = [_row("agentrl", "like", t) for t in (1000.0, 980.0, 1040.0)]
    peer = [_row("trl", "like", t) for t in (990.0, 1000.0, 1000.0)]
    text = table([x for pair in zip(close, peer) for x in pair])
    assert "0.98/1.01/1.04× (min/med/max of 3) tie" in text, text
    # one agentrl run against three TRL runs: each TRL run against it (the spread is TRL's alone)
    assert "3 pairs: 2.00/3.00/3.33×" in table([a[0], *b])


def test_combined_repeats_keep_each_runs_ratio_and_tool_latencies_apart():
    """--combine pools the repeats of one system and setting into a row, but its ratio still comes
    from the runs paired in order (their spread kept); runs at another tool latency are another row."""
    from bench.peers.table import combine

    def run(system, tput, latency=0.0):
        walls = [40.0, 5.0] + [35_000.0 / tput] * 8
        return _row(system, "like", tput, latency=latency, extra={"step_walls_s": walls})

    rows = combine([run("agentrl", 3000.0), run("trl", 1000.0), run("agentrl", 3300.0), run("trl", 1500.0),
                    run("agentrl", 2700.0), run("trl", 900.0), run("trl", 100.0, latency=0.5)])
    assert len(rows) == 3 and sorted(tool_latency(r) for r in rows if r["system"] == "trl") == [0.0, 0.5]
    text = table([{**r, "_set": "combined"} for r in rows])
    assert "24 (3 runs)" in text and "3 pairs: 2.20/3.00/3.00× (min/med/max of 3)" in text, text


def test_mfu_is_one_formula_for_every_system_beside_each_peers_own_meter():
    """MFU = (6·N + 6·L·d·s) · tokens/s / the GPU's bf16 peak for every row; verl's perf/mfu/actor and
    TRL's own tokens over its step_time are printed as they report them; a run whose first timed step
    was short of its median (an async pipeline filled in the warm-up) is marked."""
    from bench.peers.common import harness_mfu, train_flops

    mine = _row("agentrl", "like", 10_000.0, extra={"steady": {"first_over_median": 0.45, "steady": False}})
    verl = _row("verl", "recommended", 2000.0, extra={"own": {"mfu_actor": 0.231, "tokens_per_s": 2100.0}})
    trl = _row("trl", "like", 1000.0, extra={"own": {"tokens_per_s": 950.0, "step_time_median_s": 30.5}})
    expected = (6 * 1.5436e9 + 6 * 28 * 1536 * 1100.0) * 10_000.0 / 989e12
    assert harness_mfu(mine) == pytest.approx(expected, rel=1e-3)
    assert train_flops(1.0, 0.0) == pytest.approx(6 * 1.5436e9, rel=1e-3)
    assert harness_mfu({**mine, "device": "CPU (x86_64, 2 cores)"}) is None
    text = table([mine, verl, trl])
    assert f"{100 * expected:.1f}%" in _line(text, " agentrl ")
    assert "mfu/actor 0.231, 2,100 tok/s/GPU" in _line(text, " verl ")
    assert "950 tok/s over step_time 30.5 s" in _line(text, " trl ")
    assert " 8*" in _line(text, " agentrl ") and " 8*" not in _line(text, " trl ")
