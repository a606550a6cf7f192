"""TRL's GRPOTrainer on one peer-harness workload (bench/peers/README.md): writes one Result per setting.

TRL is used as installed (pinned: trl 1.16.0), through its public API: `GRPOTrainer` with vLLM in
colocate mode (its recommended one-GPU setting: the engine lives in the trainer's process at
`vllm_gpu_memory_utilization` 0.3 and generation and training alternate), and for the tool
workloads its own multi-turn mechanism: `tools=[lookup]` with `max_tool_calling_iterations`, where
the trainer parses each reply with the tokenizer's `parse_response`, runs the tool and appends the
tool message's tokens. The harness only observes: a `TrainerCallback` stamps each optimizer step,
and TRL's own profiling contexts (`sync_weights`, `vLLM.generate`) are recorded.

Settings:
  recommended  TRL's defaults for GRPO on one GPU (fp32 master weights with bf16 autocast, gradient
               checkpointing, loss_type dapo, sequence-level masked IS of the vLLM mismatch),
               with the harness's clip (0.2/0.28), KL off (beta 0, TRL's default) and learning rate.
  like         the same, with agentrl's choices where TRL has the knob: token-level truncated IS
               capped at 2, no gradient checkpointing (agentrl's Megatron learner does not recompute).
  sleep        recommended with `vllm_enable_sleep_mode` (TRL's documented memory saver in colocate
               mode: the engine drops its weights and KV cache while the model trains and wakes for the
               next generation), the setting a TRL user turns to when the long workload runs out of
               memory; agentrl's long runs sleep their engine the same way.

    python bench/peers/run_trl.py --workload multi --settings recommended --out peers.json
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers.common import (
    PINNED,
    GpuSampler,
    Result,
    close_result,
    harness_parser,
    lookup_tool,
    make_model,
    mark_cut,
    observation_text,
    pinned_versions,
    prompt_texts,
    reply_reward,
    run_workload,
    steady_state,
    step_intervals,
    stop_on_sigterm,
    timed_summary,
    write_result,
)


def _kv_blocks(trainer) -> int | None:
    """The KV cache blocks TRL's colocated vLLM sized for itself (agentrl's engines report theirs
    in engine_memory_gib: equal settings should give equal caches); None where it cannot be read."""
    for path in ("llm", "vllm_generation.llm", "vllm_client.llm"):
        obj = trainer
        try:
            for attr in path.split("."):
                obj = getattr(obj, attr)
            return int(obj.llm_engine.vllm_config.cache_config.num_gpu_blocks)
        except (AttributeError, TypeError, ValueError):  # another TRL version keeps it elsewhere
            pass
    return None


def always_a_tool_call(tokenizer) -> None:
    """Make the tokenizer parse any reply into one call of `lookup` (see common.py: a random model
    writes no tool-call syntax; agentrl's env reads every reply as the call in the same way)."""
    tokenizer.response_template = {"harness": "every reply is a lookup call"}  # TRL checks it is set

    def parse_response(ids, prefix=None, tools=None, **_):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"query": text}}}]}

    tokenizer.parse_response = parse_response


def as_dataset(rows: list[dict]):
    """A `datasets.Dataset` of ``rows``. Named by hand: datasets 5.2 hashes a new table's schema with
    dill to name it, which fails beside pyarrow 25 (the device image's) and dill 0.4.1."""
    import pyarrow as pa
    from datasets import Dataset

    return Dataset(pa.Table.from_pylist(rows), fingerprint="peer-harness-prompts")


def make_reward(new_tokens: int, completion_tokens: list[int]):
    """The shared reward; also records the tokens of each batch's completions, tool answers included
    (TRL's own `num_tokens` counts only the model's tokens of a completion)."""

    def harness_reward(prompts, completions, completion_ids=None, **_):
        if completion_ids is not None:
            completion_tokens.append(sum(len(ids) for ids in completion_ids))
        out = []
        for completion in completions:
            if isinstance(completion, str):
                replies = [completion]
            else:
                replies = [m["tool_calls"][0]["function"]["arguments"]["query"] if m.get("tool_calls") else m["content"]
                           for m in completion if m["role"] == "assistant"]
            out.append(reply_reward(replies, new_tokens))
        return out

    return harness_reward


SETTINGS = ("recommended", "like", "sleep")


