"""Training progress: plain lines where no terminal watches (agentrl/driver/progress.py).

A real run's captured output is read in tests/test_pipeline_e2e.py (test_resume_continues_a_run_from_its_last_checkpoint)."""

import io

import pytest

from agentrl.driver.progress import TrainProgress, parse_progress_line

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
