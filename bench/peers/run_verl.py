"""verl on one peer-harness workload (bench/peers/README.md): writes one Result per setting.

verl is used as installed (pinned: verl 0.9.1) through its own entry point and configs: each run is
`python -m verl.trainer.main_ppo` with hydra overrides of its `ppo_trainer` config (the V1 trainer
in its default `sync` mode: hybrid engine, FSDP actor and vLLM rollout time-share the GPU; the
engine sleeps while the actor trains and wakes for the next rollout with the new weights), GRPO
advantages, no critic, no reference model (KL off), and its agent loop for every workload. The
harness's pieces live in verl's extension points (`verl_plugin.py`): the tool class, a tool parser
that reads every reply as one call (as `run_trl.py` tells TRL), agent loops that only fix each
reply's length, and the reward function. The harness only observes: verl's own per-step metrics
(its `file` logger: `timing_s/step`, `timing_s/update_weights`, `perf/total_num_tokens`,
`critic/score/mean`, ...) and NVML.

flash-attn is not on the GPU machine (verl's FSDP extra pins flash-attn 2.8.3): the actor runs with
`attn_implementation=sdpa`; `use_remove_padding` stays on (verl's default), where transformers
builds the block-diagonal mask of the packed sequences from their position ids.

Settings:
  recommended  verl's defaults for GRPO on one GPU (its rollout/actor yaml and GRPO example): FSDP
               with fp32 master weights and bf16 compute, gradient checkpointing, remove-padding
               with dynamic batch size, the old log-probs recomputed by the actor before the update
               (decoupled PPO, no rollout IS correction), vLLM at its default
               `gpu_memory_utilization` 0.5 with CUDA graphs.
  like         the same, with agentrl's choices where verl has the knob: no recompute (bypass mode:
               the rollout's log-probs are the old policy), token-level truncated IS capped at 2,
               no gradient checkpointing.

    python bench/peers/run_verl.py --workload multi --settings recommended --out peers.json
    python bench/peers/run_verl.py --workload multi --dry-run     # CPU: config, data, tool, reward
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.peers.common import (
    PINNED,
    GpuSampler,
    Result,
    close_result,
    harness_parser,
    make_model,
    observation_text,
    pinned_versions,
    prompt_texts,
    run_workload,
    steady_state,
    timed_summary,
    write_result,
)

PLUGIN = Path(__file__).resolve().parent / "verl_plugin.py"
TOOL_LOOP, SINGLE_LOOP = "harness_tool_agent", "harness_single_turn_agent"


def lengths(wl) -> dict[str, int]:
    """verl's length settings for ``wl``: the prompt budget covers the chat template and the tool
    schema in the system turn; the response budget of a tool workload covers every reply and tool
    answer (verl ends an episode once its response reaches `response_length`)."""
    prompt = wl.prompt_tokens + (512 if wl.tool_calls else 64)
    response = wl.new_tokens if not wl.tool_calls else wl.episode_tokens - wl.prompt_tokens + 256
    return {"prompt": prompt, "response": response, "model_len": prompt + response}


def write_inputs(wl, tok, workdir: Path, steps: int) -> dict[str, str]:
    """The dataset parquet, the texts file, the tool and agent loop yamls verl reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    workdir.mkdir(parents=True, exist_ok=True)
    texts = workdir / f"verl-texts-{wl.name}.json"
    prompts = prompt_texts(tok, wl, 256)
    texts.write_text(json.dumps({"prompts": prompts, "observation": observation_text(tok, wl)}))
    agent = TOOL_LOOP if wl.tool_calls else SINGLE_LOOP
    rows = [{"data_source": "peer_harness", "agent_name": agent,
             "prompt": [{"role": "user", "content": prompts[i % len(prompts)]}],
             "reward_model": {"style": "rule", "ground_truth": ""},
             "extra_info": {"index": i, "new_tokens": wl.new_tokens, "texts_file": str(texts)}}
            for i in range(wl.prompts_per_step * (steps + 1))]
    data = workdir / f"verl-{wl.name}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    loops = workdir / "verl-agent-loops.yaml"
    loops.write_text(f"- name: {TOOL_LOOP}\n  _target_: bench.peers.verl_plugin.HarnessToolAgentLoop\n"
                     f"- name: {SINGLE_LOOP}\n  _target_: bench.peers.verl_plugin.HarnessSingleTurnAgentLoop\n")
    tools = workdir / f"verl-tools-{wl.name}.yaml"
    tools.write_text(json.dumps(tool_config(wl, texts)))  # JSON is YAML
    return {"data": str(data), "texts": str(texts), "loops": str(loops), "tools": str(tools)}


