"""Run metrics: JSONL, TensorBoard, and W&B in its offline mode (no network; the files it writes
are read back). A real training run's W&B log is checked in tests/test_pipeline_e2e.py."""

import json
import warnings

import pytest

from agentrl.config import ConfigError, WandbConfig, load_config
from agentrl.driver.metrics import MetricsLogger, read_metrics
from tests.wandb_files import offline_runs, read_offline_run

pytest.importorskip("wandb", reason="the wandb extra")  # installed by scripts/setup_venv.sh


@pytest.fixture(autouse=True)
def _no_wandb_network(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: the config says offline as well
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


def test_wandb_offline_gets_the_jsonl_rows_config_and_summary(tmp_path):
    wc = WandbConfig(enabled=True, project="proj", name="run-a", tags=["quick", "cpu"], mode="offline")
    cfg = load_config(None, ["run_dir=" + str(tmp_path / "run")]).model_dump(mode="json")
    logger = MetricsLogger(tmp_path / "run", tensorboard=False, wandb=wc, config=cfg)
    logger.log(0, {"eval_before/success": 0.25})
    logger.log(1, {"train/loss": 0.5, "rollout/reward": 0.125, "note": "text"})
    logger.log(2, {"train/loss": 0.25, "rollout/reward": 0.5})
    logger.log(2, {"eval_after/success": 0.75})
    logger.summary({"final/rollout/reward": 0.5, "eval_after/success": 0.75})
    logger.close()

    [run_file] = offline_runs(tmp_path / "run")
    run = read_offline_run(run_file)
    assert run["exited"]
    assert (run["project"], run["name"], run["tags"]) == ("proj", "run-a", ["quick", "cpu"])
    assert run["config"]["replay"]["max_staleness"] == cfg["replay"]["max_staleness"]
    assert run["config"]["run_dir"] == str(tmp_path / "run")
    by_step = {row["_step"]: row for row in run["history"]}
    for row in read_metrics(tmp_path / "run"):  # every number of metrics.jsonl, at its step
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                assert by_step[row["step"]][key] == value, (row["step"], key)
    assert "note" not in by_step[1]
    assert run["summary"]["final/rollout/reward"] == 0.5 and run["summary"]["eval_after/success"] == 0.75
    assert (tmp_path / "run" / "wandb_run_id").read_text() == run["id"]


def test_resume_continues_the_same_wandb_run(tmp_path):
    wc = WandbConfig(enabled=True, mode="offline")
    first = MetricsLogger(tmp_path / "run", tensorboard=False, wandb=wc)
    first.log(1, {"train/loss": 1.0})
    first.close()
    again = MetricsLogger(tmp_path / "run", tensorboard=False, wandb=wc, resume=True)
    again.log(2, {"train/loss": 0.5})
    again.close()
    fresh = MetricsLogger(tmp_path / "other", tensorboard=False, wandb=wc)
    fresh.close()
    ids = [read_offline_run(f)["id"] for f in offline_runs(tmp_path / "run")]
    assert len(ids) == 2 and ids[0] == ids[1]
    assert read_offline_run(offline_runs(tmp_path / "other")[0])["id"] != ids[0]
    assert read_offline_run(offline_runs(tmp_path / "run")[0])["name"] == "run"  # run_dir's name by default


def test_wandb_is_off_by_default_and_writes_nothing(tmp_path):
    cfg = load_config(None, [])
    assert cfg.metrics.wandb.enabled is False
    logger = MetricsLogger(tmp_path / "run", tensorboard=False, wandb=cfg.metrics.wandb)
    logger.log(1, {"train/loss": 1.0})
    logger.close()
    assert not (tmp_path / "run" / "wandb").exists()
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["train/loss"] == 1.0


def test_wandb_settings_without_enabled_warn(tmp_path):
    with pytest.warns(UserWarning, match="metrics.wandb.enabled"):
        load_config(None, ["metrics.wandb.project=x"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["metrics.wandb.enabled=true", "metrics.wandb.project=x", "metrics.wandb.tags=[a, b]"])


def test_a_missing_wandb_package_is_a_config_error(monkeypatch):
    import importlib.util

    from agentrl.driver.metrics import require_wandb

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"agentrl\[wandb\]"):
        require_wandb()


def test_bad_wandb_settings_name_the_key():
    with pytest.raises(ConfigError, match="metrics.wandb.mode"):
        load_config(None, ["metrics.wandb.mode=sometimes"])
