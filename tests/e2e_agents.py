"""Agents for the end-to-end tests, written with the OpenAI Agents SDK (``openai-agents``) and its
Chat Completions model, as a user of that framework would; named in configs as
``tests.e2e_agents:solve``."""

from __future__ import annotations

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

from agentrl.envs.calculator import CalculatorEnv, evaluate, last_integer

set_tracing_disabled(True)  # the SDK's tracing exports to OpenAI's servers


@function_tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses.
    """
    return evaluate(expression)


def tasks(seed: int) -> dict:
    env = CalculatorEnv()
    env.reset(seed=seed)
    return {"question": env.question, "answer": env.answer}


async def _run(client, task: dict, *, stream: bool) -> float:
    agent = Agent(
        name="calculator",
        instructions="Solve the problem. Use the calculate tool, then reply: The answer is N.",
        tools=[calculate],
        model=OpenAIChatCompletionsModel(model="agentrl-policy", openai_client=client),
        model_settings=ModelSettings(max_tokens=24),
    )
    if stream:  # server-sent events, as the SDK's streamed runs make them
        result = Runner.run_streamed(agent, task["question"], max_turns=2)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, task["question"], max_turns=2)
    text = str(result.final_output or "")
    return 1.0 if last_integer(text) == task["answer"] else 0.1 * (len(text) < 40)


async def solve(client, task: dict) -> float:
    """An Agents SDK agent with one tool; reward 1 for the right answer, else a small reward for
    a short reply (a random tiny policy still gets varied rewards, so GRPO has a signal)."""
    return await _run(client, task, stream=False)


async def solve_streamed(client, task: dict) -> float:
    """The same agent, run with streaming (server-sent events)."""
    return await _run(client, task, stream=True)


async def solve_mixed(client, task: dict) -> float:
    """The same agent, streamed on tasks with an odd answer: one run covers both kinds of request."""
    return await _run(client, task, stream=bool(task["answer"] % 2))
