"""fp32 master weights as bf16 + int16 remainders (agentrl/learner/megatron/remainders.py): the
encoding is exact for every bit pattern, the step is torch's fused AdamW over the true masters
bit for bit, and the optimizer wiring keeps Megatron's reads and writes of the masters working.
The real DistributedOptimizer needs CUDA tensors: the GPU run is tools/megatron_check.py
--mode remainders (tests/test_megatron_gpu.py); here it is a stand-in with the same attributes."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.learner.megatron.remainders import (
    RemainderStep,
    join_master,
    split_master,
    use_remainders,
)

EDGES = [0, 1, -1, 0x7FFF, 0x8000, 0x18000, 0x28000, 0x7F7FFFFF, 0x7F7F8000, 0x7F800000, 0x7FC00000,
         0x7FFFFFFF, -0x80000000, -0x7FFF8000, 0x00008000, 0x3F808000, 0x3F818000]


def _bits(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32)


@given(st.lists(st.integers(-2**31, 2**31 - 1), min_size=1, max_size=64))
@settings(max_examples=300, deadline=None)
def test_split_then_join_gives_back_every_bit_pattern(values):
    bits = _bits(values + EDGES)
    w, r = split_master(bits.view(torch.float32))
    assert w.dtype == torch.bfloat16 and r.dtype == torch.int16
    assert torch.equal(join_master(w, r).view(torch.int32), bits)


@given(st.lists(st.floats(allow_nan=False, width=32), min_size=1, max_size=64))
@settings(max_examples=300, deadline=None)
def test_bf16_part_is_torchs_rounding_except_exact_ties(values):
    x = torch.tensor(values, dtype=torch.float32)
    x = torch.cat([x, _bits(EDGES).view(torch.float32)])
    x = x[~x.isnan()]
    w, _ = split_master(x)
    rne = x.to(torch.bfloat16)
    low = x.view(torch.int32) & 0xFFFF
    tie = low == 0x8000
    assert torch.equal(w[~tie].view(torch.int16), rne[~tie].view(torch.int16))
    # on a tie: away from zero (one bf16 unit above torch's where torch kept an even mantissa)
    away = ((x.view(torch.int32)[tie] >> 16) + 1).to(torch.int16)
    assert torch.equal(w[tie].view(torch.int16), away)


def test_exact_ties_round_away_from_zero_both_signs():
    one_and_tie = _bits([0x3F808000, -0x407F8000]).view(torch.float32)  # 1.00390625 and its negative
    w, r = split_master(one_and_tie)
    assert w.tolist() == [1.0078125, -1.0078125] and r.tolist() == [-0x8000, -0x8000]
    assert one_and_tie.to(torch.bfloat16).tolist() == [1.0, -1.0]  # torch: to the even neighbour


def test_join_refuses_mismatched_inputs():
    with pytest.raises(TypeError, match="bf16 weights and int16 remainders"):
        join_master(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int16))
    with pytest.raises(TypeError, match="float32"):
        split_master(torch.zeros(3, dtype=torch.float64))


def _weights(seed: int, shapes=((37, 11), (3000,), (5, 5, 5), (7,))) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) * 0.05).to(torch.bfloat16) for s in shapes]


@pytest.mark.parametrize("chunk", [1 << 24, 1024, 7])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_remainder_step_is_fused_adamw_over_the_fp32_masters_bit_for_bit(chunk, weight_decay):
    torch.manual_seed(0)
    weights = _weights(1)
    # reference: torch's fused AdamW over real fp32 masters, bf16 = the masters rounded
    ref = [w.float().clone() for w in weights]
    ref_opt = torch.optim.AdamW([{"params": ref[:2], "lr": 1e-2}, {"params": ref[2:], "lr": 3e-3}],
                                betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, fused=True)
    # remainders: placeholders as the optimizer's parameters, values in (bf16, int16)
    mains = [torch.zeros(1).expand(w.shape) for w in weights]
    rems = {m: torch.zeros(w.shape, dtype=torch.int16) for m, w in zip(mains, weights)}
    ours = dict(zip(mains, [w.clone() for w in weights]))
    opt = torch.optim.AdamW([{"params": mains[:2], "lr": 1e-2}, {"params": mains[2:], "lr": 3e-3}],
                            betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, fused=True)
    opt.step = RemainderStep(opt, ours, rems, chunk=chunk)
    assert opt.step.chunk % 1024 == 0 and opt.step.chunk >= 1024  # 7 -> 1,024: 3,000 values in 3 chunks
    for step in range(6):
        for r, m in zip(ref, mains):
            grad = torch.randn(r.shape) * (10.0 ** (step - 3))
            r.grad, m.grad = grad.clone(), grad.clone()
        if step == 2:
            mains[1].grad = ref[1].grad = None  # a parameter without a gradient this step: untouched
        ref_opt.step()
        opt.step()
        for r, m in zip(ref, mains):
            master = join_master(ours[m], rems[m])
            assert torch.equal(master.view(torch.int32), r.view(torch.int32)), step
            assert torch.equal(opt.state[m]["exp_avg"], ref_opt.state[r]["exp_avg"])
            assert torch.equal(opt.state[m]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])
            assert float(opt.state[m]["step"]) == float(ref_opt.state[r]["step"])
            assert torch.equal(ours[m].view(torch.int16), split_master(r)[0].view(torch.int16))


class _StandInDistributedOptimizer:
    """The attributes of Megatron's DistributedOptimizer that use_remainders reads and rewires,
    over one flat bf16 buffer (DDP's parameter buffer) with one model parameter per shard."""

    def __init__(self, shapes, lr=1e-2):
        n = sum(torch.Size(s).numel() for s in shapes)
        self.buffer = (torch.randn(n) * 0.1).to(torch.bfloat16)
        self.model_params, self.shard_float16_groups, self.shard_fp32_from_float16_groups = [], [[]], [[]]
        off = 0
        for s in shapes:
            k = torch.Size(s).numel()
            p = self.buffer[off:off + k].view(s)
            off += k
            self.model_params.append(p)
            self.shard_float16_groups[0].append(p.view(-1))
            self.shard_fp32_from_float16_groups[0].append(p.view(-1).clone().float())
        self.shard_fp32_groups = [[]]
        self.optimizer = torch.optim.AdamW(self.shard_fp32_from_float16_groups[0], lr=lr, weight_decay=0.01,
                                           fused=True)
        self.model_param_group_index_map = {p: (0, i) for i, p in enumerate(self.model_params)}

    # Megatron's own methods, as they would run without the remainders
    def _copy_model_grads_to_main_grads(self, grads):
        for main, g in zip(self.shard_fp32_from_float16_groups[0], grads):
            main.grad = g.reshape(-1).float()

    def _copy_main_params_to_model_params(self):
        for main, shard in zip(self.shard_fp32_from_float16_groups[0], self.shard_float16_groups[0]):
            shard.copy_(main)

    def step(self, grads):
        self._copy_model_grads_to_main_grads(grads)
        self.optimizer.step()
        self._copy_main_params_to_model_params()


def test_use_remainders_frees_the_masters_and_steps_as_megatron_would():
    torch.manual_seed(0)
    shapes = [(64, 32), (300,), (8, 8, 4)]
    plain, remain = _StandInDistributedOptimizer(shapes), _StandInDistributedOptimizer(shapes)
    remain.buffer.copy_(plain.buffer)
    for i, main in enumerate(remain.shard_fp32_from_float16_groups[0]):
        main.copy_(plain.shard_fp32_from_float16_groups[0][i])
    masters_before = [m.untyped_storage().nbytes() for m in remain.shard_fp32_from_float16_groups[0]]
    freed = use_remainders(remain)
    assert freed == sum(masters_before) // 2  # 4 bytes a value -> 2
    assert all(m.untyped_storage().nbytes() == 4 for m in remain.shard_fp32_from_float16_groups[0])
    for step in range(5):
        grads = [torch.randn(s) for s in shapes]
        plain.step(grads)
        remain.step(grads)  # the no-op copy to the model weights: the step wrote them
        for p_main, r_param in zip(plain.shard_fp32_from_float16_groups[0], remain.model_params):
            got = remain._get_main_param_and_optimizer_states(r_param)
            assert torch.equal(got["param"].view(torch.int32), p_main.view(torch.int32)), step
        # the model's bf16 weights: torch's rounding of the same masters, except exact ties
        ties = (torch.cat([m.view(torch.int32) for m in plain.shard_fp32_from_float16_groups[0]]) & 0xFFFF) == 0x8000
        assert torch.equal(remain.buffer[~ties].view(torch.int16), plain.buffer[~ties].view(torch.int16))


def test_remainder_checkpoint_state_round_trips_and_a_reload_restarts_from_the_weights():
    torch.manual_seed(1)
    shapes = [(16, 16), (40,)]
    a, b = _StandInDistributedOptimizer(shapes), _StandInDistributedOptimizer(shapes)
    for d in (a, b):
        use_remainders(d)
    for _ in range(3):
        a.step([torch.randn(s) for s in shapes])
    saved = [{k: v.clone() for k, v in a._get_main_param_and_optimizer_states(p).items()} for p in a.model_params]
    for p, tensors in zip(b.model_params, saved):
        b._set_main_param_and_optimizer_states(p, tensors)
    for pa, pb in zip(a.model_params, b.model_params):
        ga, gb = a._get_main_param_and_optimizer_states(pa), b._get_main_param_and_optimizer_states(pb)
        assert all(torch.equal(ga[k], gb[k]) for k in ("param", "exp_avg", "exp_avg_sq", "step"))
    assert torch.equal(a.buffer.view(torch.int16), b.buffer.view(torch.int16))
    grads = [torch.randn(s) for s in shapes]
    a.step(grads)
    b.step(grads)  # the same next step, bit for bit
    assert torch.equal(a.buffer.view(torch.int16), b.buffer.view(torch.int16))
    # new model weights (a checkpoint's HF weights): the masters become exactly those weights
    b._copy_model_params_to_main_params()
    for p in b.model_params:
        assert torch.equal(b._get_main_param_and_optimizer_states(p)["param"], p.reshape(-1).float())


def test_use_remainders_refuses_what_it_cannot_keep_exact():
    with pytest.raises(ValueError, match="DistributedOptimizer over torch's AdamW"):
        use_remainders(types.SimpleNamespace(optimizer=torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=1.0)))
    d = _StandInDistributedOptimizer([(4,)])
    d.step([torch.ones(4)])
    with pytest.raises(ValueError, match="before the first optimizer step"):
        use_remainders(d)
    d = _StandInDistributedOptimizer([(4,)])
    d.shard_fp32_from_float16_groups[0][0].add_(1e-3)  # masters that are not the weights' values
    with pytest.raises(ValueError, match="not the bf16 weights' own values"):
        use_remainders(d)
    d = _StandInDistributedOptimizer([(4,)])
    d.shard_fp32_groups = [[torch.zeros(3)]]
    with pytest.raises(ValueError, match="fp32 parameters"):
        use_remainders(d)


def test_memory_report_counts_the_remainders_as_master_weights():
    from agentrl.learner.common import memory_breakdown

    d = _StandInDistributedOptimizer([(256, 64), (1000,)])
    before = memory_breakdown([], d, {}, torch.device("cpu"))["master_weights"]
    use_remainders(d)
    after = memory_breakdown([], d, {}, torch.device("cpu"))["master_weights"]
    n = 256 * 64 + 1000
    assert before * 2**30 == n * 4 and after * 2**30 == n * 2 + 2 * 4  # int16s, plus two 1-value placeholders


def test_config_needs_bf16_and_the_distributed_optimizer():
    from agentrl.config import ConfigError, load_config

    on = ["learner.backend=megatron", "learner.megatron.master_weight_remainders=true"]
    assert load_config(None, [*on, "model.dtype=bfloat16"]).learner.megatron.master_weight_remainders is True
    with pytest.raises(ConfigError, match="needs model.dtype=bfloat16"):
        load_config(None, [*on, "model.dtype=float32"])
    with pytest.raises(ConfigError, match="use_distributed_optimizer=true"):
        load_config(None, [*on, "model.dtype=bfloat16", "learner.megatron.use_distributed_optimizer=false"])
