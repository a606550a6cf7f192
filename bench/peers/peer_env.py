"""The peer harness's workload as an agentrl env (`bench.peers.peer_env:PeerTool-v0`).

Every reply but the last is a tool call (the whole reply is the call, as in bench/peers/common.py):
the tool sleeps ``latency_s`` and answers with the workload's fixed observation; reply
``tool_calls + 1`` ends the episode with :func:`bench.peers.common.reply_reward` of all replies.
With ``tool_calls=0`` it is a single-turn task. Prompts and the observation come from a JSON file
the harness writes, so every system gets the same texts. agentrl hands an env the reply's text with
special tokens kept (``<tool_call>`` carries meaning there); the reward drops the texts of the
tokenizer's special tokens (the file's ``special_tokens``), as verl's and TRL's decoding for the
reward does (``skip_special_tokens=True``).
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import gymnasium
from agentrl.envs.base import TextEnv, Turn

from bench.peers.common import reply_reward


class PeerToolEnv(TextEnv):
    def __init__(self, *, texts_file: str, tool_calls: int, latency_s: float, new_tokens: int, max_turns: int = 8) -> None:
        super().__init__(max_turns=max_turns)
        data = json.loads(open(texts_file).read())
        self.prompts: list[str] = data["prompts"]
        self.observation: str = data["observation"]
        self.special: list[str] = data.get("special_tokens", [])
        self.tool_calls, self.latency_s, self.new_tokens = tool_calls, latency_s, new_tokens
        self.replies: list[str] = []

    def new_task(self, rng: random.Random, options: dict[str, Any]) -> list[dict[str, str]]:
        self.replies = []
        return [{"role": "user", "content": rng.choice(self.prompts)}]

    def respond(self, action: str) -> Turn:
        for special in self.special:
            action = action.replace(special, "")
        self.replies.append(action)
        if self.num_turns > self.tool_calls:
            return Turn([], reward=reply_reward(self.replies, self.new_tokens), terminated=True, success=True)
        time.sleep(self.latency_s)  # the tool (env steps run in worker threads, many at once)
        return Turn([{"role": "tool", "content": self.observation}], reward=0.0, num_tool_calls=1)


gymnasium.register(id="PeerTool-v0", entry_point=PeerToolEnv)
