"""Inference engines (vLLM), imported only when an engine starts."""

__all__: list[str] = []
