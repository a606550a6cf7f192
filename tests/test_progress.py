"""Training progress: plain lines where no terminal watches (agentrl/driver/progress.py).

A real run's captured output is read in tests/test_pipeline_e2e.py (test_resume_continues_a_run_from_its_last_checkpoint)."""

import io
from pathlib import Path

import pytest

from agentrl.driver.progress import TrainProgress, parse_progress_line

REPO = Path(__file__).resolve().parents[1]

METRICS = {"rollout/reward": 0.4149, "rollout/success": 0.375, "rollout/tool_use_rate": 0.75,
           "rollout/tokens_per_s": 812.3, "replay/staleness_max": 1.0, "train/loss": 0.0123}


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_output_that_is_not_a_terminal_gets_plain_lines_every_step_when_unthrottled():
    out = io.StringIO()
    with TrainProgress(4, mode="auto", every_s=0.0, stream=out) as bar:
        assert bar.mode == "lines"
        for step in range(1, 5):
            bar.update(step, METRICS)
    lines = [parse_progress_line(line) for line in out.getvalue().splitlines()]
    assert [p["step"] for p in lines] == [1, 2, 3, 4] and all(p["total"] == 4 for p in lines)
    assert lines[0]["reward"] == 0.41 and lines[0]["tok/s"] == 812 and lines[0]["stale"] == 1
    assert lines[0]["success"] == 0.38 and lines[0]["loss"] == 0.0123
    assert lines[-1]["eta"] == "0:00:00"


def test_lines_are_throttled_but_the_first_and_last_step_always_print():
    out = io.StringIO()
    with TrainProgress(100, start=10, mode="lines", every_s=3600, stream=out) as bar:
        for step in range(11, 101):
            bar.update(step, METRICS)
    assert [parse_progress_line(line)["step"] for line in out.getvalue().splitlines()] == [11, 100]


def test_a_terminal_gets_the_bar_and_no_lines(monkeypatch):
    out = _Tty()
    with TrainProgress(3, mode="auto", stream=out) as bar:
        assert bar.mode == "bar"
        bar.update(1, METRICS)
    assert "step 1/3" not in out.getvalue()


@pytest.mark.parametrize("line", ["", "step", "stepping 1/2", "step 1/2 reward", "step x/2 reward 1",
                                  "sft: epoch 1/2 step 10/20 loss 0.1"])
def test_other_lines_are_not_progress(line):
    assert parse_progress_line(line) is None


def test_eta_follows_the_pace_of_this_run(monkeypatch):
    import agentrl.driver.progress as progress

    clock = iter([0.0, 0.0, 10.0, 20.0])  # __init__, __enter__, step 1, step 2
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    with TrainProgress(12, mode="lines", every_s=0.0, stream=out) as bar:
        bar.update(1, METRICS)
        bar.update(2, METRICS)
    last = parse_progress_line(out.getvalue().splitlines()[-1])
    assert last["elapsed"] == "0:00:20" and last["eta"] == "0:01:40"  # 10 s a step, 10 steps left


def test_a_stage_line_reads_back_with_its_stage_and_the_time_left():
    from agentrl.driver.progress import progress_line

    line = progress_line("sft", 120, 694, {"epoch": 1, "loss": "0.5083"}, 25.2, 119.6)
    assert line == "sft step 120/694  epoch 1  loss 0.5083  elapsed 0:00:25  eta 0:02:00"
    assert parse_progress_line(line) == {"stage": "sft", "step": 120, "total": 694, "epoch": 1.0, "loss": 0.5083,
                                         "elapsed": "0:00:25", "eta": "0:02:00"}


def test_stage_progress_eta_is_the_pace_so_far_times_the_steps_left(monkeypatch, tmp_path):
    import agentrl.driver.progress as progress

    clock = iter([100.0, 104.0, 106.0, 108.0, 130.0])  # made, then steps 1-4
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    printed: list[str] = []
    bar = progress.StageProgress("bootstrap", every_s=5.0, log=printed.append, log_file=tmp_path / "run" / "progress.log")
    shown = [bar.update(step, 4, {"loss": "6.500"}) for step in range(1, 5)]
    # step 1 always, steps 2-3 within 5 s of the last line, step 4 (the last) always
    assert [s is not None for s in shown] == [True, False, False, True]
    first, last = (parse_progress_line(line) for line in printed)
    assert first["stage"] == "bootstrap" and first["elapsed"] == "0:00:04" and first["eta"] == "-"  # no pace yet
    assert last["step"] == 4 and last["elapsed"] == "0:00:30" and last["eta"] == "0:00:00"
    assert (tmp_path / "run" / "progress.log").read_text().splitlines() == printed


def test_stage_progress_eta_leaves_out_what_came_before_the_first_step(monkeypatch):
    import agentrl.driver.progress as progress

    clock = iter([0.0, 60.0, 62.0, 64.0])  # made, a minute of set-up, then 2 s a step
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    printed: list[str] = []
    bar = progress.StageProgress("sft", every_s=0.0, log=printed.append)
    for step in (1, 2, 3):
        bar.update(step, 10, {})
    assert [parse_progress_line(line)["eta"] for line in printed] == ["-", "0:00:16", "0:00:14"]
    assert parse_progress_line(printed[-1])["elapsed"] == "0:01:04"


def test_rl_lines_name_their_stage_and_go_to_the_log_file_under_the_bar_too(tmp_path):
    log = tmp_path / "progress.log"
    out = _Tty()
    with TrainProgress(3, mode="auto", every_s=0.0, stream=out, log_file=log) as bar:
        for step in (1, 2, 3):
            bar.update(step, METRICS)
    lines = [parse_progress_line(line) for line in log.read_text().splitlines()]
    assert [(p["stage"], p["step"], p["total"]) for p in lines] == [("rl", 1, 3), ("rl", 2, 3), ("rl", 3, 3)]
    assert lines[0]["reward"] == 0.41 and lines[-1]["eta"] == "0:00:00"


def test_bootstrap_and_sft_stages_print_progress_lines_with_an_eta(tmp_path, monkeypatch, capsys):
    """`agentrl train` up to the RL stage (the trainer is a stand-in): the tiny model's induction
    pre-stage and the SFT each print their `STAGE step S/T ... eta` lines, also into RUN_DIR/progress.log."""
    import agentrl.driver.trainer as trainer_module
    from agentrl.config import load_config
    from agentrl.driver.pipeline import train

    class NoRL:
        def __init__(self, cfg, **kwargs):
            pass

        def run(self):
            return {}

        def shutdown(self):
            pass

    monkeypatch.setattr(trainer_module, "Trainer", NoRL)
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", f"sft.output_dir={tmp_path / 'sft'}",
        "model.tiny.induction_steps=3", "sft.num_demos=16", "sft.num_epochs=1", "sft.batch_tokens=1024"])
    train(cfg, progress=False)
    printed = [p for p in map(parse_progress_line, capsys.readouterr().out.splitlines()) if p]
    logged = [p for p in map(parse_progress_line, (tmp_path / "run" / "progress.log").read_text().splitlines()) if p]
    assert printed == logged
    stages = {p["stage"] for p in logged}
    assert stages == {"bootstrap", "sft"}
    boot = [p for p in logged if p["stage"] == "bootstrap"]
    sft = [p for p in logged if p["stage"] == "sft"]
    assert boot[0]["step"] == 1 and boot[-1]["step"] == boot[-1]["total"] == 3 and "P(copy)" in boot[-1]
    assert sft[-1]["step"] == sft[-1]["total"] > 1 and sft[-1]["eta"] == "0:00:00" and "loss" in sft[-1]
