"""Dynamic sampling (replay.dynamic_sampling): the replay queue as a state machine again, now with
groups whose raw rewards tie or not. No zero-spread group is ever trained, every batch has exactly
groups_per_step groups, nothing but zero-spread groups is dropped by the filter, the staleness
bound still holds, and a dropped group never holds admission closed."""

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentrl.config import ConfigError, load_config
from agentrl.replay.queue import DynamicSamplingStalled, ReplayQueue, raw_reward, zero_spread
from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup


def episode(version: int, reward: float, *, raw: float | None = None, status: str = "ok") -> Trajectory:
    info = {} if raw is None else {"raw_reward": raw}
    return Trajectory(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], behavior_logprobs=[0.0, -1.0, -1.0],
                      policy_versions=[-1, version, version], turn_rewards=[reward], status=status, info=info)


def group_of(gid: int, version: int, rewards: list[float]) -> TrajectoryGroup:
    return TrajectoryGroup(task_id=str(gid), trajectories=[episode(version, r) for r in rewards], group_id=gid)


rewards_of_a_group = st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=2, max_size=4)


class DynamicReplayMachine(RuleBasedStateMachine):
    """Rollouts admit, finish (on current or lagging weights) or abandon groups; the learner takes
    batches; refits move the engines on. Groups tie about half of the time."""

    def __init__(self):
        super().__init__()
        self.capacity, self.staleness, self.per_step = 6, 1, 2
        self.q = ReplayQueue(self.capacity, self.staleness, self.per_step, dynamic_sampling=True,
                             dynamic_sampling_max_dropped=10**9)
        self.learner_version = self.engine_version = 0
        self.pending: list[int] = []
        self.next_id = 0
        self.put: dict[int, TrajectoryGroup] = {}
        self.filtered_ids: list[int] = []
        self.consumed_ids: list[int] = []

    def _finish(self, ticket: int, version: int, rewards: list[float]) -> None:
        g = group_of(self.next_id, version, rewards)
        self.next_id += 1
        self.put[g.group_id] = g
        queued = self.q.put(g, ticket)
        assert queued == (len(set(rewards)) > 1), "the filter must drop exactly the groups whose rewards tie"
        if not queued:
            self.filtered_ids.append(g.group_id)

    @precondition(lambda self: self.q.can_admit())
    @rule()
    def admit(self):
        self.pending.append(self.q.admit())

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 100), tie=st.booleans(), rewards=rewards_of_a_group)
    def finish(self, i, tie, rewards):
        ticket = self.pending.pop(i % len(self.pending))
        self._finish(ticket, ticket, [rewards[0]] * len(rewards) if tie else rewards)

    @precondition(lambda self: self.pending)
    @rule(lag=st.integers(0, 3), rewards=rewards_of_a_group)
    def finish_on_old_weights(self, lag, rewards):
        ticket = self.pending.pop()
        self._finish(ticket, max(0, ticket - lag), rewards)

    @precondition(lambda self: self.pending)
    @rule()
    def abandon(self):
        self.q.release(self.pending.pop())

    @rule()
    def learner_step(self):
        batch = self.q.take(self.per_step, self.learner_version)
        if batch is None:
            return
        assert len(batch) == self.per_step, "a batch must have exactly groups_per_step groups"
        for g in batch:
            assert not zero_spread(g), "a zero-spread group reached the learner"
            assert self.learner_version - g.min_version <= self.staleness
            self.consumed_ids.append(g.group_id)
        self.learner_version += 1

    @precondition(lambda self: self.engine_version < self.learner_version)
    @rule()
    def refit(self):
        self.engine_version = self.learner_version
        self.q.set_weights_version(self.engine_version)

    @invariant()
    def accounting(self):
        queued = [g.group_id for g in self.q.queue]
        assert len(set(self.consumed_ids)) == len(self.consumed_ids)
        assert not set(queued) & set(self.consumed_ids)
        s = self.q.stats
        # every group put is queued, consumed, dropped as stale or dropped by the filter: nothing else
        assert len(self.put) == len(queued) + len(self.consumed_ids) + s.dropped_stale + s.dynamic_dropped
        assert s.dynamic_dropped == len(self.filtered_ids)
        assert all(zero_spread(self.put[i]) for i in self.filtered_ids)
        assert len(self.q) + self.q.in_flight <= self.capacity

    @invariant()
    def a_dropped_group_never_blocks_admission(self):
        # Engines on the learner's weights, nothing in flight, not a batch queued: a rollout must be
        # able to start a group, or the run would wait forever.
        if self.engine_version == self.learner_version and not self.pending and len(self.q) < self.per_step:
            assert self.q.can_admit()


