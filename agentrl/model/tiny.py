"""`agentrl bootstrap-tiny DIR --family F`: a tiny model of a family, made on the spot.

Writes a Hugging Face model directory that vLLM and transformers both load: random weights
(about 1M parameters) of the family's architecture (Qwen2, Qwen3, Qwen3-MoE, Llama, Mistral), a byte-level
BPE tokenizer trained here on a small synthetic corpus with the family's special tokens, and a
chat template in the family's format (:mod:`agentrl.model.tiny_templates`). Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from agentrl.model.tiny_templates import TEMPLATES
from agentrl.rollout.tool_calls import FAMILY_TOOL_PARSERS, format_tool_call

__all__ = ["FAMILIES", "Family", "bootstrap_tiny", "induction_batch", "pretrain_induction", "tiny_corpus", "tiny_family",
           "tiny_stamp"]

STAMP = "agentrl_tiny.json"


@dataclass(frozen=True)
class Family:
    """What a tiny model of one family is made of."""

    architecture: str
    """transformers config/model class prefix: Qwen2, Qwen3, Llama, Mistral."""
    special_tokens: tuple[str, ...]
    """Atomic tokens of the format; the first is padding."""
    eos: str
    """The tokenizer's EOS token."""
    stop: tuple[str, ...]
    """Tokens generation stops at (generation_config eos_token_id)."""
    bos: str | None = None
    template: str | None = None
    """Chat template and tool-call format of another family (None: this family's own)."""


_QWEN3_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                 "</tool_response>", "<think>", "</think>")

FAMILIES: dict[str, Family] = {
    "qwen2": Family("Qwen2", ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                              "<tool_response>", "</tool_response>"), "<|im_end|>", ("<|im_end|>",)),
    "qwen3": Family("Qwen3", _QWEN3_TOKENS, "<|im_end|>", ("<|im_end|>", "<|endoftext|>")),
    # Qwen3's tokens and chat format; every decoder layer's MLP a top-k mixture of experts.
    "qwen3_moe": Family("Qwen3Moe", _QWEN3_TOKENS, "<|im_end|>", ("<|im_end|>", "<|endoftext|>"), template="qwen3"),
    # Llama 3's tokenizer EOS is <|end_of_text|>; chat turns end in <|eot_id|> (and <|eom_id|> when
    # the model waits for a built-in tool): generation stops at all three, as Llama's own config says.
    "llama3": Family("Llama", ("<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|end_of_text|>",
                               "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                               "<|python_tag|>"), "<|end_of_text|>",
                     ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"), bos="<|begin_of_text|>"),
    "mistral": Family("Mistral", ("<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                                  "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                                  "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"), "</s>", ("</s>",), bos="<s>"),
}

_WORDS = (
    "the a an and of to in is has have had buys sells gives gets more fewer each every how many much "
    "what who which total left after before then apples books coins cards marbles pens boxes bags "
    "answer result tool call function arguments expression calculate search open read list file "
    "directory question error invalid unknown please value number sum difference product times plus "
    "minus divided by equals Tom Anna Ben Maria Li Sam Zoe Omar Ivy Raj you your assistant user system "
    "helpful solve problem use step think final correct wrong try again guess word letter position"
).split()


def tiny_corpus(num_lines: int = 4000, seed: int = 0, family: str = "qwen2") -> list[str]:
    """Synthetic training text for the tokenizer: words, numbers, arithmetic and tool calls in the
    family's format."""
    parser = FAMILY_TOOL_PARSERS[family]
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14)))
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*/")
        expr = f"{a} {op} {b}"
        call = format_tool_call(rng.choice(["calculate", "search", "open", "ls", "read"]), {"expression": expr}, parser)
        lines.append(f"{words.capitalize()} {a} and {b}? The answer is {a + b}.")
        lines.append(call)
        if i % 10 == 0:
            lines.append(json.dumps({"type": "function", "function": {"name": "calculate",
                         "description": "Evaluate an arithmetic expression.", "parameters": {
                             "type": "object", "properties": {"expression": {"type": "string"}},
                             "required": ["expression"]}}}))
    return lines


