"""rollout/agent/: bring your own agent: an OpenAI-compatible endpoint that records its episodes.

The endpoint (``endpoint``) serves an agent's chat completions from the rollout worker's engine and
records every call token-exactly (``recorder``); ``user`` loads the user's agent and task functions and
runs its episodes, in-process or in worker processes (``pool``, ``worker``, ``protocol``). Knows
nothing of Ray; the rollout actor hosts it. Names are imported on first use.
"""

from agentrl._lazy import lazy_exports

_EXPORTS = {
    "AgentEndpoint": "endpoint", "EpisodeRecorder": "recorder", "AgentWorkerPool": "pool",
    "Agent": "user", "load_agent": "user", "run_agent_group": "user",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
