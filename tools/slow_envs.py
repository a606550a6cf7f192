"""Question: what does async training buy when tools are slow?
The env that bench/async_vs_sync.py asks it with: Calculator whose tool calls take a long-tailed simulated latency (lognormal, clipped
to [0.1, 2.0] s), as real tools (search, code execution, APIs) do. Imported by Ray workers through
the id form "tools.slow_envs:SlowCalculator-v0"."""

import random

import anyio
import gymnasium

from agentrl.envs import tool
from agentrl.envs.calculator import CalculatorEnv, evaluate


class SlowCalculatorEnv(CalculatorEnv):
    def __init__(self, *, median_latency_s: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.median_latency_s = median_latency_s
        self._latency_rng = random.Random()

    @tool
    async def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers with + - * / // % ** and parentheses, e.g. "(37 + 48) * 12".
        """
        delay = min(2.0, max(0.1, self._latency_rng.lognormvariate(0.0, 0.9) * self.median_latency_s))
        await anyio.sleep(delay)
        return evaluate(expression)


gymnasium.register(id="SlowCalculator-v0", entry_point=SlowCalculatorEnv)
