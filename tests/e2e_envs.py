"""A test env whose reward varies even under a random policy, so the e2e test's GRPO advantages
are non-zero and a learner step really moves the weights. Imported by Ray workers through the
gymnasium id form "tests.e2e_envs:SayNumber-v0"."""

import gymnasium

from agentrl.envs.base import TextEnv, Turn


class SayNumberEnv(TextEnv):
    """Reward 1 when the reply contains a digit; two turns."""

    def new_task(self, rng, options):
        return [{"role": "user", "content": f"Say a number, any number ({rng.randint(0, 9)})."}]

    def respond(self, action: str) -> Turn:
        hit = any(c.isdigit() for c in action)
        if hit:
            return Turn([], reward=1.0, terminated=True, success=True)
        return Turn([{"role": "user", "content": "No digit. Try again."}], reward=0.0)


gymnasium.register(id="SayNumber-v0", entry_point=SayNumberEnv)


class LongObservationEnv(TextEnv):
    """Every reply gets back a long tool-style observation (``words`` filler words); the episode
    ends after ``num_turns`` replies, reward 1 when the last one holds a digit. Whatever a random
    policy says, the episode runs all its turns: trajectories of many thousand tokens."""

    def __init__(self, *, num_turns: int = 4, words: int = 2000) -> None:
        super().__init__(max_turns=num_turns)
        self.num_turns_total, self.words = num_turns, words

    def new_task(self, rng, options):
        self.rng = rng
        return [{"role": "user", "content": f"Read {self.num_turns_total - 1} long pages, then say a number."}]

    def respond(self, action: str) -> Turn:
        if self.num_turns >= self.num_turns_total:
            hit = any(c.isdigit() for c in action)
            return Turn([], reward=float(hit), terminated=True, success=hit)
        filler = " ".join(self.rng.choice(("the", "page", "and", "more", "word", "text")) for _ in range(self.words))
        return Turn([{"role": "tool", "content": f"page {self.num_turns}: {filler}"}])


gymnasium.register(id="LongObservation-v0", entry_point=LongObservationEnv)


class ChaosEnv(SayNumberEnv):
    """SayNumber with faults: ``reset`` raises for seeds that ``raise_reset_every`` divides, and
    ``step`` hangs forever (a tool that never returns) with probability ``hang_prob``, or sleeps
    ``delay_s`` (a slow tool, healthy)."""

    def __init__(self, *, raise_reset_every: int = 0, hang_prob: float = 0.0, delay_s: float = 0.0) -> None:
        super().__init__()
        self.raise_reset_every, self.hang_prob, self.delay_s = raise_reset_every, hang_prob, delay_s

    def reset(self, *, seed=None, options=None):
        if self.raise_reset_every and seed is not None and seed % self.raise_reset_every == 0:
            raise RuntimeError(f"chaos: reset of seed {seed} raises")
        return super().reset(seed=seed, options=options)

    def respond(self, action: str) -> Turn:
        import random
        import threading
        import time

        if self.hang_prob and random.random() < self.hang_prob:
            threading.Event().wait()  # never returns
        if self.delay_s:
            time.sleep(random.uniform(0.5, 1.5) * self.delay_s)
        return super().respond(action)


gymnasium.register(id="Chaos-v0", entry_point=ChaosEnv)
