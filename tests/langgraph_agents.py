"""A LangGraph agent (langgraph + langchain-openai's ChatOpenAI), written as a user of that
framework would: a model node and LangGraph's ToolNode in a loop. Named in tests as
``tests.langgraph_agents:solve``."""

from __future__ import annotations

from agentrl.envs.calculator import evaluate, last_integer
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition


@tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers with + - * / // % ** and parentheses."""
    return evaluate(expression)


async def solve(client, task: dict) -> float:
    """LangGraph builds its own client from the episode's base URL and key."""
    llm = ChatOpenAI(model="agentrl-policy", base_url=str(client.base_url), api_key=client.api_key,
                     max_retries=0).bind_tools([calculate])

    async def model(state: MessagesState) -> dict:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", model)
    graph.add_node("tools", ToolNode([calculate]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    out = await graph.compile().ainvoke(
        {"messages": [("system", "Solve the problem with the calculate tool."), ("user", task["question"])]},
        {"recursion_limit": 12})
    return 1.0 if last_integer(str(out["messages"][-1].content)) == task["answer"] else 0.5
