"""Refit of a mixture-of-experts policy: vLLM on CPU serves the tiny Qwen3-MoE (its logprobs equal
transformers' before any refit), and after the torch learner's weights (routers and every expert
changed) reach it through the object-store transport, the engine's logprobs are the learner's; a
second refit, back to the original weights, gives the original logprobs back. vLLM 0.32 alone
misses by up to 0.8 nats here (its CPU experts are not prepacked again on a weight update): the
engine's worker extension repacks them (``_agentrl_repack_cpu_experts``)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

pytestmark = pytest.mark.slow


def test_engine_serves_the_learners_experts_after_a_refit(tmp_path) -> None:
    from agentrl.config import Config, EngineConfig
    from agentrl.engine.vllm_engine import VLLMEngine
    from agentrl.learner.torch_learner import TorchLearner
    from agentrl.model.tiny import bootstrap_tiny
    from agentrl.rollout.trajectory import Trajectory

    path = str(bootstrap_tiny(tmp_path / "model", family="qwen3_moe", num_layers=2,  # head_dim 32: vLLM CPU has no 16
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, log=lambda *_: None))
    learner = TorchLearner(Config.model_validate({"model": {"path": path}}))
    original_weights = learner.export_weights()
    torch.manual_seed(1)
    with torch.no_grad():  # every weight moves, routers included: tokens change experts too
        for p in learner.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    exported = learner.export_weights()
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in exported  # the checkpoint's names
    assert not any(name.endswith("experts.gate_up_proj") for name in exported)

    rng = random.Random(0)
    ids = [rng.randrange(20, 300) for _ in range(48)]

    traj = Trajectory(token_ids=ids, loss_mask=[0] * len(ids), behavior_logprobs=[0.0] * len(ids),
                      policy_versions=[-1] * len(ids))
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        lp = torch.log_softmax(AutoModelForCausalLM.from_pretrained(path)(torch.tensor([ids])).logits[0].float(), -1)
    original = [0.0] + [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]

    async def scores() -> tuple[list[float], list[float], list[float]]:
        engine = VLLMEngine(path, EngineConfig(max_model_len=512))
        await engine.start()
        try:
            before = await engine.score(ids)
            await engine.update_weights(exported, 1)
            after = await engine.score(ids)
            await engine.update_weights(original_weights, 2)
            return before, after, await engine.score(ids)
        finally:
            engine.shutdown()

    before, after, back = asyncio.run(scores())
    served = max(abs(a - b) for a, b in zip(before, original))
    assert served < 1e-4, f"vLLM's Qwen3-MoE differs from transformers' before any refit ({served:.2e})"
    mine = learner.logprobs([traj])[0]
    moved = max(abs(a - b) for a, b in zip(before, after))
    agree = max(abs(a - b) for a, b in zip(mine, after))
    assert moved > 1e-2, f"the refit changed nothing ({moved:.2e})"
    assert agree < 1e-4, f"engine and learner logprobs differ after the refit (max abs {agree:.2e})"
    restored = max(abs(a - b) for a, b in zip(back, original))
    assert restored < 1e-4, f"refitting the original weights did not restore the engine ({restored:.2e})"
