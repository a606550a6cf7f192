"""`agentrl bootstrap-tiny DIR`: a tiny Qwen2-architecture model made on the spot.

Writes a Hugging Face model directory that vLLM and transformers both load: random weights
(about 1M parameters), a byte-level BPE tokenizer trained here on a small synthetic corpus, and a
Qwen/Hermes-style chat template with tool schemas and ``<tool_call>{json}</tool_call>``.
Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "bootstrap_tiny", "tiny_corpus"]

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# Qwen2.5-style turns and tool calls; tool results come back as user turns wrapped in
# <tool_response>. Every assistant turn ends with <|im_end|> (the EOS token), which chat.py relies on.
# Tools are listed as one-line signatures rather than Qwen's full JSON schemas: a ~1M-parameter
# model learns faster with a prompt of ~80 tokens than of ~250.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\nCall one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>\n"
    "{% for tool in tools %}{% set fn = tool.function if tool.function is defined else tool %}"
    "- {{ fn.name }}({% for arg in (fn.parameters or {}).get('properties', {}) %}{{ arg }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}): {{ fn.description }}\n{% endfor %}<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% if not loop.first %}<|im_start|>system\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "<tool_call>\n{\"name\": \"{{ fn.name }}\", \"arguments\": {{ fn.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the a an and of to in is has have had buys sells gives gets more fewer each every how many much "
    "what who which total left after before then apples books coins cards marbles pens boxes bags "
    "answer result tool call function arguments expression calculate search open read list file "
    "directory question error invalid unknown please value number sum difference product times plus "
    "minus divided by equals Tom Anna Ben Maria Li Sam Zoe Omar Ivy Raj you your assistant user system "
    "helpful solve problem use step think final correct wrong try again guess word letter position"
).split()


def tiny_corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """Synthetic training text for the tokenizer: words, numbers, arithmetic and tool-call JSON."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14)))
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*/")
        expr = f"{a} {op} {b}"
        call = json.dumps({"name": rng.choice(["calculate", "search", "open", "ls", "read"]),
                           "arguments": {"expression": expr}})
        lines.append(f"{words.capitalize()} {a} and {b}? The answer is {a + b}.")
        lines.append(f"<tool_call>\n{call}\n</tool_call>")
        if i % 10 == 0:
            lines.append(json.dumps({"type": "function", "function": {"name": "calculate",
                         "description": "Evaluate an arithmetic expression.", "parameters": {
                             "type": "object", "properties": {"expression": {"type": "string"}},
                             "required": ["expression"]}}}))
    return lines


def _train_tokenizer(vocab_size: int, corpus: list[str]):
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
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def bootstrap_tiny(
    out_dir: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 4096,
    rope_theta: float = 10000.0,
    seed: int = 0,
    corpus: list[str] | None = None,
) -> Path:
    """Write a tiny random Qwen2 model, tokenizer and chat template to ``out_dir``.

    ``max_position_embeddings`` is the context the model (and vLLM serving it) accepts; for long
    contexts a larger ``rope_theta`` keeps some rotary dimensions nearly still over the whole
    window, so attention can match content at any distance.

    Example:
        >>> path = bootstrap_tiny("/tmp/tiny")  # doctest: +SKIP
        >>> from transformers import AutoModelForCausalLM
        >>> AutoModelForCausalLM.from_pretrained(path).num_parameters() < 10_000_000  # doctest: +SKIP
        True
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size, corpus or tiny_corpus(seed=seed))
    tokenizer.save_pretrained(out)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=float(rope_theta),
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    return out
