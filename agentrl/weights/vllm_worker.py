"""vLLM worker extension: in-place weight loading for refit (full weights, or a LoRA adapter).

Mixed into every vLLM worker via ``worker_extension_cls`` and called through ``collective_rpc``.
``collective_rpc`` serializes its arguments (tensors would arrive as nested lists), so weights
travel as a safetensors file path on the engine's host (under /dev/shm where it exists), as a CUDA
IPC handle of the learner's flat GPU buffer (same GPU), or through a broadcast in a process group
of their own (:class:`agentrl.weights.transports.WeightGroup`); see agentrl/weights/transports.py.
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
        self._agentrl_repack_cpu_experts()
        return len(tensors)

    def agentrl_load_ipc(self, handle: bytes, spec: bytes) -> int:
        """Reload weights from views of the learner's flat GPU buffer, opened by CUDA IPC handle."""
        import torch

        from agentrl.weights.transports import open_ipc_handle, spec_from_bytes, unflatten_weights

        layout = spec_from_bytes(spec)
        buffer = open_ipc_handle(handle, self.device.index)
        try:
            self.model_runner.reload_weights(weights_iterator=unflatten_weights(buffer, layout),
                                             is_checkpoint_format=True)
            torch.cuda.synchronize()  # the learner may free the buffer once this returns
        finally:
            del buffer
        return layout.num_tensors

    def agentrl_init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                  backend: str, timeout_s: float = 300.0) -> int:
        """Join the refit process group as rank ``rank_offset + this worker's rank``."""
        from agentrl.weights.transports import WeightGroup

        rank = rank_offset + int(getattr(self, "rank", 0))
        self._agentrl_group = WeightGroup(host, port, rank, world_size, backend=backend, timeout_s=timeout_s)
        self._agentrl_recv = None
        return rank

    def agentrl_receive_weights(self, spec: bytes) -> int:
        """Receive the learner's broadcast flat buffer and reload the weights from it."""
        import torch

        from agentrl.weights.transports import spec_from_bytes, unflatten_weights

        layout = spec_from_bytes(spec)
        group = getattr(self, "_agentrl_group", None)
        if group is None:
            raise RuntimeError("agentrl_receive_weights: no refit group (agentrl_init_weight_group first)")
        buf = self._agentrl_recv
        if buf is None or buf.numel() != max(layout.nbytes, 1):  # the layout is the same every refit
            buf = self._agentrl_recv = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8, device=self.device)
        group.broadcast(buf)
        self.model_runner.reload_weights(weights_iterator=unflatten_weights(buf, layout), is_checkpoint_format=True)
        self._agentrl_redispatch_tied_heads()
        self._agentrl_repack_cpu_experts()
        return layout.num_tensors

    # -- LoRA: adapter tensors only; the engine loads the directory written here in place -------
    def agentrl_stage_adapter_ipc(self, handle: bytes, spec: bytes, path: str) -> int:
        """Write the adapter tensors of the learner's flat GPU buffer (CUDA IPC) to ``path``."""
        import torch

        from agentrl.weights.transports import open_ipc_handle, spec_from_bytes, unflatten_weights

        layout = spec_from_bytes(spec)
        buffer = open_ipc_handle(handle, self.device.index)
        try:
            # One device-to-host copy of the whole (small) buffer, then host views of it.
            host = buffer[:layout.nbytes].to("cpu")
            torch.cuda.synchronize()  # the learner may free the buffer once this returns
        finally:
            del buffer
        return self._agentrl_write_adapter(dict(unflatten_weights(host, layout)), path)

    def agentrl_receive_adapter(self, spec: bytes, path: str) -> int:
        """Receive the learner's broadcast adapter buffer and write it to ``path``."""
        from agentrl.weights.transports import unflatten_weights

        buf, layout = self._agentrl_receive_broadcast(spec, "agentrl_receive_adapter")
        return self._agentrl_write_adapter(dict(unflatten_weights(buf.to("cpu"), layout)), path)

    def _agentrl_receive_broadcast(self, spec: bytes, caller: str) -> tuple:
        # The learner's flat adapter buffer, broadcast over the refit group, and its layout.
        import torch

        from agentrl.weights.transports import spec_from_bytes

        layout = spec_from_bytes(spec)
        group = getattr(self, "_agentrl_group", None)
        if group is None:
            raise RuntimeError(f"{caller}: no refit group (agentrl_init_weight_group first)")
        buf = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8, device=self.device)
        group.broadcast(buf)
        return buf, layout

    def agentrl_swap_adapter(self, source: bytes | str, spec: bytes | None, config_json: str, lora_id: int) -> int:
        """Swap the adapter ``lora_id`` for new tensors without a file: from a CUDA IPC handle of
        the learner's flat buffer (``spec`` its layout) or a safetensors path (``spec`` None).
        The engine's refit takes this path for CUDA IPC once the adapter is loaded
        (bench/lora.py: 0.076 s at the 7B shape against 0.447 s through an adapter directory)."""
        import torch

        from agentrl.weights.transports import open_ipc_handle, spec_from_bytes, unflatten_weights

        if spec is not None:
            buffer = open_ipc_handle(source, self.device.index)  # type: ignore[arg-type]
            tensors = {name: t.clone() for name, t in unflatten_weights(buffer, spec_from_bytes(spec))}
            torch.cuda.synchronize()  # copied: the learner may free its buffer once this returns
            del buffer
        else:
            from safetensors.torch import load_file

            tensors = load_file(str(source))
        return self._agentrl_swap(tensors, config_json, lora_id)

    def agentrl_receive_swap_adapter(self, spec: bytes, config_json: str, lora_id: int) -> int:
        """Receive the learner's broadcast adapter buffer and swap it in without a file."""
        from agentrl.weights.transports import unflatten_weights

        buf, layout = self._agentrl_receive_broadcast(spec, "agentrl_receive_swap_adapter")
        return self._agentrl_swap({name: t.clone() for name, t in unflatten_weights(buf, layout)}, config_json, lora_id)

    def _agentrl_swap(self, tensors: dict, config_json: str, lora_id: int) -> int:
        # vLLM's in-place adapter load minus reading a directory: build the LoRAModel from the
        # tensors and replace the resident adapter of the same id in the worker's manager.
        import json

        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.model_runner.lora_manager
        helper = PEFTHelper.from_dict(json.loads(config_json))
        helper.validate_legal(manager.lora_config)
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=lora_id, tensors=tensors, peft_helper=helper, device=str(self.device),
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size)
        adapters = manager._adapter_manager
        adapters.remove_adapter(lora_id)
        adapters.add_adapter(lora)
        adapters.activate_adapter(lora_id)
        return len(tensors)

    def _agentrl_write_adapter(self, tensors: dict, path: str) -> int:
        from pathlib import Path

        from safetensors.torch import save_file

        from agentrl.model.loading import ADAPTER_WEIGHTS

        if int(getattr(self, "rank", 0)) == 0:  # tensor-parallel workers share the host's file
            Path(path).mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(path) / ADAPTER_WEIGHTS))
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

    def _agentrl_repack_cpu_experts(self) -> int:
        # vLLM 0.32 re-runs a MoE layer's weight processing on reload, but on a weight update it
        # skips the experts' own step, which on CPU prepacks them into the grouped GEMM's layout:
        # the reloaded experts would be read in the checkpoint's layout. Run that step again.
        try:
            from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        except ImportError:  # a vLLM without CPU MoE experts
            return 0
        repacked = 0
        for module in self.model_runner.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts):
                experts.process_weights_after_loading(module)
                repacked += 1
        return repacked

    def agentrl_limit_vocab(self, limit: int) -> int:
        """Mask the LM head's logits at ids >= ``limit`` to -inf in every forward pass from now on
        (sampling, sampled-token logprobs and prompt logprobs alike): ``model.tokenizer_vocab_only``.
        Returns the model's vocabulary size."""
        import types

        # the object the model runner calls compute_logits on (a CUDA-graph wrapper forwards to it)
        model = getattr(self.model_runner, "model", None) or self.model_runner.get_model()
        original = model.compute_logits

        def compute_logits(_self, *args, **kwargs):
            logits = original(*args, **kwargs)
            if logits is not None:
                logits[..., limit:] = float("-inf")
            return logits

        model.compute_logits = types.MethodType(compute_logits, model)
        return int(self.model_config.get_vocab_size())

    def agentrl_memory_stats(self) -> dict[str, float]:
        """GiB of this worker's GPU memory: its allocator (weights, KV cache, activations, CUDA
        graph pools: ``allocated``, ``reserved``, ``peak``, ``peak_reserved``) and, where NVML lists
        processes, the driver's count for this process (``process``: the reserve plus the CUDA
        context, NCCL, cuBLAS workspaces); empty on CPU."""
        import torch

        if not torch.cuda.is_available():
            return {}
        from agentrl.learner.common import cuda_memory_gib

        out = cuda_memory_gib()
        blocks = getattr(getattr(self, "cache_config", None), "num_gpu_blocks", None)
        if blocks:  # the KV cache vLLM sized for itself (blocks of cache_config.block_size tokens)
            out["kv_blocks"] = float(blocks)
        return out

    def agentrl_weight_checksum(self) -> float:
        """Sum of all parameters (a cheap check that a refit changed the weights)."""
        model = self.model_runner.get_model()
        return float(sum(p.detach().double().sum().item() for p in model.parameters()))
