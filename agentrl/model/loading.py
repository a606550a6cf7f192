"""Model directories: which one a run starts from, what travels with it, how it is loaded.

The one place that knows what a Hugging Face model directory is (a ``config.json``, and the
tokenizer files that must follow the weights into every checkpoint), how a config's ``model``
section resolves to one (making the tiny model when ``model.bootstrap_tiny`` asks for it), and
how a causal LM is loaded for training. The driver, SFT, evaluation and the learners come here;
this module imports none of them, and torch and transformers only when a model is loaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from agentrl.config import Config

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "TOKENIZER_FILES", "copy_tokenizer_files", "is_model_dir", "load_hf_model", "resolve_model_path",
           "tokenizer_vocab_limit", "torch_dtype"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")
"""Files beside the weights that a saved model needs to load, render chats and stop (those present)."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""A LoRA adapter directory's files (the PEFT layout that vLLM loads): its config and its tensors."""


def is_model_dir(path: str | Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory (it has a ``config.json``).

    >>> is_model_dir("/nonexistent")
    False
    """
    return (Path(path) / "config.json").is_file()


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype of a ``model.dtype`` name (``float32``, ``bfloat16``, ``float16``)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_hf_model(path: str | Path, dtype: str = "float32", device: "str | torch.device" = "cpu"):
    """Load a causal LM in Hugging Face format with SDPA attention, on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype), attn_implementation="sdpa")
    return model.to(device)


def tokenizer_vocab_limit(path: str | Path, enabled: bool = True) -> int | None:
    """``len(tokenizer)`` of the model at ``path`` (ids past it have no text): the vocabulary a
    policy samples from and is trained on under ``model.tokenizer_vocab_only``; None when not
    ``enabled``."""
    if not enabled:
        return None
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(path)))


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the :data:`TOKENIZER_FILES` that ``src`` has into ``dst``; returns their names."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy(src / name, dst / name)
            copied.append(name)
    return copied


def resolve_model_path(cfg: "Config", progress=None) -> str:
    """The model directory a run starts from; makes the tiny model there if ``model.bootstrap_tiny``
    asks for one (``progress``: see :func:`agentrl.model.tiny.bootstrap_tiny`). Raises ConfigError before any actor starts when the path is not a model, or holds a
    tiny model made with other settings than the config's."""
    from agentrl.config import ConfigError

    path = Path(cfg.model.path)
    if not is_model_dir(path):
        if cfg.model.bootstrap_tiny:
            from agentrl.model.tiny import bootstrap_tiny

            bootstrap_tiny(path, seed=cfg.seed, family=cfg.model.family, progress=progress, **cfg.model.tiny.model_dump())
        else:
            raise ConfigError(
                f"model.path: '{path}' is not a Hugging Face model directory (no config.json). "
                "Point it at a local checkpoint, or set model.bootstrap_tiny=true to create a tiny model there."
            )
    elif cfg.model.bootstrap_tiny:
        from agentrl.model.tiny import tiny_stamp

        stamp = tiny_stamp(path) or {}
        made = stamp.get("family")
        if made is not None and made != cfg.model.family:
            raise ConfigError(f"model.family: {cfg.model.family!r}, but model.path '{path}' holds a tiny {made!r} "
                              "model made earlier; point model.path at another directory (e.g. "
                              f"model.path=.cache/tiny-{cfg.model.family})")
        steps = stamp.get("induction", {}).get("steps", 0)
        if stamp and steps != cfg.model.tiny.induction_steps:
            raise ConfigError(f"model.tiny.induction_steps: {cfg.model.tiny.induction_steps}, but model.path '{path}' "
                              f"holds a tiny model made earlier with {steps}; point model.path at another directory "
                              "or delete it to make the model again")
    return str(path)
