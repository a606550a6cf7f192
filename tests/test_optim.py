"""agentrl.learner.optim: AdamW on the fused kernel where the parameters live on a GPU (fuse_adamw). The
switch must leave the update as it was and drop the multi-tensor step's parameter-sized temporary;
the GPU test measures that temporary with the allocator's peak."""

from __future__ import annotations

import types

import pytest
import torch

from agentrl.learner.optim import adamw, fuse_adamw, torch_optimizers


def _params(seed: int, shapes=((64, 33), (33,), (7, 5, 3))) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _run(opt: torch.optim.Optimizer, params, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_fused_adamw_updates_as_the_multi_tensor_step_does():
    ref_params, params = _params(0), _params(0)
    ref = torch.optim.AdamW(ref_params, lr=0.05, weight_decay=0.1, betas=(0.9, 0.98), foreach=True)
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, betas=(0.9, 0.98), foreach=True)
    assert fuse_adamw(opt, device_types=("cpu",)) == 1
    assert opt.param_groups[0]["fused"] and not opt.param_groups[0]["foreach"]
    assert fuse_adamw(opt, device_types=("cpu",)) == 0  # already fused: nothing switched again
    _run(ref, ref_params, 5, seed=1)
    _run(opt, params, 5, seed=1)
    for a, b in zip(ref_params, params, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(ref_params, params, strict=True):
        assert float(opt.state[b]["step"]) == float(ref.state[a]["step"]) == 5.0


def test_fuse_adamw_leaves_groups_on_other_devices_and_other_optimizers_alone():
    params = _params(0)
    opt = torch.optim.AdamW(params, lr=0.1)
    assert fuse_adamw(opt) == 0  # default: GPU groups only; these parameters are on the host
    assert not opt.param_groups[0]["fused"]
    sgd = torch.optim.SGD(_params(1), lr=0.1)
    assert fuse_adamw(sgd, device_types=("cpu",)) == 0
    amsgrad = torch.optim.AdamW(_params(2), lr=0.1, amsgrad=True)
    assert fuse_adamw(amsgrad, device_types=("cpu",)) == 0
    # on the host, adamw() keeps torch's default (the CPU recipes' figures were measured with it)
    assert not adamw(_params(3), 0.1).param_groups[0]["fused"]


def test_fuse_adamw_reaches_the_optimizers_inside_megatrons_wrappers():
    a, b = torch.optim.AdamW(_params(0), lr=0.1), torch.optim.AdamW(_params(1), lr=0.1)
    mixed = types.SimpleNamespace(optimizer=a)  # Float16OptimizerWithFloat16Params holds .optimizer
    chained = types.SimpleNamespace(chained_optimizers=[mixed, types.SimpleNamespace(optimizer=b)])
    assert torch_optimizers(chained) == [a, b]
    assert fuse_adamw(chained, device_types=("cpu",)) == 2
    assert a.param_groups[0]["fused"] and b.param_groups[0]["fused"]


def test_a_checkpoint_of_the_unfused_optimizer_resumes_fused_with_the_same_update():
    params, ref_params = _params(0), _params(0)
    old = torch.optim.AdamW(params, lr=0.05, foreach=True)
    ref = torch.optim.AdamW(ref_params, lr=0.05, foreach=True)
    _run(old, params, 3, seed=1)
    _run(ref, ref_params, 3, seed=1)
    saved = old.state_dict()
    resumed = torch.optim.AdamW(params, lr=0.05, foreach=True)
    fuse_adamw(resumed, device_types=("cpu",))
    resumed.load_state_dict(saved)
    assert not resumed.param_groups[0]["fused"]  # loading brought the saved group's flags back
    assert fuse_adamw(resumed, device_types=("cpu",)) == 1
    _run(resumed, params, 2, seed=2)
    _run(ref, ref_params, 2, seed=2)
    for a, b in zip(ref_params, params, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_the_fused_step_drops_the_parameter_sized_temporary():
    dev = torch.device("cuda")
    n = 64 * 2**20  # 256 MiB of fp32 parameters in 8 tensors

    def peak_over_step(fused: bool) -> tuple[int, list[torch.Tensor]]:
        g = torch.Generator(device=dev).manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n // 8, device=dev, generator=g)) for _ in range(8)]
        for p in params:
            p.grad = torch.randn(p.shape, device=dev, generator=g)
        opt = adamw(params, 1e-3) if fused else torch.optim.AdamW(
            params, lr=1e-3, betas=(0.9, 0.98), weight_decay=0.0, foreach=True)
        opt.step()  # the moments now exist; the next step's extra memory is the step's own
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        opt.step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, [p.detach().clone() for p in params]

    unfused_extra, unfused = peak_over_step(False)
    fused_extra, fused = peak_over_step(True)
    assert unfused_extra >= 0.9 * n * 4  # the multi-tensor step's sqrt of every second moment
    assert fused_extra < 0.05 * n * 4
    for a, b in zip(unfused, fused, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # a checkpoint of the unfused optimizer (host step counters) resumes on the fused kernel
    params = [torch.nn.Parameter(t.clone()) for t in fused]
    old = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    for p in params:
        p.grad = torch.ones_like(p)
    old.step()
    new = adamw(params, 1e-3)
    new.load_state_dict(old.state_dict())
    fuse_adamw(new)
    assert all(new.state[p]["step"].is_cuda for p in params)  # cuda:0, which != torch.device("cuda")
    new.step()
    assert all(float(new.state[p]["step"]) == 2.0 for p in params)