def tool_config(wl, texts: Path) -> dict:
    """verl's tool config: the harness's `BaseTool`, sleeping the workload's tool latency a call."""
    return {"tools": [{
        "class_name": "bench.peers.verl_plugin.LookupTool",
        "config": {"type": "native", "texts_file": str(texts), "latency_s": wl.tool_latency_s},
        "tool_schema": {"type": "function", "function": {
            "name": "lookup", "description": "Look something up.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "What to look up."}},
                           "required": ["query"]}}}}]}


def overrides(args: argparse.Namespace, wl, model: str, files: dict[str, str], setting: str, log_file: str) -> list[str]:
    """Hydra overrides of verl's `ppo_trainer` config (the same list for the run and --dry-run)."""
    n = lengths(wl)
    like = setting == "like"
    steps = args.warmup + args.steps
    max_tokens_per_gpu = max(16384, n["model_len"])  # verl's default; one 16k episode per micro-batch
    engine_mem = args.engine_mem or (0.3 if like else 0.5)
    out = [
        # data: one optimizer step per batch of `prompts_per_step` groups
        f"data.train_files={files['data']}", f"data.val_files={files['data']}",
        f"data.train_batch_size={wl.prompts_per_step}", f"data.max_prompt_length={n['prompt']}",
        f"data.max_response_length={n['response']}", "data.filter_overlong_prompts=false", "data.truncation=error",
        "data.shuffle=false", "data.dataloader_num_workers=0",
        # GRPO, no KL term (use_kl_loss / use_kl_in_reward off: no reference model), no critic
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "algorithm.norm_adv_by_std_in_grpo=true",
        # the model: the harness's random Qwen2.5-1.5B; sdpa, since flash-attn is not installed
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.use_remove_padding=true",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={'false' if like else 'true'}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        # the actor (FSDP, one GPU): one update per step over the whole batch
        f"actor_rollout_ref.actor.optim.lr={args.lr}", f"actor_rollout_ref.actor.ppo_mini_batch_size={wl.prompts_per_step}",
        "actor_rollout_ref.actor.ppo_epochs=1", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={max_tokens_per_gpu}",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.fsdp_config.param_offload=false", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false",
        # the rollout: vLLM in the hybrid engine, sleeping while the actor trains
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.n={wl.group_size}", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={engine_mem}",
        f"actor_rollout_ref.rollout.max_model_len={n['model_len']}",
        "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.top_p=1.0", "actor_rollout_ref.rollout.top_k=-1",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={files['loops']}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={TOOL_LOOP if wl.tool_calls else SINGLE_LOOP}",
        # the reward: the shared reply_reward of the model's replies
        f"reward.custom_reward_function.path={PLUGIN}", "reward.custom_reward_function.name=compute_score",
        # a lean run: no validation, no checkpoint, console + file logger only
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=1000", "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.resume_mode=disable", "trainer.logger=[console,file]", "trainer.project_name=peers",
        f"trainer.experiment_name=verl-{wl.name}-{setting}", f"trainer.default_local_dir={args.workdir}/verl-ckpt",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={log_file}",
    ]
    if wl.tool_calls:
        out += ["actor_rollout_ref.rollout.multi_turn.enable=true",
                f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={wl.tool_calls + 1}",
                "actor_rollout_ref.rollout.multi_turn.format=harness_every_reply",
                f"actor_rollout_ref.rollout.multi_turn.tool_config_path={files['tools']}",
                # verl cuts tool answers at 256 characters by default; the workload's are 1-30k
                "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=10000000"]
    if like:
        out += ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token",
                "algorithm.rollout_correction.rollout_is_threshold=2.0"]
    return out + list(args.set)


