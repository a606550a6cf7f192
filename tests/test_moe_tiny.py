"""The tiny mixture-of-experts family (qwen3_moe) and the torch learner on it: the bootstrap writes a
Qwen3MoeForCausalLM that transformers loads, packed logprobs equal per-sequence ones, the router
balancing loss is transformers' own, and ``learner.moe_aux_loss_coef`` adds it to the RL loss."""

from __future__ import annotations

import random

import pytest
import torch

from agentrl.config import Config


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from agentrl.model.tiny import bootstrap_tiny

    return str(bootstrap_tiny(tmp_path_factory.mktemp("tiny_moe") / "model", family="qwen3_moe", hidden_size=64,
                              num_layers=2, intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, log=lambda *_: None))


def test_bootstrap_writes_a_qwen3_moe_with_qwen3_chat(moe_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.model.tiny import tiny_family
    from agentrl.model.tiny_templates import TEMPLATES

    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    c = model.config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (4, 2, 32, True)
    assert all(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers)
    tok = AutoTokenizer.from_pretrained(moe_dir)
    assert tok.chat_template == TEMPLATES["qwen3"] and tok.eos_token == "<|im_end|>"
    assert tiny_family(moe_dir) == "qwen3_moe"


def test_config_takes_the_family_and_checks_top_k() -> None:
    cfg = Config.model_validate({"model": {"family": "qwen3_moe", "tiny": {"num_experts": 4}}})
    assert cfg.model.family == "qwen3_moe" and cfg.model.tiny.num_experts_per_tok == 2
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Config.model_validate({"model": {"tiny": {"num_experts": 2, "num_experts_per_tok": 3}}})


def test_packed_logprobs_and_router_loss_match_transformers(moe_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from agentrl.learner.hf_forward import packed_token_logprobs
    from agentrl.learner.packing import pack_sequences, unpack

    model = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    rng = random.Random(0)
    seqs = [[rng.randrange(20, 300) for _ in range(n)] for n in (11, 7, 15)]
    packed = pack_sequences(seqs, pad_id=0)
    losses: list[torch.Tensor] = []
    with torch.no_grad():
        got = unpack(packed_token_logprobs(model, packed, router_losses=losses), packed)
        for seq, mine in zip(seqs, got):
            lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
            ref = torch.cat([torch.zeros(1), lp[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]])
            torch.testing.assert_close(torch.as_tensor(mine), ref, atol=1e-5, rtol=0)
        # the balancing loss over all tokens of the pack (no padding at this length) is transformers'
        # loss of the documents' own router logits, each document run alone
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        assert packed.input_ids.numel() == sum(map(len, seqs))
        per_doc = [model(torch.tensor([s]), output_router_logits=True).router_logits for s in seqs]
        layers = tuple(torch.cat([doc[i] for doc in per_doc]) for i in range(len(per_doc[0])))
        ref_aux = load_balancing_loss_func(layers, 4, 2)
        one = model(torch.tensor([seqs[0]]), output_router_logits=True)
        torch.testing.assert_close(load_balancing_loss_func(one.router_logits, 4, 2), one.aux_loss)
    assert len(losses) == 1
    torch.testing.assert_close(losses[0], ref_aux, atol=1e-6, rtol=1e-5)


def _group(seed: int):
    from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

    rng = random.Random(seed)
    trajectories = []
    for reward in (1.0, 0.0, 0.0, 1.0):
        prompt, sampled = rng.randint(4, 12), rng.randint(3, 10)
        mask = [0] * prompt + [1] * sampled
        trajectories.append(Trajectory(
            token_ids=[rng.randrange(20, 300) for _ in mask], loss_mask=mask, behavior_logprobs=[-3.0 * m for m in mask],
            policy_versions=[0 if m else -1 for m in mask], turn_spans=[(prompt, prompt + sampled)],
            turn_rewards=[reward]))
    return TrajectoryGroup(task_id=f"t{seed}", trajectories=trajectories)


def test_torch_learner_trains_experts_and_routers_with_optional_aux_loss(moe_dir: str) -> None:
    from agentrl.learner.torch_learner import TorchLearner

    groups = [_group(0), _group(1)]
    steps = {}
    for coef in (0.0, 0.5):
        cfg = Config.model_validate({"model": {"path": moe_dir}, "learner": {"lr": 1e-3, "moe_aux_loss_coef": coef}})
        learner = TorchLearner(cfg)
        before = {k: v.detach().clone() for k, v in learner.model.named_parameters()}
        out = learner.train_step(groups)
        after = dict(learner.model.named_parameters())
        for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj",
                     "model.layers.1.mlp.experts.down_proj"):
            assert not torch.equal(before[name], after[name]), name
        assert out["train/num_microbatches"] == 1.0
        steps[coef] = out
    assert "train/moe_aux_loss" not in steps[0.0]
    aux = steps[0.5]["train/moe_aux_loss"]
    assert aux > 0
    # the same micro-batch, the same policy loss: the difference is the weighted balancing loss
    assert abs(steps[0.5]["train/loss"] - steps[0.0]["train/loss"] - 0.5 * aux) < 1e-5

    none = Config.model_validate({"model": {"path": moe_dir}, "learner": {"moe_aux_loss_coef": None}})
    assert TorchLearner(none).moe_aux_loss_coef == 0.001  # the checkpoint's router_aux_loss_coef


def test_learner_exports_the_checkpoints_expert_names(moe_dir: str) -> None:
    """The refit sends what save_pretrained writes and the engines load: per-expert tensors."""
    from safetensors.torch import load_file

    from agentrl.learner.torch_learner import TorchLearner

    learner = TorchLearner(Config.model_validate({"model": {"path": moe_dir}}))
    exported = {k: v for k, v in learner.export_weights().items() if k != "lm_head.weight"}  # tied to the embedding
    saved = load_file(f"{moe_dir}/model.safetensors")
    assert sorted(exported) == sorted(saved)
    assert all(torch.equal(exported[k], saved[k]) for k in exported)
