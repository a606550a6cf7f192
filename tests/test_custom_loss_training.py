"""A policy loss from a module of one's own (examples/custom_loss.py, `loss.type=module:name`)
trains in the quickstart config: `agentrl train`, the console script, from the project directory
with no PYTHONPATH; the learner actor (another process) imports the module and calls its loss."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_pipeline_e2e import REPO, e2e_overrides, read_rows

pytestmark = pytest.mark.slow


@pytest.mark.full  # the registry's module:name path: tests/test_custom_loss.py and test_registry.py; training: the e2e run
def test_a_custom_loss_trains_in_the_quickstart_config(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    # (the session's tiny model has no induction pre-stage; the quickstart config asks for one)
    overrides = e2e_overrides(tiny_model_dir, run_dir, "loss.type=examples.custom_loss:cispo",
                              "sft.enabled=false", "train.num_steps=2", "model.tiny.induction_steps=0")
    cmd = [str(Path(sys.executable).parent / "agentrl"), "train", "configs/quickstart.yaml", *overrides,
           "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r for r in read_rows(run_dir) if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    # the metrics only the example loss reports: it ran in the learner, and the built-in did not
    called = [r for r in rows if "train/cispo_weight_mean" in r]
    assert called, rows
    assert all(0.0 < r["train/cispo_weight_mean"] <= 1.28 + 1e-6 for r in called), called
    assert not any("train/clip_frac_high" in r for r in rows), rows
