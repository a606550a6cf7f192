"""The peer harness's workload in verl's own extension points (used by `run_verl.py`; needs verl).

verl loads each piece by name from its config, in its own worker processes:
  - `LookupTool` (a `verl.tools.base_tool.BaseTool`, declared in the tool config yaml that
    `rollout.multi_turn.tool_config_path` names): sleeps `latency_s` without blocking the agent
    loop's event loop and answers with the workload's fixed observation;
  - `EveryReplyIsACall` (a `ToolParser`, `rollout.multi_turn.format=harness_every_reply`): a
    random model writes no tool-call syntax, so every reply is parsed into one call of `lookup`
    with the reply's text as its query, as `run_trl.py` tells TRL's tokenizer and agentrl's env
    reads it (bench/peers/common.py);
  - `HarnessToolAgentLoop` / `HarnessSingleTurnAgentLoop` (verl's `ToolAgentLoop` and
    `SingleTurnAgentLoop`, named in the agent loop yaml that `rollout.agent.agent_loop_config_path`
    names): they only set each reply's length (`min_tokens = max_tokens = new_tokens`, verl has no
    per-turn length setting) and hand the model's replies to the reward, decoded from the spans of
    the response mask;
  - `compute_score` (`reward.custom_reward_function`): the shared `reply_reward` of those replies.
Every row of the dataset carries `extra_info = {"new_tokens": N, "texts_file": PATH}`.
"""

from __future__ import annotations

import asyncio
import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

from bench.peers.common import reply_reward

PARSER = "harness_every_reply"


@lru_cache(maxsize=4)
def _texts(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


@ToolParser.register(PARSER)
class EveryReplyIsACall(ToolParser):
    """Any reply is one call of `lookup` whose query is the reply's text."""

    async def extract_tool_calls(self, responses_ids, tools=None):
        text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
        return "", [FunctionCall(name="lookup", arguments=json.dumps({"query": text}))]


class LookupTool(BaseTool):
    """The workload's tool: `config = {"texts_file": PATH, "latency_s": S}`."""

    def __init__(self, config: dict, tool_schema) -> None:
        super().__init__(config, tool_schema)
        self.observation = _texts(config["texts_file"])["observation"]
        self.latency_s = float(config["latency_s"])

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        await asyncio.sleep(self.latency_s)
        return ToolResponse(text=self.observation), 0.0, {}


def model_replies(tokenizer, response_ids: list[int], response_mask: list[int]) -> list[str]:
    """The model's replies: the decoded runs of mask 1 (tool answers and template tokens are 0)."""
    replies, run = [], []
    for tok, m in zip(response_ids, response_mask):
        if m:
            run.append(tok)
        elif run:
            replies.append(run)
            run = []
    if run:
        replies.append(run)
    return [tokenizer.decode(r, skip_special_tokens=True) for r in replies]


class _FixedLength:
    """Mixed into verl's agent loops: every reply is exactly `new_tokens` long; the replies go to the reward."""

    async def run(self, sampling_params: dict[str, Any], **kwargs):
        n = int(kwargs["extra_info"]["new_tokens"])
        output = await super().run({**sampling_params, "max_tokens": n, "min_tokens": n}, **kwargs)
        replies = model_replies(self.tokenizer, output.response_ids, output.response_mask)
        output.extra_fields["harness_replies"] = replies
        output.extra_fields["harness_model_tokens"] = int(sum(output.response_mask))
        return output


class HarnessToolAgentLoop(_FixedLength, ToolAgentLoop):
    pass


class HarnessSingleTurnAgentLoop(_FixedLength, SingleTurnAgentLoop):
    pass


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict[str, float]:
    """verl's custom reward function: `reply_reward` of the model's replies (not of the tool answers
    inside `solution_str`, which is the whole decoded response)."""
    extra_info = extra_info or {}
    replies = extra_info.get("harness_replies")
    if replies is None:  # not through the harness's agent loops: the whole response is the reply
        replies = [solution_str]
    return {"score": reply_reward(list(replies), int(extra_info["new_tokens"])),
            "model_tokens": float(extra_info.get("harness_model_tokens") or 0)}