def compose(ovr: list[str]):
    """verl's `ppo_trainer` config with ``ovr``, composed as `verl.trainer.main_ppo` does."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from verl.trainer import main_ppo

    with initialize_config_dir(config_dir=str(Path(main_ppo.__file__).parent / "config"), version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=ovr)


def dry_run(args: argparse.Namespace, wl, model: str, files: dict[str, str], setting: str) -> None:
    """Everything of a run that needs no GPU, through verl's own code: the config (composed and
    checked by verl's validate_config and its dataclasses), the dataset, the agent loop classes,
    the tool parser and tool, one episode's token bookkeeping and the reward."""
    import asyncio

    import hydra
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.device import auto_set_device

    t0 = time.perf_counter()
    cfg = compose(overrides(args, wl, model, files, setting, f"{args.workdir}/verl-{wl.name}-{setting}.jsonl"))
    auto_set_device(cfg)
    ref, critic = need_reference_policy(cfg), need_critic(cfg)
    validate_config(config=cfg, use_reference_policy=ref, use_critic=critic)
    assert not ref and not critic, f"GRPO without KL needs neither a reference model nor a critic ({ref=}, {critic=})"
    arr = cfg.actor_rollout_ref
    rollout = omega_conf_to_dataclass(arr.rollout)
    model_cfg = omega_conf_to_dataclass(arr.model)  # loads the tokenizer and the HF config (attn sdpa)
    algo = omega_conf_to_dataclass(cfg.algorithm)
    print(f"[dry-run] {setting}: config composed and validated ({time.perf_counter() - t0:.1f}s); "
          f"rollout {rollout.name}/{rollout.mode} n={rollout.n} mem={rollout.gpu_memory_utilization} "
          f"len={rollout.prompt_length}+{rollout.response_length}; attn={model_cfg.hf_config._attn_implementation}; "
          f"adv={algo.adv_estimator} bypass={cfg.algorithm.rollout_correction.bypass_mode} "
          f"is={cfg.algorithm.rollout_correction.rollout_is}")
    if args.print_config:
        print(OmegaConf.to_yaml(cfg, resolve=True))

    # the dataset, read by verl's RLHFDataset (datasets + pyarrow, as on the device)
    from verl.utils.dataset.rl_dataset import RLHFDataset

    tok = AutoTokenizer.from_pretrained(model)
    ds = RLHFDataset(data_files=[files["data"]], tokenizer=tok, config=cfg.data)
    row = ds[0]
    assert len(ds) >= wl.prompts_per_step * (args.warmup + args.steps), len(ds)
    print(f"[dry-run] dataset: {len(ds)} rows; row 0 agent={row['agent_name']} "
          f"extra_info={ {k: v for k, v in row['extra_info'].items() if k != 'texts_file'} }")

    # the agent loops named in the yaml, the parser and the tool, loaded as verl's workers load them
    from verl.experimental.agent_loop.tool_parser import ToolParser
    from verl.tools.tool_registry import load_all_tools
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    for entry in OmegaConf.load(files["loops"]):
        hydra.utils.get_class(entry["_target_"])
    from bench.peers import verl_plugin

    reward_fn = _load_reward(cfg)
    builder = create_continuous_token_builder(tok, hf_model_type=model_cfg.hf_config.model_type)
    import random

    rng = random.Random(0)
    word_ids = [i for i in range(len(tok)) if tok.decode([i]).strip().isalpha()][:200]
    reply = lambda: [rng.choice(word_ids) for _ in range(wl.new_tokens)]
    messages = list(row["raw_prompt"])
    if not wl.tool_calls:
        ids = builder.build_initial_tokens(messages)
        merged = builder.merge_assistant_tokens(ids, reply())
        mask = builder.align_response_metadata(merged, [])[0]
        ids = merged.token_ids
    else:
        tools = load_all_tools(tool_config_path=files["tools"], function_tool_path=None)
        assert [t.name for t in tools] == ["lookup"], tools
        parser = ToolParser.get_tool_parser(cfg.actor_rollout_ref.rollout.multi_turn.format, tok)
        schemas = [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for t in tools]
        ids = builder.build_initial_tokens(messages, tools=schemas)
        mask: list[int] = []
        for turn in range(wl.tool_calls + 1):
            gen = reply()
            merged = builder.merge_assistant_tokens(ids, gen)
            mask = builder.align_response_metadata(merged, mask)[0]
            ids = merged.token_ids
            if turn == wl.tool_calls:
                break
            content, calls = asyncio.run(parser.extract_tool_calls(gen, [t.tool_schema for t in tools]))
            assert [c.name for c in calls] == ["lookup"], calls
            # as ToolAgentLoop: the assistant message (with its call) is in the context before the tool runs
            messages.append({"role": "assistant", "content": content, "tool_calls": [
                {"type": "function", "function": {"name": "lookup", "arguments": json.loads(calls[0].arguments)}}]})
            prev = list(messages)
            t = time.perf_counter()
            resp, _, _ = asyncio.run(tools[0].execute("i", json.loads(calls[0].arguments)))
            slept = time.perf_counter() - t
            assert slept >= wl.tool_latency_s * 0.99 and resp.text, (slept, resp)
            messages.append({"role": "tool", "content": resp.text})
            merged = builder.merge_context_tokens(prev, messages, ids, tools=schemas)
            mask = builder.align_response_metadata(merged, mask)[0]
            ids = merged.token_ids
    prompt_len = len(ids) - len(mask)
    response = ids[prompt_len:]
    replies = verl_plugin.model_replies(tok, response, mask)
    assert len(replies) == wl.tool_calls + 1 and sum(mask) == (wl.tool_calls + 1) * wl.new_tokens, (len(replies), sum(mask))
    solution = tok.decode(response, skip_special_tokens=True)
    score = reward_fn(data_source="peer_harness", solution_str=solution, ground_truth="",
                      extra_info={**row["extra_info"], "harness_replies": replies, "harness_model_tokens": sum(mask)})
    whole = reward_fn(data_source="peer_harness", solution_str=solution, ground_truth="",
                      extra_info=dict(row["extra_info"]))
    print(f"[dry-run] one episode: prompt {prompt_len} tokens (budget {rollout.prompt_length}), response "
          f"{len(response)} tokens (budget {rollout.response_length}), {len(replies)} replies, "
          f"model tokens {sum(mask)}; reward {score['score']:.4f} (of the whole decoded response it "
          f"would be {whole['score']:.4f})")
    assert prompt_len <= rollout.prompt_length and len(response) <= rollout.response_length
    diff = packed_sdpa_check(model)
    assert diff < 1e-3, f"packed sequences attend across their boundary under sdpa (max |dlogit| {diff})"
    print(f"[dry-run] remove-padding under sdpa: packed == separate (max |dlogit| {diff:.1e})")
    print(f"[dry-run] {setting}: ok ({time.perf_counter() - t0:.1f}s)")


