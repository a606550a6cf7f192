"""engine/: the inference engine (vLLM), token ids in, sampled tokens with logprobs and weight versions out.

vLLM is imported only when :class:`VLLMEngine` is first used (importing this package costs nothing).
The engine-side loading of refits is :mod:`agentrl.weights.vllm_worker`; knows nothing of Ray or the learner.
"""

from agentrl._lazy import lazy_exports

_EXPORTS = {"GenerationResult": "vllm_engine", "VLLMEngine": "vllm_engine"}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
