"""LoRA adapters through PEFT: wrapping the learner's model, the adapter's tensors, merged exports.

The learner trains a PEFT adapter over a frozen base. A refit moves either the adapter's tensors
(``learner.lora.serve: adapter``), named as PEFT saves them
(``base_model.model.<module>.lora_A.weight``), which is also the layout vLLM's LoRA loader reads,
or base + adapter merged as full weights (``serve: merged``). An adapter directory
(``adapter_model.safetensors`` beside ``adapter_config.json``) is the one format on disk:
checkpoints, the engines' refits and :func:`merge_adapter` all use it. This module knows nothing
of Ray or vLLM; peft and transformers are imported when used.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.model.loading import ADAPTER_CONFIG, ADAPTER_WEIGHTS  # the adapter directory's files

if TYPE_CHECKING:
    import torch

    from agentrl.config import LoRAConfig
    from agentrl.weights.transports import FlatSpec

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "adapter_config",
    "adapter_tensors",
    "engine_max_rank",
    "fuse_adapters",
    "merge_adapter",
    "merge_run",
    "merged_flat",
    "merged_weights",
    "wrap_model",
    "write_adapter_dir",
]

_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values (0.26 and 0.32)


def engine_max_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``.

    >>> engine_max_rank(4), engine_max_rank(16), engine_max_rank(17)
    (8, 16, 32)
    """
    for allowed in _VLLM_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"learner.lora.rank: {rank} exceeds vLLM's largest max_lora_rank ({_VLLM_RANKS[-1]})")


def _peft_config(cfg: LoRAConfig, base_path: str | Path | None = None):
    from peft import LoraConfig

    config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                        target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    if base_path is not None:
        config.base_model_name_or_path = str(Path(base_path).resolve())
    return config


