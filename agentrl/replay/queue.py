"""Replay-queue logic: admission control, a hard staleness bound, capacity, batching.

Pure and synchronous, so it can be tested as a state machine; ``agentrl.actors.replay`` wraps it
in an async Ray actor that turns "not now" answers into waiting.

Staleness is counted in learner steps: a group whose oldest sampled token was made by weights of
version ``v`` has staleness ``learner_version - v`` when the learner takes it, and is consumed only
if that is at most ``max_staleness``.

Admission control keeps rollouts from running ahead: a rollout may start a new group only while
``admitted < (weights_version + max_staleness + 1) * groups_per_step``, where ``weights_version``
is the version the engines serve. With FIFO consumption of ``groups_per_step`` groups per step,
the group admitted n-th is consumed at step ``n // groups_per_step``, so its staleness is at most
``max_staleness`` by construction; the per-sample check at consumption catches everything else
(slow refits, in-flight groups that straddle versions). ``max_staleness = 0`` is strictly
on-policy: one batch is generated per weight version.

Long episodes finish late. If the learner kept stepping while one was still running, it would
go over the bound and be dropped, and long episodes would be dropped more often than short ones
(a bias toward short answers). So each admission returns a ticket (the weights version it was
admitted under, a lower bound on its tokens' versions) and, with ``wait_for_stragglers``, the
learner does not take a batch while a group in flight would go over the bound by that step: it
waits for the straggler. Only groups that were already over the bound when admitted (engines
lagging behind a refit) can still be dropped.

Dynamic sampling (DAPO's, ``dynamic_sampling=True``): a group whose raw rewards all tie
(:func:`zero_spread`) has all-zero group-relative advantages and would only dilute its batch. It
is dropped when it is put, and its admission slot is given back as a released one is, so another
group is admitted in its place: batches keep exactly ``groups_per_step`` groups, all with a reward
spread, and a dropped group never holds admission closed. The replacement is admitted under the
weights the engines serve then, so the staleness bound holds as before.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from agentrl.rollout.trajectory import TrajectoryGroup

__all__ = ["DynamicSamplingStalled", "ReplayQueue", "ReplayStats", "raw_reward", "zero_spread"]


class DynamicSamplingStalled(RuntimeError):
    """Dynamic sampling dropped more groups in a row than ``replay.dynamic_sampling_max_dropped``."""


def raw_reward(traj) -> float:
    """The episode's reward as the env gave it (before ``rollout.overlong`` zeroes it)."""
    return float(traj.info.get("raw_reward", traj.reward))


def zero_spread(group: TrajectoryGroup) -> bool:
    """Whether the raw rewards of the group's trainable trajectories all tie (or fewer than two
    are trainable): GRPO/RLOO/Dr. GRPO advantages are then zero for every episode.

    Example:
        >>> from agentrl.rollout.trajectory import Trajectory
        >>> def ep(r): return Trajectory([1, 2], [0, 1], [0.0, -1.0], [-1, 0], turn_rewards=[r])
        >>> zero_spread(TrajectoryGroup("t", [ep(1.0), ep(1.0)])), zero_spread(TrajectoryGroup("t", [ep(1.0), ep(0.0)]))
        (True, False)
    """
    rewards = {raw_reward(t) for t in group.trajectories if t.trainable}
    return len(rewards) <= 1 if len(group.trainable()) >= 2 else True


@dataclass
class ReplayStats:
    admitted: int = 0
    put: int = 0
    consumed: int = 0
    dropped_stale: int = 0
    released: int = 0
    abandoned: int = 0  # of the released: slots of a rollout actor that died with its groups in flight
    dynamic_dropped: int = 0  # groups dropped by dynamic sampling (raw rewards tie)
    dynamic_dropped_trajectories: int = 0
    dynamic_dropped_since_take: int = 0
    # Length histograms (tokens, bucketed by 256) of generated and consumed trajectories, so a
    # bias against long episodes shows up.
    generated_lengths: Counter = field(default_factory=Counter)
    consumed_lengths: Counter = field(default_factory=Counter)


