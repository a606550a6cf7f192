"""On-policy distillation: the per-token reverse-KL advantage, through the real loss, moves the
student toward the teacher (its expected gradient is the reverse KL's gradient); the per-token KL
the pipeline computes (a vLLM teacher engine scoring the student's own token ids in multi-turn
episodes) agrees with a direct Hugging Face computation, on the policy's tokens only."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.config import AdvantageConfig, ConfigError, DistillConfig, LossConfig
from agentrl.distill import (
    check_teacher,
    distill_token_advantages,
    policy_token_logprobs,
    reverse_kl_per_token,
    reverse_kl_summary,
)
from agentrl.learners.common import build_samples
from agentrl.losses import compute_policy_loss
from agentrl.trajectory import Trajectory, TrajectoryGroup

logit_tables = st.integers(1, 3).flatmap(
    lambda positions: st.integers(2, 6).flatmap(
        lambda vocab: st.tuples(
            *[st.lists(st.floats(-4, 4, allow_nan=False), min_size=positions * vocab, max_size=positions * vocab)
              .map(lambda xs, p=positions, v=vocab: torch.tensor(xs, dtype=torch.float64).reshape(p, v))
              for _ in range(2)])))


def one_token_episode(token: int, behavior: float, teacher: float, reward: float = 0.0) -> Trajectory:
    return Trajectory(token_ids=[0, token], loss_mask=[0, 1], behavior_logprobs=[0.0, behavior],
                      policy_versions=[-1, 0], turn_rewards=[reward], teacher_logprobs=[0.0, teacher])


@settings(max_examples=60, deadline=None)
@given(logit_tables, st.floats(0.1, 2.0), st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]))
def test_the_loss_gradient_is_the_reverse_kl_gradient_in_expectation(tables, coef, aggregation):
    """A tabular student (free logits per state) and a teacher: for every state and every token
    the student may sample there, the real pipeline (build_samples -> compute_policy_loss, on
    policy) gives a loss gradient; weighted by the student's own probability of sampling that
    token, they sum to the gradient of coef * Σ_states KL(π‖π_T), and a small step against it
    brings the student closer to the teacher."""
    student_logits, teacher_logits = tables
    theta = student_logits.clone().requires_grad_(True)
    teacher_lp = torch.log_softmax(teacher_logits, -1)
    num_states, vocab = theta.shape
    cfg = DistillConfig(teacher="t", coef=coef)
    expected = torch.zeros_like(theta)
    for s in range(num_states):
        probs = torch.softmax(theta[s].detach(), -1)
        for y in range(vocab):
            logp = torch.log_softmax(theta[s], -1)[y]
            traj = one_token_episode(y, float(logp.detach()), float(teacher_lp[s, y]))
            (sample,) = build_samples([TrajectoryGroup("t", [traj])], AdvantageConfig(), cfg)
            row = lambda xs: torch.tensor(xs, dtype=torch.float64).reshape(1, -1)  # noqa: E731
            logprobs = torch.stack([torch.zeros((), dtype=torch.float64), logp]).reshape(1, 2)
            loss, _ = compute_policy_loss(
                logprobs, logprobs.detach(), row(sample.behavior_logprobs), row(sample.advantages),
                row(sample.loss_mask) > 0, LossConfig(aggregation=aggregation), num_tokens=1, num_sequences=1)
            (grad,) = torch.autograd.grad(loss, theta)
            expected += probs[y] * grad

    def reverse_kl(logits):
        lp = torch.log_softmax(logits, -1)
        return (lp.exp() * (lp - teacher_lp)).sum()

    (direct,) = torch.autograd.grad(coef * reverse_kl(theta), theta)
    torch.testing.assert_close(expected, direct, atol=1e-9, rtol=1e-7)
    before = float(reverse_kl(theta.detach()))
    if float(direct.norm()) > 1e-6:
        step = 1e-3 / float(direct.norm())
        assert float(reverse_kl(theta.detach() - step * expected)) < before


@given(st.lists(st.tuples(st.booleans(), st.floats(-8, 0), st.floats(-8, 0)), min_size=1, max_size=12),
       st.floats(0.1, 3.0), st.floats(0, 2.0))
def test_advantage_is_the_negated_token_kl_plus_the_weighted_task_advantage(tokens, coef, reward_weight):
    mask = [int(m) for m, _, _ in tokens]
    behavior = [b if m else 0.0 for m, b, _ in tokens]
    traj = Trajectory(token_ids=list(range(len(tokens))), loss_mask=mask, behavior_logprobs=behavior,
                      policy_versions=[0 if m else -1 for m in mask],
                      teacher_logprobs=policy_token_logprobs([t for _, _, t in tokens], mask))
    task = [0.7] * len(tokens)
    adv = distill_token_advantages(traj, task, DistillConfig(teacher="t", coef=coef, reward_weight=reward_weight))
    for (m, b, t), a, k in zip(tokens, adv, reverse_kl_per_token(traj)):
        if m:
            assert math.isclose(k, b - t, abs_tol=1e-12)
            assert math.isclose(a, coef * (t - b) + reward_weight * 0.7, abs_tol=1e-9)
        else:
            assert a == 0.0 and k == 0.0, "a prompt or observation token got a distillation signal"


def test_task_reward_weight_adds_the_group_advantage():
    # Two episodes, rewards 1 and 0: GRPO advantages +1 / -1 (population std), weighted in.
    good, bad = one_token_episode(3, -1.0, -1.0, reward=1.0), one_token_episode(4, -1.0, -1.0, reward=0.0)
    group = [TrajectoryGroup("t", [good, bad])]
    pure = build_samples(group, AdvantageConfig(), DistillConfig(teacher="t"))
    mixed = build_samples(group, AdvantageConfig(), DistillConfig(teacher="t", reward_weight=0.5))
    assert [s.advantages[1] for s in pure] == [0.0, 0.0]  # same logprob as the teacher: no signal
    assert [round(s.advantages[1], 4) for s in mixed] == [0.5, -0.5]
    task_only = build_samples(group, AdvantageConfig())
    assert [round(s.advantages[1], 4) for s in task_only] == [1.0, -1.0]


def test_an_unscored_trajectory_is_a_clear_error():
    t = one_token_episode(3, -1.0, -1.0)
    t.teacher_logprobs = None
    with pytest.raises(ValueError, match="teacher_logprobs"):
        build_samples([TrajectoryGroup("t", [t])], AdvantageConfig(), DistillConfig(teacher="t"))
    with pytest.raises(ValueError, match="entries for"):
        Trajectory([1, 2], [0, 1], [0.0, -1.0], [-1, 0], teacher_logprobs=[0.0])


def test_summary_is_the_mean_token_kl():
    g = TrajectoryGroup("t", [one_token_episode(3, -1.0, -2.0), one_token_episode(4, -0.5, -0.5)])
    assert reverse_kl_summary([g]) == {"distill/reverse_kl": 0.5, "distill/teacher_logprob": -1.25}
    assert reverse_kl_summary([]) == {}


def test_teacher_must_be_a_model_with_the_students_tokenizer(tiny_model_dir, tiny_family_dir, tmp_path):
    with pytest.raises(ConfigError, match="distill.teacher.*no config.json"):
        check_teacher(str(tmp_path), tiny_model_dir)
    with pytest.raises(ConfigError, match="another tokenizer"):
        check_teacher(tiny_family_dir("llama3"), tiny_model_dir)
    check_teacher(tiny_model_dir, tiny_model_dir)


@pytest.mark.slow
def test_teacher_engine_scores_the_students_tokens_in_multi_turn_episodes(tiny_model_dir, tmp_path):
    """Two tiny models (student and a differently seeded teacher) served by real vLLM engine
    actors; multi-turn episodes with tool observations between the turns. The teacher's
    engine-side logprobs of the student's exact token ids, and the per-token reverse KL built from
    them, agree with a direct Hugging Face computation; prompt and observation tokens get none."""
    import anyio
    import gymnasium as gym
    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tests.e2e_envs  # noqa: F401  (registers LongObservation-v0)
    from agentrl.actors.engine import EngineActor
    from agentrl.actors.rollout import Router
    from agentrl.chat import ChatRenderer
    from agentrl.config import EngineConfig, RolloutConfig
    from agentrl.distill import score_group
    from agentrl.rollout import run_group
    from agentrl.tiny import bootstrap_tiny, tiny_corpus

    # other weights, the same tokenizer (trained on the seed-0 corpus, as the student's)
    teacher_dir = str(bootstrap_tiny(tmp_path / "teacher", seed=1, corpus=tiny_corpus(seed=0)))
    check_teacher(teacher_dir, tiny_model_dir)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        student = EngineActor.options(num_cpus=1).remote(tiny_model_dir, EngineConfig(max_model_len=512))
        teacher = EngineActor.options(num_cpus=1).remote(teacher_dir, EngineConfig(max_model_len=513))
        ray.get([student.start.remote(), teacher.start.remote()])
        renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))
        cfg = RolloutConfig(group_size=3, max_turns=3, max_new_tokens=12, temperature=1.0, max_total_tokens=500)

        async def episodes():
            group = await run_group(lambda: gym.make("LongObservation-v0", num_turns=3, words=4), renderer,
                                    Router([student]), seed=0, cfg=cfg, max_model_len=512)
            await score_group(group, lambda ids: teacher.score.remote(ids))
            return group

        group = anyio.run(episodes)
    finally:
        ray.shutdown()

    models = {d: AutoModelForCausalLM.from_pretrained(d).eval() for d in (tiny_model_dir, teacher_dir)}

    def hf(model_dir, ids):
        with torch.no_grad():
            lp = torch.log_softmax(models[model_dir](torch.tensor([ids])).logits[0].double(), -1)
        return [0.0] + [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]

    multi_turn = 0
    for traj in group.trajectories:
        assert traj.status != "failed", traj.info
        mask = traj.loss_mask
        first, last = mask.index(1), len(mask) - 1 - mask[::-1].index(1)
        multi_turn += traj.num_turns >= 2 and 0 in mask[first:last]  # observation tokens between turns
        teacher_ref, student_ref = hf(teacher_dir, traj.token_ids), hf(tiny_model_dir, traj.token_ids)
        kl = reverse_kl_per_token(traj)
        for pos, m in enumerate(mask):
            if not m:
                assert traj.teacher_logprobs[pos] == 0.0 and kl[pos] == 0.0
                continue
            assert abs(traj.teacher_logprobs[pos] - teacher_ref[pos]) < 1e-4, pos
            assert abs(kl[pos] - (student_ref[pos] - teacher_ref[pos])) < 2e-4, pos
        # the teacher is another model: its scores are not the student's
        assert any(abs(k) > 1e-2 for k, m in zip(kl, mask) if m)
    assert multi_turn == len(group.trajectories), "every episode should run its three turns"


def test_config_refuses_a_teacher_ray_cannot_place():
    from pathlib import Path

    from agentrl.config import load_config

    quickstart = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    with pytest.raises(ConfigError, match="cluster.num_cpus"):
        load_config(quickstart, ["distill.teacher=/x"])
    cfg = load_config(quickstart, ["distill.teacher=/x", "cluster.num_cpus=3"])
    assert cfg.distill.enabled and not load_config(None).distill.enabled


@pytest.mark.slow
def test_train_with_a_teacher_and_dynamic_sampling(tiny_model_dir, tmp_path):
    """The trainer end to end: a teacher engine actor beside the student's, two learner steps of
    distillation plus task reward with dynamic sampling; every batch is full and scored, and the
    held-out curve (eval.interval) is logged."""
    from tests.test_pipeline_e2e import e2e_overrides, read_rows, start_ray

    from agentrl.config import load_config
    from agentrl.pipeline import train
    from agentrl.tiny import bootstrap_tiny, tiny_corpus

    teacher = bootstrap_tiny(tmp_path / "teacher", seed=1, corpus=tiny_corpus(seed=0))
    run_dir = tmp_path / "run"
    cfg = load_config(None, e2e_overrides(
        tiny_model_dir, run_dir, f"distill.teacher={teacher}", "distill.reward_weight=1.0", "distill.num_cpus=0",
        "replay.dynamic_sampling=true", "train.num_steps=2", "eval.num_episodes=4", "eval.interval=1"))
    start_ray()
    try:
        train(cfg, progress=False)
    finally:
        import ray

        ray.shutdown()
    rows = read_rows(run_dir)
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["rollout/trajectories"] == cfg.replay.groups_per_step * cfg.rollout.group_size
        assert r["distill/reverse_kl"] != 0.0 and math.isfinite(r["distill/reverse_kl"])
        assert "replay/dynamic_dropped_frac" in r
    assert [r["step"] for r in rows if "eval_step/success" in r] == [1]