TestDynamicReplayMachine = DynamicReplayMachine.TestCase
TestDynamicReplayMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


@given(st.lists(st.floats(-2, 2, allow_nan=False), min_size=0, max_size=6))
def test_zero_spread_is_a_tie_of_raw_rewards(rewards):
    g = group_of(0, 0, rewards)
    assert zero_spread(g) == (len(set(rewards)) <= 1)


@given(rewards_of_a_group, st.integers(0, 3))
def test_the_filter_reads_raw_rewards_not_shaped_ones(raw, cut):
    # rollout.overlong = zero_reward sets an overlong episode's rewards to 0 and keeps the env's in
    # info["raw_reward"]: the filter must judge the env's rewards (NeMo-RL once used the shaped ones).
    trajs = [episode(0, 0.0 if i == cut % len(raw) else r, raw=r) for i, r in enumerate(raw)]
    g = TrajectoryGroup("t", trajs)
    assert [raw_reward(t) for t in trajs] == raw
    assert zero_spread(g) == (len(set(raw)) <= 1)


def test_failed_episodes_take_no_part_and_a_lone_episode_ties():
    g = TrajectoryGroup("t", [episode(0, 1.0), episode(0, 0.0, status="failed"), episode(0, 1.0)])
    assert zero_spread(g)
    assert zero_spread(TrajectoryGroup("t", [episode(0, 1.0), episode(0, 0.0, status="failed")]))
    assert not zero_spread(TrajectoryGroup("t", [episode(0, 1.0), episode(0, 0.0), episode(0, 0.0, status="failed")]))


def test_off_by_default_keeps_tied_groups():
    assert load_config(None).replay.dynamic_sampling is False
    q = ReplayQueue(4, 1, 1)
    assert q.put(group_of(0, 0, [1.0, 1.0]), q.admit())
    assert len(q.take(1, 0)) == 1 and "replay/dynamic_dropped" not in q.metrics()


def test_metrics_count_the_share_dropped_and_the_extra_episodes():
    q = ReplayQueue(8, 1, 2, dynamic_sampling=True)
    for gid, rewards in enumerate([[1, 1, 1], [0, 1, 0], [0, 0, 0], [1, 0, 1]]):
        q.put(group_of(gid, 0, rewards), q.admit())
    m = q.metrics()
    assert m["replay/dynamic_dropped"] == 2 and m["replay/dynamic_dropped_frac"] == 0.5
    assert m["replay/dynamic_extra_trajectories"] == 6
    assert [g.group_id for g in q.take(2, 0)] == [1, 3]
    q2 = ReplayQueue(8, 1, 2, dynamic_sampling=True)
    q2.load_state_dict(q.state_dict())
    assert q2.metrics()["replay/dynamic_dropped"] == 2


def test_sync_mode_generates_until_the_batch_is_full():
    # max_staleness 0 admits one batch per version; dropped groups give their slots back.
    q = ReplayQueue(capacity=4, max_staleness=0, groups_per_step=2, dynamic_sampling=True)
    tickets = [q.admit(), q.admit()]
    assert not q.can_admit()
    q.put(group_of(0, 0, [1, 1]), tickets[0])
    assert q.can_admit(), "the dropped group's slot must be admitted again"
    q.put(group_of(1, 0, [0, 1]), tickets[1])
    q.put(group_of(2, 0, [1, 0]), q.admit())
    assert not q.can_admit()
    assert [g.group_id for g in q.take(2, 0)] == [1, 2]


