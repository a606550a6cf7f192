"""Chunked vocab-parallel logprobs (single rank): values and gradients against a float64 log-softmax."""

from __future__ import annotations

import pytest
import torch

from agentrl.learners.megatron.logprobs import vocab_parallel_logprobs


@pytest.mark.parametrize("keep_grad_logits", [False, True])
@pytest.mark.parametrize("chunk_size,temperature", [(8, 0.7), (64, 1.0)])
def test_matches_log_softmax_and_its_gradient(keep_grad_logits: bool, chunk_size: int, temperature: float) -> None:
    g = torch.Generator().manual_seed(chunk_size)
    hidden = torch.randn(37, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(23, 16, dtype=torch.float64, generator=g, requires_grad=True)  # 3 padding rows
    labels = torch.randint(0, 20, (37,), generator=g)
    lp = vocab_parallel_logprobs(hidden, weight, labels, real_vocab=20, temperature=temperature,
                                 chunk_size=chunk_size, keep_grad_logits=keep_grad_logits)
    ref = torch.log_softmax(hidden @ weight[:20].T / temperature, -1)[torch.arange(37), labels]
    assert (lp - ref).abs().max() < 1e-4  # logits are made in float32
    up = torch.randn(37, dtype=torch.float64, generator=g)
    got = torch.autograd.grad((lp * up).sum(), [hidden, weight])
    want = torch.autograd.grad((ref * up).sum(), [hidden, weight])
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-4 * b.abs().max()
    assert not got[1][20:].any()  # padding rows get no gradient