def _load_reward(cfg):
    """The reward function as verl loads it (`reward.custom_reward_function`)."""
    from verl.trainer.ppo.reward import get_custom_reward_fn

    return get_custom_reward_fn(cfg)


def packed_sdpa_check(model: str) -> float:
    """Without flash-attn the actor runs remove-padding through sdpa: two sequences packed into one
    row (no attention mask, position ids restarting at 0, as verl feeds the model) must give the
    logits of each sequence alone. Returns the largest difference."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 700, (1, 37), generator=g), torch.randint(0, 700, (1, 53), generator=g)
    with torch.no_grad():
        alone = torch.cat([m(input_ids=a).logits, m(input_ids=b).logits], dim=1)
        pos = torch.cat([torch.arange(37), torch.arange(53)]).unsqueeze(0)
        packed = m(input_ids=torch.cat([a, b], dim=1), position_ids=pos, use_cache=False).logits  # as verl calls it
    return float((alone - packed).abs().max())


class _Stamps(threading.Thread):
    """Timestamps each step of verl's metrics file by verl's own step number: its file logger writes
    one line ``{"step": N, "data": {...}}`` as step N ends (``stamps[N]``: when the line of step N
    that timed it, ``timing_s/step``, was first seen). Keyed by the step, not by the line's place, so
    a line that is no training step (a validation's, the final one's) shifts nothing."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.stamps, self._done, self._seen = path, {}, threading.Event(), 0

    def poll(self, now: float) -> None:
        """Stamp the complete lines written since the last poll with ``now``."""
        try:
            lines = self.path.read_bytes().split(b"\n")[:-1] if self.path.is_file() else []
        except OSError:
            return
        for line in lines[self._seen:]:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec.get("step"), int) and "timing_s/step" in (rec.get("data") or {}):
                self.stamps.setdefault(rec["step"], now)
        self._seen = len(lines)

    def run(self) -> None:
        while not self._done.wait(0.1):
            self.poll(time.perf_counter())

    def stop(self) -> None:
        self._done.set()
        self.join()


