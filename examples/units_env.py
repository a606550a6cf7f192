"""The README's example environment, `UnitsEnv` (registered as `my/Units-v0`), as a module of
your own project: train on it with `env.id=examples.units_env:my/Units-v0`
(docs/guides/training-your-env.md). Below this docstring the file is the README block, verbatim
(tests/test_own_env.py checks it); importing the module also test-drives the env once.
"""

import gymnasium
from agentrl.rollout.chat import format_tool_call
from agentrl.envs import ToolEnv, tool


class UnitsEnv(ToolEnv):
    def new_task(self, rng, options):  # rng: random.Random seeded from reset(seed=...)
        self.miles = rng.randint(2, 500)
        return [{"role": "user", "content": f"How many km are {self.miles} miles?"}]

    @tool
    def to_km(self, miles: float) -> float:
        """Convert miles to kilometres.

        Args:
            miles: A distance in miles.
        """
        return round(miles * 1.609344, 1)

    def score(self, answer: str) -> float:  # reward in [0, 1]; 1.0 counts as success
        return float(f"{round(self.miles * 1.609344, 1)} km" in answer)


gymnasium.register("my/Units-v0", entry_point=UnitsEnv)
env = gymnasium.make("my/Units-v0", max_turns=4)
messages, info = env.reset(seed=0)  # info["tools"]: schemas for apply_chat_template(tools=...)
obs, reward, terminated, truncated, info = env.step(format_tool_call("to_km", {"miles": env.unwrapped.miles}))
obs, reward, terminated, truncated, info = env.step(f"That is {obs[0]['content']} km.")
assert (reward, terminated, info["success"]) == (1.0, True, True)
