"""End to end on CPU: real Ray actors, a real vLLM engine, the torch learner, refits."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentrl.config import ConfigError, load_config
from agentrl.driver.progress import parse_progress_line

pytestmark = pytest.mark.slow

REPO = str(Path(__file__).resolve().parents[1])
TEST_ENV = "tests.e2e_envs:SayNumber-v0"  # reward varies under a random policy: GRPO has signal


def start_ray():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": REPO}})


def e2e_overrides(model_dir, run_dir, *extra):
    return [
        f"model.path={model_dir}", f"run_dir={run_dir}", f"env.id={TEST_ENV}",
        "rollout.num_actors=2", "rollout.group_size=4", "rollout.max_concurrent_groups=2",
        "rollout.max_new_tokens=24", "rollout.max_turns=2", "rollout.max_total_tokens=512",
        "engine.max_model_len=1024", "engine.num_cpus=1", "learner.num_cpus=1", "learner.lr=0.003",
        "replay.groups_per_step=2", "replay.max_staleness=1", "replay.capacity=8",
        "packing.max_tokens_per_microbatch=1024", "train.num_steps=3", "refit.interval=1",
        "eval.num_episodes=0", "cluster.num_cpus=2", *extra,
    ]


def read_rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_missing_model_path_fails_before_any_actor(tmp_path):
    from agentrl.driver.trainer import Trainer

    cfg = load_config(None, [f"model.path={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="model.path"):
        Trainer(cfg)


@pytest.fixture(scope="module")
def e2e_run(tiny_model_dir, tmp_path_factory):
    """Three learner steps with a refit after each, on 2 rollout actors and 1 vLLM engine."""
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    # W&B in its offline mode (no network): test_wandb_offline_holds_the_real_run reads what it wrote
    wandb = ["metrics.wandb.enabled=true", "metrics.wandb.mode=offline", "metrics.wandb.tags=[e2e]"]
    cfg = load_config(None, e2e_overrides(tiny_model_dir, run_dir, "eval.num_episodes=8",
                                          *(wandb if importlib.util.find_spec("wandb") else [])))
    return {"cfg": cfg, "run_dir": run_dir, **train_and_score(cfg)}


def test_train_three_steps_with_refit(e2e_run):
    cfg, before, after, learner = e2e_run["cfg"], e2e_run["before"], e2e_run["after"], e2e_run["learner"]
    assert e2e_run["version"] == 3 and e2e_run["engine_version"] == 3
    changed = sum(abs(a - b) for a, b in zip(before[1:], after[1:])) / 39
    agree = sum(abs(a - b) for a, b in zip(learner[1:], after[1:])) / 39
    assert changed > 1e-3, "the refit did not change the engine's logprobs"
    assert agree < 1e-3, f"engine and learner logprobs differ after refit (mean abs {agree:.2e})"

    rows = read_rows(e2e_run["run_dir"])
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["replay/staleness_max"] <= cfg.replay.max_staleness
        # every consumed sampled token carries the engine version that produced it
        assert 0 <= r["replay/token_version_min"] <= r["replay/token_version_max"] <= r["step"] - 1
        assert r["replay/staleness_max"] == r["step"] - 1 - r["replay/token_version_min"]
    assert steps[-1]["replay/token_version_max"] >= 1, "no token was sampled with refit weights"
    assert any("eval_before/success" in r for r in rows) and any("eval_after/success" in r for r in rows)
    assert (Path(e2e_run["run_dir"]) / "checkpoints" / "latest").is_file()


def test_wandb_offline_holds_the_real_run(e2e_run):
    """The same numbers as metrics.jsonl at the same steps, held-out eval, config and summary."""
    pytest.importorskip("wandb", reason="the wandb extra")
    from tests.wandb_files import offline_runs, read_offline_run

    [run_file] = offline_runs(e2e_run["run_dir"])
    run = read_offline_run(run_file)
    assert run["exited"] and run["tags"] == ["e2e"] and run["name"] == "run"
    assert run["config"]["replay"]["max_staleness"] == e2e_run["cfg"].replay.max_staleness
    by_step: dict[int, dict] = {}
    for row in run["history"]:
        by_step.setdefault(row["_step"], {}).update(row)
    rows = read_rows(e2e_run["run_dir"])
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                assert by_step[row["step"]][key] == pytest.approx(value), (row["step"], key)
    assert "eval_before/success" in by_step[0] and "eval_after/success" in by_step[3]
    summary = json.loads((Path(e2e_run["run_dir"]) / "summary.json").read_text())
    assert run["summary"]["eval_after/success"] == pytest.approx(summary["eval_after/success"])
    assert run["summary"]["final/train/loss"] == pytest.approx(summary["final/train/loss"])


def test_plot_renders_real_run(e2e_run):
    from PIL import Image

    from agentrl.plot import plot_run

    paths = plot_run(e2e_run["run_dir"])
    assert {p.name for p in paths} == {"learning.png", "timing.png"}
    for p in paths:
        img = Image.open(p).convert("L")
        assert img.size[0] > 600 and img.size[1] > 300
        colors = img.getcolors(maxcolors=1 << 16)
        assert colors is not None and len(colors) > 20, f"{p.name} looks blank"


def _agentrl(*args, cwd=REPO, log=None, env_vars=None):
    """`agentrl ARGS` in a subprocess; its output goes to ``log`` (a file) if given, else to a pipe
    (read it with communicate(): an unread pipe fills up and blocks the process)."""
    env = dict(os.environ, PYTHONPATH=REPO, **(env_vars or {}))
    out = open(log, "w") if log is not None else subprocess.PIPE  # noqa: SIM115 (the child owns it)
    # SIGINT back to the default in the child: a test session started as a background job inherits
    # "ignore SIGINT", and Python then installs no KeyboardInterrupt handler, so the interrupt
    # below would be lost.
    return subprocess.Popen([sys.executable, "-m", "agentrl.cli", *args], cwd=cwd, env=env,
                            stdout=out, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _adam_steps(ckpt):
    """The learner state of a checkpoint, and the step counts of Adam's per-parameter states."""
    import torch

    state = torch.load(ckpt / "learner" / "learner_state.pt", weights_only=False)
    return state, {int(s["step"]) for s in state["optimizer"]["state"].values()}


