"""The torch learner's optimizer step: groups whose rewards tie carry no signal and move nothing."""

import random

import pytest
import torch

from agentrl.config import Config
from agentrl.learner.torch_learner import TorchLearner
from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup


def _group(rewards: list[float], seed: int) -> TrajectoryGroup:
    rng = random.Random(seed)
    trajectories = []
    for reward in rewards:
        prompt, sampled = rng.randint(4, 12), rng.randint(3, 10)
        ids = [rng.randrange(20, 200) for _ in range(prompt + sampled)]
        mask = [0] * prompt + [1] * sampled
        trajectories.append(Trajectory(
            token_ids=ids, loss_mask=mask, behavior_logprobs=[-3.0 * m for m in mask],
            policy_versions=[0 if m else -1 for m in mask], turn_spans=[(prompt, prompt + sampled)],
            turn_rewards=[reward]))
    return TrajectoryGroup(task_id=f"t{seed}", trajectories=trajectories)


def _weights(learner: TorchLearner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.model.parameters()]


def test_tied_rewards_leave_the_weights_alone_even_with_adam_momentum(tiny_model_dir):
    cfg = Config.model_validate({"model": {"path": tiny_model_dir}, "learner": {"lr": 1e-3}})
    learner = TorchLearner(cfg)
    before = _weights(learner)
    out = learner.train_step([_group([1.0, 0.0, 0.0, 1.0], 0), _group([0.0, 0.0, 0.0, 0.0], 1)])
    assert out["train/optimizer_stepped"] == 1.0 and out["train/grad_norm"] > 0
    after_signal = _weights(learner)
    assert any(not torch.equal(a, b) for a, b in zip(before, after_signal))

    # Now only tied groups: AdamW's momentum would keep moving the weights; the learner must not.
    out = learner.train_step([_group([0.0] * 4, 2), _group([1.0] * 4, 3)])
    assert out["train/grad_norm"] == 0.0 and out["train/optimizer_stepped"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(after_signal, _weights(learner)))
    assert learner.version == 2  # the version still advances: the batch was consumed


