"""The Calculator task as a plain OpenAI-tools agent loop, trained through agentrl's agent endpoint.

Nothing here knows agentrl's internals: ``solve`` is an ordinary agent written against the
``openai`` SDK (it would run against any OpenAI-compatible server), ``tasks`` draws word problems
by seed. The config names both (``agent.solve``, ``agent.tasks``); see
``examples/calculator_agent.yaml`` and docs/guides/agent-endpoint.md.
"""

from __future__ import annotations

import json

from agentrl.envs.calculator import CalculatorEnv, evaluate, last_integer

MODEL = "agentrl-policy"  # the endpoint's agent.model_name
SYSTEM = "Solve the problem. Use the calculate tool, then reply: The answer is N."
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": (
                'Numbers with + - * / // % ** and parentheses, e.g. "(37 + 48) * 12".')}},
            "required": ["expression"],
        },
    },
}]
MAX_TURNS = 3


def tasks(seed: int) -> dict:
    """The word problem of ``seed`` and its answer (the same problems as agentrl/Calculator-v0)."""
    env = CalculatorEnv()
    env.reset(seed=seed)
    return {"question": env.question, "answer": env.answer}


def run_tool(name: str, arguments: str) -> str:
    try:
        if name != "calculate":
            raise ValueError(f"unknown tool {name!r}; available: calculate")
        return evaluate(json.loads(arguments)["expression"])
    except Exception as exc:  # the model sees the error and may try again
        return f"Error: {type(exc).__name__}: {exc}"


async def solve(client, task: dict) -> float:
    """Answer one problem with the calculate tool; the reward is 1.0 for the right number."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        message = response.choices[0].message
        if not message.tool_calls:
            return 1.0 if last_integer(message.content or "") == task["answer"] else 0.0
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    return 0.0
