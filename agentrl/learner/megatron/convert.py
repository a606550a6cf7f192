"""Hugging Face <-> Megatron-Core weight conversion for Llama 3, Qwen2/2.5, Qwen3 and Qwen3-MoE models.

Pure torch: nothing here imports Megatron, so conversion is testable anywhere.

Layouts (Megatron's local/TE GPT spec, facts of its format):

* ``linear_qkv`` fuses Q, K and V per query group: for each of the ``ng`` KV heads, the
  ``nh / ng`` query heads of that group, then its key head, then its value head, each
  ``head_dim`` rows. Tensor parallelism splits dim 0 into contiguous pieces, so each rank holds
  whole groups (``ng`` must be divisible by the TP size).
* ``linear_fc1`` of the gated MLP is ``[gate; up]``. Under TP each rank holds
  ``[gate_r; up_r]``, so sharding splits gate and up separately.
* A mixture-of-experts layer (Qwen3-MoE) has ``mlp.router.weight`` (HF ``mlp.gate.weight``,
  ``[experts, hidden]``, replicated) and, per expert ``e``, Megatron's SequentialMLP
  ``mlp.experts.local_experts.{e}.linear_fc1`` (``[gate; up]`` of HF's
  ``mlp.experts.{e}.gate_proj`` / ``up_proj``) and ``linear_fc2`` (``down_proj``), sharded under
  tensor parallelism like the dense MLP's (expert tensor parallelism equal to TP, no expert
  parallelism).
* ``linear_proj`` and ``linear_fc2`` are row-parallel (split dim 1); embeddings and the output
  layer are vocab-parallel (split dim 0, vocab padded to a multiple of the TP size); norms are
  replicated.

Megatron names here use *global* layer indices (``decoder.layers.{i}``); `localize_layers`
maps them onto one pipeline stage's local indices.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ModelShape",
    "experts_to_checkpoint_names",
    "gather_tp",
    "globalize_layers",
    "hf_to_megatron",
    "localize_layers",
    "megatron_to_hf",
    "shard_tp",
]

_SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe")
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ModelShape:
    """The architecture facts conversion and model building need, read off an HF config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rms_eps: float
    max_position_embeddings: int
    num_experts: int = 0
    """Routed experts of a mixture-of-experts layer (0: a dense model)."""
    moe_topk: int = 0
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = 0
    """Intermediate width of one expert."""
    moe_norm_topk: bool = False
    """The top-k routing weights are renormalized to sum to 1 (HF ``norm_topk_prob``)."""
    moe_layers: tuple[bool, ...] = ()
    """Per layer: True where its MLP is a mixture of experts (the others are dense)."""
    router_aux_loss_coef: float = 0.0
    """The checkpoint's load-balancing loss weight (HF ``router_aux_loss_coef``)."""

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelShape:
        """Read a transformers ``PretrainedConfig`` (or anything with the same attributes).

        Raises:
            ValueError: for an architecture or option this backend cannot represent.
        """
        mt = getattr(cfg, "model_type", "")
        if mt not in _SUPPORTED:
            raise ValueError(f"model_type '{mt}' is not supported by the Megatron learner "
                             f"(supported: {', '.join(_SUPPORTED)})")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act '{cfg.hidden_act}' is not supported (only silu / SwiGLU)")
        if getattr(cfg, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported by the Megatron learner")
        if mt in ("llama", "qwen3", "qwen3_moe") and getattr(cfg, "attention_bias", False):
            # q/k/v/o all biased: Megatron would also need MLP biases (add_bias_linear).
            raise ValueError(f"{mt} with attention_bias=True is not supported by the Megatron learner")
        heads = cfg.num_attention_heads
        moe: dict[str, Any] = {}
        if mt == "qwen3_moe" and cfg.num_experts > 0:
            step, dense = int(getattr(cfg, "decoder_sparse_step", 1) or 1), set(getattr(cfg, "mlp_only_layers", []) or [])
            moe = dict(num_experts=int(cfg.num_experts), moe_topk=int(cfg.num_experts_per_tok),
                       moe_ffn_hidden_size=int(cfg.moe_intermediate_size), moe_norm_topk=bool(cfg.norm_topk_prob),
                       moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)),
                       router_aux_loss_coef=float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0))
        return cls(
            model_type=mt,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            ffn_hidden_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2",
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            rms_eps=float(cfg.rms_norm_eps),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 32768)),
            **moe,
        )

    def is_moe_layer(self, i: int) -> bool:
        """Whether global layer ``i``'s MLP is a mixture of experts."""
        return bool(self.moe_layers) and self.moe_layers[i]

    def padded_vocab_size(self, tp_size: int) -> int:
        """Vocabulary rounded up to a multiple of ``tp_size`` (vocab-parallel layers need it)."""
        return -(-self.vocab_size // tp_size) * tp_size

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def experts_to_checkpoint_names(hf: dict[str, Any]) -> dict[str, Any]:
    """HF tensors with transformers' in-memory expert layout (``mlp.experts.gate_up_proj``
    ``[experts, 2 * ffn, hidden]`` and ``mlp.experts.down_proj`` ``[experts, hidden, ffn]``, as a
    ``Qwen3MoeForCausalLM``'s ``state_dict()`` has them) renamed to the checkpoint's per-expert
    tensors (``mlp.experts.{e}.gate_proj.weight`` ...: what ``save_pretrained`` writes and vLLM
    loads). Views, not copies; every other tensor passes through."""
    out: dict[str, Any] = {}
    for name, t in hf.items():
        m = _FUSED_EXPERTS.match(name)
        if not m:
            out[name] = t
        elif m.group(2) == "gate_up_proj":
            for e, w in enumerate(t.unbind(0)):
                out[f"{m.group(1)}.{e}.gate_proj.weight"], out[f"{m.group(1)}.{e}.up_proj.weight"] = w.chunk(2, dim=0)
        else:
            for e, w in enumerate(t.unbind(0)):
                out[f"{m.group(1)}.{e}.down_proj.weight"] = w
    return out


def hf_to_megatron(hf: dict[str, torch.Tensor], shape: ModelShape, *, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """Full (unsharded) Megatron state dict with global layer indices from HF tensors (checkpoint
    names, or transformers' in-memory fused experts: `experts_to_checkpoint_names`).

    The vocabulary dimension is zero-padded to ``shape.padded_vocab_size(tp_size)``.
    """
    if shape.num_experts:
        hf = experts_to_checkpoint_names(hf)
    vocab = shape.padded_vocab_size(tp_size)
    ng, hd, hpg, h = shape.num_kv_heads, shape.head_dim, shape.heads_per_group, shape.hidden_size
    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": _pad_rows(hf["model.embed_tokens.weight"], vocab)}
    for i in range(shape.num_layers):
        src, dst = _hf_layer(i), f"decoder.layers.{i}."
        attn = src + "self_attn."
        q = hf[attn + "q_proj.weight"].reshape(ng, hpg * hd, h)
        k = hf[attn + "k_proj.weight"].reshape(ng, hd, h)
        v = hf[attn + "v_proj.weight"].reshape(ng, hd, h)
        out[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, h)
        if shape.qkv_bias:
            qb = hf[attn + "q_proj.bias"].reshape(ng, hpg * hd)
            kb = hf[attn + "k_proj.bias"].reshape(ng, hd)
            vb = hf[attn + "v_proj.bias"].reshape(ng, hd)
            out[dst + "self_attention.linear_qkv.bias"] = torch.cat([qb, kb, vb], dim=1).reshape(-1)
        if shape.qk_norm:
            out[dst + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"]
        out[dst + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        if shape.is_moe_layer(i):
            out[dst + "mlp.router.weight"] = hf[src + "mlp.gate.weight"]
            for e in range(shape.num_experts):
                hx, mx = f"{src}mlp.experts.{e}.", f"{dst}mlp.experts.local_experts.{e}."
                out[mx + "linear_fc1.weight"] = torch.cat([hf[hx + "gate_proj.weight"], hf[hx + "up_proj.weight"]])
                out[mx + "linear_fc2.weight"] = hf[hx + "down_proj.weight"]
            continue
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]]
        )
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not shape.tied_embeddings:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], vocab)
    return out


