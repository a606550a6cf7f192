"""Packed forward of a Hugging Face causal LM and chunked logprobs (agentrl/learner/hf_forward.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from agentrl.learner.hf_forward import (
    PACKED_ATTENTION,
    chunked_logprobs,
    document_block_mask,
    packed_token_logprobs,
    padded_token_logprobs,
)
from agentrl.learner.packing import make_microbatches, pack_sequences, unpack, unpack_padded

VOCAB = 256


def _tiny_qwen2(dtype: torch.dtype, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).to(dtype).eval()


@pytest.fixture(scope="module")
def model64() -> Qwen2ForCausalLM:
    return _tiny_qwen2(torch.float64)


def _pg_loss(
    logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    # A stand-in policy-gradient loss: -(A * logprob) summed over loss tokens / token count.
    return -(advantages * logprobs * loss_mask).sum() / num_tokens


def _pad_rows(rows: list[list[float]]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rows], batch_first=True)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


# ---------------------------------------------------------------------------------------------- chunked


@settings(max_examples=25, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    chunk_size=st.integers(1, 50),
    temperature=st.sampled_from([1.0, 0.6, 1.7]),
    seed=st.integers(0, 2**16),
)
def test_chunked_logprobs_equal_full_log_softmax_and_its_gradient(
    num_tokens, chunk_size, temperature, seed
):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 37, (num_tokens,), generator=g)
    upstream = torch.randn(num_tokens, generator=g, dtype=torch.float64)

    ours = chunked_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size)
    grad_ours = torch.autograd.grad((ours * upstream).sum(), (hidden, weight))
    ref = torch.log_softmax(hidden @ weight.T / temperature, -1).gather(1, targets[:, None])[:, 0]
    grad_ref = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))

    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grad_ours, grad_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_chunked_logprobs_float32_and_frozen_weight():
    torch.manual_seed(1)
    hidden = torch.randn(50, 32, requires_grad=True)
    weight = torch.randn(300, 32)  # frozen head: only d/d hidden
    targets = torch.randint(0, 300, (50,))
    ours = chunked_logprobs(hidden, weight, targets, chunk_size=7)
    assert ours.dtype == torch.float32
    ref = torch.log_softmax(hidden @ weight.T, -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    (g_ours,) = torch.autograd.grad(ours.sum(), hidden)
    (g_ref,) = torch.autograd.grad(ref.sum(), hidden)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-4, atol=1e-5)


def test_chunked_logprobs_keep_no_token_by_vocab_tensor_for_backward():
    num_tokens, vocab = 64, 500
    hidden = torch.randn(num_tokens, 8, requires_grad=True)
    weight = torch.randn(vocab, 8, requires_grad=True)
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.shape) or t, lambda t: t
    ):
        chunked_logprobs(
            hidden, weight, torch.randint(0, vocab, (num_tokens,)), chunk_size=16
        ).sum().backward()
    assert saved and all(s.numel() < num_tokens * vocab for s in saved), saved


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature must be positive"):
        chunked_logprobs(
            torch.randn(2, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long), temperature=0.0
        )


# ---------------------------------------------------------------------------------------------- packed forward


@st.composite
def trajectories(draw, max_len: int = 40):
    lens = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=6))
    seqs = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)) for n in lens]
    adv = [[draw(st.floats(-2, 2))] * n for n in lens]
    mask = [draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)) for n in lens]
    return seqs, adv, mask


@settings(max_examples=12, deadline=None)
@given(
    case=trajectories(),
    pad_multiple=st.sampled_from([1, 4]),
    temperature=st.sampled_from([1.0, 0.7]),
)
def test_packed_and_padded_forward_give_equal_logprobs_and_loss_gradients(
    model64, case, pad_multiple, temperature
):
    seqs, adv, mask = case
    num_tokens = sum(map(len, seqs))

    batch = pack_sequences(seqs, {"adv": adv, "loss_mask": mask}, pad_multiple=pad_multiple)
    packed = packed_token_logprobs(model64, batch, temperature=temperature, chunk_size=16)
    assert packed.shape == (batch.input_ids.shape[1],)
    _pg_loss(packed, batch.fields["adv"][0], batch.fields["loss_mask"][0], num_tokens).backward()
    grads_packed = _grads(model64)

    padded = padded_token_logprobs(model64, seqs, temperature=temperature, chunk_size=16)
    _pg_loss(padded, _pad_rows(adv), _pad_rows(mask), num_tokens).backward()
    grads_padded = _grads(model64)

    torch.testing.assert_close(unpack_padded(packed, batch), padded, rtol=1e-10, atol=1e-10)
    assert grads_packed.keys() == grads_padded.keys()
    for name in grads_padded:
        torch.testing.assert_close(
            grads_packed[name], grads_padded[name], rtol=1e-9, atol=1e-11, msg=name
        )
    # Zero at each sequence's first token and on padding; negative elsewhere.
    for lp in unpack(packed, batch):
        assert lp[0] == 0 and (lp[1:] < 0).all()
    assert (packed[~batch.real_mask()[0]] == 0).all()


def _assert_packed_equals_alone(model, lengths: tuple[int, ...], seed: int) -> None:
    torch.manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,)).tolist() for n in lengths]
    batch = pack_sequences(seqs, pad_multiple=8)
    with torch.no_grad():
        packed = unpack(packed_token_logprobs(model, batch, chunk_size=32), batch)
        alone = [padded_token_logprobs(model, [s])[0] for s in seqs]
    for a, b in zip(packed, alone):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_packed_logprobs_match_each_sequence_alone_in_float32():
    _assert_packed_equals_alone(_tiny_qwen2(torch.float32, seed=3), (37, 5, 120, 1, 64), seed=3)


def _tiny(family: str, seed: int):
    import transformers

    torch.manual_seed(seed)
    kw: dict = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                "attn_implementation": "sdpa"}
    if family == "qwen3":
        kw["head_dim"] = 16
    if family == "mistral":
        kw["sliding_window"] = None  # packed attention refuses sliding-window layers
    cls = {"llama": "Llama", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
    model = getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**kw))
    with torch.no_grad():  # non-trivial norms (Qwen3's q/k norms too)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_packed_logprobs_of_other_families_match_each_sequence_alone(family):
    # Llama's decoder builds its mask with create_causal_mask directly (no per-layer-type mapping),
    # Qwen3 and Mistral take the mapping: the packed path must serve both.
    _assert_packed_equals_alone(_tiny(family, seed=6), (23, 4, 70, 1), seed=6)


def test_without_the_document_mask_sequences_would_leak_into_each_other():
    # Shows the test above can fail: transformers' own packed-position_ids detection is disabled
    # when forward creates a cache (use_cache defaults to True), so sequences attend across.
    model = _tiny_qwen2(torch.float64, seed=4)
    seqs = [[5, 6, 7, 8], [9, 10, 11]]
    batch = pack_sequences(seqs)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits[0]
        naive = torch.log_softmax(logits[4:6], -1).gather(1, torch.tensor([[10], [11]]))[:, 0]
        ours = packed_token_logprobs(model, batch)[5:7]
    assert not torch.allclose(naive, ours, atol=1e-3)
    torch.testing.assert_close(ours, padded_token_logprobs(model, seqs)[1, 1:3])


def test_ordinary_calls_still_behave_like_sdpa_after_switching():
    model = _tiny_qwen2(torch.float64, seed=5)
    stock = copy.deepcopy(model)
    packed_token_logprobs(model, pack_sequences([[1, 2, 3]]))
    assert model.config._attn_implementation == PACKED_ATTENTION
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=attention_mask).logits
        ref = stock(input_ids=ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_microbatched_packed_step_equals_one_padded_step(model64):
    # Token-budget micro-batches with gradient accumulation give the padded batch's gradient.
    torch.manual_seed(7)
    seqs = [torch.randint(0, VOCAB, (n,)).tolist() for n in (30, 12, 25, 3, 18, 40, 9)]
    adv = [[float(i % 3 - 1)] * len(s) for i, s in enumerate(seqs)]
    num_tokens = sum(map(len, seqs))
    ones = [[1] * len(s) for s in seqs]
    for microbatch in make_microbatches([len(s) for s in seqs], 48, pad_multiple=2)[0]:
        batch = pack_sequences(seqs, {"adv": adv}, indices=microbatch, pad_multiple=2)
        lp = packed_token_logprobs(model64, batch)
        _pg_loss(lp, batch.fields["adv"][0], batch.real_mask()[0], num_tokens).backward()
    grads_packed = _grads(model64)
    _pg_loss(
        padded_token_logprobs(model64, seqs), _pad_rows(adv), _pad_rows(ones), num_tokens
    ).backward()
    for name, g in _grads(model64).items():
        torch.testing.assert_close(grads_packed[name], g, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_attention_path_on_cuda_matches_padded(dtype):
    model = _tiny_qwen2(torch.float32, seed=6).cuda()
    stock = copy.deepcopy(model)
    model, stock = model.to(dtype), stock.to(dtype)
    torch.manual_seed(6)
    seqs = [torch.randint(0, VOCAB, (n,)).tolist() for n in (300, 17, 129, 1, 64)]
    batch = pack_sequences(seqs, {"adv": [[1.0] * len(s) for s in seqs]}, pad_multiple=8)
    packed = packed_token_logprobs(model, batch)
    packed.sum().backward()
    padded = padded_token_logprobs(stock, seqs)
    padded.sum().backward()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(unpack_padded(packed, batch), padded, rtol=tol, atol=tol)
    for (name, p), q in zip(model.named_parameters(), stock.parameters()):
        torch.testing.assert_close(
            p.grad.float(), q.grad.float(), rtol=tol * 10, atol=tol * 10, msg=name
        )


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=8), pad_multiple=st.sampled_from([1, 8, 64]))
def test_document_block_mask_equals_torchs_dense_builder(lens, pad_multiple):
    # The GPU path's BlockMask is built from the host boundaries; it must visit the same tiles
    # and allow the same pairs as create_block_mask evaluating "same document, not after" densely.
    from torch.nn.attention.flex_attention import create_block_mask

    batch = pack_sequences([[1] * n for n in lens], pad_multiple=pad_multiple)
    total = batch.input_ids.shape[1]
    doc = batch.document_ids()

    def document_causal(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    ref = create_block_mask(document_causal, None, None, total, total, device="cpu", _compile=False)
    got = document_block_mask(batch)
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert torch.equal(got.to_dense(), ref.to_dense())
    q, kv = torch.arange(total)[:, None], torch.arange(total)[None, :]
    assert torch.equal(got.mask_mod(None, None, q, kv), document_causal(None, None, q, kv))


def test_a_token_past_the_vocab_limit_is_a_clear_error_before_any_gpu_work():
    model = _tiny_qwen2(torch.float32)
    batch = pack_sequences([[1, 2, 3], [4, 200]])
    with pytest.raises(ValueError, match="token id 200 is past vocab_limit 100"):
        packed_token_logprobs(model, batch, vocab_limit=100)
    teacher = torch.tensor([[[5], [7], [150], [1], [2]]])
    with pytest.raises(ValueError, match="token id 150 is past vocab_limit 120"):
        packed_token_logprobs(model, pack_sequences([[1, 2, 3], [4, 5]]), vocab_limit=120, extra_ids=teacher)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_logprobs_and_their_backward_never_wait_for_the_gpu():
    # The learner's micro-batch (host batch in, logprobs, loss, backward) queues its kernels
    # without reading anything back, so the host runs ahead of the GPU (25 syncs a micro-batch
    # once left the H100 idle 20 % of a learner step at 1.5B: bench/history/lora.md).
    model = _tiny_qwen2(torch.bfloat16, seed=3).cuda()
    seqs = [torch.randint(0, VOCAB - 6, (n,)).tolist() for n in (300, 17, 129, 1, 64)]
    batch = pack_sequences(seqs, {"adv": [[1.0] * len(s) for s in seqs]}, pad_multiple=8)

    def step():
        lp = packed_token_logprobs(model, batch, vocab_limit=VOCAB - 6)
        moved = batch.to("cuda", non_blocking=True)
        loss = (unpack_padded(lp, moved) * unpack_padded(moved.fields["adv"], moved)).sum()
        loss.backward()
        return loss.detach()

    step()  # compiles (flex attention) outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss).item()


@pytest.mark.parametrize("vocab_limit", [None, VOCAB - 6])
def test_the_fused_head_gives_the_chunked_heads_logprobs_and_gradients(monkeypatch, vocab_limit):
    # On a GPU with bf16 weights the packed path scores tokens with the Megatron learner's fused
    # head; here both heads run on CPU (the fused one uncompiled) on the same bf16 model.
    import agentrl.learner.hf_forward as hf

    torch.manual_seed(11)
    seqs = [torch.randint(0, VOCAB - 6, (n,)).tolist() for n in (40, 9, 1, 23)]
    batch = pack_sequences(seqs, pad_multiple=4)
    results = []
    for fused in (False, True):
        monkeypatch.setattr(hf, "_fused_head", lambda h, w, fused=fused: fused)
        model = _tiny_qwen2(torch.bfloat16, seed=4)
        lp = packed_token_logprobs(model, batch, temperature=0.7, chunk_size=16, vocab_limit=vocab_limit)
        (lp * torch.linspace(-1, 1, lp.numel())).sum().backward()
        results.append((lp.detach(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (lp_c, g_c), (lp_f, g_f) = results
    assert torch.equal(lp_f == 0, lp_c == 0)  # the same positions scored
    torch.testing.assert_close(lp_f, lp_c, rtol=2e-2, atol=2e-2)
    for name, g in g_c.items():
        torch.testing.assert_close(g_f[name], g, rtol=5e-2, atol=5e-2 * float(g.abs().max()) + 1e-6, msg=name)
