"""docs/guides/custom-loss.md: its example loss (examples/custom_loss.py, verbatim) passes
agentrl.testing's property checks, its blocks run, and the learner's code paths use the loss and
the backend the config names."""

from __future__ import annotations

import ast
import sys

import pytest
import torch

from agentrl.config import ConfigError, load_config
from agentrl.docs import REPO, code_blocks
from agentrl.config.registry import LOSSES, check_components
from agentrl.testing import check_policy_loss, loss_configs

GUIDE = REPO / "docs" / "guides" / "custom-loss.md"
EXAMPLE = REPO / "examples" / "custom_loss.py"


pytestmark = pytest.mark.usefixtures("isolated_registries")


def guide_blocks() -> list[str]:
    blocks = [b.code for b in code_blocks(GUIDE) if b.mark == "doc-test" and b.mark_value == "tests/test_custom_loss.py"]
    assert len(blocks) == 3, "the guide's loss, its test and the estimator"
    return blocks


def test_the_example_module_is_the_guide_block():
    tree = ast.parse(EXAMPLE.read_text())
    body_start = tree.body[1].lineno  # after the module docstring
    body = "\n".join(EXAMPLE.read_text().splitlines()[body_start - 1:]).strip()
    assert body == guide_blocks()[0].strip()


def test_the_guide_blocks_run_as_a_user_project(tmp_path, monkeypatch):
    loss, test, estimator = guide_blocks()
    (tmp_path / "my_losses.py").write_text(loss)
    (tmp_path / "my_estimators.py").write_text(estimator)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict = {}
    exec(compile(test, f"{GUIDE}:test block", "exec"), namespace)  # noqa: S102 - the guide's own block
    namespace["test_cispo_keeps_the_loss_invariants"]()

    from agentrl.learner.advantages import group_advantages

    cfg = load_config(None, ["loss.type=my_losses:cispo", "advantage.estimator=my_estimators:median"])
    check_components(cfg)  # imports both modules, as a run's start does
    assert LOSSES.resolve(cfg.loss.type) is sys.modules["my_losses"].cispo
    adv = group_advantages(torch.tensor([0.0, 1.0, 5.0]), cfg.advantage.estimator)
    assert adv.tolist() == [-1.0, 0.0, 4.0]  # the median's baseline, not the mean's (2.0)


def test_the_example_loss_passes_the_property_checks():
    loss = LOSSES.resolve("examples.custom_loss:cispo")
    check_policy_loss(loss, loss_configs(), clipping=False, importance_weights=False, max_examples=40)


def test_the_property_checks_catch_a_loss_that_reads_padding():
    from examples.custom_loss import cispo

    def leaky(logprobs, *args, **kwargs):  # forgets the mask on the log-probabilities
        loss, metrics = cispo(logprobs, *args, **kwargs)
        return loss + 0.0 * logprobs.sum(), metrics

    with pytest.raises(AssertionError):
        check_policy_loss(leaky, clipping=False, importance_weights=False, max_examples=40)


def _samples():
    from agentrl.learner.common import TrainSample

    return [TrainSample([1, 2, 3, 4], [0, 1, 1, 1], [0.0, -1.0, -0.5, -2.0], [0.0, 1.0, 1.0, 1.0], [0] * 4),
            TrainSample([5, 6, 7], [0, 1, 1], [0.0, -0.3, -0.7], [0.0, 0.0, 0.0], [0] * 3)]


def test_the_learners_micro_batch_loss_calls_the_configured_loss():
    from agentrl.learner.common import global_counts, microbatch_loss, pack_samples, with_signal

    samples = _samples()
    packed = pack_samples(samples, [0, 1])
    logp = packed.fields["behavior_logprobs"].clone().requires_grad_(True)
    tokens, seqs = global_counts(samples)
    runs = {}
    for spec in ("ppo", "examples.custom_loss:cispo"):
        cfg = load_config(None, [f"loss.type={spec}"])
        loss, metrics = microbatch_loss(logp, logp.detach(), packed, cfg.loss, num_tokens=tokens,
                                        num_sequences=seqs)
        runs[spec] = metrics
        assert torch.isfinite(loss)
    assert "train/cispo_weight_mean" in runs["examples.custom_loss:cispo"]
    assert "train/cispo_weight_mean" not in runs["ppo"] and "train/clip_frac_high" in runs["ppo"]
    # the all-zero-advantage sample is skipped only for a loss registered with advantage_factor
    assert len(with_signal(samples, has_kl=False, loss_type="ppo")) == 1
    assert len(with_signal(samples, has_kl=False, loss_type="examples.custom_loss:cispo")) == 1
    with pytest.raises(ConfigError, match="loss.type: module 'no_such_user_module'"):
        with_signal(samples, has_kl=False, loss_type="no_such_user_module:x")


def test_a_loss_of_unknown_form_keeps_every_sample(tmp_path, monkeypatch):
    from agentrl.learner.common import with_signal

    (tmp_path / "my_plain.py").write_text("def entropy_bonus(*args, **kwargs):\n    return None\n")
    monkeypatch.chdir(tmp_path)
    assert len(with_signal(_samples(), has_kl=False, loss_type="my_plain:entropy_bonus")) == 2


def test_the_runtime_env_ships_the_loss_module_and_placement_asks_the_backend(tmp_path, monkeypatch):
    from agentrl.actors.placement import learner_world_size
    from agentrl.actors.runtime_env import build_runtime_env

    monkeypatch.chdir(REPO)
    cfg = load_config(None, ["loss.type=examples.custom_loss:cispo"])
    check_components(cfg)
    assert str(REPO / "examples") in build_runtime_env(cfg).get("py_modules", [])
    (tmp_path / "my_backend.py").write_text(
        "from agentrl.learner.base import register_learner\n\n"
        "@register_learner('ranked', distributed=True)\n"
        "class Ranked:\n    def __init__(self, cfg, **kwargs):\n        self.kwargs = kwargs\n")
    monkeypatch.chdir(tmp_path)
    ranked = load_config(None, ["learner.backend=my_backend:ranked", "learner.num_gpus=3"])
    check_components(ranked)
    assert learner_world_size(ranked) == 3
    assert learner_world_size(load_config(None, ["learner.num_gpus=3"])) == 1  # torch: one actor
    from agentrl.learner.base import build_learner

    assert build_learner(ranked, model_path="m", rank=1).kwargs == {"model_path": "m", "rank": 1}