def read_steps(log_file: Path) -> list[dict]:
    """verl's training steps from its metrics file, in step order: ``data`` with ``_step`` (verl's
    step number) of each line that timed a step (``timing_s/step``)."""
    rows = []
    for ln in log_file.read_text().splitlines() if log_file.is_file() else []:
        if not ln.strip():
            continue
        rec = json.loads(ln)
        data = rec.get("data") or {}
        if "timing_s/step" in data:
            rows.append({**data, "_step": rec.get("step")})
    return sorted(rows, key=lambda r: (r["_step"] is None, r["_step"] or 0))


def step_walls(rows: list[dict], stamps: dict[int, float]) -> tuple[list[float], list[float]]:
    """Each step's wall as the other runners measure it (from the previous step's end to its own,
    :func:`~bench.peers.common.step_intervals`), aligned by verl's step number: a step whose own or
    previous step's line was not stamped (the first step has no start here) keeps verl's own
    ``timing_s/step``. Returns the walls and the stamps of the steps' ends (for the GPU's busy share)."""
    walls, ends = [], []
    for r in rows:
        n = r["_step"]
        if n in stamps and (n - 1) in stamps:
            walls.append(stamps[n] - stamps[n - 1])
        else:
            walls.append(float(r["timing_s/step"]))
        ends.append(stamps.get(n))
    return walls, ends


def run_setting(args: argparse.Namespace, wl, model: str, files: dict[str, str], setting: str) -> Result:
    res = Result(system="verl", setting=setting, workload=wl.name, workload_spec=wl.__dict__.copy(),
                 versions=pinned_versions("verl", "ray", "tensordict", "transferqueue"))
    log_file = Path(args.workdir) / f"verl-{wl.name}-{setting}.jsonl"
    log_file.unlink(missing_ok=True)
    ovr = overrides(args, wl, model, files, setting, str(log_file))
    res.extra["overrides"] = ovr
    res.extra["set"] = list(args.set)  # the user's own among them (table.py: another row)
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(log_file), "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "1"}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *ovr, f"hydra.run.dir={args.workdir}/verl-hydra/{wl.name}-{setting}"]
    print("verl:", " ".join(cmd), flush=True)
    stamps = _Stamps(log_file)
    sampler = GpuSampler().start()
    stamps.start()
    tail: list[str] = []
    proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=True)

    def pump() -> None:
        for line in proc.stdout:
            sys.stdout.write(line)
            tail.append(line)
            del tail[:-400]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        rc = None
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=10)
    stamps.stop()
    sampler.stop()
    busy_from = None
    text = "".join(tail)
    if rc != 0:
        oom = "out of memory" in text.lower() or "OutOfMemoryError" in text
        why = f"timed out after {args.timeout}s" if rc is None else f"exit {rc}"
        err = [ln for ln in tail if "Error" in ln or "error:" in ln][-3:]
        # a run its --timeout stopped is "cut" (as the other runners' are), not an error of verl's:
        # its last lines are then whatever verl was printing (import warnings, say), not a cause
        res.status = "oom" if oom else ("cut" if rc is None else "error")
        res.reason = f"{why}: {''.join(err)[-600:]}" if res.status != "cut" else why
    rows = read_steps(log_file)
    if rows:
        walls, ends = step_walls(rows, stamps.stamps)
        verl_walls = [r["timing_s/step"] for r in rows]
        trained = [r.get("perf/total_num_tokens", 0.0) for r in rows]
        n_seq = wl.group_size * wl.prompts_per_step
        # every reply is new_tokens long; num_turns counts 2 per reply (user/tool turn + assistant turn)
        gen = [n_seq * r.get("num_turns/mean", 2.0) / 2.0 * wl.new_tokens for r in rows]
        for k, v in timed_summary(walls, trained, gen, args.warmup).items():
            setattr(res, k, v)
        timed = rows[args.warmup:]
        syncs = [r["timing_s/update_weights"] for r in timed if "timing_s/update_weights" in r]
        res.weight_sync_s = sum(syncs) / len(syncs) if syncs else None
        res.reward_curve = [round(r.get("critic/score/mean", 0.0), 4) for r in rows]
        res.episode_tokens = sum(trained) / (n_seq * len(trained))
        res.extra["step_walls_s"] = [round(w, 3) for w in walls]
        res.extra["steady"] = steady_state(walls, args.warmup)
        res.extra["verl_steps"] = [r["_step"] for r in rows]
        res.extra["verl_timing_step_s"] = [round(w, 3) for w in verl_walls]
        for key in ("timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/update_weights",
                    "num_turns/mean", "response_length/mean", "prompt_length/mean", "perf/max_memory_allocated_gb",
                    "perf/max_memory_reserved_gb", "perf/throughput", "perf/mfu/actor"):
            res.extra[key] = [r.get(key) for r in rows]
        res.extra["own"] = own_meter(timed)
        if len(ends) > args.warmup and ends[args.warmup - 1] is not None and args.warmup:
            busy_from = ends[args.warmup - 1]
    if res.status == "cut":
        res.reason += f", {len(rows)} of {args.warmup + args.steps} steps done (warm-up included)"
    return close_result(res, sampler, busy_from, args.steps)


