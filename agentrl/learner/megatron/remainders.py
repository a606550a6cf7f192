"""fp32 master weights kept as 16-bit remainders beside the bf16 weights.

Megatron-Core's mixed-precision optimizer keeps, per parameter, the bf16 weight the model computes
with (2 bytes) and an fp32 master copy the optimizer updates (4 bytes). The bf16 weight is the top
half of the master's bits, rounded; so the master is fully described by the bf16 weight plus the
16 bits the rounding dropped. Keeping those bits (an int16 "remainder") instead of the master
saves 2 bytes a parameter (2.9 GiB at 1.5B parameters) and loses nothing: every optimizer step
rebuilds the exact fp32 master, runs the same fused AdamW kernel on it, and splits it again.
Transformer Engine's FusedAdam offers the same (``store_param_remainders``); this is a plain-torch
version for machines without it.

The split rounds the master to bf16 half away from zero (the dropped 16 bits, read as a signed
number, are the remainder: ``master_bits = (bf16_bits << 16) + remainder``). torch's own
float32 -> bfloat16 cast rounds half to even; the two differ only when the dropped bits are
exactly 0x8000 and the kept ones even (about 1 value in 131,072), by one bf16 unit. The fp32
master weights, and so every update, are bit for bit those of the fp32-master optimizer.

:func:`use_remainders` installs this on a built Megatron ``DistributedOptimizer`` (bf16 weights,
the inner optimizer torch's AdamW: Megatron's choice without TE and Apex).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["join_master", "split_master", "use_remainders"]

_CHUNK = 1 << 24
"""Elements per step of the rebuilt fp32 master (64 MiB), so the step's scratch stays small."""


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master`` -> (its bf16 rounding, the int16 remainder that restores it exactly)."""
    if master.dtype != torch.float32:
        raise TypeError(f"split_master needs float32, got {master.dtype}")
    bits = master.contiguous().view(torch.int32)
    high = (bits + 0x8000) >> 16  # round the dropped half away from zero (int32 wraps past NaN)
    rem = bits - (high << 16)  # in [-0x8000, 0x7fff]
    return high.to(torch.int16).view(torch.bfloat16), rem.to(torch.int16)


def join_master(weight: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """(bf16 ``weight``, int16 ``rem``) -> the fp32 master they encode (:func:`split_master`)."""
    if weight.dtype != torch.bfloat16 or rem.dtype != torch.int16 or weight.shape != rem.shape:
        raise TypeError(f"join_master needs bf16 weights and int16 remainders of one shape, got "
                        f"{weight.dtype} {tuple(weight.shape)} and {rem.dtype} {tuple(rem.shape)}")
    high = weight.contiguous().view(torch.int16).to(torch.int32)
    return ((high << 16) + rem.to(torch.int32)).view(torch.float32)


def _adamw_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
            step: torch.Tensor, group: dict[str, Any]) -> None:
    """One AdamW update of ``master`` in place with torch's fused kernel, as
    ``torch.optim.AdamW(fused=True)`` makes it (``step``: the count before this update; the kernel
    reads the count after it, which torch's wrapper adds before the call)."""
    beta1, beta2 = group["betas"]
    torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], [step + 1],
                        lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                        eps=group["eps"], amsgrad=False, maximize=group.get("maximize", False),
                        grad_scale=None, found_inf=None)


