"""On-policy distillation: a teacher scores the student's own samples token by token.

The student (the policy) samples an episode; the teacher's log-probability of every token the
policy sampled, given everything before it (prompt, earlier turns, tool outputs), comes from the
teacher's engine on the student's exact token ids (no retokenization: both must share a
tokenizer). Each policy token ``t`` then gets the per-token advantage

    A_t = coef · (log π_T(y_t | y_<t) − log μ(y_t | y_<t))  +  reward_weight · A_task_t

where μ is the engine that sampled it and ``A_task`` the group-relative task advantage. The first
term is the negated single-sample estimate of the reverse KL ``KL(π‖π_T)`` at that position: with
it as the advantage, the policy-gradient loss's expected gradient is the gradient of the reverse
KL (REINFORCE with a per-token reward, no discounting), so the student moves toward the teacher on
the states it visits itself. Prompt and observation tokens (``loss_mask == 0``) are never scored
into the advantage: in multi-turn episodes only the policy's own tokens are distilled.

With ``distill.top_k = k > 0`` (dense distillation) the teacher also returns its k most likely
tokens ``S_t`` at every policy position with their logprobs, and the advantage's KL term is
replaced by a loss term the learner adds per policy token (:func:`top_k_kl`):

    L_t = coef · KL(q_t ‖ π(·|y_<t)) = coef · Σ_{i∈S_t} q_t(i) · (log q_t(i) − log π(i|y_<t))

where ``q_t = softmax(log π_T(S_t))`` is the teacher's top-k renormalised (zero outside ``S_t``)
and π the student's full softmax. Its gradient in the student's logits is ``coef · (π − q_t)``:
every token of ``S_t`` is pulled toward the teacher's share, every other token down, so the
student learns *which* token the teacher would have written, not only that its own was unlikely.
The states are still the student's own samples (on-policy). This is the forward direction on the
teacher's support (GKD's forward-KL variant), chosen because it names the teacher's tokens; the
reverse direction on the support would ignore student mass outside ``S_t``.

Pure logic on lists; the teacher engines and their actors live in ``agentrl.actors``. Knows
nothing of Ray or vLLM.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.config import ConfigError

if TYPE_CHECKING:
    import torch

    from agentrl.config import DistillConfig
    from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

__all__ = [
    "check_teacher",
    "distill_token_advantages",
    "policy_token_logprobs",
    "reverse_kl_per_token",
    "reverse_kl_summary",
    "score_group",
    "top_k_kl",
]


def policy_token_logprobs(scored: list[float], loss_mask: list[int]) -> list[float]:
    """A teacher's scores of a whole sequence, kept on the policy's tokens only (0.0 elsewhere).

    Example:
        >>> policy_token_logprobs([0.0, -1.0, -2.0, -3.0], [0, 1, 0, 1])
        [0.0, -1.0, 0.0, -3.0]
    """
    if len(scored) != len(loss_mask):
        raise ValueError(f"teacher scored {len(scored)} tokens of a {len(loss_mask)}-token trajectory")
    return [float(s) if m else 0.0 for s, m in zip(scored, loss_mask)]


def reverse_kl_per_token(traj: "Trajectory") -> list[float]:
    """``log μ(y_t) − log π_T(y_t)`` on the policy's tokens, 0.0 elsewhere: the single-sample
    estimate of ``KL(μ‖π_T)`` at each sampled position (its mean over μ's samples is the KL).

    Raises:
        ValueError: the trajectory was not scored by a teacher.
    """
    if traj.teacher_logprobs is None:
        raise ValueError(f"trajectory of task seed {traj.seed} has no teacher_logprobs (distill.teacher is set, "
                         "but nothing scored it)")
    return [b - t if m else 0.0 for b, t, m in zip(traj.behavior_logprobs, traj.teacher_logprobs, traj.loss_mask)]


def distill_token_advantages(
    traj: "Trajectory", task_advantages: list[float], cfg: "DistillConfig"
) -> list[float]:
    """Per-token advantages of one trajectory under distillation:
    ``-coef · reverse_kl_t + reward_weight · task_advantage_t`` on the policy's tokens, 0 elsewhere.

    Example:
        >>> from agentrl.config import DistillConfig
        >>> from agentrl.rollout.trajectory import Trajectory
        >>> t = Trajectory([5, 6, 7], [0, 1, 1], [0.0, -0.5, -2.0], [-1, 0, 0], teacher_logprobs=[0.0, -0.1, -3.0])
        >>> [round(a, 3) for a in distill_token_advantages(t, [0.0, 1.0, 1.0], DistillConfig(teacher="t", reward_weight=0.5))]
        [0.0, 0.9, -0.5]
    """
    if cfg.top_k > 0:  # dense distillation: the KL is a loss term of its own (top_k_kl)
        if traj.teacher_top_ids is None:
            raise ValueError(f"trajectory of task seed {traj.seed} has no teacher top-k (distill.top_k is "
                             f"{cfg.top_k}, but the teacher did not return them)")
        return [cfg.reward_weight * a if m else 0.0 for a, m in zip(task_advantages, traj.loss_mask)]
    kl = reverse_kl_per_token(traj)
    return [(-cfg.coef * k + cfg.reward_weight * a) if m else 0.0
            for k, a, m in zip(kl, task_advantages, traj.loss_mask)]


def top_k_kl(student_logprobs: "torch.Tensor", teacher_logprobs: "torch.Tensor",
             direction: str = "forward") -> "torch.Tensor":
    """Per-position ``KL(q ‖ π)`` with ``q = softmax(teacher_logprobs)`` over the last dim (the
    teacher's top k, renormalised) and ``student_logprobs`` the student's full-vocabulary
    logprobs of the same k ids: ``Σ_i q_i (log q_i − log π_i)`` (>= 0; 0 only when the student
    puts exactly q on those ids). Differentiable in ``student_logprobs``.

    ``direction="reverse"``: ``KL(π ‖ π_T)`` over k + 1 outcomes, the k ids and one bucket for
    every other token: ``Σ_i π_i (log π_i − log π_T,i) + π_rest (log π_rest − log π_T,rest)``,
    ``π_rest = 1 − Σ_i π_i`` (likewise the teacher's, from its unnormalised top-k logprobs;
    both floored at 1e-6 inside the log). It is at most the full reverse KL and equals it when
    the k ids are the whole vocabulary.

    Example:
        >>> import torch
        >>> t = torch.log(torch.tensor([[0.6, 0.2]]))  # renormalised: 0.75, 0.25
        >>> round(float(top_k_kl(torch.log(torch.tensor([[0.75, 0.25]])), t)[0]), 6)
        0.0
        >>> float(top_k_kl(torch.log(torch.tensor([[0.5, 0.1]])), t)[0]) > 0
        True
    """
    import torch

    dtype = torch.promote_types(student_logprobs.dtype, torch.float32)  # float64 stays float64
    s_log, t_log = student_logprobs.to(dtype), teacher_logprobs.to(dtype)
    if direction == "reverse":
        p = s_log.exp()
        p_rest = (1 - p.sum(-1)).clamp(min=0.0)
        q_rest = (1 - t_log.exp().sum(-1)).clamp(min=0.0)
        floor = 1e-6
        return (p * (s_log - t_log)).sum(-1) + p_rest * (p_rest.clamp(min=floor).log() - q_rest.clamp(min=floor).log())
    if direction != "forward":
        raise ValueError(f"top_k_kl: direction must be 'forward' or 'reverse', got {direction!r}")
    q_log = torch.log_softmax(t_log, -1)
    return (q_log.exp() * (q_log - s_log)).sum(-1)


def reverse_kl_summary(groups: "list[TrajectoryGroup]") -> dict[str, float]:
    """``distill/reverse_kl``: the mean per-token reverse-KL estimate over the batch's policy
    tokens (falls as the student approaches the teacher); ``distill/teacher_logprob``: the
    teacher's mean logprob of those tokens. Empty when nothing was scored."""
    kl_sum = lp_sum = 0.0
    n = 0
    for g in groups:
        for t in g.trajectories:
            if t.teacher_logprobs is None or not t.trainable:
                continue
            for b, tl, m in zip(t.behavior_logprobs, t.teacher_logprobs, t.loss_mask):
                if m:
                    kl_sum += b - tl
                    lp_sum += tl
                    n += 1
    return {"distill/reverse_kl": kl_sum / n, "distill/teacher_logprob": lp_sum / n} if n else {}


def _vocab(path: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    return tok.get_vocab() | {"<size>": len(tok)}


def check_teacher(teacher: str, student: str) -> None:
    """Refuse a teacher that is not a model directory or whose tokenizer differs from the
    student's (its scores of the student's token ids would be of other strings).

    Raises:
        ConfigError: naming ``distill.teacher`` and what is wrong.
    """
    path = Path(teacher)
    if not (path / "config.json").is_file():
        raise ConfigError(f"distill.teacher: '{teacher}' is not a Hugging Face model directory (no config.json)")
    if _vocab(path) != _vocab(Path(student)):
        raise ConfigError(f"distill.teacher: '{teacher}' has another tokenizer than the student ('{student}'); "
                          "on-policy distillation scores the student's own token ids, so both must share one")


async def score_group(group: "TrajectoryGroup", score: "Callable[[list[int]], Awaitable[Any]]") -> None:
    """Have the teacher score every trainable trajectory of ``group`` at once, in place.

    ``score(token_ids)`` returns the teacher's logprob of each token given its prefix (0.0 at
    position 0), as :meth:`agentrl.engine.vllm_engine.VLLMEngine.score` does on the student's
    exact ids; each trajectory keeps them on its policy tokens (``teacher_logprobs``). A dict
    (:meth:`~agentrl.engine.vllm_engine.VLLMEngine.score_top_k`: ``logprobs``, ``top_ids``,
    ``top_logprobs``) also fills ``teacher_top_ids`` / ``teacher_top_logprobs`` on the policy
    tokens (zeros elsewhere).
    """
    import anyio

    async def one(traj: "Trajectory") -> None:
        scored = await score(list(traj.token_ids))
        if isinstance(scored, dict):
            k = len(scored["top_ids"][0]) if scored["top_ids"] else 0
            if len(scored["top_ids"]) != len(traj) or len(scored["top_logprobs"]) != len(traj):
                raise ValueError(f"teacher returned top-k for {len(scored['top_ids'])} of {len(traj)} tokens")
            traj.teacher_top_ids = [list(map(int, r)) if m else [0] * k
                                    for r, m in zip(scored["top_ids"], traj.loss_mask)]
            traj.teacher_top_logprobs = [list(map(float, r)) if m else [0.0] * k
                                         for r, m in zip(scored["top_logprobs"], traj.loss_mask)]
            scored = scored["logprobs"]
        traj.teacher_logprobs = policy_token_logprobs(list(scored), traj.loss_mask)

    async with anyio.create_task_group() as tg:
        for traj in group.trajectories:
            if traj.trainable and traj.num_sampled_tokens:
                tg.start_soon(one, traj)