def own_meter(timed: list[dict]) -> dict:
    """verl's own account of its speed over the timed steps: the medians of ``perf/mfu/actor`` (its
    actor update's FLOPs, by its own FLOPs counter, over the update's time, over the GPU's peak) and
    ``perf/throughput`` (its tokens a second a GPU over its ``timing_s/step``)."""
    import statistics

    own = {}
    for key, name in (("perf/mfu/actor", "mfu_actor"), ("perf/throughput", "tokens_per_s")):
        vals = [float(r[key]) for r in timed if isinstance(r.get(key), (int, float))]
        if vals:
            own[name] = round(statistics.median(vals), 4 if name == "mfu_actor" else 1)
    return own


def main() -> None:
    p = harness_parser(__doc__)
    p.add_argument("--engine-mem", type=float, default=0.0,
                   help="rollout.gpu_memory_utilization (0: 0.5, verl's default; like: 0.3)")
    p.add_argument("--timeout", type=int, default=int(os.environ.get("RUN_TIMEOUT", "540")) - 45,
                   help="seconds for one verl run, then it is stopped and its steps so far are written "
                        "(default: device.sh's RUN_TIMEOUT - 45)")
    p.add_argument("--dry-run", action="store_true", help="CPU: build and check config, data, tool, reward; no training")
    p.add_argument("--print-config", action="store_true", help="with --dry-run: print the resolved config")
    p.add_argument("--any-version", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra hydra override")
    args = p.parse_args()
    import verl

    if verl.__version__ != PINNED["verl"] and not args.any_version:
        raise SystemExit(f"the harness pins verl=={PINNED['verl']}, found {verl.__version__} (--any-version to run anyway)")
    wl = run_workload(args)
    workdir = Path(args.workdir)
    model = make_model(workdir / f"model-{'cpu' if args.dry_run else '1.5b'}", "cpu" if args.dry_run else "1.5b")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    files = write_inputs(wl, tok, workdir, args.warmup + args.steps)
    for setting in args.settings.split(","):
        if args.dry_run:
            dry_run(args, wl, model, files, setting)
            continue
        try:
            res = run_setting(args, wl, model, files, setting)
        except Exception as exc:  # noqa: BLE001  (the harness itself failed: still one row with the reason)
            traceback.print_exc()
            res = Result(system="verl", setting=setting, workload=wl.name, status="error",
                         reason=f"{type(exc).__name__}: {str(exc)[-600:]}", workload_spec=wl.__dict__.copy())
        write_result(res, Path(args.out))


if __name__ == "__main__":
    main()
