"""`agentrl sft CONFIG`: supervised warm start on an env's expert demonstrations.

Demonstrations are rendered exactly as rollouts are (prompt once, assistant tokens + EOS, then
observation deltas), and the loss covers assistant tokens only. The same packing and chunked
logprob code as the RL learner is used. The result is cached: a second run with the same
settings reuses ``sft.output_dir``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from agentrl.rollout.chat import ChatRenderer
    from agentrl.config import Config
    from agentrl.rollout.tool_calls import ToolCallParser

__all__ = ["build_demonstrations", "digit_tokens", "run_sft"]


def __getattr__(name: str):
    if name == "plateau_schedule":  # moved beside the optimizer code; the old path keeps working
        import warnings

        from agentrl.learner.optim import plateau_schedule

        warnings.warn("agentrl.driver.sft.plateau_schedule moved to agentrl.learner.optim.plateau_schedule", DeprecationWarning,
                      stacklevel=2)
        return plateau_schedule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def digit_tokens(tokenizer) -> "torch.Tensor":
    """``[len(tokenizer)]`` bool: which token ids decode to digits only (spaces around allowed)."""
    import torch

    vocab = tokenizer.get_vocab()
    out = torch.zeros(max(len(tokenizer), max(vocab.values()) + 1), dtype=torch.bool)
    for token, i in vocab.items():
        text = tokenizer.convert_tokens_to_string([token]).strip()
        out[i] = text.isascii() and text.isdigit()
    return out


def build_demonstrations(
    env_id: str, renderer: "ChatRenderer", seeds: list[int], env_kwargs: dict | None = None,
    tool_parser: "ToolCallParser | None" = None, **expert_kwargs
) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of the expert's episodes on ``seeds``; with ``tool_parser``, the
    expert writes its calls in that parser's format and the env reads them with it."""
    import gymnasium as gym

    import agentrl.envs  # noqa: F401
    from agentrl.env.ids import import_env_module
    from agentrl.envs.base import set_tool_parser

    env = gym.make(import_env_module(env_id), **(env_kwargs or {}))
    expert = getattr(env.unwrapped, "expert", None)
    if expert is None:
        raise ValueError(f"{env_id} has no expert(seed) demonstrator; SFT needs one")
    if tool_parser is not None and set_tool_parser(env, tool_parser):
        if "tool_parser" not in inspect.signature(expert).parameters:
            raise ValueError(f"{env_id}'s expert takes no tool_parser argument: it cannot write calls in the "
                             f"{tool_parser.name} format (rollout.tool_parser)")
        expert_kwargs = {**expert_kwargs, "tool_parser": tool_parser.name}
    if "env_kwargs" in inspect.signature(expert).parameters:  # its task depends on the env's settings
        expert_kwargs = {"env_kwargs": dict(env_kwargs or {}), **expert_kwargs}
    demos = []
    for seed in seeds:
        obs, info = env.reset(seed=seed)
        ids = renderer.prompt_ids(obs, info.get("tools"))
        mask = [0] * len(ids)
        for action in expert(seed, **expert_kwargs):
            sampled = renderer.encode(action) + [renderer.end_of_turn_id]
            ids += sampled
            mask += [1] * len(sampled)
            obs, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                break
            delta = renderer.observation_delta_ids(obs)
            ids += delta
            mask += [0] * len(delta)
        demos.append((ids, mask))
    env.close()
    return demos