def config_kwargs(args: argparse.Namespace, wl, setting: str, per_device: int, max_completion: int,
                  steps: int) -> dict:
    """GRPOConfig's arguments for one setting (module docstring): plain data, so a CPU test can read
    them without TRL installed. ``setting``: one of SETTINGS (main refuses others before any work)."""
    like = setting == "like"
    total = wl.group_size * wl.prompts_per_step
    return dict(
        output_dir=f"{args.workdir}/trl-{wl.name}-{setting}", max_steps=steps, learning_rate=args.lr,
        per_device_train_batch_size=per_device, gradient_accumulation_steps=total // per_device,
        num_generations=wl.group_size, max_completion_length=max_completion,
        temperature=1.0, top_p=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.28,
        # per reply (vLLM's SamplingParams; transformers' generate on the CPU check)
        generation_kwargs=({"min_new_tokens": wl.new_tokens, "max_new_tokens": wl.new_tokens} if args.cpu
                           else {"min_tokens": wl.new_tokens, "max_tokens": wl.new_tokens}),
        max_tool_calling_iterations=wl.tool_calls if wl.tool_calls else None,
        use_vllm=not args.cpu, vllm_mode="colocate", vllm_gpu_memory_utilization=args.engine_mem,
        vllm_max_model_length=wl.episode_tokens + 512,
        # TRL's memory saver for colocate: the engine drops its weights and KV cache while the model trains
        vllm_enable_sleep_mode=setting == "sleep" and not args.cpu,
        gradient_checkpointing=not like, bf16=not args.cpu, use_cpu=args.cpu,
        vllm_importance_sampling_mode="token_truncate" if like else "sequence_mask",
        vllm_importance_sampling_clip_max=2.0 if like else 3.0,
        lr_scheduler_type="constant" if like else "linear",
        logging_steps=1, save_strategy="no", report_to="none", seed=0, shuffle_dataset=False,
        dataloader_num_workers=0,
    )


def own_meter(log_rows: list[dict], end_logs: dict, warmup: int) -> dict:
    """TRL's own account of its speed: GRPOTrainer's ``step_time`` (its training_step's time summed
    over an optimizer step's gradient accumulation, generation inside) and ``num_tokens`` (the
    Trainer's input tokens seen, cumulative: prompts and completions), per timed step, and its
    tokens over its step time; the Trainer's end-of-train ``train_runtime`` and
    ``train_samples_per_second`` (over every step, the warm-up included)."""
    import statistics

    seen = [lg.get("num_tokens") for lg in log_rows]
    times = [lg.get("step_time") for lg in log_rows]
    own: dict = {"step_time_s": [round(t, 3) if t is not None else None for t in times[warmup:]]}
    pairs = [(b - a, t) for a, b, t in zip([0.0, *seen[:-1]], seen, times)
             if a is not None and b is not None and t][warmup:]
    if pairs:
        own["tokens_per_s"] = round(sum(n for n, _ in pairs) / sum(t for _, t in pairs), 1)
        own["step_time_median_s"] = round(statistics.median(t for _, t in pairs), 3)
    for key in ("train_runtime", "train_samples_per_second", "train_steps_per_second"):
        if key in end_logs:
            own[key] = end_logs[key]
    return own


