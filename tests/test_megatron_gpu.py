"""Megatron learner on GPUs (device machine): each test runs tools/megatron_check.py under torchrun.

* logprobs of a converted model (Qwen2, Qwen3 with q/k norms, Llama with an untied head) equal
  HF's within bf16 tolerance on packed input;
* one train_step gives the torch learner's loss on the same batch; save/load round trip;
* TP=2 gives TP=1's logprobs (needs 2 GPUs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(nproc: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "tools" / "megatron_check.py"), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


@needs_cuda
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_megatron_matches_hf_and_torch_learner(tmp_path: Path, family: str) -> None:
    out = tmp_path / f"hf_{family}.json"
    _run(1, "--mode", "hf", "--family", family, "--workdir", str(tmp_path), "--out", str(out))
    r = json.loads(out.read_text())
    # bf16 vs the float32 truth: no worse than HF's own bf16 forward (plus a little slack).
    assert r["mega_vs_fp32_mean"] < 1.5 * r["hfbf16_vs_fp32_mean"] + 1e-3, r
    assert r["mega_vs_fp32_max"] < 2.0 * r["hfbf16_vs_fp32_max"] + 0.05, r
    assert r["first_token_zero"]
    marks = r["build_marks"]  # the build's timeline, in the order it ran
    assert list(marks) == ["imports", "distributed", "parallel_state", "model_built", "weights_read",
                           "weights_loaded", "optimizer"], marks
    assert list(marks.values()) == sorted(marks.values()), marks
    assert r["optimizer_fused_built"] and r["optimizer_fused_loaded"], r  # no parameter-sized AdamW temporary
    assert r["dist_backend"] == "agentrl_solo", r  # one process: no NCCL communicator (megatron/solo.py)
    # save -> step -> load restores weights exactly, the step counter and the optimizer state:
    # the step after the reload repeats the step after the save.
    assert r["weights_changed"] and r["reload_max_diff"] == 0.0 and r["reload_version"] == 1
    assert r["export_equals_checkpoint"]
    assert r["zero_copy_equals_export"], r  # refit.zero_copy: the engine's views are the exported weights
    assert abs(r["resumed_step_loss"] - r["first_step2_loss"]) <= 1e-3 * max(1.0, abs(r["first_step2_loss"])), r
    assert abs(r["resumed_step_grad_norm"] - r["first_step2_grad_norm"]) <= 1e-2 * r["first_step2_grad_norm"], r
    assert r["resumed_step_lp_max_diff"] < 0.1 * r["step2_lp_change"], r
    ml, tl = r["megatron train/loss"], r["torch train/loss"]
    assert abs(ml - tl) <= 2e-2 * max(1.0, abs(tl)), (ml, tl)
    mg, tg = r["megatron train/grad_norm"], r["torch train/grad_norm"]
    assert abs(mg - tg) <= 5e-2 * tg, (mg, tg)


@needs_cuda
def test_master_weights_as_remainders_step_as_fp32_masters_bit_for_bit(tmp_path: Path) -> None:
    """learner.megatron.master_weight_remainders: every step equals torch's fused AdamW over the
    true fp32 masters (masters, moments, step count, bf16 weights), in half the masters' memory."""
    out = tmp_path / "remainders.json"
    _run(1, "--mode", "remainders", "--workdir", str(tmp_path), "--out", str(out))
    r = json.loads(out.read_text())
    for s in r["steps"]:
        assert all(v == 0 for v in s["mismatches"].values()), r["steps"]
        assert s["weights_off_torch_rounding"] <= max(8, r["params"] // 20_000), s  # exact ties only
    assert r["steps"][-1]["loss"] == r["steps"][-1]["loss"]  # not NaN
    assert abs(r["master_weights_gib"] - r["master_weights_expected_gib"]) < 0.01, r
    assert r["reload_equal"], r


@needs_cuda
def test_recompute_above_tokens_recomputes_long_microbatches_with_the_same_step(tmp_path: Path) -> None:
    """learner.megatron.recompute_above_tokens: micro-batches above the threshold recompute their
    layers (less memory), the step's loss and gradient norm stay those of no recompute; auto with
    memory to spare recomputes nothing, with memory for some layers only some of them."""
    runs = {}
    for rc, extra in (("0", ()), ("1024", ()), ("auto", ()), ("partial", ("--partial",))):
        out = tmp_path / f"recompute_{rc}.json"
        _run(1, "--mode", "recompute", "--recompute", "auto" if rc == "partial" else rc, *extra,
             "--workdir", str(tmp_path), "--out", str(out))
        runs[rc] = json.loads(out.read_text())
    off, on, auto, part = runs["0"], runs["1024"], runs["auto"], runs["partial"]
    assert off["recomputed"] == 0 and 0 < on["recomputed"] <= on["microbatches"], runs
    assert auto["recomputed"] == 0, runs
    for r in (on, part):
        assert abs(r["loss"] - off["loss"]) <= 1e-3 * max(1.0, abs(off["loss"])), runs
        assert abs(r["grad_norm"] - off["grad_norm"]) <= 1e-2 * off["grad_norm"], runs
    assert on["peak_above_start_gib"] < off["peak_above_start_gib"], runs
    # auto with memory for about half the layers: some micro-batches recompute some of their layers,
    # and the step's peak lies below none recomputed, at or above all (the optimizer's first step,
    # its moments made then, may be the peak of both)
    assert part["recomputed"] > 0 and 0 < part["recomputed_layers"] < part["layers"], runs
    assert on["peak_above_start_gib"] - 1e-3 <= part["peak_above_start_gib"] < off["peak_above_start_gib"], runs


@needs_cuda
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_recomputed_layers_that_keep_their_attention_give_the_same_step(tmp_path: Path, attention: str) -> None:
    """learner.megatron.recompute_keeps_attention on CUDA (cuDNN's SDPA, compiled FlexAttention): the
    recomputed layers keep their attention and the step's loss and gradient norm stay those of plain
    recompute, at a peak no lower than plain recompute's."""
    runs = {}
    for name, extra in (("plain", ()), ("kept", ("--keep-attention",))):
        out = tmp_path / f"{name}.json"
        _run(1, "--mode", "recompute", "--recompute", "1024", "--attention", attention, *extra,
             "--workdir", str(tmp_path), "--out", str(out))
        runs[name] = json.loads(out.read_text())
    plain, kept = runs["plain"], runs["kept"]
    assert plain["recomputed"] > 0 and plain["attention_kept_layers"] == 0, runs
    assert kept["recomputed"] == plain["recomputed"] and kept["attention_kept_layers"] == kept["recomputed_layers"] > 0, runs
    assert abs(kept["loss"] - plain["loss"]) <= 1e-3 * max(1.0, abs(plain["loss"])), runs
    assert abs(kept["grad_norm"] - plain["grad_norm"]) <= 1e-2 * plain["grad_norm"], runs
    assert kept["peak_above_start_gib"] >= plain["peak_above_start_gib"] - 1e-3, runs


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_2_matches_tp_1(tmp_path: Path) -> None:
    outs = {}
    for tp in (1, 2):
        outs[tp] = tmp_path / f"tp{tp}.json"
        _run(tp, "--mode", "logprobs", "--tp", str(tp), "--workdir", str(tmp_path), "--out", str(outs[tp]))
    a, b = (json.loads(outs[tp].read_text())["logprobs"] for tp in (1, 2))
    diff = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    mean = sum(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / sum(len(r) for r in a)
    # Different reduction orders in bf16: small, never structural.
    assert mean < 2e-2 and diff < 0.5, (mean, diff)
