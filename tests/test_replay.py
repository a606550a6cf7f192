"""The replay queue as a state machine: the staleness bound holds for every consumed group,
nothing is lost or duplicated, capacity is never exceeded, and (waiting for stragglers) no group
made on current weights is ever dropped, however late it finishes."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentrl.replay.queue import ReplayQueue
from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup


def make_group(gid: int, version: int, length: int = 10) -> TrajectoryGroup:
    t = Trajectory(token_ids=[1] * length, loss_mask=[0] + [1] * (length - 1),
                   behavior_logprobs=[0.0] * length, policy_versions=[-1] + [version] * (length - 1))
    return TrajectoryGroup(task_id=str(gid), trajectories=[t], group_id=gid)


class ReplayMachine(RuleBasedStateMachine):
    wait_for_stragglers = True

    def __init__(self):
        super().__init__()
        self.capacity, self.staleness, self.per_step = 6, 1, 2
        self.q = ReplayQueue(self.capacity, self.staleness, self.per_step, wait_for_stragglers=self.wait_for_stragglers)
        self.learner_version = 0
        self.engine_version = 0
        self.pending: list[int] = []  # admitted groups being generated: their tickets (start version)
        self.lagging_puts = 0  # groups put with tokens older than their admission
        self.next_id = 0
        self.put_ids: set[int] = set()
        self.consumed_ids: list[int] = []

    @precondition(lambda self: self.q.can_admit())
    @rule()
    def admit(self):
        ticket = self.q.admit()
        assert ticket == self.engine_version
        self.pending.append(ticket)

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        start_version = self.pending.pop(i % len(self.pending))
        g = make_group(self.next_id, start_version)
        self.next_id += 1
        self.q.put(g, start_version)
        self.put_ids.add(g.group_id)

    @precondition(lambda self: self.pending)
    @rule(lag=st.integers(0, 5))
    def finish_on_old_weights(self, lag):
        # A group served partly by an engine that lags (e.g. restarted before its refit):
        # admission control alone cannot bound its staleness, the check at consumption must.
        start_version = self.pending.pop()
        g = make_group(self.next_id, max(0, start_version - lag))
        self.next_id += 1
        self.lagging_puts += g.min_version < start_version
        self.q.put(g, start_version)
        self.put_ids.add(g.group_id)

    @precondition(lambda self: self.pending)
    @rule()
    def abandon(self):
        self.q.release(self.pending.pop())

    @precondition(lambda self: self.pending)
    @rule()
    def rollout_actor_dies(self):
        # its groups in flight are lost with it: their slots come back, counted as abandoned
        self.q.abandon(self.pending.pop())

    @rule()
    def learner_step(self):
        batch = self.q.take(self.per_step, self.learner_version)
        if batch is None:
            return
        for g in batch:
            assert self.learner_version - g.min_version <= self.staleness
            self.consumed_ids.append(g.group_id)
        self.learner_version += 1

    @precondition(lambda self: self.engine_version < self.learner_version)
    @rule()
    def refit(self):
        self.engine_version = self.learner_version
        self.q.set_weights_version(self.engine_version)

    @invariant()
    def bounded(self):
        assert len(self.q) + self.q.in_flight <= self.capacity

    @invariant()
    def nothing_lost_or_duplicated(self):
        queued = [g.group_id for g in self.q.queue]
        assert len(set(self.consumed_ids)) == len(self.consumed_ids)
        assert not set(queued) & set(self.consumed_ids)
        assert len(set(queued)) == len(queued)
        # every group put is queued, consumed or dropped as stale (counted)
        assert len(self.put_ids) == len(queued) + len(self.consumed_ids) + self.q.stats.dropped_stale


    @invariant()
    def every_admission_is_accounted_for(self):
        st_ = self.q.stats
        assert st_.abandoned <= st_.released
        assert st_.admitted == st_.put + st_.released + self.q.in_flight

    @invariant()
    def only_lagging_groups_are_dropped(self):
        if self.wait_for_stragglers:
            assert self.q.stats.dropped_stale <= self.lagging_puts


class DroppingReplayMachine(ReplayMachine):
    wait_for_stragglers = False


TestReplayMachine = ReplayMachine.TestCase
TestReplayMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestDroppingReplayMachine = DroppingReplayMachine.TestCase
TestDroppingReplayMachine.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)


def test_sync_mode_admits_exactly_one_batch_per_version():
    q = ReplayQueue(capacity=8, max_staleness=0, groups_per_step=2)
    a, b = q.admit(), q.admit()
    assert not q.can_admit()
    q.put(make_group(0, 0), a); q.put(make_group(1, 0), b)
    assert [g.group_id for g in q.take(2, 0)] == [0, 1]
    assert not q.can_admit()  # the learner stepped, the engines have not been refit yet
    q.set_weights_version(1)
    assert q.can_admit()


def test_stale_groups_are_dropped_and_counted():
    q = ReplayQueue(capacity=8, max_staleness=1, groups_per_step=1)
    q.put(make_group(0, 0), q.admit())
    q.put(make_group(1, 2), q.admit())
    assert [g.group_id for g in q.take(1, 2)] == [1]
    assert q.stats.dropped_stale == 1


@pytest.mark.parametrize("wait", [True, False])
def test_a_straggler_is_waited_for_not_dropped(wait):
    q = ReplayQueue(capacity=8, max_staleness=1, groups_per_step=1, wait_for_stragglers=wait)
    long_episode = q.admit()  # admitted under version 0, still running
    q.put(make_group(1, 0), q.admit())
    assert [g.group_id for g in q.take(1, 0)] == [1]  # step 0 -> 1: the straggler stays within the bound
    q.set_weights_version(1)
    q.put(make_group(2, 1), q.admit())
    # Step 1 -> 2 would leave the straggler (version 0) two steps behind: over the bound of 1.
    if wait:
        assert q.straggling(1) == 1 and q.take(1, 1) is None
        q.put(make_group(0, 0), long_episode)
        assert [g.group_id for g in q.take(1, 1)] == [0]  # oldest weights first
        assert q.stats.dropped_stale == 0
    else:
        assert [g.group_id for g in q.take(1, 1)] == [2]
        q.put(make_group(0, 0), long_episode)
        assert q.take(1, 2) is None and q.stats.dropped_stale == 1


def test_tickets_must_match_an_admission():
    q = ReplayQueue(capacity=4, max_staleness=1, groups_per_step=1)
    with pytest.raises(RuntimeError, match="without a matching admit"):
        q.put(make_group(0, 0), 0)
    t = q.admit()
    with pytest.raises(RuntimeError, match="without a matching admit"):
        q.release(t + 1)
    q.release(t)
    assert q.in_flight == 0 and q.stats.released == 1


def test_capacity_must_hold_a_batch():
    with pytest.raises(ValueError, match="replay.capacity"):
        ReplayQueue(capacity=1, max_staleness=0, groups_per_step=2)


def test_state_roundtrip():
    q = ReplayQueue(capacity=8, max_staleness=3, groups_per_step=1)
    for i in range(3):
        q.put(make_group(i, 0), q.admit())
    q.admit()  # in flight: not saved
    q2 = ReplayQueue(capacity=8, max_staleness=3, groups_per_step=1)
    q2.load_state_dict(q.state_dict())
    assert [g.group_id for g in q2.queue] == [0, 1, 2]
    assert q2.in_flight == 0 and q2.stats.admitted == 3