def _stepped(rows):  # optimizer steps taken (a step whose advantages all tie takes none)
    return int(sum(r["train/optimizer_stepped"] for r in rows))


def test_resume_continues_a_run_from_its_last_checkpoint(e2e_run, tiny_model_dir, tmp_path):
    """`agentrl train --resume` on a copy of the three-step run with two more steps: the step
    counter, the optimizer state and the replay queue's counters go on from its checkpoint, not
    restart; its plain progress lines (a pipe is no terminal) count from there and match its metrics."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(e2e_run["run_dir"], run_dir)
    first = [r for r in read_rows(run_dir) if "train/loss" in r]
    k = int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert k == first[-1]["step"] == 3
    _, at_k = _adam_steps(run_dir / "checkpoints" / f"step_{k:06d}")
    assert at_k == ({_stepped(first)} if _stepped(first) else set())
    steps_total = k + 2
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text("")
    n_rows = len(read_rows(run_dir))
    proc = _agentrl("train", str(cfg_path), *e2e_overrides(tiny_model_dir, run_dir, f"train.num_steps={steps_total}"),
                    "--no-progress", "--resume")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    resumed = [r for r in read_rows(run_dir)[n_rows:] if "train/loss" in r]
    assert [r["step"] for r in resumed] == list(range(k + 1, steps_total + 1))  # continued, not restarted
    lines = [p for p in map(parse_progress_line, out.splitlines()) if p]
    assert lines and lines[0]["step"] == k + 1 and lines[-1]["step"] == steps_total, out[-3000:]
    assert all(p["total"] == steps_total for p in lines) and lines[-1]["eta"] == "0:00:00", out[-3000:]
    assert {"reward", "tok/s", "stale", "eta"} <= set(lines[0])
    logged = {r["step"]: r for r in resumed}
    for p in lines:
        assert p["reward"] == pytest.approx(logged[p["step"]]["rollout/reward"], abs=0.0051)
        assert p["stale"] == logged[p["step"]]["replay/staleness_max"]
    state, at_end = _adam_steps(run_dir / "checkpoints" / f"step_{steps_total:06d}")
    assert state["version"] == steps_total
    n_end = _stepped(first + resumed)
    assert at_end == ({n_end} if n_end else set())  # Adam's step counts went on from the checkpoint
    # the replay queue's counters continued: 2 groups per step, k + 1 steps consumed in all
    assert resumed[0]["replay/consumed"] == 2 * (k + 1)


@pytest.mark.full  # resume: test_resume_continues_a_run_from_its_last_checkpoint; a signal's stop: Supervision's unit test
def test_interrupt_and_resume_continues(tiny_model_dir, tmp_path):
    """`agentrl train` is interrupted after its step-2 checkpoint; `--resume` continues from the
    last checkpoint: step counter, optimizer state and replay-queue counters go on, not restart."""
    steps_total = 30  # a step takes ~0.5 s here: the interrupt must land before the end
    run_dir = tmp_path / "run"
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text("")
    overrides = e2e_overrides(tiny_model_dir, run_dir, f"train.num_steps={steps_total}", "train.checkpoint_interval=2")
    log = tmp_path / "first_run.log"
    proc = _agentrl("train", str(cfg_path), *overrides, "--no-progress", log=log)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() >= "step_000002":
            break
        time.sleep(0.1)
    assert proc.poll() is None, log.read_text()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    first = [r for r in read_rows(run_dir) if "train/loss" in r]
    assert first and first[-1]["step"] < steps_total, "the run finished before it could be interrupted"
    # --no-progress: plain lines while it trains (a file is not a terminal), read back from the log
    lines = [p for p in map(parse_progress_line, log.read_text().splitlines()) if p]
    assert lines and lines[0]["step"] == 1 and all(p["total"] == steps_total for p in lines), log.read_text()[-3000:]
    assert {"reward", "tok/s", "stale", "eta"} <= set(lines[0])
    assert [p["step"] for p in lines] == sorted({p["step"] for p in lines})
    logged = {r["step"]: r for r in first}
    for p in lines:
        assert p["reward"] == pytest.approx(logged[p["step"]]["rollout/reward"], abs=0.0051)
        assert p["stale"] == logged[p["step"]]["replay/staleness_max"]
    assert proc.returncode is not None, log.read_text()[-3000:]
    k = int(latest.read_text().strip().split("_")[1])  # the checkpoint --resume starts from
    assert k >= 2

    _, at_2 = _adam_steps(run_dir / "checkpoints" / "step_000002")
    n2 = _stepped([r for r in first if r["step"] <= 2])
    assert at_2 == ({n2} if n2 else set())

    n_rows = len(read_rows(run_dir))
    proc = _agentrl("train", str(cfg_path), *overrides, "--no-progress", "--resume")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    resumed = [r for r in read_rows(run_dir)[n_rows:] if "train/loss" in r]
    assert [r["step"] for r in resumed] == list(range(k + 1, steps_total + 1))  # continued, not restarted
    lines = [p for p in map(parse_progress_line, out.splitlines()) if p]  # a pipe: plain lines too
    assert lines[0]["step"] == k + 1 and lines[-1]["step"] == steps_total and lines[-1]["eta"] == "0:00:00", out
    state, at_end = _adam_steps(run_dir / "checkpoints" / f"step_{steps_total:06d}")
    assert state["version"] == steps_total
    n_end = _stepped([r for r in first if r["step"] <= k] + resumed)
    assert at_end == ({n_end} if n_end else set())  # Adam's step counts went on from the checkpoint
    # the replay queue's counters continued: 2 groups per step, k + 1 steps consumed in all
    assert resumed[0]["replay/consumed"] == 2 * (k + 1)


@pytest.mark.full  # engine death: the chaos run's frozen engine and test_engine_actor's restart
def test_engine_killed_mid_run_training_continues(tiny_model_dir, tmp_path):
    """Kill the engine actor after step 2: Ray restarts it, it loads the current weights before
    taking work, episodes it was serving are dropped and counted, and training finishes."""
    import ray

    from agentrl.driver.trainer import Trainer

    run_dir = tmp_path / "run"
    steps_total = 20  # a step takes ~0.5 s here: the kill must land while training has work left
    cfg = load_config(None, e2e_overrides(tiny_model_dir, run_dir, f"train.num_steps={steps_total}"))
    start_ray()
    trainer = Trainer(cfg, progress=False)
    killed = {}

    def killer():
        while not (run_dir / "metrics.jsonl").is_file() or not any(
                r.get("step", 0) >= 2 for r in read_rows(run_dir)):
            time.sleep(0.2)
        killed["pid"] = ray.get(trainer.engines[0].pid.remote())
        ray.kill(trainer.engines[0], no_restart=False)
        killed["step"] = max(r.get("step", 0) for r in read_rows(run_dir))

    try:
        trainer.start()
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        trainer.run()
        thread.join(timeout=5)
        engine = trainer.engines[0]
        assert ray.get(engine.pid.remote()) != killed["pid"], "the engine was not restarted"
        assert killed["step"] < steps_total, "training finished before the engine was killed"
        assert ray.get(engine.version.remote()) == trainer.version == steps_total
        counts = ray.get(trainer.replay.metrics.remote())
        queued = counts["replay/size"]
    finally:
        trainer.shutdown()
        ray.shutdown()
    rows = [r for r in read_rows(run_dir) if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, steps_total + 1))
    # counts add up: every admitted group was consumed, dropped as stale, released, queued or in flight
    admitted = counts["replay/admitted"]
    assert admitted == (counts["replay/consumed"] + counts["replay/dropped_stale"] + counts["replay/released"]
                        + queued + counts["replay/in_flight"])
    assert counts["replay/consumed"] == steps_total * cfg.replay.groups_per_step


def train_and_score(cfg, extra=None) -> dict:
    """Start a Trainer on ``cfg``, score a fixed sequence with the engine before and after the run,
    and with the learner after it; returns those, the versions and the transport used, plus
    ``extra(trainer)``'s items when given (measured after the run, before shutdown)."""
    import ray

    from agentrl.driver.trainer import Trainer
    from agentrl.rollout.trajectory import Trajectory

    fixed = list(range(5, 45))
    start_ray()
    trainer = Trainer(cfg, progress=False)
    try:
        trainer.start()
        engine = trainer.engines[0]
        before = ray.get(engine.score.remote(fixed))
        trainer.run()
        return {
            "transport": trainer.weights.transport, "version": trainer.version,
            "engine_version": ray.get(engine.version.remote()), "before": before,
            "after": ray.get(engine.score.remote(fixed)),
            "learner": ray.get(trainer.learner.logprobs.remote([Trajectory(
                token_ids=fixed, loss_mask=[0] * 40, behavior_logprobs=[0.0] * 40, policy_versions=[-1] * 40)]))[0],
            **(extra(trainer) if extra else {}),
        }
    finally:
        trainer.shutdown()
        ray.shutdown()