def _train_tokenizer(vocab_size: int, corpus: list[str], family: Family, template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits one by one: a tiny model copies numbers between question, tool call and answer.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(family.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    extra = [t for t in family.special_tokens[1:] if t not in (family.eos, family.bos)]
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=family.eos,
        pad_token=family.special_tokens[0],
        bos_token=family.bos,
        additional_special_tokens=extra,
    )
    hf.chat_template = template
    return hf


def bootstrap_tiny(
    out_dir: str | Path,
    *,
    family: str = "qwen2",
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 4096,
    rope_theta: float = 10000.0,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 96,
    seed: int = 0,
    corpus: list[str] | None = None,
    induction_steps: int = 0,
    induction_lr: float = 3e-3,
    log=print,
    progress=None,
) -> Path:
    """Write a tiny random model of ``family`` (qwen2, qwen3, qwen3_moe, llama3, mistral), its
    tokenizer and chat template to ``out_dir``.

    ``num_experts``, ``num_experts_per_tok`` and ``moe_intermediate_size`` shape the experts of a
    mixture-of-experts family (qwen3_moe); the dense families ignore them.

    ``max_position_embeddings`` is the context the model (and vLLM serving it) accepts; for long
    contexts a larger ``rope_theta`` keeps some rotary dimensions nearly still over the whole
    window, so attention can match content at any distance.

    ``induction_steps`` > 0 trains the random model first on sequences of random tokens that
    repeat (:func:`pretrain_induction`), so that it has induction heads, as every pretrained LM
    has: copying a token read earlier is then a skill the model starts from, not one it has to
    discover inside a task's sparse copy targets (the long-context recipe depends on it).

    Example:
        >>> path = bootstrap_tiny("/tmp/tiny-llama3", family="llama3")  # doctest: +SKIP
        >>> from transformers import AutoModelForCausalLM
        >>> AutoModelForCausalLM.from_pretrained(path).num_parameters() < 10_000_000  # doctest: +SKIP
        True

    Raises:
        ValueError: an unknown family.
    """
    if family not in FAMILIES:
        import difflib

        close = difflib.get_close_matches(family, list(FAMILIES), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"unknown model family {family!r}.{hint} Known: {', '.join(FAMILIES)}")
    import torch
    import transformers

    spec = FAMILIES[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size, corpus or tiny_corpus(seed=seed, family=family), spec,
                                 TEMPLATES[spec.template or family])
    tokenizer.save_pretrained(out)
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in spec.stop]
    config_cls = getattr(transformers, f"{spec.architecture}Config")
    model_cls = getattr(transformers, f"{spec.architecture}ForCausalLM")
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=float(rope_theta),
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id if spec.bos else tokenizer.pad_token_id,
        eos_token_id=stop_ids if len(stop_ids) > 1 else stop_ids[0],
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    if family == "mistral":
        config.sliding_window = None
    if spec.architecture.endswith("Moe"):
        # Every layer sparse, top-k probabilities renormalized to sum to 1 (as Qwen3-30B-A3B).
        config.num_experts, config.num_experts_per_tok = num_experts, num_experts_per_tok
        config.moe_intermediate_size, config.norm_topk_prob = moe_intermediate_size, True
        config.decoder_sparse_step, config.mlp_only_layers = 1, []
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config.eos_token_id = stop_ids if len(stop_ids) > 1 else stop_ids[0]
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    stamp = {"family": family, "seed": seed}
    if induction_steps:
        stamp["induction"] = pretrain_induction(model, tokenizer, steps=induction_steps, lr=induction_lr,
                                                seed=seed, log=log, progress=progress)
    model.save_pretrained(out, safe_serialization=True)
    (out / STAMP).write_text(json.dumps(stamp))
    return out


def induction_batch(rng: random.Random, token_ids: list[int], batch_tokens: int,
                    span: tuple[int, int] = (16, 128)) -> tuple[list[list[int]], list[list[int]]]:
    """Sequences of ``batch_tokens`` in all: each a block of random tokens (length log-uniform
    over ``span``) written twice; the loss mask covers the second copy after its first token
    (the tokens a copy of the first block predicts; its first token is unpredictable)."""
    seqs, masks, total = [], [], 0
    low, high = span
    while total < batch_tokens:
        n = min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))
        block = [rng.choice(token_ids) for _ in range(n)]
        seqs.append(block + block)
        masks.append([0] * (n + 1) + [1] * (n - 1))
        total += 2 * n
    return seqs, masks


def pretrain_induction(model, tokenizer, *, steps: int, lr: float = 3e-3, batch_tokens: int = 2048,
                       span: tuple[int, int] = (16, 128), seed: int = 0, log=print, progress=None) -> dict:
    """Train ``model`` in place to continue a repeated block of random tokens (the standard
    setting in which small transformers form induction heads: a previous-token head and a head
    that attends to the token after an earlier occurrence of the current one, then copies it).

    In the 0.2M-parameter long-context model (hidden 64, 3 layers) the copy appears abruptly
    after ~400 steps of 2,048 tokens and reaches P(copy) ~0.99 by 1,000 (~100 s on one core);
    without this stage, ~2,000 steps of LongNeedle SFT formed an in-page copy in some seeds only
    (bench/history/long_context.md). Returns ``{"steps", "loss", "p_copy", "seconds"}`` of
    the last 50 steps.
    """
    import time

    import torch

    from agentrl.learner.hf_forward import packed_token_logprobs
    from agentrl.learner.optim import adamw, plateau_schedule
    from agentrl.learner.packing import pack_sequences

    special = set(tokenizer.all_special_ids)
    token_ids = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(f"induction:{seed}")
    torch.manual_seed(seed)
    model.train()
    opt = adamw(model.parameters(), lr)
    sched = plateau_schedule(opt, steps)
    t0, recent = time.perf_counter(), []
    for step in range(steps):
        seqs, masks = induction_batch(rng, token_ids, batch_tokens, span)
        packed = pack_sequences(seqs, {"loss_mask": masks})
        logp = packed_token_logprobs(model, packed).reshape(-1)
        mask = packed.fields["loss_mask"].reshape(-1).float()
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        p_copy = float((logp.detach().exp() * mask).sum() / mask.sum())
        recent = (recent + [(loss.item(), p_copy)])[-50:]
        if progress is not None:
            progress(step + 1, steps, {"loss": f"{loss.item():.3f}", "P(copy)": f"{p_copy:.3f}"})
        elif (step + 1) % 100 == 0 or step + 1 == steps:
            log(f"induction: step {step + 1}/{steps} loss {loss.item():.3f} P(copy) {p_copy:.3f} "
                f"({time.perf_counter() - t0:.0f}s)")
    model.eval()
    return {"steps": steps, "loss": sum(r[0] for r in recent) / len(recent),
            "p_copy": sum(r[1] for r in recent) / len(recent), "seconds": round(time.perf_counter() - t0, 1)}


def tiny_stamp(path: str | Path) -> dict | None:
    """What :func:`bootstrap_tiny` recorded at ``path`` (family, seed, induction stage), or None."""
    stamp = Path(path) / STAMP
    return json.loads(stamp.read_text()) if stamp.is_file() else None


def tiny_family(path: str | Path) -> str | None:
    """The family of a tiny model made by :func:`bootstrap_tiny` at ``path`` (None: not one, or one
    made before families existed, which were all qwen2)."""
    return (tiny_stamp(path) or {}).get("family")
