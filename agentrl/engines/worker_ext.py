"""vLLM worker extension: in-place weight loading for refit.

Mixed into every vLLM worker via ``worker_extension_cls`` and called through ``collective_rpc``.
``collective_rpc`` serializes its arguments (tensors would arrive as nested lists), so weights
travel as a safetensors file path on the engine's host (under /dev/shm where it exists).
"""

from __future__ import annotations

__all__ = ["WeightSyncExtension"]


class WeightSyncExtension:
    """Methods vLLM adds to its worker class; ``self`` is the worker."""

    def agentrl_load_weights(self, path: str) -> int:
        """Load HF-named tensors from a safetensors file into the running model; returns the count."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        # After start-up, vLLM on CPU has pre-packed linear weights for oneDNN and emptied the
        # original parameters, so model.load_weights fails; reload_weights goes through the
        # loader's in-place path, which re-runs the post-load processing.
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        self._agentrl_redispatch_tied_heads()
        return len(tensors)

    def _agentrl_redispatch_tied_heads(self) -> None:
        # With tied embeddings the LM head shares the embedding parameter; its CPU GEMM packing is
        # not rebuilt by reload_weights, so outputs would stay stale until re-dispatched.
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model = self.model_runner.get_model()
        for module in model.modules():
            if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
                from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

                dispatch_cpu_unquantized_gemm(module, remove_weight=False)

    def agentrl_weight_checksum(self) -> float:
        """Sum of all parameters (a cheap check that a refit changed the weights)."""
        model = self.model_runner.get_model()
        return float(sum(p.detach().double().sum().item() for p in model.parameters()))
