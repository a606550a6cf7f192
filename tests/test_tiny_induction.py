"""The tiny model's induction pre-stage (agentrl.model.tiny.pretrain_induction): its data and that it
gives a random model the copy skill."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.model.tiny import induction_batch


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10**6), batch_tokens=st.integers(1, 3000), low=st.integers(2, 40), extra=st.integers(0, 100))
def test_every_scored_token_is_a_copy_of_the_token_one_block_back(seed, batch_tokens, low, extra):
    span = (low, low + extra)
    seqs, masks = induction_batch(random.Random(seed), list(range(5, 400)), batch_tokens, span)
    assert sum(map(len, seqs)) >= batch_tokens
    for seq, mask in zip(seqs, masks):
        n = len(seq) // 2
        assert len(seq) == 2 * n and len(mask) == len(seq) and span[0] <= n <= span[1]
        assert seq[:n] == seq[n:]
        scored = [t for t, m in enumerate(mask) if m]
        # the second copy after its first token: exactly the tokens an earlier occurrence predicts
        assert scored == list(range(n + 1, 2 * n))
        assert all(5 <= tok < 400 for tok in seq)


def test_a_random_model_learns_to_copy_a_repeated_block(tmp_path):
    import torch

    from agentrl.learner.hf_forward import packed_token_logprobs
    from agentrl.model.loading import load_hf_model
    from agentrl.learner.packing import pack_sequences
    from agentrl.model.tiny import bootstrap_tiny, pretrain_induction
    from transformers import AutoTokenizer

    path = bootstrap_tiny(tmp_path / "m", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                          intermediate_size=128)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load_hf_model(str(path), "float32")

    def p_copy() -> float:  # on blocks it never trained on
        seqs, masks = induction_batch(random.Random(123), list(range(20, len(tokenizer))), 2048, (16, 64))
        packed = pack_sequences(seqs, {"m": masks})
        with torch.no_grad():
            logp = packed_token_logprobs(model, packed).reshape(-1)
        m = packed.fields["m"].reshape(-1).float()
        return float((logp.exp() * m).sum() / m.sum())

    before = p_copy()
    stats = pretrain_induction(model, tokenizer, steps=600, batch_tokens=1024, span=(16, 64), log=lambda _: None)
    after = p_copy()
    assert before < 0.01  # a random model cannot copy (chance is 1/vocab)
    assert after > 0.5 and stats["p_copy"] > 0.5, (before, after, stats)



def test_a_cached_tiny_model_made_with_other_induction_steps_is_refused(tmp_path):
    import pytest

    from agentrl.config import ConfigError, load_config
    from agentrl.model.tiny import tiny_stamp
    from agentrl.model.loading import resolve_model_path

    args = [f"model.path={tmp_path / 'm'}", "model.bootstrap_tiny=true", "model.tiny.hidden_size=32",
            "model.tiny.num_heads=1", "model.tiny.num_kv_heads=1"]
    path = resolve_model_path(load_config(None, [*args, "model.tiny.induction_steps=2"]))
    assert tiny_stamp(path)["induction"]["steps"] == 2
    assert resolve_model_path(load_config(None, [*args, "model.tiny.induction_steps=2"])) == path  # reused
    with pytest.raises(ConfigError, match=r"model.tiny.induction_steps: 0, but model.path .* made earlier with 2"):
        resolve_model_path(load_config(None, args))
