"""Chunked vocab-parallel logprobs (single rank): values and gradients against a float64 log-softmax."""

from __future__ import annotations

import pytest
import torch

from agentrl.learner.megatron.logprobs import vocab_parallel_logprobs


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


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])  # on CUDA the fused head runs compiled kernels
@pytest.mark.parametrize("keep_grad_logits", [False, True])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_fused_equals_unfused_in_bf16(keep_grad_logits: bool, temperature: float, device: str) -> None:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(53, 32, generator=g).bfloat16().to(device)
    weight = (0.3 * torch.randn(40, 32, generator=g)).bfloat16().to(device)  # 4 padding rows
    labels = torch.randint(0, 36, (53,), generator=g).to(device)
    up = torch.randn(53, generator=g).to(device)
    results = []
    for fused in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp = vocab_parallel_logprobs(h, w, labels, real_vocab=36, temperature=temperature, chunk_size=16,
                                     keep_grad_logits=keep_grad_logits, fused=fused)
        (lp * up).sum().backward()
        results.append((lp.detach(), h.grad.float(), w.grad.float()))
    (lp0, gh0, gw0), (lp1, gh1, gw1) = results
    assert (lp0 - lp1).abs().max() < 1e-5  # both score the same bf16 logits in float32
    assert (gh0 - gh1).abs().max() <= 1e-2 * gh0.abs().max()  # bf16 rounding of the kept/scaled grads
    assert (gw0 - gw1).abs().max() <= 1e-2 * gw0.abs().max()
    assert not gw1[36:].any()  # padding rows get no gradient


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("keep_grad_logits", [False, True])
def test_the_weights_gradient_goes_into_main_grad_when_asked(fused: bool, keep_grad_logits: bool) -> None:
    # Megatron DDP's main_grad (float32) gets the head's weight gradient directly; autograd gets none
    # (accumulate_main_grad); the same gradient as the .grad path, added to what main_grad held.
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(41, 32, generator=g).bfloat16()
    weight = (0.3 * torch.randn(40, 32, generator=g)).bfloat16()
    labels = torch.randint(0, 36, (41,), generator=g)
    up = torch.randn(41, generator=g)
    kw = {"real_vocab": 36, "temperature": 0.7, "chunk_size": 16, "keep_grad_logits": keep_grad_logits, "fused": fused}
    h0, w0 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    (vocab_parallel_logprobs(h0, w0, labels, **kw) * up).sum().backward()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    held = torch.randn(40, 32, generator=g)  # what earlier micro-batches (or the tied embedding) left there
    w1.main_grad = held.clone()
    (vocab_parallel_logprobs(h1, w1, labels, accumulate_main_grad=True, **kw) * up).sum().backward()
    assert w1.grad is None  # nothing for DDP's hook to add
    added = w1.main_grad - held
    assert (added - w0.grad.float()).abs().max() <= 1e-2 * w0.grad.float().abs().max()  # .grad was rounded to bf16
    assert not added[36:].any()  # padding rows get no gradient
    assert torch.equal(h1.grad, h0.grad)
    # without main_grad (the torch learner's HF weight) the flag changes nothing
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    (vocab_parallel_logprobs(h2, w2, labels, accumulate_main_grad=True, **kw) * up).sum().backward()
    assert torch.equal(w2.grad, w0.grad)
