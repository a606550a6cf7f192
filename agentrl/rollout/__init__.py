"""rollout/: episodes, token in, token out: the multi-turn loop, chat rendering, tool calls, trajectories.

Owns the token-exact record of an episode (:class:`Trajectory`: sampled tokens with their logprobs and
weight versions, observation deltas masked out) and the agent endpoint that records one for an
OpenAI-client agent (:mod:`agentrl.rollout.agent`). Talks to an engine only through
:class:`EngineClient`; knows nothing of Ray, vLLM or the learner. Names are imported on first use.
"""

from agentrl._lazy import lazy_exports

_EXPORTS = {
    "EngineClient": "episode", "EpisodeFailed": "episode", "run_episode": "episode", "run_group": "episode",
    "ChatRenderer": "chat",
    "ToolCall": "tool_calls", "format_tool_call": "tool_calls", "parse_tool_calls": "tool_calls",
    "Trajectory": "trajectory", "TrajectoryGroup": "trajectory",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