def mean_abs_diff(a: list[float], b: list[float]) -> float:
    """Mean |a - b| past the first position (whose logprob is 0 by convention)."""
    return sum(abs(x - y) for x, y in zip(a[1:], b[1:])) / (len(a) - 1)


@pytest.mark.full  # the broadcast transport runs end to end in test_lora_e2e's nccl case
def test_broadcast_refit_transport_on_cpu(tiny_model_dir, tmp_path):
    """refit.transport=nccl runs its protocol over gloo on CPU: the learner's rank 0 and the vLLM
    engine's worker form a group of their own, weights travel as one flat buffer, and afterwards
    the engine scores exactly as the learner does."""
    cfg = load_config(None, e2e_overrides(tiny_model_dir, tmp_path / "run", "refit.transport=nccl",
                                          "train.num_steps=2", "rollout.num_actors=1"))
    import ray

    r = train_and_score(cfg, lambda t: {"start_s": dict(t.start_s),
                                        "timeline": ray.get(t.learner.start_timeline.remote()),
                                        "rollout_began": ray.get(t.rollouts[0].init_began.remote()),
                                        "engines_up": t.engines_up_at})
    assert r["transport"] == "nccl" and r["engine_version"] == r["version"] == 2
    # where the start-up went, part by part (the weight group: this transport's own part)
    assert list(r["start_s"]) == ["ray", "replay_and_placement", "engines", "weight_group", "rollouts"]
    assert all(v >= 0 for v in r["start_s"].values()) and r["start_s"]["engines"] > 0
    assert r["timeline"]["built"] > 0  # the learner actor's build, from its start
    # the rollout actors are built while the engines start, not after (no GPU, nothing of theirs needed)
    assert r["rollout_began"] < r["engines_up"], (r["rollout_began"], r["engines_up"])
    assert mean_abs_diff(r["before"], r["after"]) > 1e-3, "the broadcast refit did not change the engine's logprobs"
    agree = mean_abs_diff(r["learner"], r["after"])
    assert agree < 1e-3, f"engine and learner logprobs differ after a broadcast refit (mean abs {agree:.2e})"