def adapter_config(cfg: LoRAConfig, base_path: str | Path | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` of an adapter made under ``cfg`` (what PEFT itself writes)."""
    config = _peft_config(cfg, base_path).to_dict()
    return json.loads(json.dumps(config, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))


def wrap_model(model: torch.nn.Module, cfg: LoRAConfig, base_path: str | Path | None = None):
    """``model`` as a PEFT model with fresh adapters (B = 0: the same outputs as the base); only the
    adapters train. The adapters take the base's dtype (a bf16 base keeps bf16 adapters, as vLLM
    serves them)."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, _peft_config(cfg, base_path), autocast_adapter_dtype=False)
    fuse_adapters(peft_model)
    return peft_model


FUSED_BACKWARD = True
"""The fused layer's backward for a frozen base (``_frozen_base_lora``); False: autograd's, through the
same two GEMMs (tools/learner_step.py's ``torch_lora_autograd`` variant profiles the difference)."""


def _fused_forward(self, x, *args, **kwargs):
    """A plain LoRA linear layer's forward with the adapter added inside one GEMM's epilogue:
    ``y = base(x); y += scale * (x @ A^T) @ B^T`` as an in-place ``addmm_``. PEFT's own forward
    (``result + lora_B(lora_A(x)) * scaling``) writes the adapter's [tokens x out] product, scales
    it and adds it: three more passes over every projection's output forward and one backward,
    which at the 1.5B shape cost more than the frozen base saves. Anything but the plain
    case (adapters disabled or merged, several active adapters, dropout, DoRA-like variants,
    mixed-batch ``adapter_names``, a dtype cast) goes to PEFT's forward."""
    import torch

    active = self.active_adapters
    plain = (not self.disable_adapters and not self.merged and len(active) == 1 and not args and not kwargs
             and active[0] in self.lora_A and active[0] not in self.lora_variant
             and isinstance(self.lora_dropout[active[0]], torch.nn.Identity))
    if plain:
        name = active[0]
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        plain = a.dtype == x.dtype == b.dtype == self.base_layer.weight.dtype
    if not plain:
        return type(self).__mro__[1].forward(self, x, *args, **kwargs)
    x2 = x.reshape(-1, x.shape[-1])  # 2-D: the GEMMs' own outputs, not views of them (an in-place
    base = self.base_layer           # update of a view would make autograd copy the gradient back)
    if (FUSED_BACKWARD and type(base) is torch.nn.Linear and not base.weight.requires_grad
            and (base.bias is None or not base.bias.requires_grad) and not torch.is_autocast_enabled()):
        y = _frozen_base_lora().apply(x2, base.weight, base.bias, a, b, self.scaling[name])
    else:  # a base that trains too (or another base module): autograd through the same two GEMMs
        y = base(x2)
        # y is not saved by the base GEMM's backward (which needs only its weight and input), so an
        # in-place update keeps autograd exact; addmm_'s backward is d(y) = g, d(h) = s g B, d(B) = s g^T h.
        y.addmm_(torch.nn.functional.linear(x2, a), b.t(), alpha=self.scaling[name])
    return y.view(*x.shape[:-1], y.shape[-1])


@functools.cache
def _frozen_base_lora() -> type:
    import torch  # (built on first use: this module imports without torch)

    class FrozenBaseLora(torch.autograd.Function):
        """``y = x W^T + bias + s (x A^T) B^T`` for a frozen ``W`` (and bias), with a backward that
        adds the adapter's share of the input gradient into the base's in place:
        ``dx = g W`` then ``dx += (s g B) A`` as one ``addmm_``. Autograd would write the adapter's
        [tokens x in] gradient separately and then sum the two: two more passes over every adapted
        projection's input gradient. ``dA = (s g B)^T x``, ``dB = s g^T (x A^T)``."""

        @staticmethod
        def forward(ctx, x, weight, bias, a, b, scale):  # type: ignore[override]
            h = x @ a.t()  # [T, r]
            y = torch.nn.functional.linear(x, weight, bias)
            y.addmm_(h, b.t(), alpha=scale)
            ctx.save_for_backward(x, weight, a, b, h)
            ctx.scale = scale
            return y

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, g):  # type: ignore[override]
            x, weight, a, b, h = ctx.saved_tensors
            gh = (g @ b).mul_(ctx.scale)  # [T, r]: d(x A^T)
            dx = da = db = None
            if ctx.needs_input_grad[0]:
                dx = g @ weight
                dx.addmm_(gh, a)
            if ctx.needs_input_grad[3]:
                da = gh.t() @ x
            if ctx.needs_input_grad[4]:
                db = (g.t() @ h).mul_(ctx.scale)
            return dx, None, None, da, db, None

    return FrozenBaseLora


_FUSED: dict[type, type] = {}


def fuse_adapters(peft_model: Any) -> int:
    """Give every PEFT LoRA ``Linear`` of ``peft_model`` the fused forward above (a subclass of its
    own class, so isinstance checks, state-dict names, saving and merging are PEFT's); returns how
    many layers changed. The result equals PEFT's forward up to floating-point rounding order
    (tests/test_lora.py)."""
    from peft.tuners.lora.layer import Linear

    n = 0
    for module in peft_model.modules():
        cls = type(module)
        if cls is Linear:
            if cls not in _FUSED:
                _FUSED[cls] = type("FusedLoraLinear", (cls,), {"forward": _fused_forward,
                                                                "__module__": __name__})
            module.__class__ = _FUSED[cls]
            n += 1
    return n


def adapter_tensors(peft_model: Any, *, device: str | torch.device | None = "cpu",
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (what vLLM's LoRA loader reads): copies on
    ``device`` (``None``: the learner's own tensors, detached, for a GPU refit's flat buffer)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model)
    out = {}
    for name, tensor in state.items():
        t = tensor.detach()
        if dtype is not None:
            t = t.to(dtype)
        out[name] = t if device is None else t.to(device, copy=True)
    return out


def _deltas(base: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face weight name, scale * B @ A)`` of every adapted linear layer of ``base``
    (the PEFT model's base model), one layer at a time; call under ``torch.no_grad()``."""
    from peft.tuners.lora import LoraLayer

    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and module.active_adapters:
            adapters = [a for a in module.active_adapters if a in module.lora_A]
            if adapters:
                yield f"{name}.weight", sum(module.get_delta_weight(a) for a in adapters)


def _base_weights(base: Any) -> dict[str, torch.Tensor]:
    # The base's own tensors under Hugging Face names (PEFT's wrapper adds ".base_layer.").
    return {name.replace(".base_layer.", "."): t.detach() for name, t in base.state_dict().items()
            if ".lora_" not in name}


def merged_weights(peft_model: Any, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The base's Hugging Face-named weights with each adapter's ``scale * B @ A`` added: copies
    on ``device`` (the model is left unmerged)."""
    import torch

    with torch.no_grad():
        out = {name: t.to(device, copy=True) for name, t in _base_weights(peft_model.get_base_model()).items()}
        for name, delta in _deltas(peft_model.get_base_model()):
            out[name].add_(delta.to(device=out[name].device, dtype=out[name].dtype))
    return out


def merged_flat(peft_model: Any, device: str | torch.device | None = None) -> tuple[torch.Tensor, FlatSpec]:
    """:func:`merged_weights` packed straight into one flat refit buffer (the layout of
    :func:`agentrl.weights.transports.flatten_weights`, on ``device``, default the model's): the base's tensors
    are copied in once and each adapted weight gets its delta added in place, so a GPU refit of
    merged weights holds the buffer and one layer's delta, never a merged copy of the model beside
    the buffer.

    Example:
        >>> import torch
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> from agentrl.config import LoRAConfig
        >>> from agentrl.weights.transports import unflatten_weights
        >>> base = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> model = wrap_model(base, LoRAConfig(rank=2))
        >>> _ = [torch.nn.init.normal_(p) for n, p in model.named_parameters() if ".lora_B." in n]
        >>> buf, spec = merged_flat(model)
        >>> want = merged_weights(model)
        >>> all(torch.equal(t, want[n]) for n, t in unflatten_weights(buf, spec))
        True
    """
    import torch

    from agentrl.weights.transports import flatten_weights, unflatten_weights

    base = peft_model.get_base_model()
    with torch.no_grad():
        buf, spec = flatten_weights(_base_weights(base), device)
        views = dict(unflatten_weights(buf, spec))
        for name, delta in _deltas(base):
            if name not in views:  # left out as a tied copy of another tensor: the engine would re-tie the base
                raise ValueError(f"merged refit: the adapted weight {name} shares its memory with another "
                                 "weight (tied); remove its module from learner.lora.target_modules")
            views[name].add_(delta.to(device=buf.device, dtype=views[name].dtype))
    return buf, spec


def write_adapter_dir(path: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """Write an adapter directory (weights, then config: a reader that sees the config sees both)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path / ADAPTER_WEIGHTS))
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return path


def merge_adapter(adapter_dir: str | Path, out_dir: str | Path, *, base: str | Path | None = None,
                  dtype: str = "float32") -> Path:
    """Write base + adapter as one Hugging Face model (``merge_and_unload``), with the base's
    tokenizer files, loadable by transformers and vLLM.

    Args:
        adapter_dir: An adapter directory (a checkpoint's ``learner/adapter``).
        out_dir: Where the merged model goes.
        base: The base model directory (default: the adapter config's ``base_model_name_or_path``).
        dtype: Weight dtype of the merge and of the written model.
    """
    from peft import PeftModel

    from agentrl.model.loading import copy_tokenizer_files, is_model_dir, load_hf_model

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / ADAPTER_CONFIG).is_file() or not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{adapter_dir} is not a LoRA adapter directory (needs {ADAPTER_CONFIG} "
                                f"and {ADAPTER_WEIGHTS})")
    base = Path(base or json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or "")
    if not is_model_dir(base):
        raise FileNotFoundError(f"the adapter's base model '{base}' is not a Hugging Face model directory; "
                                "pass the base explicitly (agentrl export ... --base DIR)")
    model = PeftModel.from_pretrained(load_hf_model(base, dtype), str(adapter_dir))
    merged = model.merge_and_unload()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer_files(base, out_dir)
    return out_dir


def merge_run(run_dir: str | Path, out_dir: str | Path, *, checkpoint: str | None = None,
              base: str | Path | None = None) -> Path:
    """:func:`merge_adapter` of a run's checkpoint (default: the latest) of a ``learner.lora`` run."""
    from agentrl.config import Config, ConfigError

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.json)")
    cfg = Config.model_validate_json((run_dir / "config.json").read_text())
    if not cfg.learner.lora.enabled:
        raise ConfigError(f"{run_dir}: learner.lora is off in this run (full fine-tuning): its checkpoints' "
                          "learner/model is already a Hugging Face model")
    ckpt_dir = Path(cfg.train.checkpoint_dir or run_dir / "checkpoints")
    if checkpoint is None:
        latest = ckpt_dir / "latest"
        if not latest.is_file():
            raise FileNotFoundError(f"no checkpoint in {ckpt_dir}")
        checkpoint = latest.read_text().strip()
    return merge_adapter(ckpt_dir / checkpoint / "learner" / "adapter", out_dir, base=base, dtype=cfg.model.dtype)
