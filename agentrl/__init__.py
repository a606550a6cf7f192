"""agentrl: async actor-model multi-turn agentic RL for LLMs.

Core modules import neither Ray nor vLLM nor Megatron at module level: they load without them.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