def run_setting(args: argparse.Namespace, wl, model: str, prompts: list[str], observation: str, setting: str) -> Result:
    import torch
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    res = Result(system="trl", setting=setting, workload=wl.name, workload_spec=wl.__dict__.copy(),
                 versions=pinned_versions("trl", "accelerate", "datasets"))
    if trl.__version__ != PINNED["trl"] and not args.any_version:
        raise SystemExit(f"the harness pins trl=={PINNED['trl']}, found {trl.__version__} (--any-version to run anyway)")
    total = wl.group_size * wl.prompts_per_step  # completions per optimizer step
    per_device = args.micro_batch or (1 if wl.name.startswith("long") else min(8, total))
    max_completion = wl.episode_tokens - wl.prompt_tokens + 64
    steps = args.warmup + args.steps
    tok = AutoTokenizer.from_pretrained(model)
    tools = []
    if wl.tool_calls:
        always_a_tool_call(tok)
        tools = [lookup_tool(observation, wl.tool_latency_s)]
    cfg = GRPOConfig(**config_kwargs(args, wl, setting, per_device, max_completion, steps))
    rows = [{"prompt": [{"role": "user", "content": prompts[i % len(prompts)]}]} for i in range(wl.prompts_per_step * steps)]
    stamps: list[float] = []
    log_rows: list[dict] = []
    end_logs: dict = {}
    completion_tokens: list[int] = []  # per generation batch (= per optimizer step here)
    timings: dict[str, list[float]] = {}
    original = profiling.ProfilingContext._log_metrics

    def record(self, duration):  # TRL's own timers (sync_weights, vLLM.generate), observed, not changed
        timings.setdefault(self.name.split(".", 1)[-1], []).append(duration)
        return original(self, duration)

    class Stamp(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                log_rows.append({**logs, "_step": state.global_step})
            elif logs and "train_runtime" in logs:  # the Trainer's own summary at the end of train()
                end_logs.update(logs)

    sampler = GpuSampler().start()
    profiling.ProfilingContext._log_metrics = record
    t0 = time.perf_counter()
    trainer = None
    try:
        trainer = GRPOTrainer(model=model, reward_funcs=make_reward(wl.new_tokens, completion_tokens), args=cfg,
                              train_dataset=as_dataset(rows), processing_class=tok, tools=tools or None,
                              callbacks=[Stamp()])
        t0 = time.perf_counter()
        trainer.train()
    except KeyboardInterrupt as exc:  # SIGTERM at the run step's limit (stop_on_sigterm) or Ctrl-C
        mark_cut(res, exc, len(stamps), steps)
    except Exception as exc:
        oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()
        res.status, res.reason = ("oom" if oom else "error"), f"{type(exc).__name__}: {str(exc)[-600:]}"
        traceback.print_exc()
    finally:
        profiling.ProfilingContext._log_metrics = original
        sampler.stop()
        res.extra["kv_blocks"] = _kv_blocks(trainer)
    if stamps:
        walls = step_intervals(t0, stamps)
        seen = [lg.get("num_tokens", 0.0) for lg in log_rows]
        gen = [lg.get("completions/mean_length", 0.0) * total for lg in log_rows]
        # prompt + model tokens (TRL's num_tokens), plus the tool answers' tokens inside each completion
        trained = [b - a + max(0.0, c - g) for a, b, c, g in
                   zip([0.0, *seen[:-1]], seen, completion_tokens + [0] * len(seen), gen)]
        walls = walls[:len(trained)]  # a run cut between a step's end and its log: that step is not counted
        summary = timed_summary(walls, trained, gen, args.warmup)
        for k, v in summary.items():
            setattr(res, k, v)
        syncs = timings.get("sync_weights", [])[args.warmup:]
        res.weight_sync_s = sum(syncs) / len(syncs) if syncs else None
        res.reward_curve = [round(lg.get("reward", 0.0), 4) for lg in log_rows]
        res.episode_tokens = (sum(trained) / (total * len(trained))) if trained else None
        res.extra["step_walls_s"] = [round(w, 3) for w in walls]
        res.extra["steady"] = steady_state(walls, args.warmup)
        res.extra["own"] = own_meter(log_rows, end_logs, args.warmup)
        res.extra["generate_s"] = [round(x, 3) for k, v in timings.items() if k.endswith("generate") for x in v]
        res.extra["tool_calls_per_episode"] = [lg.get("tools/call_frequency") for lg in log_rows]
        res.extra["config"] = {"per_device_train_batch_size": per_device, "gradient_accumulation_steps": total // per_device,
                               "gradient_checkpointing": cfg.gradient_checkpointing,
                               "is_mode": cfg.vllm_importance_sampling_mode,
                               "engine_sleep": cfg.vllm_enable_sleep_mode}
    busy_from = stamps[args.warmup - 1] if len(stamps) > args.warmup else 0.0
    return close_result(res, sampler, busy_from, args.steps)


def main() -> None:
    p = harness_parser(__doc__)
    p.add_argument("--engine-mem", type=float, default=0.3)
    p.add_argument("--micro-batch", type=int, default=0, help="per_device_train_batch_size (0: 8, long: 1)")
    p.add_argument("--cpu", action="store_true", help="a CPU check of the harness (transformers generate, no vLLM)")
    p.add_argument("--any-version", action="store_true")
    args = p.parse_args()
    unknown = [s for s in args.settings.split(",") if s not in SETTINGS]
    if unknown:
        p.error(f"unknown setting(s) {', '.join(unknown)}: TRL runs {', '.join(SETTINGS)}")
    wl = run_workload(args)
    model = make_model(Path(args.workdir) / f"model-{'cpu' if args.cpu else '1.5b'}", "cpu" if args.cpu else "1.5b")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts, observation = prompt_texts(tok, wl, 256), observation_text(tok, wl)
    stop_on_sigterm()
    for setting in args.settings.split(","):
        res = run_setting(args, wl, model, prompts, observation, setting)
        write_result(res, Path(args.out))
        if res.status == "cut":
            raise SystemExit(f"run_trl: {res.reason}")


if __name__ == "__main__":
    main()