class ReplayQueue:
    """Bounded FIFO of trajectory groups with a staleness bound.

    Args:
        capacity: groups held at most; ``can_put`` is False when full (backpressure).
        max_staleness: learner steps a consumed token may lag behind.
        groups_per_step: groups in one learner batch.
        wait_for_stragglers: ``take`` waits for an in-flight group that its step would make stale,
            instead of dropping that group later.
        task_order: a batch lists its groups by ``group_id`` (the task seed) rather than by arrival
            (``train.deterministic``: the order of arrival depends on timing).
        dynamic_sampling: drop groups whose raw rewards tie when they are put.
        dynamic_sampling_max_dropped: ``take`` raises :class:`DynamicSamplingStalled` once this
            many groups were dropped since the last batch.
    """

    def __init__(self, capacity: int, max_staleness: int, groups_per_step: int, *,
                 wait_for_stragglers: bool = True, task_order: bool = False, dynamic_sampling: bool = False,
                 dynamic_sampling_max_dropped: int = 512) -> None:
        if capacity < groups_per_step:
            raise ValueError(
                f"replay.capacity ({capacity}) must hold at least one batch (replay.groups_per_step = {groups_per_step})"
            )
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self.wait_for_stragglers = wait_for_stragglers
        self.task_order = task_order
        self.dynamic_sampling = dynamic_sampling
        self.dynamic_sampling_max_dropped = dynamic_sampling_max_dropped
        self.weights_version = 0
        self.tickets: Counter[int] = Counter()  # in-flight groups by the version they were admitted under
        self.queue: deque[TrajectoryGroup] = deque()
        self.stats = ReplayStats()

    # -- rollout side ---------------------------------------------------------------------------
    @property
    def admission_limit(self) -> int:
        return (self.weights_version + self.max_staleness + 1) * self.groups_per_step

    def can_admit(self) -> bool:
        s = self.stats
        # Slots given back (stale, released, dropped by dynamic sampling) are admitted again.
        live = s.admitted - s.dropped_stale - s.released - s.dynamic_dropped
        return live < self.admission_limit and len(self.queue) + self.in_flight < self.capacity

    @property
    def in_flight(self) -> int:
        return sum(self.tickets.values())

    def admit(self) -> int:
        """Reserve a slot for a group about to be generated; returns its ticket for put/release."""
        if not self.can_admit():
            raise RuntimeError("admit() called while admission is closed; check can_admit() first")
        self.stats.admitted += 1
        self.tickets[self.weights_version] += 1
        return self.weights_version

    def _return_ticket(self, ticket: int, what: str) -> None:
        if self.tickets[ticket] <= 0:
            raise RuntimeError(f"{what}(ticket={ticket}) without a matching admit()")
        self.tickets[ticket] -= 1
        if not self.tickets[ticket]:
            del self.tickets[ticket]

    def release(self, ticket: int) -> None:
        """Give back a slot whose group was abandoned (engine died, shutdown)."""
        self._return_ticket(ticket, "release")
        self.stats.released += 1

    def abandon(self, ticket: int) -> None:
        """Give back the slot of a group lost with the rollout actor that was making it (counted
        apart, as ``replay/abandoned``: lost work is never silent)."""
        self.release(ticket)
        self.stats.abandoned += 1

    def put(self, group: TrajectoryGroup, ticket: int) -> bool:
        """Add a finished group; it always fits, since admission reserved its place. With dynamic
        sampling a group whose raw rewards tie is dropped instead (its slot is given back);
        returns whether the group was queued."""
        self._return_ticket(ticket, "put")
        for t in group.trajectories:
            self.stats.generated_lengths[len(t) // 256 * 256] += 1
        if self.dynamic_sampling and zero_spread(group):
            self.stats.dynamic_dropped += 1
            self.stats.dynamic_dropped_trajectories += len(group)
            self.stats.dynamic_dropped_since_take += 1
            return False
        self.queue.append(group)
        self.stats.put += 1
        return True

    def set_weights_version(self, version: int) -> None:
        if version < self.weights_version:
            raise ValueError(f"weights version went backwards ({self.weights_version} -> {version})")
        self.weights_version = version

    # -- learner side ---------------------------------------------------------------------------
    def staleness(self, group: TrajectoryGroup, learner_version: int) -> int:
        return learner_version - group.min_version if group.min_version >= 0 else 0

    def straggling(self, learner_version: int) -> int:
        """In-flight groups that a learner step taken now would push over the staleness bound
        (admitted exactly ``max_staleness`` versions ago; older ones are over it anyway)."""
        return self.tickets.get(learner_version - self.max_staleness, 0)

    def take(self, num_groups: int, learner_version: int) -> list[TrajectoryGroup] | None:
        """``num_groups`` groups within the staleness bound, those sampled with the oldest weights
        first, or None if not enough yet (or, with ``wait_for_stragglers``, while a group in
        flight would go stale by this step). Groups over the bound are dropped (counted) and give
        their slot back.

        Raises:
            DynamicSamplingStalled: dynamic sampling dropped ``dynamic_sampling_max_dropped``
                groups since the last batch.
        """
        if self.dynamic_sampling and self.stats.dynamic_dropped_since_take >= self.dynamic_sampling_max_dropped:
            raise DynamicSamplingStalled(
                f"dynamic sampling dropped {self.stats.dynamic_dropped_since_take} groups in a row whose rewards "
                "all tie (the policy solves, or fails, every task it is given); raise "
                "replay.dynamic_sampling_max_dropped, make the tasks harder or easier, or turn "
                "replay.dynamic_sampling off")
        fresh = [g for g in self.queue if self.staleness(g, learner_version) <= self.max_staleness]
        # Drop stale groups now, enough fresh ones or not: they must give their slots back, or
        # admission could stall with a queue full of groups nobody may consume.
        self.stats.dropped_stale += len(self.queue) - len(fresh)
        self.queue = deque(fresh)
        if len(fresh) < num_groups or (self.wait_for_stragglers and self.straggling(learner_version)):
            return None
        # Oldest weights first, not arrival order: a long episode finishes late but started early;
        # taking it before newer short ones keeps it from going stale, so long episodes are not
        # dropped more often than short ones.
        chosen = {id(g) for g in sorted(fresh, key=lambda g: g.min_version)[:num_groups]}
        batch = [g for g in fresh if id(g) in chosen]
        if self.task_order:
            batch.sort(key=lambda g: g.group_id)
        self.queue = deque(g for g in fresh if id(g) not in chosen)
        self.stats.consumed += len(batch)
        self.stats.dynamic_dropped_since_take = 0
        for g in batch:
            for t in g.trajectories:
                self.stats.consumed_lengths[len(t) // 256 * 256] += 1
        return batch

    def __len__(self) -> int:
        return len(self.queue)

    def metrics(self) -> dict[str, float]:
        s = self.stats
        return {
            "replay/size": float(len(self.queue)),
            "replay/in_flight": float(self.in_flight),
            "replay/admitted": float(s.admitted),
            "replay/consumed": float(s.consumed),
            "replay/dropped_stale": float(s.dropped_stale),
            "replay/released": float(s.released),
            "replay/abandoned": float(s.abandoned),
            "replay/put": float(s.put),
            "replay/weights_version": float(self.weights_version),
        } | ({
            "replay/dynamic_dropped": float(s.dynamic_dropped),
            # share of finished groups dropped, and the episodes generated for them (extra rollouts)
            "replay/dynamic_dropped_frac": s.dynamic_dropped / max(s.dynamic_dropped + s.put, 1),
            "replay/dynamic_extra_trajectories": float(s.dynamic_dropped_trajectories),
        } if self.dynamic_sampling else {})

    # -- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: queued groups and counters (in-flight slots are not
        saved; their groups are regenerated after a resume)."""
        s = self.stats
        return {
            "queue": list(self.queue),
            "weights_version": self.weights_version,
            "stats": {
                "admitted": s.admitted - self.in_flight,
                "put": s.put,
                "consumed": s.consumed,
                "dropped_stale": s.dropped_stale,
                "released": s.released,
                "abandoned": s.abandoned,
                "dynamic_dropped": s.dynamic_dropped,
                "dynamic_dropped_trajectories": s.dynamic_dropped_trajectories,
                "generated_lengths": dict(s.generated_lengths),
                "consumed_lengths": dict(s.consumed_lengths),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.queue = deque(state["queue"])
        self.weights_version = int(state["weights_version"])
        st = state["stats"]
        self.stats = ReplayStats(
            admitted=st["admitted"], put=st["put"], consumed=st["consumed"], dropped_stale=st["dropped_stale"],
            released=st["released"], abandoned=st.get("abandoned", 0), dynamic_dropped=st.get("dynamic_dropped", 0),
            dynamic_dropped_trajectories=st.get("dynamic_dropped_trajectories", 0),
            generated_lengths=Counter(st["generated_lengths"]),
            consumed_lengths=Counter(st["consumed_lengths"]),
        )
        self.tickets = Counter()
