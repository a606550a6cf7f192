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
