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
from agentrl.learner.distill import (
    check_teacher,
    distill_token_advantages,
    policy_token_logprobs,
    reverse_kl_per_token,
    reverse_kl_summary,
)
from agentrl.learner.common import build_samples
from agentrl.learner.losses import compute_policy_loss
from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

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
@pytest.mark.full  # distillation: the teacher run below
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
    from agentrl.rollout.chat import ChatRenderer
    from agentrl.config import EngineConfig, RolloutConfig
    from agentrl.learner.distill import score_group
    from agentrl.rollout.episode import run_group
    from agentrl.model.tiny import bootstrap_tiny, tiny_corpus

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
            plain = [list(t.teacher_logprobs) for t in group.trajectories]
            await score_group(group, lambda ids: teacher.score_top_k.remote(ids, 5))  # distill.top_k = 5
            return group, plain

        group, plain = anyio.run(episodes)
    finally:
        ray.shutdown()

    models = {d: AutoModelForCausalLM.from_pretrained(d).eval() for d in (tiny_model_dir, teacher_dir)}

    def hf(model_dir, ids, full=False):
        with torch.no_grad():
            lp = torch.log_softmax(models[model_dir](torch.tensor([ids])).logits[0].double(), -1)
        return lp if full else [0.0] + [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]

    multi_turn = 0
    for traj in group.trajectories:
        assert traj.status != "failed", traj.info
        mask = traj.loss_mask
        first, last = mask.index(1), len(mask) - 1 - mask[::-1].index(1)
        multi_turn += traj.num_turns >= 2 and 0 in mask[first:last]  # observation tokens between turns
        teacher_ref, student_ref = hf(teacher_dir, traj.token_ids), hf(tiny_model_dir, traj.token_ids)
        kl = reverse_kl_per_token(traj)
        teacher_full = hf(teacher_dir, traj.token_ids, full=True)
        assert max(abs(a - b) for a, b in zip(plain[group.trajectories.index(traj)], traj.teacher_logprobs)) < 1e-5
        for pos, m in enumerate(mask):
            if not m:
                assert traj.teacher_logprobs[pos] == 0.0 and kl[pos] == 0.0
                assert traj.teacher_top_ids[pos] == [0] * 5 and traj.teacher_top_logprobs[pos] == [0.0] * 5
                continue
            assert abs(traj.teacher_logprobs[pos] - teacher_ref[pos]) < 1e-4, pos
            assert abs(kl[pos] - (student_ref[pos] - teacher_ref[pos])) < 2e-4, pos
            # the teacher's top 5 at this position, most likely first, as Hugging Face ranks them
            ref_lps, ref_ids = teacher_full[pos - 1].topk(5)
            assert traj.teacher_top_ids[pos] == ref_ids.tolist(), pos
            assert max(abs(a - b) for a, b in zip(traj.teacher_top_logprobs[pos], ref_lps.tolist())) < 1e-4, pos
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
# top_k=0 runs the same path without the dense top-k term
@pytest.mark.parametrize("top_k", [pytest.param(0, marks=pytest.mark.full), 3])
def test_train_with_a_teacher_and_dynamic_sampling(tiny_model_dir, tmp_path, top_k):
    """The trainer end to end: a teacher engine actor beside the student's, two learner steps of
    distillation plus task reward with dynamic sampling; every batch is full and scored, and the
    held-out curve (eval.interval) is logged. top_k 3: the teacher returns its top 3 and the
    learner adds the dense top-k KL."""
    from tests.test_pipeline_e2e import e2e_overrides, read_rows, start_ray

    from agentrl.config import load_config
    from agentrl.driver.pipeline import train
    from agentrl.model.tiny import bootstrap_tiny, tiny_corpus

    teacher = bootstrap_tiny(tmp_path / "teacher", seed=1, corpus=tiny_corpus(seed=0))
    run_dir = tmp_path / "run"
    cfg = load_config(None, e2e_overrides(
        tiny_model_dir, run_dir, f"distill.teacher={teacher}", "distill.reward_weight=1.0", "distill.num_cpus=0",
        "replay.dynamic_sampling=true", "train.num_steps=2", "eval.num_episodes=4", "eval.interval=1",
        f"distill.top_k={top_k}"))
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
        if top_k:
            assert r["train/distill_top_k_kl"] > 0 and math.isfinite(r["train/distill_top_k_kl"])
        else:
            assert "train/distill_top_k_kl" not in r
    assert [r["step"] for r in rows if "eval_step/success" in r] == [1]