@pytest.mark.full  # two more train runs; train.deterministic's seeds and order: test_deterministic
def test_deterministic_runs_train_on_the_same_batches_at_any_concurrency(tiny_model_dir, tmp_path):
    """train.deterministic: two runs of one seed whose engine sees other batch-mates and other timing
    (one group generated at a time vs two at once) consume the same batches and end with bit-identical
    weights."""
    import ray
    from safetensors.torch import load_file

    from agentrl.driver.trainer import Trainer

    def run(name, *extra):
        cfg = load_config(None, e2e_overrides(tiny_model_dir, tmp_path / name, "train.num_steps=2",
                                              "rollout.temperature=1.0", *extra))
        trainer = Trainer(cfg, progress=False)
        try:
            trainer.run()
        finally:
            trainer.shutdown()
        steps = [r for r in read_rows(cfg.run_dir) if "train/loss" in r]
        weights = load_file(str(Path(cfg.run_dir) / "checkpoints" / "step_000002" / "learner" / "model" / "model.safetensors"))
        return steps, weights

    start_ray()  # one Ray instance for both runs (a second start-up is slow on a loaded machine)
    try:
        with pytest.warns(UserWarning, match="train.deterministic"):
            runs = [run(f"det{c}", "train.deterministic=true", f"rollout.max_concurrent_groups={c}") for c in (1, 4)]
    finally:
        ray.shutdown()
    (steps_a, w_a), (steps_b, w_b) = runs
    assert [r["replay/staleness_max"] for r in steps_a + steps_b] == [0, 0, 0, 0]
    for a, b in zip(steps_a, steps_b):
        for key in ("train/loss", "rollout/reward", "rollout/tokens", "train/grad_norm"):
            if key in a:
                assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert w_a.keys() == w_b.keys() and all(w_a[k].equal(w_b[k]) for k in w_a), "the weights differ"