def megatron_to_hf(mc: dict[str, torch.Tensor], shape: ModelShape, *, lazy: bool = False) -> dict[str, Any]:
    """HF-named tensors from a full Megatron state dict (global layer indices, any vocab padding).

    Tied models get no ``lm_head.weight`` (as ``save_pretrained`` writes them). Every tensor is a
    view of ``mc``'s but q, k and v (and their biases), which a reshape copies out of the
    interleaved QKV weight; ``lazy``: those come as :class:`agentrl.weights.transports.LazyReshape` of the
    view instead (a zero-copy refit: the engine reshapes).
    """
    from agentrl.weights.transports import LazyReshape

    def reshape(t: torch.Tensor, *size: int) -> Any:
        if not lazy:
            return t.reshape(*size)
        known = math.prod(n for n in size if n != -1)
        return LazyReshape(t, tuple(t.numel() // known if n == -1 else n for n in size))

    ng, hd, hpg, h = shape.num_kv_heads, shape.head_dim, shape.heads_per_group, shape.hidden_size
    V = shape.vocab_size
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": mc["embedding.word_embeddings.weight"][:V]}
    for i in range(shape.num_layers):
        src, dst = f"decoder.layers.{i}.", _hf_layer(i)
        attn = dst + "self_attn."
        qkv = mc[src + "self_attention.linear_qkv.weight"].reshape(ng, (hpg + 2) * hd, h)
        q, k, v = qkv.split([hpg * hd, hd, hd], dim=1)
        out[attn + "q_proj.weight"] = reshape(q, -1, h)
        out[attn + "k_proj.weight"] = reshape(k, -1, h)
        out[attn + "v_proj.weight"] = reshape(v, -1, h)
        if shape.qkv_bias:
            b = mc[src + "self_attention.linear_qkv.bias"].reshape(ng, (hpg + 2) * hd)
            qb, kb, vb = b.split([hpg * hd, hd, hd], dim=1)
            out[attn + "q_proj.bias"] = reshape(qb, -1)
            out[attn + "k_proj.bias"] = reshape(kb, -1)
            out[attn + "v_proj.bias"] = reshape(vb, -1)
        if shape.qk_norm:
            out[attn + "q_norm.weight"] = mc[src + "self_attention.q_layernorm.weight"]
            out[attn + "k_norm.weight"] = mc[src + "self_attention.k_layernorm.weight"]
        out[attn + "o_proj.weight"] = mc[src + "self_attention.linear_proj.weight"]
        out[dst + "input_layernorm.weight"] = mc[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = mc[src + "pre_mlp_layernorm.weight"]
        if shape.is_moe_layer(i):
            out[dst + "mlp.gate.weight"] = mc[src + "mlp.router.weight"]
            for e in range(shape.num_experts):
                hx, mx = f"{dst}mlp.experts.{e}.", f"{src}mlp.experts.local_experts.{e}."
                out[hx + "gate_proj.weight"], out[hx + "up_proj.weight"] = mc[mx + "linear_fc1.weight"].chunk(2, dim=0)
                out[hx + "down_proj.weight"] = mc[mx + "linear_fc2.weight"]
            continue
        gate, up = mc[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"] = gate
        out[dst + "mlp.up_proj.weight"] = up
        out[dst + "mlp.down_proj.weight"] = mc[src + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = mc["decoder.final_layernorm.weight"]
    if not shape.tied_embeddings:
        out["lm_head.weight"] = mc["output_layer.weight"][:V]
    return out


def _tp_rule(name: str) -> str:
    """How a Megatron tensor is split under TP: 'rep', 'col' (dim 0), 'row' (dim 1) or 'glu'."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")):
        return "col"
    if name.endswith("linear_fc1.weight"):
        return "glu"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "rep"


def shard_tp(full: dict[str, torch.Tensor], tp_size: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """This TP rank's slice of every tensor of a full Megatron state dict (views, not copies)."""
    out = {}
    for name, t in full.items():
        rule = _tp_rule(name)
        if rule == "col":
            out[name] = t.chunk(tp_size, dim=0)[tp_rank]
        elif rule == "row":
            out[name] = t.chunk(tp_size, dim=1)[tp_rank]
        elif rule == "glu":
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
        else:
            out[name] = t
    return out


def gather_tp(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of `shard_tp`: the full tensors from every TP rank's slices, in rank order."""
    out = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        rule = _tp_rule(name)
        if rule == "col":
            out[name] = torch.cat(parts, dim=0)
        elif rule == "row":
            out[name] = torch.cat(parts, dim=1)
        elif rule == "glu":
            halves = [p.chunk(2, dim=0) for p in parts]
            out[name] = torch.cat([g for g, _ in halves] + [u for _, u in halves])
        else:
            out[name] = parts[0]
    return out


def localize_layers(full: dict[str, torch.Tensor], first_layer: int, num_local: int, *,
                    pre_process: bool, post_process: bool, tied: bool) -> dict[str, torch.Tensor]:
    """The tensors one pipeline stage holds, renamed to its local layer indices.

    A tied model's last stage (when it is not also the first) holds its own copy of the
    embedding as ``output_layer.weight``, which Megatron keeps in sync.
    """
    out = {}
    for name, t in full.items():
        m = _LAYER.match(name)
        if m:
            i = int(m.group(1)) - first_layer
            if 0 <= i < num_local:
                out[f"decoder.layers.{i}.{m.group(2)}"] = t
        elif name.startswith("embedding."):
            if pre_process:
                out[name] = t
            if post_process and tied and not pre_process:
                out["output_layer.weight"] = t
        elif post_process:
            out[name] = t
    return out


def globalize_layers(local: dict[str, torch.Tensor], first_layer: int, *,
                     drop_tied_copy: bool = False) -> dict[str, torch.Tensor]:
    """Inverse of `localize_layers` for one stage.

    ``drop_tied_copy`` drops ``output_layer.weight`` (a tied model's last-stage copy of the
    embedding, which the first stage exports).
    """
    out = {}
    for name, t in local.items():
        m = _LAYER.match(name)
        if m:
            out[f"decoder.layers.{int(m.group(1)) + first_layer}.{m.group(2)}"] = t
        elif not (drop_tied_copy and name == "output_layer.weight"):
            out[name] = t
    return out
