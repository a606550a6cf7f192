"""Trajectories as the learner sees them: exactly the tokens the policy produced, plus what the
off-policy correction needs (behaviour logprobs and the weight version of every sampled token)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["Trajectory", "TrajectoryGroup", "Status"]

Status = Literal["ok", "truncated", "failed"]


@dataclass
class Trajectory:
    """One episode as a flat token sequence.

    All per-token lists have the same length. Prompt and observation tokens have
    ``loss_mask == 0``, ``behavior_logprobs == 0.0`` and ``policy_versions == -1``; tokens the
    engine sampled have ``loss_mask == 1``, the engine's logprob and the weight version that made
    them. ``turn_spans`` gives the ``[start, end)`` token range of each assistant turn, and
    ``turn_rewards`` the reward the env returned after that turn.
    """

    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    policy_versions: list[int]
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    status: Status = "ok"
    env_id: str = ""
    seed: int = 0
    num_tool_calls: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: the teacher's logprob of each policy token given its prefix (0.0 on
    prompt and observation tokens); None when no teacher scored the episode."""
    teacher_top_ids: list[list[int]] | None = None
    """Dense distillation (``distill.top_k``): the teacher's k most likely token ids at each
    position (the distribution of that token given its prefix), most likely first; k zeros on
    prompt and observation tokens. None when not asked for."""
    teacher_top_logprobs: list[list[float]] | None = None
    """The teacher's logprobs of ``teacher_top_ids`` (unnormalised over the k; 0.0 where the ids
    are padding)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise ValueError(f"teacher_logprobs has {len(self.teacher_logprobs)} entries for {n} tokens")
        if (self.teacher_top_ids is None) != (self.teacher_top_logprobs is None):
            raise ValueError("teacher_top_ids and teacher_top_logprobs come together")
        if self.teacher_top_ids is not None:
            if len(self.teacher_top_ids) != n or len(self.teacher_top_logprobs) != n:
                raise ValueError(f"teacher top-k lists have {len(self.teacher_top_ids)} and "
                                 f"{len(self.teacher_top_logprobs)} entries for {n} tokens")
            if len({len(r) for r in self.teacher_top_ids} | {len(r) for r in self.teacher_top_logprobs}) > 1:
                raise ValueError("teacher top-k rows differ in length")
        if not (len(self.loss_mask) == len(self.behavior_logprobs) == len(self.policy_versions) == n):
            raise ValueError(
                f"per-token lists differ in length: token_ids={n}, loss_mask={len(self.loss_mask)}, "
                f"behavior_logprobs={len(self.behavior_logprobs)}, policy_versions={len(self.policy_versions)}"
            )

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    @property
    def num_sampled_tokens(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def min_version(self) -> int:
        """Oldest weight version among sampled tokens (-1 when nothing was sampled)."""
        sampled = [v for v, m in zip(self.policy_versions, self.loss_mask) if m]
        return min(sampled) if sampled else -1

    @property
    def success(self) -> bool:
        return bool(self.info.get("success", self.reward > 0))

    @property
    def trainable(self) -> bool:
        """Whether the loss and its group's baseline see this trajectory: not failed, and not left
        out by ``rollout.overlong = mask`` (``info["loss_excluded"]``)."""
        return self.status != "failed" and not self.info.get("loss_excluded", False)


@dataclass
class TrajectoryGroup:
    """G episodes of the same task (env id + seed); the unit GRPO normalizes over."""

    task_id: str
    trajectories: list[Trajectory]
    group_id: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def min_version(self) -> int:
        versions = [t.min_version for t in self.trajectories if t.num_sampled_tokens]
        return min(versions) if versions else -1

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.trajectories)

    def trainable(self) -> list[Trajectory]:
        """Trajectories that may be trained on (failed episodes never are, nor overlong ones
        under ``rollout.overlong = mask``)."""
        return [t for t in self.trajectories if t.trainable]