def _fingerprint(cfg: "Config", model_path: str) -> str:
    # (a default observation_loss_weight is left out: caches made before the key existed stay valid)
    # (as is a num_threads left to torch's default)
    sft = cfg.sft.model_dump(exclude={key for key, unset in (("observation_loss_weight", not cfg.sft.observation_loss_weight),
                                                             ("num_threads", cfg.sft.num_threads is None)) if unset})
    parts = {"sft": sft, "env": cfg.env.model_dump(), "model": model_path, "seed": cfg.seed}
    if cfg.rollout.tool_parser != "auto":  # (absent when auto: caches made before the key existed stay valid)
        parts["tool_parser"] = cfg.rollout.tool_parser
    blob = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_sft(cfg: "Config", *, model_path: str | None = None, log=print, log_file: str | Path | None = None) -> Path:
    """Train (or reuse) the warm-started model; returns its HF directory. Progress lines (``sft step
    S/T ... eta``) go to ``log`` and ``log_file``."""
    import torch
    from transformers import AutoTokenizer

    from agentrl.rollout.chat import ChatRenderer
    from agentrl.env.ids import check_env
    from agentrl.learner.hf_forward import packed_token_logprobs
    from agentrl.driver.progress import StageProgress
    from agentrl.model.loading import copy_tokenizer_files, load_hf_model, resolve_model_path
    from agentrl.learner.optim import adamw, plateau_schedule
    from agentrl.learner.packing import make_microbatches, pack_sequences
    from agentrl.rollout.tool_calls import build_tool_parser

    check_env(cfg.env.id, cfg.env.kwargs, need_expert=True)  # before the model loads
    sc = cfg.sft
    base = model_path or resolve_model_path(cfg)
    out = Path(sc.output_dir)
    stamp = out / "agentrl_sft.json"
    fp = _fingerprint(cfg, base)
    if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == fp:
        log(f"sft: reusing {out} (same settings)")
        return out

    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    renderer = ChatRenderer(tokenizer)
    parser = build_tool_parser(cfg.rollout.tool_parser, base, tokenizer)
    seeds = [sc.seed_offset + k for k in range(sc.num_demos)]
    demos = build_demonstrations(cfg.env.id, renderer, seeds, {**cfg.env.kwargs, **sc.env_kwargs}, parser, **sc.expert_kwargs)
    # On a GPU machine (learner.num_gpus > 0) SFT runs on the GPU, in float32 weights (a tiny
    # model: master precision costs nothing there); the engines cast to model.dtype on load.
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.learner.num_gpus else "cpu")
    model = load_hf_model(base, cfg.model.dtype if device.type == "cpu" else "float32", device)
    model.train()
    digits = digit_tokens(renderer.tokenizer).to(device)
    opt = adamw(model.parameters(), sc.lr)
    lengths = [len(ids) for ids, _ in demos]
    # A demonstration longer than batch_tokens is a batch of its own (the budget of the others stays).
    fits = [i for i, n in enumerate(lengths) if n <= sc.batch_tokens]
    batches = [[fits[j] for j in b] for b in make_microbatches(
        [lengths[i] for i in fits], sc.batch_tokens, algorithm=cfg.packing.algorithm)[0]] if fits else []
    batches += [[i] for i, n in enumerate(lengths) if n > sc.batch_tokens]
    total = sc.num_epochs * len(batches)
    sched = plateau_schedule(opt, total)
    rng = random.Random(cfg.seed)
    t0, step = time.perf_counter(), 0
    bar = StageProgress("sft", log=log, log_file=log_file)
    for epoch in range(sc.num_epochs):
        rng.shuffle(batches)
        for batch in batches:
            fields = {"loss_mask": [demos[i][1] for i in batch]}
            if sc.observation_loss_weight:  # the env's tokens (not the first: it has no prediction)
                fields["env_mask"] = [[0] + [1 - m for m in demos[i][1][1:]] for i in batch]
            packed = pack_sequences([demos[i][0] for i in batch], fields).to(device)
            logp = packed_token_logprobs(model, packed, chunk_size=cfg.packing.logprob_chunk_size)
            weight = packed.fields["loss_mask"].reshape(-1).float()
            if sc.observation_loss_weight:
                weight = weight + sc.observation_loss_weight * packed.fields["env_mask"].reshape(-1).float()
            if sc.digit_loss_weight != 1.0:
                weight = weight * torch.where(digits[packed.input_ids.reshape(-1)], sc.digit_loss_weight, 1.0)
            loss = -(logp.reshape(-1) * weight).sum() / weight.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            bar.update(step, total, {"epoch": epoch + 1, "loss": f"{loss.item():.4f}"})
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    copy_tokenizer_files(base, tmp)
    (tmp / "agentrl_sft.json").write_text(json.dumps({"fingerprint": fp, "base": base, "steps": step,
                                                      "seconds": time.perf_counter() - t0}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"sft: wrote {out} after {step} steps ({time.perf_counter() - t0:.0f}s)")
    return out
