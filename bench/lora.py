"""LoRA vs full fine-tuning on one GPU, side by side: refit seconds and bytes, trajectories/s, the
largest shape that trains, and the engine's logprobs with an adapter vs the learner's.

Parts (``--parts``, any subset, in this order; the JSON at ``--out`` is rewritten after each):

- ``refit``: a vLLM engine (random weights, ``load_format=dummy``, bf16) at the 1.5B and the
  Qwen2.5-7B shape, once without and once with LoRA; the full weights (CUDA IPC of one flat GPU
  buffer, the colocated transport) vs the adapter's tensors (rank ``--rank`` on every linear
  layer, the same transport, loaded in place), each ``--repeats`` times: seconds (median, with
  packing the buffer) and megabytes moved.
- ``fit``: two learner steps (the torch learner's pieces: HF model, SDPA forward of equal-length
  rows, chunked logprobs, AdamW) at 1.5B/3B/7B/14B, full fine-tuning vs LoRA, each in a process of its
  own: peak and resident GPU memory, or OOM; "fits colocated" also counts the engine beside it.
- ``agreement``: a 1.5B-shaped checkpoint, a random adapter refit into the engine by CUDA IPC;
  tokens sampled at T = 1 scored again by the learner (HF + PEFT, bf16): mean/max |diff| and the
  k3 mismatch KL, with the base (no adapter) beside it as the bf16 floor.
- ``e2e``: bench/gpu_e2e.py's loop (multi-turn tool workload, engine + learner on one GPU:
  ``--e2e-placement`` colocated, the engine asleep in each learner step, or split, both awake)
  at ``--e2e-shape`` (1.5b; 3b, 7b, 14b: random weights of that Qwen2.5 shape) for each of
  ``--learners`` (torch_full, torch_lora: served as an adapter, torch_lora_merged:
  ``learner.lora.serve=merged``, megatron_full): trajectories/s, refit seconds, learner memory;
  then each LoRA mode's ratio to torch_full.

    python bench/lora.py --parts refit,fit,agreement --out $OUT/lora_a.json   # device (bench/device_lora.sh)
    python bench/lora.py --parts e2e --out $OUT/lora_b.json
    python bench/lora.py --parts e2e --e2e-shape 7b --out $OUT/lora_b7.json
    python bench/lora.py --parts e2e --e2e-placement split --engine-mem 0.2 --out $OUT/lora_b.json
    python bench/lora.py --cpu --out /tmp/lora_cpu.json                # CPU: tiny shapes, every part
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Qwen2.5 shapes (random weights). 1.5B/3B tie the embeddings; 7B/14B do not.
SHAPES: dict[str, dict[str, Any]] = {
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "14b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    # --cpu stand-ins (the harness on the CPU machine)
    "cpu-s": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "cpu-m": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def qwen2_config(shape: str):
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       bos_token_id=0, eos_token_id=1, pad_token_id=0)


def config_dir(out: Path, shape: str) -> str:
    """A model directory with the shape's config and the tiny tokenizer, no weights (vLLM's dummy load)."""
    from agentrl.model.tiny import bootstrap_tiny

    out = Path(out)
    if not (out / "shape.txt").is_file() or (out / "shape.txt").read_text() != shape:
        bootstrap_tiny(out, log=lambda *a, **k: None)
        for f in out.glob("model*.safetensors"):
            f.unlink()
        qwen2_config(shape).save_pretrained(out)
        (out / "shape.txt").write_text(shape)
    return str(out)


def meta_linears(shape: str) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, int]]]:
    """HF weight names -> shapes, and adapted linear module names -> (in, out), from a meta model."""
    import torch
    from transformers import Qwen2ForCausalLM

    cfg = qwen2_config(shape)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    weights = {k: tuple(v.shape) for k, v in model.state_dict().items()
               if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    linears = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in TARGETS}
    return weights, linears


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# -- refit -----------------------------------------------------------------------------------------
def bench_refit(args: argparse.Namespace, shapes: list[str]) -> list[dict[str, Any]]:
    import torch

    from agentrl.config import EngineConfig, LoRAConfig
    from agentrl.engine.vllm_engine import VLLMEngine
    from agentrl.weights.transports import RefitPayload, flatten_weights, ipc_handle, spec_to_bytes

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for shape in shapes:
        model_dir = config_dir(Path(args.workdir) / f"cfg-{shape}", shape)
        weight_shapes, linears = meta_linears(shape)
        for mode in ("full", "lora"):
            gen = torch.Generator(device=device).manual_seed(0)
            if mode == "full":
                tensors = {k: (torch.randn(s, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)
                           for k, s in weight_shapes.items()}
            else:
                tensors = {}
                for name, (fan_in, fan_out) in linears.items():
                    prefix = f"base_model.model.{name}"
                    tensors[f"{prefix}.lora_A.weight"] = (torch.randn(args.rank, fan_in, generator=gen, device=device) * 0.01).to(dtype)
                    tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, args.rank, generator=gen, device=device) * 0.01).to(dtype)
            lora = LoRAConfig(rank=args.rank, alpha=2 * args.rank) if mode == "lora" else None
            eng_cfg = EngineConfig(num_gpus=1 if cuda else 0, gpu_memory_utilization=args.refit_engine_mem,
                                   max_model_len=1024, enforce_eager=True, max_num_seqs=16)
            row: dict[str, Any] = {"shape": shape, "mode": mode, "tensors": len(tensors)}

            async def scenario(model_dir: str, eng_cfg: Any, lora: Any, mode: str, tensors: dict, row: dict) -> None:
                eng = VLLMEngine(model_dir, eng_cfg, dtype="bfloat16" if cuda else "float32", lora=lora,
                                 engine_args={"load_format": "dummy"})
                t0 = time.perf_counter()
                await eng.start()
                row["engine_start_s"] = time.perf_counter() - t0
                times, packs = [], []
                try:
                    for v in range(1, args.repeats + 2):
                        t0 = time.perf_counter()
                        if cuda:
                            buf, spec = flatten_weights(tensors)
                            torch.cuda.synchronize()
                            payload: Any = RefitPayload("cuda_ipc", spec_to_bytes(spec), ipc_handle(buf))
                            row["megabytes"] = spec.nbytes / 1e6
                        else:
                            payload = tensors
                            row["megabytes"] = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
                        t1 = time.perf_counter()
                        await eng.update_weights(payload, v)
                        times.append(time.perf_counter() - t0)
                        packs.append(t1 - t0)
                        del payload
                        if cuda:
                            del buf
                        out = await eng.generate(list(range(10, 30)), max_tokens=4, temperature=0.0)
                        assert out.versions == [v] * len(out.token_ids)
                    if mode == "lora":
                        await refit_direct(eng, tensors, row, args)
                finally:
                    eng.shutdown()
                row["first_refit_s"] = times[0]  # the first load allocates; the rest are steady state
                row["refit_s_median"] = statistics.median(times[1:])
                row["refit_s_all"] = [round(t, 4) for t in times]
                row["pack_s_median"] = statistics.median(packs[1:])

            asyncio.run(scenario(model_dir, eng_cfg, lora, mode, tensors, row))
            del tensors
            if cuda:
                torch.cuda.empty_cache()
            print(f"[refit] {json.dumps(row)}", flush=True)
            rows.append(row)
    return rows


async def refit_direct(eng: Any, tensors: dict, row: dict[str, Any], args: argparse.Namespace) -> None:
    """The file-free adapter swap (worker_ext.agentrl_swap_adapter) beside the engine's file path:
    its seconds, and whether it gives the same greedy output as the file path for the same adapter."""
    import torch

    from agentrl.learner.lora import adapter_config, write_adapter_dir
    from agentrl.weights.transports import flatten_weights, ipc_handle, spec_to_bytes

    cuda = torch.cuda.is_available()
    config_json = json.dumps(adapter_config(eng.lora, eng.model_path))

    async def swap(ts: dict) -> float:
        t0 = time.perf_counter()
        if cuda:
            buf, spec = flatten_weights(ts)
            torch.cuda.synchronize()
            source, layout = ipc_handle(buf), spec_to_bytes(spec)
        else:
            source, layout = str(write_adapter_dir(Path(args.workdir) / "direct", ts, {}) / "adapter_model.safetensors"), None
        await eng.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await eng.llm.collective_rpc("agentrl_swap_adapter", args=(source, layout, config_json, eng.LORA_ID))
            await eng.llm.reset_prefix_cache()
        finally:
            await eng.llm.resume_generation()
        return time.perf_counter() - t0

    prompt = list(range(10, 40))

    async def greedy() -> list[int]:
        return (await eng.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)).token_ids

    try:
        times = [await swap(tensors) for _ in range(args.repeats)]
        row["direct_swap_s_median"] = statistics.median(times)
        row["direct_swap_s_all"] = [round(t, 4) for t in times]
        other = {k: v * 50 for k, v in tensors.items()}  # large enough to move the greedy output
        await swap(other)
        direct_other = await greedy()
        await eng.update_weights(other, eng.version + 1)
        file_other = await greedy()
        await swap(tensors)
        direct_first = await greedy()
        await eng.update_weights(tensors, eng.version + 1)
        file_first = await greedy()
        row["direct_equals_file_path"] = direct_other == file_other and direct_first == file_first
        row["adapters_differ_in_output"] = file_other != file_first
    except Exception as err:  # data for the follow-up, never a failed benchmark
        row["direct_swap_error"] = f"{type(err).__name__}: {str(err)[:400]}"


# -- fit -------------------------------------------------------------------------------------------
def fit_one(shape: str, mode: str, tokens: int, rank: int) -> dict[str, Any]:
    """One process: build the model on the device, take two learner steps, report memory."""
    import torch

    from agentrl.config import LoRAConfig
    from agentrl.learner.hf_forward import padded_token_logprobs
    from agentrl.learner.lora import wrap_model
    from agentrl.learner.optim import adamw

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    from transformers import Qwen2ForCausalLM

    cfg = qwen2_config(shape)
    cfg._attn_implementation = "sdpa"
    out: dict[str, Any] = {"shape": shape, "mode": mode, "tokens_per_step": tokens}
    t0 = time.perf_counter()
    try:
        torch.manual_seed(0)
        torch.set_default_dtype(dtype)  # built in bf16 directly: an fp32 14B would not fit while converting
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
        torch.set_default_dtype(torch.float32)
        if cuda:
            torch.cuda.reset_peak_memory_stats()  # the step's peak, not the construction's
        out["parameters_b"] = sum(p.numel() for p in model.parameters()) / 1e9
        if mode == "lora":
            model = wrap_model(model, LoRAConfig(rank=rank, alpha=2 * rank))
        model.eval()
        params = [p for p in model.parameters() if p.requires_grad]
        out["trainable_b"] = sum(p.numel() for p in params) / 1e9
        opt = adamw(params, 1e-5)
        seq = 1024
        gen = torch.Generator().manual_seed(0)
        # Equal-length rows through SDPA (the learner's packed FlexAttention would compile for ~30 s
        # in every process; the memory is the same: weights, grads, Adam state, activations).
        seqs = [torch.randint(2, 700, (seq,), generator=gen).tolist() for _ in range(max(1, tokens // seq))]
        for _ in range(2):  # Adam's state exists from the first step on
            lp = padded_token_logprobs(model, seqs, chunk_size=1024)
            loss = -(lp * torch.randn(lp.shape, device=lp.device)).sum() / lp.numel()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            out["resident_gib"] = torch.cuda.memory_allocated() / 2**30  # weights + Adam state between steps
            out["device_gib"] = torch.cuda.mem_get_info()[1] / 2**30
        out["status"] = "ok"
    except torch.OutOfMemoryError as err:
        out["status"] = "OOM"
        out["error"] = str(err).splitlines()[0][:300]
    out["seconds"] = time.perf_counter() - t0
    return out


def bench_fit(args: argparse.Namespace, shapes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for mode in ("full", "lora"):
        for shape in shapes:
            cmd = [sys.executable, __file__, "--fit-one", shape, mode, "--fit-tokens", str(args.fit_tokens),
                   "--rank", str(args.rank)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.fit_timeout)
                lines = [x for x in done.stdout.splitlines() if x.startswith("FIT ")]
                row = json.loads(lines[-1][4:]) if lines else {
                    "shape": shape, "mode": mode, "status": f"failed (rc {done.returncode})",
                    "error": (done.stderr or done.stdout)[-600:]}
            except subprocess.TimeoutExpired:
                row = {"shape": shape, "mode": mode, "status": f"timeout ({args.fit_timeout} s)"}
            if "peak_gib" in row:
                # Colocated (engine asleep during the step, awake beside the learner's resident state):
                # the step's peak beside a sleeping engine, and the resident state beside an awake
                # engine holding the bf16 weights plus --engine-kv-gib of KV cache.
                weights_gib = row["parameters_b"] * 2 * 1e9 / 2**30
                row["engine_awake_gib"] = weights_gib + args.engine_kv_gib
                row["fits_colocated"] = (row["peak_gib"] + args.engine_asleep_gib <= row["device_gib"]
                                         and row["resident_gib"] + row["engine_awake_gib"] <= row["device_gib"])
            print(f"[fit] {json.dumps(row)}", flush=True)
            rows.append(row)
            if row.get("status") != "ok":
                break  # larger shapes of this mode will not fit either
    return rows


# -- agreement -------------------------------------------------------------------------------------
def bench_agreement(args: argparse.Namespace, shape: str) -> dict[str, Any]:
    import torch

    from agentrl.config import EngineConfig, LoRAConfig
    from agentrl.engine.vllm_engine import VLLMEngine
    from agentrl.learner.hf_forward import padded_token_logprobs
    from agentrl.learner.lora import adapter_tensors, wrap_model
    from agentrl.model.loading import load_hf_model
    from agentrl.weights.transports import RefitPayload, flatten_weights, ipc_handle, spec_to_bytes
    from bench.peers.common import make_model

    cuda = torch.cuda.is_available()
    dtype = "bfloat16" if cuda else "float32"
    if cuda:  # the checkpoint the e2e part trains too (bench/gpu_e2e.py's 1.5B shape)
        from bench.gpu_e2e import make_model as make_1p5b

        model_dir = make_1p5b(Path(args.workdir) / "qwen2.5-1.5b-shape")
    else:
        model_dir = make_model(Path(args.workdir) / "ckpt-cpu", "cpu")
    lora = LoRAConfig(rank=args.rank, alpha=2 * args.rank)
    model = wrap_model(load_hf_model(model_dir, dtype, "cuda" if cuda else "cpu"), lora, model_dir).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:  # a trained-looking adapter: B away from its zero init
                p.copy_((torch.randn(p.shape, generator=gen) * args.agreement_b_scale).to(p.dtype))
    prompts = [list(range(5 + k, 69 + k)) for k in range(8)]
    result: dict[str, Any] = {"shape": "1.5b" if cuda else "cpu", "rank": args.rank, "dtype": dtype}

    def compare(samples, use_adapter: bool) -> dict[str, float]:
        seqs = [p + s.token_ids for p, s in zip(prompts, samples)]
        with torch.no_grad():
            if use_adapter:
                lp = padded_token_logprobs(model, seqs)
            else:
                with model.disable_adapter():
                    lp = padded_token_logprobs(model, seqs)
        diffs, kl = [], []
        for row, p, s in zip(lp.float().cpu(), prompts, samples):
            for i, (tok_lp) in enumerate(s.logprobs):
                d = tok_lp - float(row[len(p) + i])
                diffs.append(abs(d))
                kl.append(float(torch.expm1(torch.tensor(-d))) + d)
        return {"tokens": len(diffs), "mean_abs": statistics.fmean(diffs), "max_abs": max(diffs),
                "mismatch_kl_k3": statistics.fmean(kl)}

    async def scenario() -> None:
        eng = VLLMEngine(model_dir, EngineConfig(num_gpus=1 if cuda else 0, gpu_memory_utilization=0.3,
                                                 max_model_len=1024, enforce_eager=True), dtype=dtype, lora=lora)
        await eng.start()
        try:
            base = [await eng.generate(p, max_tokens=64, temperature=1.0, ignore_eos=True, seed=k)
                    for k, p in enumerate(prompts)]
            tensors = adapter_tensors(model, device=None if cuda else "cpu")
            if cuda:
                buf, spec = flatten_weights(tensors)
                torch.cuda.synchronize()
                result["refit_s"] = await eng.update_weights(RefitPayload("cuda_ipc", spec_to_bytes(spec),
                                                                          ipc_handle(buf)), 1)
                del buf
            else:
                result["refit_s"] = await eng.update_weights(tensors, 1)
            adapted = [await eng.generate(p, max_tokens=64, temperature=1.0, ignore_eos=True, seed=k)
                       for k, p in enumerate(prompts)]
        finally:
            eng.shutdown()
        result["base_engine_vs_learner"] = compare(base, use_adapter=False)
        result["adapter_engine_vs_learner"] = compare(adapted, use_adapter=True)
        result["adapter_changed_samples"] = sum(a.token_ids != b.token_ids for a, b in zip(adapted, base))

    asyncio.run(scenario())
    print(f"[agreement] {json.dumps(result)}", flush=True)
    return result


# -- e2e -------------------------------------------------------------------------------------------
LEARNERS = {
    "torch_full": ["learner.backend=torch", "learner.lr=1e-6"],
    "torch_lora": ["learner.backend=torch", "learner.lr=1e-5", "learner.lora.rank={rank}",
                   "learner.lora.alpha={alpha}"],
    "torch_lora_merged": ["learner.backend=torch", "learner.lr=1e-5", "learner.lora.rank={rank}",
                          "learner.lora.alpha={alpha}", "learner.lora.serve=merged"],
    "megatron_full": [],  # configs/gpu_1x.yaml's learner
}


def bench_e2e(args: argparse.Namespace, report: dict[str, Any] | None = None, save: Any = None) -> dict[str, Any]:
    import bench.gpu_e2e as e2e

    cuda = _cuda()
    if not cuda:  # the same loop on CPU: tiny model, no NVML, no colocation
        class NoBusy:
            def __enter__(self): return self
            def __exit__(self, *exc): return None
            def fraction(self, since: float = 0.0) -> float: return 0.0

        e2e.GpuBusy = NoBusy  # type: ignore[assignment]
        from bench.peers.common import make_model

        model = make_model(Path(args.workdir) / "ckpt-cpu", "cpu")
        placement = "split"
        base_set = ["engine.num_gpus=0", "learner.num_gpus=0", "colocate.enabled=false", "model.dtype=float32",
                    "cluster.num_cpus=2", "engine.num_cpus=1", "learner.num_cpus=1", "engine.kv_cache_gib=1",
                    "rollout.max_total_tokens=1024", "engine.max_model_len=1024", "packing.max_tokens_per_microbatch=2048"]
    else:
        shape = args.e2e_shape
        model = e2e.make_model(Path(args.workdir) / f"qwen2.5-{shape}-shape", qwen2_config(shape),
                               init_dtype="float32" if shape == "1.5b" else "bfloat16")
        placement = args.e2e_placement
        base_set = []
    ns = argparse.Namespace(
        workdir=args.workdir, seconds=args.e2e_seconds, tool_latency=args.tool_latency, obs_words=args.obs_words,
        turns=args.turns, new_tokens=args.new_tokens, group_size=args.group_size, groups_per_step=args.groups_per_step,
        concurrent_groups=args.concurrent_groups, max_num_seqs=args.max_num_seqs, engine_eager=args.engine_eager,
        engine_mem_colocated=args.engine_mem, engine_mem_split=args.engine_mem, set=[])
    runs: dict[str, Any] = {}
    out: dict[str, Any] = {"placement": placement, "max_staleness": args.staleness, "runs": runs,
                           "shape": args.e2e_shape if cuda else "cpu"}
    for name in args.learners.split(","):
        ns.set = base_set + [s.format(rank=args.rank, alpha=2 * args.rank) for s in LEARNERS[name]] + args.set
        t0 = time.perf_counter()
        try:
            res = e2e.run_one(model, ns, placement=placement, staleness=args.staleness)
        except Exception as err:  # a run that fails (OOM included) is data; the next one still runs
            res = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
        res["total_s"] = time.perf_counter() - t0
        runs[name] = res
        print(f"[e2e] {name}: {json.dumps(res)}", flush=True)
        if report is not None and save is not None:  # a later run that overruns the call keeps this one
            report["e2e"] = out
            save()
    full = runs.get("torch_full", {}).get("trajectories_per_s")
    for name, key in (("torch_lora", "lora_over_full_trajectories_per_s"),
                      ("torch_lora_merged", "lora_merged_over_full_trajectories_per_s")):
        tps = runs.get(name, {}).get("trajectories_per_s")
        if full and tps:
            out[key] = tps / full
    return out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="lora.json")
    p.add_argument("--workdir", default="/tmp/bench_lora")
    p.add_argument("--cpu", action="store_true", help="tiny shapes on CPU: checks the harness end to end")
    p.add_argument("--parts", default="refit,fit,agreement,e2e")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 * rank), every linear layer")
    p.add_argument("--refit-shapes", default="1.5b,7b")
    p.add_argument("--refit-engine-mem", type=float, default=0.35)
    p.add_argument("--repeats", type=int, default=5, help="timed refits per engine (after a first one)")
    p.add_argument("--fit-shapes", default="1.5b,3b,7b,14b")
    p.add_argument("--fit-tokens", type=int, default=8192, help="tokens in the learner step's batch")
    p.add_argument("--fit-timeout", type=float, default=150.0)
    p.add_argument("--engine-asleep-gib", type=float, default=2.0, help="a sleeping engine's residue (context)")
    p.add_argument("--engine-kv-gib", type=float, default=4.0, help="KV cache an awake colocated engine needs")
    p.add_argument("--agreement-b-scale", type=float, default=0.01)
    p.add_argument("--learners", default="torch_full,torch_lora_merged,torch_lora", help=f"of {', '.join(LEARNERS)}")
    p.add_argument("--e2e-shape", default="1.5b", choices=[s for s in SHAPES if not s.startswith("cpu")],
                   help="model shape of the e2e part on the GPU (random weights; --cpu: the tiny model)")
    p.add_argument("--e2e-seconds", type=float, default=60.0, help="timed training per learner")
    p.add_argument("--e2e-placement", default="colocated", choices=["colocated", "split"], help="GPU: the engine "
                   "asleep in each learner step (configs/gpu_1x.yaml), or awake beside the learner (--engine-mem its share)")
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--tool-latency", type=float, default=0.5)
    p.add_argument("--obs-words", type=int, default=150)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--concurrent-groups", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--engine-eager", action="store_true")
    p.add_argument("--engine-mem", type=float, default=0.3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (e2e runs)")
    p.add_argument("--fit-one", nargs=2, metavar=("SHAPE", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = [n for n in args.learners.split(",") if n not in LEARNERS]
    if unknown:
        p.error(f"--learners: unknown {', '.join(unknown)} (known: {', '.join(LEARNERS)})")
    if args.fit_one:
        print("FIT " + json.dumps(fit_one(args.fit_one[0], args.fit_one[1], args.fit_tokens, args.rank)), flush=True)
        return
    if args.cpu:
        args.refit_shapes, args.fit_shapes, args.repeats, args.fit_tokens = "cpu-s,cpu-m", "cpu-s,cpu-m", 2, 1024
        args.e2e_seconds, args.tool_latency, args.obs_words, args.turns = 15.0, 0.05, 20, 2
        args.new_tokens, args.group_size, args.groups_per_step, args.concurrent_groups = 16, 4, 2, 2
        args.max_num_seqs, args.staleness = 32, 1
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    import torch

    report: dict[str, Any] = {"date": _now(), "commit": _commit(), "cpu_mode": args.cpu, "rank": args.rank,
                              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                              "args": vars(args)}

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))

    parts = args.parts.split(",")
    for part in ("refit", "fit", "agreement", "e2e"):
        if part not in parts:
            continue
        t0 = time.perf_counter()
        try:
            if part == "refit":
                report["refit"] = bench_refit(args, args.refit_shapes.split(","))
            elif part == "fit":
                report["fit"] = bench_fit(args, args.fit_shapes.split(","))
            elif part == "agreement":
                report["agreement"] = bench_agreement(args, "1.5b")
            else:
                report["e2e"] = bench_e2e(args, report, save)
        except Exception as err:  # later parts still run; the error is part of the report
            import traceback

            traceback.print_exc()
            report[f"{part}_error"] = f"{type(err).__name__}: {str(err)[:800]}"
        report[f"{part}_seconds"] = time.perf_counter() - t0
        save()
    summarize(report)


def summarize(r: dict[str, Any]) -> None:
    print(f"\nLoRA bench on {r['device']} ({r['date']}, commit {r['commit']}), rank {r['rank']}")
    if r.get("refit"):
        print(f"{'shape':6s} {'mode':5s} {'MB':>9s} {'refit s':>8s} {'pack s':>7s} {'first s':>8s}")
        for x in r["refit"]:
            print(f"{x['shape']:6s} {x['mode']:5s} {x['megabytes']:9.1f} {x['refit_s_median']:8.4f} "
                  f"{x['pack_s_median']:7.4f} {x['first_refit_s']:8.4f}"
                  + (f"  file-free swap {x['direct_swap_s_median']:.4f} s, same output as the file path: "
                     f"{x.get('direct_equals_file_path')}" if "direct_swap_s_median" in x else "")
                  + (f"  file-free swap failed: {x['direct_swap_error']}" if "direct_swap_error" in x else ""))
        by = {(x["shape"], x["mode"]): x for x in r["refit"]}
        for shape in dict.fromkeys(x["shape"] for x in r["refit"]):
            f, lo = by.get((shape, "full")), by.get((shape, "lora"))
            if f and lo:
                print(f"  {shape}: adapter refit {f['refit_s_median'] / lo['refit_s_median']:.1f}x faster, "
                      f"{f['megabytes'] / lo['megabytes']:.0f}x fewer bytes than full weights")
    if r.get("fit"):
        print(f"{'shape':6s} {'mode':5s} {'status':8s} {'peak GiB':>9s} {'resident':>9s} {'colocated':>9s}")
        for x in r["fit"]:
            print(f"{x['shape']:6s} {x['mode']:5s} {x['status'][:8]:8s} {x.get('peak_gib', float('nan')):9.1f} "
                  f"{x.get('resident_gib', float('nan')):9.1f} {str(x.get('fits_colocated', '-')):>9s}")
    if r.get("agreement"):
        a = r["agreement"]
        for key in ("base_engine_vs_learner", "adapter_engine_vs_learner"):
            v = a[key]
            print(f"{key}: mean |d| {v['mean_abs']:.2e}, max {v['max_abs']:.2e}, mismatch KL k3 {v['mismatch_kl_k3']:.2e}")
    if r.get("e2e"):
        for name, x in r["e2e"]["runs"].items():
            print(f"e2e {name:14s} traj/s {x.get('trajectories_per_s', float('nan')):7.2f}  refit s "
                  f"{x.get('refit_s_mean', float('nan')):6.3f}  {x.get('error', '')}")
        shape = r["e2e"].get("shape", "1.5b")
        for key, mode in (("lora_over_full_trajectories_per_s", "served as an adapter"),
                          ("lora_merged_over_full_trajectories_per_s", "served merged")):
            if key in r["e2e"]:
                print(f"LoRA {mode} / full FT trajectories/s (torch learner, {shape}): {r['e2e'][key]:.2f}x")


if __name__ == "__main__":
    main()