class RemainderStep:
    """The step of an AdamW over fp32 parameters whose values live as (bf16 ``weights[p]``,
    int16 ``rems[p]``): ``p`` itself holds no values, only its ``.grad``. Replaces
    ``inner.step``; equal, value for value, to ``inner.step`` over real fp32 masters."""

    def __init__(self, inner: torch.optim.Optimizer, weights: dict[torch.Tensor, torch.Tensor],
                 rems: dict[torch.Tensor, torch.Tensor], chunk: int = _CHUNK) -> None:
        # whole multiples of 1,024 values: every chunk starts where the fused kernel's vector lanes
        # would over the whole tensor, so no value moves between its vector and scalar paths
        # (on a CPU those round differently: a chunk of 7 changed last bits)
        self.inner, self.weights, self.rems = inner, weights, rems
        self.chunk = max(1024, int(chunk) // 1024 * 1024)

    @torch.no_grad()
    def __call__(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("a remainder step takes no closure")
        inner = self.inner
        for group in inner.param_groups:
            if group.get("amsgrad"):
                raise ValueError("master weights as remainders: amsgrad is not supported")
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p not in self.weights:
                    raise KeyError("a parameter of the optimizer has no bf16 weights and remainders")
                grad, weight, rem = p.grad.reshape(-1), self.weights[p].view(-1), self.rems[p].view(-1)
                state = inner.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=grad.device)
                    state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=grad.device)
                    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=grad.device)
                m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
                for s in range(0, grad.numel(), self.chunk):
                    e = min(s + self.chunk, grad.numel())
                    master = join_master(weight[s:e], rem[s:e])
                    _adamw_(master, grad[s:e], m[s:e], v[s:e], state["step"], group)
                    w, r = split_master(master)
                    weight[s:e].copy_(w)
                    rem[s:e].copy_(r)
                state["step"].add_(1)


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape, dtype and device over one element: what ``t`` keeps once its
    values live elsewhere (a ``.grad`` of its shape can still be set on it)."""
    return torch.zeros(1, dtype=t.dtype, device=t.device).expand(t.shape)


def use_remainders(dopt: Any, chunk: int = _CHUNK) -> int:
    """Replace ``dopt``'s fp32 master shards (a Megatron ``DistributedOptimizer`` with bf16
    weights) by int16 remainders beside its bf16 shards; returns the bytes freed. Rewires the
    methods that read or write the masters (the inner step, the copies between model and master
    weights, the checkpoint state) to the remainders; must run before the first step."""
    inner = getattr(dopt, "optimizer", None)
    if not isinstance(inner, torch.optim.AdamW | torch.optim.Adam) or not hasattr(dopt, "shard_fp32_from_float16_groups"):
        raise ValueError("master weights as remainders need Megatron's DistributedOptimizer over torch's AdamW "
                         "(learner.megatron.use_distributed_optimizer=true, no TransformerEngine/Apex optimizer)")
    if isinstance(inner, torch.optim.Adam) and not isinstance(inner, torch.optim.AdamW) \
            and any(g["weight_decay"] for g in inner.param_groups):
        raise ValueError("master weights as remainders: Adam's L2 weight decay is not supported (AdamW's is)")
    if any(inner.state.values()):
        raise ValueError("master weights as remainders must be installed before the first optimizer step")
    if any(dopt.shard_fp32_groups):
        raise ValueError("master weights as remainders: the model has fp32 parameters; all must be bf16")
    weights: dict[torch.Tensor, torch.Tensor] = {}
    rems: dict[torch.Tensor, torch.Tensor] = {}
    pairs = [(main, shard) for mains, shards in zip(dopt.shard_fp32_from_float16_groups, dopt.shard_float16_groups,
                                                    strict=True) for main, shard in zip(mains, shards, strict=True)]
    for main, shard in pairs:  # every check before anything changes
        if shard.dtype != torch.bfloat16:
            raise ValueError(f"master weights as remainders need bf16 weights, got {shard.dtype}")
        w, r = split_master(main.detach().reshape(-1))
        if r.any() or not torch.equal(w.view(torch.int16), shard.reshape(-1).view(torch.int16)):
            raise ValueError("the master weights are not the bf16 weights' own values (already trained?)")
    freed = 0
    for main, shard in pairs:
        weights[main] = shard
        rems[main] = torch.zeros(shard.shape, dtype=torch.int16, device=shard.device)
        freed += main.numel() * (main.element_size() - 2)
        main.data = _placeholder(main)
    step = RemainderStep(inner, weights, rems, chunk)
    inner.step = step

    def copy_main_to_model() -> None:  # the step writes the bf16 weights itself
        return None

    def copy_model_to_main(state_dict: Any = None) -> None:  # after new bf16 weights: masters = them
        if state_dict is not None:
            raise ValueError("master weights as remainders reload from the model's own weights only")
        for r in rems.values():
            r.zero_()

    def get_states(model_param: torch.Tensor) -> dict[str, torch.Tensor]:
        g, i = dopt.model_param_group_index_map[model_param]
        main = inner.param_groups[g]["params"][i]
        return {"param": join_master(weights[main], rems[main]), **inner.state[main]}

    def set_states(model_param: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        g, i = dopt.model_param_group_index_map[model_param]
        main = inner.param_groups[g]["params"][i]
        w, r = split_master(tensors["param"].to(device=weights[main].device, dtype=torch.float32).reshape(-1))
        weights[main].view(-1).copy_(w)
        rems[main].view(-1).copy_(r)
        state, device = inner.state[main], weights[main].device
        for k in ("exp_avg", "exp_avg_sq"):  # fresh tensors: a loaded state may alias the saved ones
            state[k] = tensors[k].to(device=device, dtype=torch.float32).reshape(main.shape).clone()
        if "step" in tensors:
            state["step"] = torch.as_tensor(tensors["step"], dtype=torch.float32).to(device).clone()

    dopt._copy_main_params_to_model_params = copy_main_to_model
    dopt._copy_model_params_to_main_params = copy_model_to_main
    dopt._get_main_param_and_optimizer_states = get_states
    dopt._set_main_param_and_optimizer_states = set_states
    dopt.master_weight_remainders = rems
    return freed