def test_a_run_where_every_group_ties_stops_with_a_clear_error():
    q = ReplayQueue(capacity=4, max_staleness=1, groups_per_step=1, dynamic_sampling=True,
                    dynamic_sampling_max_dropped=3)
    for gid in range(3):
        q.put(group_of(gid, 0, [1, 1]), q.admit())
    with pytest.raises(DynamicSamplingStalled, match="replay.dynamic_sampling_max_dropped"):
        q.take(1, 0)


def test_the_actor_wakes_a_waiting_admission_when_it_drops_a_group():
    # The Ray actor's logic without Ray: the class under @ray.remote, driven by asyncio.
    from agentrl.actors.replay import ReplayActor

    actor = ReplayActor.__ray_metadata__.modified_class(2, 0, 1, dynamic_sampling=True)

    async def run():
        ticket = await actor.admit()
        waiting = asyncio.ensure_future(actor.admit())  # closed: one group per version, in flight
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert await actor.put(group_of(0, 0, [1, 1]), ticket) is False
        second = await asyncio.wait_for(waiting, 1.0)
        assert await actor.put(group_of(1, 0, [0, 1]), second) is True
        return await asyncio.wait_for(actor.take(1, 0), 1.0)

    assert [g.group_id for g in asyncio.run(run())] == [1]


def test_config_refuses_combinations_without_effect():
    with pytest.raises(ConfigError, match="group_size"):
        load_config(None, ["replay.dynamic_sampling=true", "rollout.group_size=1"])
    with pytest.raises(ConfigError, match="distill.reward_weight"):
        load_config(None, ["replay.dynamic_sampling=true", "distill.teacher=/x"])
    cfg = load_config(None, ["replay.dynamic_sampling=true", "distill.teacher=/x", "distill.reward_weight=1"])
    assert cfg.replay.dynamic_sampling and cfg.distill.enabled


def test_the_episode_loop_keeps_the_envs_reward_when_overlong_zeroes_it(tiny_model_dir):
    """rollout.overlong = zero_reward: an episode paid 1.0 on its first turn, then cut by the token
    cap on its second, trains as reward 0, but the filter sees the 1.0 the env gave."""
    import anyio
    from transformers import AutoTokenizer

    from agentrl.rollout.chat import ChatRenderer
    from agentrl.config import RolloutConfig
    from agentrl.envs.base import TextEnv, Turn
    from agentrl.rollout.episode import run_episode
    from tests.test_rollout_families import ScriptedEngine

    class PaysThenTalks(TextEnv):
        def new_task(self, rng, options):
            return [{"role": "user", "content": "Say something."}]

        def respond(self, action: str) -> Turn:
            return Turn([{"role": "user", "content": "More."}], reward=1.0)

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    reply = renderer.encode("ok") + [renderer.end_of_turn_id]
    prompt = len(renderer.prompt_ids([{"role": "user", "content": "Say something."}], None))
    # room for the first reply and its observation, not for the second reply
    cap = prompt + len(reply) + len(renderer.observation_delta_ids([{"role": "user", "content": "More."}])) + 2
    cfg = RolloutConfig(max_turns=3, max_new_tokens=8, max_total_tokens=cap, overlong="zero_reward")
    traj = anyio.run(lambda: run_episode(PaysThenTalks(max_turns=3), renderer, ScriptedEngine([reply, [7] * 8]),
                                         seed=0, cfg=cfg, episode_id="e"))
    assert traj.info["truncated_by"] == "tokens" and traj.reward == 0.0
    assert raw_reward(traj) == 1.0