def test_tied_groups_are_skipped_without_changing_the_step(tiny_model_dir, monkeypatch):
    """Dropping zero-advantage samples before the passes gives the same update as keeping them."""
    import agentrl.learner.torch_learner as tl

    cfg = Config.model_validate({"model": {"path": tiny_model_dir}, "learner": {"lr": 1e-3}})
    groups = [_group([1.0, 0.0, 0.0, 1.0], 0), _group([1.0] * 4, 1), _group([0.0, 1.0, 1.0, 1.0], 2)]
    filtered = TorchLearner(cfg)
    out = filtered.train_step(groups)
    assert out["train/num_sequences"] == 12.0 and out["train/num_sequences_trained"] == 8.0

    monkeypatch.setattr(tl, "with_signal", lambda samples, **_: samples)
    kept = TorchLearner(cfg)
    out_kept = kept.train_step(groups)
    assert out_kept["train/num_sequences_trained"] == 12.0
    assert abs(out["train/loss"] - out_kept["train/loss"]) < 1e-6
    assert abs(out["train/grad_norm"] - out_kept["train/grad_norm"]) < 1e-5 * max(1.0, out_kept["train/grad_norm"])
    for a, b in zip(_weights(filtered), _weights(kept)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_proximal_logprobs_are_the_training_pass_own(tiny_model_dir, monkeypatch):
    """Under ``proximal: recompute`` the loss gets, as pi_prox, exactly what a separate no-grad
    pass over the same micro-batch under the pre-step weights gives (one optimizer step per
    batch), so the learner saves that pass."""
    import agentrl.learner.torch_learner as tl

    cfg = Config.model_validate({"model": {"path": tiny_model_dir}, "learner": {"lr": 1e-3},
                                 "packing": {"max_tokens_per_microbatch": 64}, "rollout": {"max_total_tokens": 64}})
    learner = TorchLearner(cfg)
    seen = []
    real_loss = tl.microbatch_loss

    def checked(logp, prox_lp, packed, *args, **kwargs):
        with torch.no_grad():
            separate = learner._logprobs(learner.model, packed)
        assert prox_lp is not None and not prox_lp.requires_grad
        assert torch.equal(prox_lp, separate)
        seen.append(packed.input_ids.numel())
        return real_loss(logp, prox_lp, packed, *args, **kwargs)

    monkeypatch.setattr(tl, "microbatch_loss", checked)
    groups = [_group([1.0, 0.0, 0.0, 1.0], 0), _group([0.0, 1.0, 1.0, 1.0], 2)]
    out = learner.train_step(groups)
    assert len(seen) == out["train/num_microbatches"] > 1  # several micro-batches, one step
    assert out["train/ratio_mean"] == 1.0 and out["train/clip_frac_low"] == out["train/clip_frac_high"] == 0.0
    out = learner.train_step(groups)  # and again after the weights moved
    assert len(seen) == 2 * out["train/num_microbatches"]


def test_memory_breakdown_names_what_holds_the_learners_memory(tiny_model_dir):
    from agentrl.learner.common import learner_memory

    groups = [_group([1.0, 0.0, 0.0, 1.0], 0)]
    full = TorchLearner(Config.model_validate({"model": {"path": tiny_model_dir}, "learner": {"lr": 1e-3}}))
    full.train_step(groups)
    param_gib = sum(p.numel() * p.element_size() for p in full.model.parameters()) / 2**30
    buf = torch.zeros(1000, dtype=torch.bfloat16)
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    with FunctionalTensorMode():  # such tensors outlive torch.compile's tracing; they have no memory to count
        traced = FunctionalTensor.to_functional(torch.ones(3))
    mem = learner_memory(full, {"refit_buffer": buf})
    assert traced.shape == (3,)
    assert abs(mem["weights"] - param_gib) < 0.01 * param_gib + 1e-5  # + buffers (rotary inv_freq)
    assert abs(mem["grads"] - param_gib) < 1e-3 * param_gib + 1e-6  # .grad kept after the step
    assert abs(mem["optimizer_state"] - 2 * param_gib) < 0.01 * param_gib + 1e-5  # Adam's two moments
    assert mem["refit_buffer"] == 2000 / 2**30 and "master_weights" not in mem
    assert "allocated" not in mem  # CPU: no allocator figures

    lora = TorchLearner(Config.model_validate({"model": {"path": tiny_model_dir}, "learner": {
        "lr": 1e-3, "lora": {"rank": 2, "alpha": 4}}}))
    lora.train_step(groups)
    small = learner_memory(lora)
    trainable = sum(p.numel() * p.element_size() for p in lora.model.parameters() if p.requires_grad) / 2**30
    assert abs(small["optimizer_state"] - 2 * trainable) < 0.01 * trainable + 1e-5
    assert small["optimizer_state"] < 0.2 * mem["optimizer_state"] and small["grads"] < 0.2 * mem["grads"]


def test_peaks_by_phase_are_a_no_op_without_cuda():
    from agentrl.learner.common import PeakByPhase

    peaks = PeakByPhase()
    with peaks.phase("optimizer"):
        x = torch.ones(1000)
    assert x.sum() == 1000 and peaks.report() == {} and peaks.overall() == (0.0, 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peaks_by_phase_keep_each_phases_own_peak_and_the_runs(tiny_model_dir):
    from agentrl.learner.common import PEAKS, PeakByPhase, learner_memory

    mib = 2**20
    peaks = PeakByPhase()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() / 2**30
    with peaks.phase("big"):
        big = torch.empty(512 * mib, dtype=torch.uint8, device="cuda")
        del big
    with peaks.phase("small"):
        small = torch.empty(64 * mib, dtype=torch.uint8, device="cuda")
        del small
    rep = peaks.report()
    assert abs(rep["peak_big"] - base - 0.5) < 0.01 and abs(rep["peak_small"] - base - 1 / 16) < 0.01
    assert rep["peak_reserved_big"] >= rep["peak_big"]
    assert peaks.overall()[0] >= rep["peak_big"]  # the run's peak survives the second phase's reset
    # a learner's step reports its phases through the memory report
    # the configuration of test_a_train_step_on_the_gpu_matches_the_cpu_step's first GPU step (one
    # group of 76 tokens in bf16 found no FlexAttention kernel to compile on the H200, 2026-11-28)
    cfg = Config.model_validate({"model": {"path": tiny_model_dir, "dtype": "float32"},
                                 "learner": {"lr": 1e-3, "num_gpus": 1}})
    learner = TorchLearner(cfg, device="cuda")
    learner.train_step([_group([1.0, 0.0, 0.0, 1.0], 0), _group([0.0, 1.0, 1.0, 0.0], 5)])
    mem = learner_memory(learner)
    assert {"peak_forward_backward", "peak_optimizer"} <= set(mem)
    assert mem["peak"] >= max(mem["peak_forward_backward"], mem["peak_optimizer"]) >= mem["allocated"] > 0
    assert PEAKS.allocated["optimizer"] == mem["peak_optimizer"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_train_step_on_the_gpu_matches_the_cpu_step(tiny_model_dir):
    # The GPU path differs from the CPU one (FlexAttention with a BlockMask built from the host
    # boundaries, asynchronous copies, the fused head under bf16): the same step must agree.
    groups = [_group([1.0, 0.0, 0.0, 1.0], 0), _group([0.0, 1.0, 1.0, 0.0], 5)]
    out = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")):
        cfg = Config.model_validate({"model": {"path": tiny_model_dir, "dtype": dtype},
                                     "learner": {"lr": 1e-3, "num_gpus": int(device == "cuda")}})
        learner = TorchLearner(cfg, device=device)
        before = _weights(learner)
        out[device, dtype] = learner.train_step(groups)
        assert any(not torch.equal(a, b) for a, b in zip(before, _weights(learner)))
    ref = out["cpu", "float32"]  # bf16 on the CPU differs from it by 1.3e-5 (loss) and 1.5e-4 (grad norm)
    for key in ("train/loss", "train/grad_norm"):
        assert ref[key] != 0.0
        assert abs(out["cuda", "float32"][key] - ref[key]) <= 1e-3 * abs(ref[key]) + 1e-5, key
        assert abs(out["cuda", "bfloat16"][key] - ref[key]) <= 2e-2 * abs(ref[key]) + 2e-4, key
