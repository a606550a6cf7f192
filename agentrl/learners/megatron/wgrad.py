"""Gradient-accumulation fusion without apex: the weight-gradient GEMM adds into ``main_grad``.

Megatron's linear layers, with ``gradient_accumulation_fusion``, hand the weight gradient to
apex's ``fused_weight_gradient_mlp_cuda`` (``main_grad += grad_output^T @ input`` in one GEMM)
instead of returning a bf16 ``weight.grad`` that DDP's hook then adds to ``main_grad`` (a
separate read-modify-write of every weight per micro-batch). apex is not installed here, so
`TorchWgrad` provides the same two functions with torch GEMMs: bf16/fp16 main grads by
``addmm_`` (beta = 1 in the GEMM epilogue), float32 main grads by ``addmm`` with
``out_dtype=float32`` where this torch supports it in place, else GEMM then add.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["TorchWgrad", "set_grad_accum_fusion"]


class TorchWgrad:
    """Stands in for apex's ``fused_weight_gradient_mlp_cuda`` (same names and arguments)."""

    fp32_in_place: bool | None = None  # None: not tried yet

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
        """``main_grad`` (float32 [out, in]) += ``grad_output``^T [out, T] @ ``total_input`` [T, in]."""
        if TorchWgrad.fp32_in_place is not False:
            try:
                torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)
                TorchWgrad.fp32_in_place = True
                return
            except (RuntimeError, TypeError) as e:  # older torch, or no aliasing of self and out
                print(f"TorchWgrad: float32 addmm(out_dtype) unavailable ({str(e)[:200]}); GEMM then add",
                      flush=True)
                TorchWgrad.fp32_in_place = False
        main_grad.add_(grad_output.t() @ total_input)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
        """``main_grad`` (bf16/fp16 [out, in]) += ``grad_output``^T @ ``total_input``, one GEMM."""
        main_grad.addmm_(grad_output.t(), total_input)


def set_grad_accum_fusion(model: torch.nn.Module, enabled: bool) -> list[torch.nn.Parameter]:
    """Turn gradient-accumulation fusion on or off in ``model``'s Megatron linear layers.

    Needs Megatron DDP around ``model`` (``weight.main_grad``). With it on, the weights' gradients
    reach ``main_grad`` inside the backward GEMM; DDP's hook skips them (``grad_added_to_main_grad``).
    Returns the weights concerned.
    """
    from megatron.core.tensor_parallel import layers

    if enabled and not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = TorchWgrad  # the name layers.py calls at backward
    weights = []
    for module in model.modules():
        if hasattr(module, "gradient_accumulation_fusion") and isinstance(getattr(module, "weight", None),
                                                                          torch.nn.Parameter):
            module.gradient_accumulation_fusion = enabled
            weights.append(module.weight)
    return weights