@pytest.mark.full  # a signal's stop: test_interrupt_and_resume_continues (SIGINT)
def test_sigterm_stops_the_run_as_ctrl_c_does(tiny_model_dir, tmp_path):
    """A SIGTERM (kill, timeout, a job scheduler) while it trains: the run shuts down as on Ctrl-C,
    so no process of its tree outlives it and no temp file of its engines is left. Before the fix,
    Ray's driver handler aborted the process (exit -6) and left Ray's agent processes, the engine's
    temp dir and the run's compile cache (bench/soak.py, 2026-11-27)."""
    import shutil
    import tempfile

    import psutil

    run_dir = tmp_path / "run"
    tmp = Path(tempfile.mkdtemp(prefix="sigterm-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    try:
        _sigterm_run(tiny_model_dir, tmp_path, run_dir, tmp, psutil)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sigterm_run(tiny_model_dir, tmp_path, run_dir, tmp, psutil):
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text("")
    log = tmp_path / "run.log"
    proc = _agentrl("train", str(cfg_path), *e2e_overrides(tiny_model_dir, run_dir, "train.num_steps=200"),
                    "--no-progress", log=log, env_vars={"TMPDIR": str(tmp)})
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and '"train/loss"' in metrics.read_text():
            break
        time.sleep(0.2)
    assert proc.poll() is None, log.read_text()[-3000:]
    assert any(p.name.startswith("agentrl-compile-") for p in tmp.iterdir()), sorted(tmp.iterdir())
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert any("EngineActor" in " ".join(p.cmdline()) for p in tree if p.is_running())
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=180)
    text = log.read_text()
    assert proc.returncode != -6 and "SIGTERM received" not in text, text[-3000:]
    assert "stopped by signal SIGTERM" in text, text[-3000:]
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [(p.pid, p.name()) for p in alive]
    left = sorted(p.name for p in tmp.iterdir() if p.name.startswith(("agentrl-compile-", "agentrl-engine-")))
    assert not left, left
