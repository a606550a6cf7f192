"""Question: does the Megatron learner compute what Hugging Face does (logprobs, a train step, save/load, TP)?
GPU correctness checks, run under torchrun by tests/test_megatron_gpu.py.

Modes (all on a random model written to ``--workdir`` as an HF checkpoint, bf16; Qwen2 unless
``--family qwen3`` or ``llama``):

* ``hf``: (world 1) packed logprobs vs Hugging Face (bf16 SDPA, and float32 as the truth); one
  ``train_step`` vs the torch learner on the same batch (loss, grad norm); save -> step -> load
  restores weights, logprobs and the step counter.
* ``remainders``: (world 1) ``learner.megatron.master_weight_remainders``: each of 3 steps leaves
  the fp32 masters, Adam's moments and the bf16 weights that torch's fused AdamW makes from the
  masters before the step and the step's (clipped) gradients, bit for bit; the masters take 2
  bytes a parameter; save -> step -> load restores them bit for bit.
* ``recompute``: (world 1) one ``train_step`` with ``learner.megatron.recompute_above_tokens =
  --recompute`` (an integer or ``auto``): its loss, gradient norm, how many micro-batches recomputed
  layers (and how many a micro-batch, on average) and the step's peak memory, for comparing runs with
  and without recompute; ``--partial`` (with auto) stands in a free memory that holds about half the
  layers' activations of a full micro-batch, so auto recomputes only some layers.
* ``logprobs``: (any world / TP) logprobs of the fixed trajectories, written to ``--out`` (JSON),
  so TP=2 can be compared with TP=1.

Example:
    torchrun --nproc-per-node 1 tools/megatron_check.py --mode hf --workdir /tmp/mc --out /tmp/hf.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import torch

__all__ = ["make_model_dir", "make_trajectories"]

SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1000000.0)
LENGTHS = [700, 1500, 37, 1200, 333, 2048, 90]


FAMILIES = ("qwen2", "qwen3", "llama")


def make_model_dir(path: Path, family: str = "qwen2") -> Path:
    """A random HF checkpoint of ``SHAPE`` (bf16 safetensors), made once per workdir: Qwen2 (QKV
    bias, tied embedding), Qwen3 (q/k RMSNorm, no bias, tied) or Llama (untied LM head)."""
    import transformers

    if (path / "config.json").exists():
        return path
    config_cls, model_cls, extra = {
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": SHAPE["hidden_size"] // SHAPE["num_attention_heads"]}),
        "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    }[family]
    torch.manual_seed(0)
    hf_config = getattr(transformers, config_cls)(**{**SHAPE, **extra})
    model = getattr(transformers, model_cls)(hf_config).to(torch.bfloat16)
    with torch.no_grad():  # non-trivial norms (q/k norms included) and biases
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_trajectories(seed: int = 0) -> list:
    """Groups of multi-turn-like trajectories: a prompt (mask 0) then sampled tokens (mask 1)."""
    from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

    rng = random.Random(seed)
    groups = []
    for g in range(2):
        trajs = []
        for n in LENGTHS[g::2] + LENGTHS[:1]:
            p = max(1, n // 5)
            trajs.append(Trajectory(
                token_ids=[rng.randrange(SHAPE["vocab_size"]) for _ in range(n)],
                loss_mask=[0] * p + [1] * (n - p),
                behavior_logprobs=[0.0] * p + [-rng.uniform(0.5, 12.0) for _ in range(n - p)],
                policy_versions=[-1] * p + [0] * (n - p),
                turn_spans=[(p, n)], turn_rewards=[rng.choice([0.0, 1.0])],
            ))
        groups.append(TrajectoryGroup(task_id=f"t{g}", trajectories=trajs, group_id=g))
    return groups


def config(model_dir: Path, tp: int = 1, attention: str = "flex", zero_copy: bool = False, remainders: bool = False,
           recompute: str = "0"):
    from agentrl.config import load_config

    return load_config(None, [f"learner.megatron.master_weight_remainders={str(remainders).lower()}",
        f"learner.megatron.recompute_above_tokens={recompute}",
        f"model.path={model_dir}", "model.dtype=bfloat16", "learner.backend=megatron", f"learner.num_gpus={tp}",
        f"learner.megatron.tensor_parallel_size={tp}", f"learner.megatron.attention={attention}",
        "packing.max_tokens_per_microbatch=4096", "rollout.max_total_tokens=2048", "engine.max_model_len=4096",
        "rollout.temperature=0.9", "learner.lr=1e-4", f"refit.zero_copy={str(zero_copy).lower()}",
    ])


def hf_logprobs(model_dir: Path, trajs: list, dtype: torch.dtype, temperature: float) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa").cuda()
    out = []
    with torch.no_grad():
        for t in trajs:
            ids = torch.tensor([t.token_ids], device="cuda")
            logits = model(ids).logits[0].float() / temperature
            lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            out.append(torch.cat([lp.new_zeros(1), lp]).cpu())
    del model
    torch.cuda.empty_cache()
    return out


def check_hf(args: argparse.Namespace) -> dict:
    from agentrl.learner.megatron.learner import MegatronLearner
    from agentrl.learner.torch_learner import TorchLearner

    model_dir = make_model_dir(Path(args.workdir) / "model", args.family)
    groups = make_trajectories()
    trajs = [t for g in groups for t in g.trajectories]
    # the parameters gathered into one buffer (refit.zero_copy): every step, save and load below runs on them
    cfg = config(model_dir, attention=args.attention, zero_copy=True)
    temp = cfg.rollout.temperature
    ref32 = hf_logprobs(model_dir, trajs, torch.float32, temp)
    ref16 = hf_logprobs(model_dir, trajs, torch.bfloat16, temp)
    from agentrl.learner.common import STARTUP

    STARTUP.restart()
    learner = MegatronLearner(cfg)
    build_marks = dict(STARTUP.marks)  # where its build went (run_agentrl reports it for each run)
    mega = [torch.tensor(x) for x in learner.logprobs(trajs)]
    from agentrl.learner.optim import torch_optimizers

    def fused() -> bool:  # every AdamW group on torch's fused kernel (agentrl.learner.optim.fuse_adamw)
        groups = [g for o in torch_optimizers(learner.optimizer) for g in o.param_groups]
        return bool(groups) and all(g.get("fused") for g in groups)

    def err(a: list, b: list) -> tuple[float, float]:
        d = torch.cat([(x - y).abs() for x, y in zip(a, b)])
        return float(d.max()), float(d.mean())

    res: dict = {"family": args.family, "lengths": [len(t) for t in trajs], "build_marks": build_marks}
    res["mega_vs_fp32_max"], res["mega_vs_fp32_mean"] = err(mega, ref32)
    res["hfbf16_vs_fp32_max"], res["hfbf16_vs_fp32_mean"] = err(ref16, ref32)
    res["mega_vs_hfbf16_max"], res["mega_vs_hfbf16_mean"] = err(mega, ref16)
    res["first_token_zero"] = all(float(x[0]) == 0.0 for x in mega)

    # Step 1 (compared with the torch learner below), then save; step 2; load; step 2 again.
    m_metrics = learner.train_step(groups)
    lp1 = [torch.tensor(x) for x in learner.logprobs(trajs)]
    res["weights_changed"] = err(lp1, mega)[0] > 0
    ck = Path(args.workdir) / "ckpt"
    learner.save(ck)
    m2 = learner.train_step(groups)
    lp2 = [torch.tensor(x) for x in learner.logprobs(trajs)]
    res["optimizer_fused_built"] = fused()
    learner.load(ck)
    res["optimizer_fused_loaded"] = fused()
    res["reload_max_diff"] = err([torch.tensor(x) for x in learner.logprobs(trajs)], lp1)[0]
    res["reload_version"] = learner.version
    m2_again = learner.train_step(groups)
    lp2_again = [torch.tensor(x) for x in learner.logprobs(trajs)]
    res["resumed_step_loss"], res["first_step2_loss"] = m2_again["train/loss"], m2["train/loss"]
    res["resumed_step_grad_norm"], res["first_step2_grad_norm"] = m2_again["train/grad_norm"], m2["train/grad_norm"]
    res["resumed_step_lp_max_diff"] = err(lp2_again, lp2)[0]
    res["step2_lp_change"] = err(lp2, lp1)[0]
    from safetensors.torch import load_file

    learner.load(ck)
    saved = load_file(str(ck / "model" / "model.safetensors"))
    exported = learner.export_weights()
    res["export_equals_checkpoint"] = sorted(exported) == sorted(saved) and all(
        torch.equal(exported[k], saved[k]) for k in exported)
    # zero-copy refit: the views of the parameter buffer, as the engine rebuilds them, are the export
    from agentrl.weights.transports import describe_views, unflatten_weights

    buf, views = learner.export_views()
    rebuilt = dict(unflatten_weights(buf, describe_views(buf, views)))
    res["zero_copy_equals_export"] = sorted(rebuilt) == sorted(exported) and all(
        torch.equal(rebuilt[k].cpu(), exported[k]) for k in exported)
    res["zero_copy_buffer_gib"] = round(buf.numel() / 2**30, 3)
    # Same batch through the torch learner (HF model, same loss).
    torch_learner = TorchLearner(cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"num_gpus": 1})}),
                                 device="cuda")
    t_metrics = torch_learner.train_step(groups)
    for k in ("train/loss", "train/grad_norm"):
        res[f"megatron {k}"], res[f"torch {k}"] = m_metrics[k], t_metrics[k]
    res["megatron_metrics"] = m_metrics
    # one process: torch.distributed without NCCL (agentrl.learner.megatron.solo), and what the
    # driver counts for this process beyond its allocator after the steps (NCCL's buffers were here)
    from agentrl.learner.common import PEAKS

    res["dist_backend"] = torch.distributed.get_backend()
    res["outside_allocator_gib"] = {k: round(v, 3) for k, v in PEAKS.report().items() if k.startswith("outside_")}
    return res


def check_remainders(args: argparse.Namespace) -> dict:
    from agentrl.learner.common import learner_memory
    from agentrl.learner.megatron.learner import MegatronLearner
    from agentrl.learner.megatron.remainders import split_master

    model_dir = make_model_dir(Path(args.workdir) / "model", args.family)
    groups = make_trajectories()
    learner = MegatronLearner(config(model_dir, attention=args.attention, zero_copy=True, remainders=True))
    opts = list(getattr(learner.optimizer, "chained_optimizers", None) or [learner.optimizer])
    owned = [(o, p) for o in opts for p in o.model_param_group_index_map]

    def states() -> list[dict]:
        return [{k: v.detach().clone() for k, v in o._get_main_param_and_optimizer_states(p).items()} for o, p in owned]

    def main_of(o, p):
        g, i = o.model_param_group_index_map[p]
        return o.optimizer.param_groups[g], o.optimizer.param_groups[g]["params"][i]

    res: dict = {"family": args.family, "params": sum(p.numel() for _, p in owned), "steps": []}
    for step in range(3):
        before = states()
        metrics = learner.train_step(groups)
        after = states()
        bad = {"master": 0, "exp_avg": 0, "exp_avg_sq": 0, "weights": 0, "step": 0}
        rne_differs = 0
        for (o, p), b, a in zip(owned, before, after):
            group, main = main_of(o, p)
            ref = b["param"].clone()
            m = b.get("exp_avg", torch.zeros_like(ref)).clone()
            v = b.get("exp_avg_sq", torch.zeros_like(ref)).clone()
            n = b.get("step", torch.zeros((), device=ref.device)).to(ref.device)
            # the reference: torch's own AdamW (fused) over a real fp32 master with the same state
            ref_opt = torch.optim.AdamW([ref], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                        weight_decay=group["weight_decay"], fused=True)
            if "exp_avg" in b:
                ref_opt.state[ref] = {"step": n.clone().float(), "exp_avg": m, "exp_avg_sq": v}
            ref.grad = main.grad.reshape(ref.shape).float().clone()
            ref_opt.step()
            m, v = ref_opt.state[ref]["exp_avg"], ref_opt.state[ref]["exp_avg_sq"]
            bad["master"] += int((a["param"].view(torch.int32) != ref.view(torch.int32)).sum())
            bad["exp_avg"] += int((a["exp_avg"] != m).sum())
            bad["exp_avg_sq"] += int((a["exp_avg_sq"] != v).sum())
            bad["step"] += int(float(a["step"]) != float(n) + 1)
            w = p.detach().reshape(-1)
            bad["weights"] += int((w.view(torch.int16) != split_master(ref)[0].view(torch.int16)).sum())
            rne_differs += int((w.view(torch.int16) != ref.to(torch.bfloat16).view(torch.int16)).sum())
        res["steps"].append({"loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"],
                             "mismatches": bad, "weights_off_torch_rounding": rne_differs})
    mem = learner_memory(learner)
    res["master_weights_gib"], res["master_weights_expected_gib"] = mem.get("master_weights", 0.0), res["params"] * 2 / 2**30
    ck = Path(args.workdir) / "ckpt_remainders"
    learner.save(ck)
    saved = states()
    learner.train_step(groups)
    learner.load(ck)
    loaded = states()
    res["reload_equal"] = all(torch.equal(s[k].cpu(), l[k].cpu()) for s, l in zip(saved, loaded) for k in s)
    return res


def check_recompute(args: argparse.Namespace) -> dict:
    from agentrl.learner.megatron.learner import MegatronLearner

    model_dir = make_model_dir(Path(args.workdir) / "model", args.family)
    cfg = config(model_dir, attention=args.attention, recompute=args.recompute)
    cfg.learner.megatron.cuda_graphs = False  # the same eager path in every run (graphs keep their own pools)
    cfg.learner.megatron.recompute_keeps_attention = args.keep_attention
    learner = MegatronLearner(cfg)
    res: dict = {"recompute": args.recompute}
    if args.partial:  # auto, as if the free memory held about half the layers' activations of a full micro-batch
        from agentrl.learner.megatron import model as model_mod

        m = learner.model
        tokens = cfg.packing.max_tokens_per_microbatch
        res["layers"] = len(m.decoder.layers)
        available = next(a for a in (2**20 * k for k in range(1, 2**17))
                         if model_mod.layers_to_recompute(tokens, "auto", shape=m.shape, keep_grad_logits=m.keep_grad_logits,
                                                          available=a, **m._stage_sizes()) <= res["layers"] // 2)
        model_mod._available_bytes = lambda device: available
        res["available_stood_in_gib"] = available / 2**30
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    metrics = learner.train_step(make_trajectories())
    return {**res, "loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"],
            "microbatches": metrics["train/num_microbatches"],
            "recomputed": metrics.get("train/recomputed_microbatches", 0.0),
            "recomputed_layers": metrics.get("train/recomputed_layers", 0.0),
            "attention_kept_layers": metrics.get("train/attention_kept_layers", 0.0),
            "peak_above_start_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["hf", "remainders", "recompute", "logprobs"], required=True)
    ap.add_argument("--recompute", default="0", help="learner.megatron.recompute_above_tokens (recompute mode)")
    ap.add_argument("--partial", action="store_true",
                    help="recompute mode, auto: stand in a free memory that holds about half the layers' activations")
    ap.add_argument("--keep-attention", action="store_true",
                    help="recompute mode: learner.megatron.recompute_keeps_attention")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--attention", default="flex")
    ap.add_argument("--family", choices=FAMILIES, default="qwen2", help="model family of the random checkpoint (hf mode)")
    args = ap.parse_args()
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    if args.mode == "hf":
        res = check_hf(args)
    elif args.mode == "remainders":
        res = check_remainders(args)
    elif args.mode == "recompute":
        res = check_recompute(args)
    else:
        from agentrl.learner.megatron.learner import MegatronLearner

        model_dir = Path(args.workdir) / "model"
        if int(os.environ.get("RANK", "0")) == 0:
            make_model_dir(model_dir)
        torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
        torch.distributed.barrier()
        learner = MegatronLearner(config(model_dir, tp=args.tp, attention=args.attention))
        trajs = [t for g in make_trajectories() for t in g.trajectories]
        res = {"layout": learner.layout.describe(), "logprobs": learner.logprobs(trajs)}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(res))
        print(json.dumps({k: v for k, v in res.items() if k not in ("logprobs", "megatron_metrics")}, indent=1))


if __name__ == "__main__":
    main()
