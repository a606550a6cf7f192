"""The episode loop with each family's tokenizer and tool parser: a scripted engine replays a tool
call and an answer in the family's format; the Calculator env reads the call with the family's
vLLM parser; the trajectory holds exactly the sampled tokens plus the family's observation deltas."""

from dataclasses import dataclass, field

import anyio
import gymnasium as gym
import pytest

import agentrl.envs  # noqa: F401  (registers the built-in envs)
from agentrl.rollout.chat import ChatRenderer
from agentrl.config import RolloutConfig
from agentrl.envs.base import set_tool_parser
from agentrl.rollout.episode import run_episode
from agentrl.rollout.tool_calls import build_tool_parser

RESULT = {"qwen2": "<tool_response>\n{}\n</tool_response>", "qwen3": "<tool_response>\n{}\n</tool_response>",
          "llama3": "<|start_header_id|>ipython<|end_header_id|>\n\n{}<|eot_id|>", "mistral": "[TOOL_RESULTS]{}[/TOOL_RESULTS]"}


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"


class ScriptedEngine:
    """Stands in for the vLLM engine: returns the given turns in order, and records the prompts."""

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.prompts = list(turns), []

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, episode_id):
        self.prompts.append(list(prompt_ids))
        ids = self.turns.pop(0)
        return Generation(ids, [-0.5] * len(ids), [0] * len(ids))


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3", "mistral"])
@pytest.mark.parametrize("ending", ["end_of_turn", "other_stop", "cut"])
def test_tool_episode_in_the_familys_format(family, ending, tiny_family_dir):
    from transformers import AutoTokenizer

    path = tiny_family_dir(family)
    tok = AutoTokenizer.from_pretrained(path)
    renderer, parser = ChatRenderer(tok), build_tool_parser("auto", path, tok)
    env = gym.make("agentrl/Calculator-v0")
    assert set_tool_parser(env, parser)
    env.reset(seed=7)
    inner = env.unwrapped
    # How the call turn ends: the template's end-of-turn token, another stop id (Llama's
    # <|eom_id|>, else the EOS), or nothing (cut by max_new_tokens: the loop closes the turn).
    other = tok.convert_tokens_to_ids("<|eom_id|>") if family == "llama3" else tok.eos_token_id
    stop = {"end_of_turn": [renderer.end_of_turn_id], "other_stop": [other], "cut": []}[ending]
    call = renderer.encode(parser.format("calculate", {"expression": inner.expression})) + stop
    answer = renderer.encode(f"The answer is {inner.answer}.") + [renderer.end_of_turn_id]
    engine = ScriptedEngine([call, answer])
    traj = anyio.run(lambda: run_episode(env, renderer, engine, seed=7, cfg=RolloutConfig(max_turns=3),
                                         episode_id="e"))
    assert (traj.status, traj.success, traj.num_tool_calls, traj.reward) == ("ok", True, 1, 1.0)
    sampled = [i for i, m in zip(traj.token_ids, traj.loss_mask) if m]
    assert sampled == call + answer  # exactly what was sampled, nothing re-rendered
    text = tok.decode(traj.token_ids)
    assert RESULT[family].format(inner.answer) in text
    closing = [renderer.end_of_turn_id] if ending == "cut" else []
    assert engine.prompts[1] == engine.prompts[0] + call + closing + renderer.observation_delta_ids(
        [{"role": "tool", "content": str(inner.answer)}])