# ---------------------------------------------------------------------------------------------
# Dense distillation over the teacher's top k (distill.top_k)
# ---------------------------------------------------------------------------------------------


def _top_k_episode(state: int, top_ids: list[int], top_lps: list[float]) -> Trajectory:
    """One policy token in state ``state`` (the token id names the state); the teacher's top k there."""
    k = len(top_ids)
    return Trajectory(token_ids=[0, state], loss_mask=[0, 1], behavior_logprobs=[0.0, -1.0],
                      policy_versions=[-1, 0], turn_rewards=[0.0], teacher_logprobs=[0.0, top_lps[0]],
                      teacher_top_ids=[[0] * k, top_ids], teacher_top_logprobs=[[0.0] * k, top_lps])


@settings(max_examples=80, deadline=None)
@given(logit_tables, st.floats(0.1, 2.0), st.integers(1, 6),
       st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]),
       st.sampled_from(["forward", "reverse"]))
def test_dense_top_k_loss_is_the_top_k_kl_and_pulls_the_student_to_the_teacher(tables, coef, k, aggregation,
                                                                                 direction):
    """A tabular student (free logits per state), a teacher, its top k per state: the real path
    (build_samples -> pack_samples -> microbatch_loss with the student's logprobs of the teacher's
    ids) gives coef * mean_states KL, computed here directly: forward, KL(q_k || student) with
    q_k the teacher's renormalised top k, whose gradient in the logits is
    coef * (student - q_k) / states; reverse, KL(student || teacher) over the k ids and one
    bucket for the rest. A small step against the gradient lowers that KL, and with k = vocab
    the full KL of that direction too."""
    from agentrl.learner.common import microbatch_loss, pack_samples

    student_logits, teacher_logits = tables
    num_states, vocab = student_logits.shape
    k = min(k, vocab)
    teacher_lp = torch.log_softmax(teacher_logits, -1)
    top_lps, top_ids = teacher_lp.topk(k, dim=-1)
    q = torch.softmax(top_lps, -1)  # renormalised over the k
    episodes = [_top_k_episode(s, top_ids[s].tolist(), top_lps[s].tolist()) for s in range(num_states)]
    cfg = DistillConfig(teacher="t", coef=coef, top_k=k, top_k_direction=direction)
    samples = build_samples([TrajectoryGroup("t", episodes)], AdvantageConfig(), cfg)
    assert all(a == 0.0 for s in samples for a in s.advantages), "top_k > 0 leaves no sampled-estimate advantage"
    packed = pack_samples(samples, list(range(len(samples))))
    assert packed.fields["teacher_top_ids"].shape == (1, 2 * num_states, k)

    def loss_of(theta):
        lp = torch.log_softmax(theta, -1)  # [states, vocab]
        flat_lp = torch.zeros(2 * num_states, dtype=lp.dtype)
        flat_top = torch.zeros(2 * num_states, k, dtype=lp.dtype)
        ids = packed.fields["teacher_top_ids"][0].long()
        for row, s in enumerate(packed.indices):  # policy token at 2*row+1 is in state s
            flat_lp = flat_lp.index_put((torch.tensor([2 * row + 1]),), lp[s, s % vocab].reshape(1))
            flat_top = flat_top.index_put((torch.tensor([2 * row + 1]),), lp[s, ids[2 * row + 1]].reshape(1, k))
        loss, metrics = microbatch_loss(flat_lp, flat_lp.detach(), packed, LossConfig(aggregation=aggregation),
                                        num_tokens=num_states, num_sequences=num_states,
                                        top_k_logprobs=flat_top, distill_coef=coef, distill_direction=direction)
        return loss, metrics

    def direct_kl(theta):
        lp = torch.log_softmax(theta, -1).gather(1, top_ids)
        if direction == "forward":
            return (q * (q.log() - lp)).sum(-1)  # [states]
        p_rest = (1 - lp.exp().sum(-1)).clamp(min=0)
        t_rest = (1 - top_lps.exp().sum(-1)).clamp(min=0)
        rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp(min=1e-6).log() - t_rest.clamp(min=1e-6).log()), 0.0)
        return (lp.exp() * (lp - top_lps)).sum(-1) + rest

    def full_kl(logits):
        lp = torch.log_softmax(logits, -1)
        if direction == "forward":
            return (teacher_lp.exp() * (teacher_lp - lp)).sum()
        return (lp.exp() * (lp - teacher_lp)).sum()

    theta = student_logits.clone().requires_grad_(True)
    loss, metrics = loss_of(theta)
    per_state = direct_kl(theta.detach())
    # the packed teacher logprobs are float32, as in the learner
    torch.testing.assert_close(float(loss.detach()), coef * float(per_state.mean()), atol=1e-6, rtol=1e-5)
    # float32 as the loss (a sum of differences of logprobs: Hypothesis found 4.5e-6 relative at 1e-6)
    torch.testing.assert_close(float(metrics["train/distill_top_k_kl"]), float(per_state.mean()),
                               atol=1e-6, rtol=1e-5)
    (grad,) = torch.autograd.grad(loss, theta)
    if direction == "forward":
        target = torch.zeros_like(theta).scatter(1, top_ids, q)
        torch.testing.assert_close(grad, coef * (torch.softmax(theta.detach(), -1) - target) / num_states,
                                   atol=1e-6, rtol=1e-5)
    else:
        direct_theta = student_logits.clone().requires_grad_(True)
        (want,) = torch.autograd.grad(coef * direct_kl(direct_theta).mean(), direct_theta)
        torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-4)
    if k == vocab:
        torch.testing.assert_close(float(per_state.sum()), float(full_kl(theta.detach())), atol=1e-5, rtol=1e-5)
    if float(grad.norm()) > 1e-4:
        stepped = theta.detach() - 1e-3 / float(grad.norm()) * grad
        assert float(direct_kl(stepped).sum()) < float(per_state.sum())
        if k == vocab:
            assert float(full_kl(stepped)) < float(full_kl(theta.detach()))


