"""agentrl: async actor-model multi-turn agentic RL for LLMs.

One package per role of the pipeline: :mod:`agentrl.config`, :mod:`agentrl.rollout` (with the agent
endpoint in :mod:`agentrl.rollout.agent`), :mod:`agentrl.env` (with the envs in :mod:`agentrl.envs`),
:mod:`agentrl.replay`, :mod:`agentrl.model`, :mod:`agentrl.weights`, :mod:`agentrl.learner`,
:mod:`agentrl.engine`, the Ray actors in :mod:`agentrl.actors`, and :mod:`agentrl.driver`. Importing
any of them starts neither Ray, vLLM nor Megatron-Core; the modules that need one import it themselves.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
