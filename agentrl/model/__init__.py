"""model/: model directories: which one a run starts from, how it is loaded, and the tiny models.

``loading`` is the one place that knows what a Hugging Face model directory is and loads a causal
LM (torch and transformers only when a model is loaded); ``tiny`` makes a tiny model of a family on
the spot (``tiny_templates``: their chat templates). Knows nothing of Ray, vLLM or the trainer.
Names are imported on first use.
"""

from agentrl._lazy import lazy_exports

_EXPORTS = {
    "is_model_dir": "loading", "load_hf_model": "loading", "resolve_model_path": "loading",
    "bootstrap_tiny": "tiny", "tiny_family": "tiny",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