def test_top_k_needs_the_teachers_top_k_and_consistent_rows():
    t = one_token_episode(3, -1.0, -1.0)
    with pytest.raises(ValueError, match="top-k"):
        build_samples([TrajectoryGroup("t", [t])], AdvantageConfig(), DistillConfig(teacher="t", top_k=2))
    with pytest.raises(ValueError, match="come together"):
        Trajectory([1, 2], [0, 1], [0.0, -1.0], [-1, 0], teacher_top_ids=[[0], [1]])
    with pytest.raises(ValueError, match="differ in length"):
        Trajectory([1, 2], [0, 1], [0.0, -1.0], [-1, 0], teacher_top_ids=[[0], [1, 2]],
                   teacher_top_logprobs=[[0.0], [-1.0, -2.0]])
    with pytest.raises(ValueError, match="entries for 2 tokens"):
        Trajectory([1, 2], [0, 1], [0.0, -1.0], [-1, 0], teacher_top_ids=[[1]], teacher_top_logprobs=[[-1.0]])


def test_config_top_k_is_bounded_and_torch_only():
    from pydantic import ValidationError

    from agentrl.config import load_config

    with pytest.raises(ValidationError, match="top_k"):
        DistillConfig(teacher="t", top_k=21)
    with pytest.raises((ConfigError, ValueError), match="learner.backend=torch"):
        load_config(None, ["distill.teacher=/x", "distill.top_k=4", "learner.backend=megatron"])
    assert load_config(None, ["distill.teacher=/x", "distill.top_k=4"]).distill.top_k == 4


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.integers(2, 12), st.integers(1, 5), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_chunked_logprobs_of_k_ids_per_row_match_log_softmax_and_its_gradient(rows, vocab, k, chunk, seed):
    """The learner scores the sampled token and the teacher's top k in one pass: chunked_logprobs
    with [T, K] targets (duplicates allowed) equals log_softmax(...).gather, value and gradient."""
    from agentrl.learner.hf_forward import chunked_logprobs

    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, vocab, (rows, k), generator=g)
    up = torch.randn(rows, k, generator=g, dtype=torch.float64)
    out = chunked_logprobs(h, w, y, temperature=0.7, chunk_size=chunk)
    ref = torch.log_softmax(h @ w.T / 0.7, -1).gather(1, y)
    torch.testing.assert_close(out, ref)
    got = torch.autograd.grad((out * up).sum(), (h, w))
    want = torch.autograd.grad((ref * up).sum(), (h, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_a_learner_step_of_dense_distillation_lowers_the_top_k_kl(tiny_model_dir, tmp_path, direction):
    """The torch learner end to end on the tiny model, packed micro-batches: episodes whose
    policy tokens carry a teacher's top k (another tiny model, scored in Hugging Face); with no
    task reward every step trains, and the top-k KL it reports falls over a few steps."""
    import random

    from transformers import AutoModelForCausalLM

    from agentrl.config import Config
    from agentrl.learner.torch_learner import TorchLearner
    from agentrl.model.tiny import bootstrap_tiny, tiny_corpus

    teacher_dir = bootstrap_tiny(tmp_path / "teacher", seed=1, corpus=tiny_corpus(seed=0))
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir)).eval()
    rng = random.Random(0)
    k = 4
    episodes = []
    for _ in range(6):
        prompt, sampled = rng.randint(5, 12), rng.randint(5, 12)
        ids = [rng.randrange(20, 200) for _ in range(prompt + sampled)]
        mask = [0] * prompt + [1] * sampled
        with torch.no_grad():
            lp = torch.log_softmax(teacher(torch.tensor([ids])).logits[0].double(), -1)
        top_lps, top_ids = lp.topk(k, -1)
        episodes.append(Trajectory(
            token_ids=ids, loss_mask=mask, behavior_logprobs=[-3.0 * m for m in mask],
            policy_versions=[0 if m else -1 for m in mask], turn_spans=[(prompt, prompt + sampled)],
            turn_rewards=[0.0], teacher_logprobs=[float(lp[i - 1, ids[i]]) if m and i else 0.0
                                                  for i, m in enumerate(mask)],
            teacher_top_ids=[top_ids[i - 1].tolist() if m else [0] * k for i, m in enumerate(mask)],
            teacher_top_logprobs=[top_lps[i - 1].tolist() if m else [0.0] * k for i, m in enumerate(mask)]))
    cfg = Config.model_validate({"model": {"path": tiny_model_dir}, "learner": {"lr": 3e-3},
                                 "distill": {"teacher": str(teacher_dir), "top_k": k, "top_k_direction": direction},
                                 "packing": {"max_tokens_per_microbatch": 64}, "rollout": {"max_total_tokens": 64},
                                 "engine": {"max_model_len": 64}})
    learner = TorchLearner(cfg)
    kls = []
    for _ in range(4):
        out = learner.train_step([TrajectoryGroup("a", episodes[:3]), TrajectoryGroup("b", episodes[3:])])
        assert out["train/optimizer_stepped"] == 1.0 and out["train/num_sequences_trained"] == 6.0
        assert out["train/num_microbatches"] > 1
        kls.append(out["train/distill_top_k_kl"])
    # two near-uniform random models: the reverse KL over the top 4 and the rest starts small
    assert kls[0] > (0.05 if direction == "forward" else 5e-4) and kls[-1] < 0.8 * kls[0], kls
