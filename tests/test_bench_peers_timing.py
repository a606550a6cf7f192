"""The peer harness's timing and meters: every system is timed the same way (warm-up steps, steps
between consecutive step ends), the tool latency reaches every runner, verl's steps are read by its own
step number, and each peer's own throughput meter is kept beside the harness's."""

from __future__ import annotations

import json
import itertools

import pytest
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_every_runner_times_eight_steps_after_two_warm_up_steps_by_default():
    from bench.peers import run_agentrl, run_trl, run_verl
    from bench.peers.common import harness_parser

    for mod in (run_agentrl, run_trl, run_verl):
        args = harness_parser(mod.__doc__).parse_args(["--workload", "multi"])
        assert (args.warmup, args.steps, args.tool_latency) == (2, 8, None)


def test_agentrl_times_its_steps_from_a_drained_pipeline():
    """agentrl's async pipeline fills during the first step: the step after it trains on rollouts
    made meanwhile and takes about half a normal step (H100 2026-11-25: 41.1, 1.3, 3.5, 2.3, 2.2, 3.9 s).
    With the runners' two warm-up steps the timed steps start after that one, each the interval
    between two step ends; a run timed from the fill is marked not steady."""
    from bench.peers.common import Result, harness_parser
    from bench.peers.run_agentrl import summarize

    walls = [41.0, 1.3, 3.0, 2.5, 3.0, 2.5, 3.0, 2.5, 3.0, 2.5]  # warm-up, fill, 8 steady steps
    stamps = list(itertools.accumulate(walls, initial=100.0))[1:]
    rows = [{"train/num_tokens": 30_000.0, "rollout/reward": 0.1} for _ in walls]
    args = harness_parser("x").parse_args(["--workload", "multi"])
    res = Result(system="agentrl", setting="recommended", workload="multi")
    summarize(res, rows, stamps, 100.0, args.warmup)
    assert res.steps == 8 and res.extra["step_walls_s"] == walls
    assert res.trained_tokens_per_s_per_gpu == pytest.approx(8 * 30_000.0 / 22.0)  # 8 steady steps, 22 s
    assert res.extra["steady"] == {"first_over_median": pytest.approx(3.0 / 2.75, abs=1e-3), "steady": True}
    early = Result(system="agentrl", setting="recommended", workload="multi")
    summarize(early, rows, stamps, 100.0, warmup=1)  # the old default: the fill counted as a timed step
    assert early.extra["steady"]["steady"] is False and early.trained_tokens_per_s_per_gpu > res.trained_tokens_per_s_per_gpu


def test_tool_latency_is_a_parameter_of_every_runner(tmp_path, tok):
    """--tool-latency S: agentrl's env, TRL's tool function and verl's tool config sleep S a call; the
    workload keeps its name (the table pairs rows by workload_spec.tool_latency_s); a workload without
    tools refuses a latency."""
    import time as _time

    from bench.peers import run_agentrl, run_verl
    from bench.peers.common import harness_parser, lookup_tool, run_workload

    parser = harness_parser("x")
    assert run_workload(parser.parse_args(["--workload", "multi"])).tool_latency_s == 0.5
    wl = run_workload(parser.parse_args(["--workload", "multi", "--tool-latency", "0"]))
    assert wl.name == "multi" and wl.tool_latency_s == 0.0
    assert run_workload(parser.parse_args(["--workload", "long", "--tool-latency", "0.1", "--scale", "0.25"])).tool_latency_s == 0.1
    with pytest.raises(SystemExit, match="calls no tool"):
        run_workload(parser.parse_args(["--workload", "single", "--tool-latency", "0.5"]))
    with pytest.raises(SystemExit, match=">= 0"):
        run_workload(parser.parse_args(["--workload", "multi", "--tool-latency", "-1"]))
    args = parser.parse_args(["--workload", "multi", "--tool-latency", "0", "--workdir", str(tmp_path)])
    args.cpu, args.engine_mem, args.set = False, 0.2, []
    ovr = run_agentrl.overrides(args, wl, str(tmp_path / "m"), str(tmp_path / "t.json"), "like")
    assert any(o.startswith("env.kwargs=") and "latency_s: 0.0," in o for o in ovr), ovr
    t = _time.perf_counter()
    assert lookup_tool("obs", wl.tool_latency_s)("q") == "obs" and _time.perf_counter() - t < 0.25
    assert run_verl.tool_config(wl, tmp_path / "t.json")["tools"][0]["config"]["latency_s"] == 0.0


def test_verl_steps_are_aligned_by_verl_s_own_step_number(tmp_path):
    """verl's metrics file may hold a line that is no training step (a validation's): each step's wall
    is the interval between the ends of steps N-1 and N by their step numbers, not by the lines' places
    (counting lines gave step 2 the validation line's stamp)."""
    from bench.peers.run_verl import _Stamps, read_steps, step_walls

    log = tmp_path / "verl.jsonl"
    stamps = _Stamps(log)
    lines = [({"step": 1, "data": {"timing_s/step": 50.0, "perf/total_num_tokens": 1000}}, 150.0),
             ({"step": 1, "data": {"val-core/peer_harness/reward/mean@1": 0.5}}, 160.0),
             ({"step": 2, "data": {"timing_s/step": 19.0, "perf/total_num_tokens": 1000}}, 170.0),
             ({"step": 3, "data": {"timing_s/step": 17.5, "perf/total_num_tokens": 1000}}, 188.0)]
    with log.open("w") as f:
        for rec, now in lines:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            stamps.poll(now)
        f.write('{"step": 4, "da')  # a line being written: not stamped until it is whole
    stamps.poll(190.0)
    assert stamps.stamps == {1: 150.0, 2: 170.0, 3: 188.0}
    log.write_text("".join(json.dumps(rec) + "\n" for rec, _ in lines))
    rows = read_steps(log)
    assert [r["_step"] for r in rows] == [1, 2, 3]
    walls, ends = step_walls(rows, stamps.stamps)
    assert walls == [50.0, 20.0, 18.0] and ends == [150.0, 170.0, 188.0]  # the first: verl's own timing_s/step
    walls, _ = step_walls(rows, {1: 150.0, 3: 188.0})  # a step seen late (not stamped): verl's own time
    assert walls == [50.0, 19.0, 17.5]


def test_each_peer_s_own_meter_is_kept():
    """TRL's own step_time and num_tokens give its own tokens/s over the timed steps; verl's
    perf/mfu/actor and perf/throughput are kept as it reports them (medians of the timed steps)."""
    from bench.peers.run_trl import own_meter
    from bench.peers.run_verl import own_meter as verl_own

    logs = [{"num_tokens": 1000.0, "step_time": 20.0}, {"num_tokens": 2000.0, "step_time": 10.0},
            {"num_tokens": 3500.0, "step_time": 10.0}, {"num_tokens": 5000.0, "step_time": 20.0}]
    own = own_meter(logs, {"train_runtime": 60.0, "train_samples_per_second": 2.1, "other": 1}, warmup=1)
    assert own["tokens_per_s"] == pytest.approx(4000.0 / 40.0) and own["step_time_s"] == [10.0, 10.0, 20.0]
    assert own["train_runtime"] == 60.0 and "other" not in own and own["step_time_median_s"] == 10.0
    timed = [{"perf/mfu/actor": 0.2, "perf/throughput": 2000.0}, {"perf/mfu/actor": 0.3, "perf/throughput": 2100.0},
             {"perf/mfu/actor": 0.25}]
    assert verl_own(timed) == {"mfu_actor": 0.25, "tokens_per_s": 2050.0}
