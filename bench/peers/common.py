"""What every system in the peer harness shares: the workloads, the model, the prompts, the tool,
the reward and the measurements. Each runner (`run_agentrl.py`, `run_trl.py`, `run_verl.py`)
imports this and nothing of the others, so a system is measured only through its own code path.

The model is a Qwen2.5-1.5B-shaped Qwen2 with random weights in bf16 (no checkpoint can be
downloaded on the device) and the project's tiny byte-level tokenizer with a Qwen-style chat
template; every system loads the same directory. With random weights almost every sampled id lies
beyond the tokenizer's 749 entries and decodes to nothing, so the reward is the share of a reply's
tokens that decode to text (:func:`reply_reward`): a signal GRPO can climb from random weights,
which shows that each system really trains (a flat curve would mean it trains on garbage).

Every reply is `min_tokens = max_tokens` long (no system wins by stopping early); every reply in a
tool workload counts as one tool call (a random model writes no tool-call syntax, so each system
is told that its whole reply is the call: agentrl's env reads the text as the call, TRL's tokenizer
parses any reply into a call of the `lookup` tool). The tool sleeps `tool_latency_s` and answers
with a fixed text of `obs_tokens` tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.peers.gpu import GpuSampler, _nvml_gpu_count, device_name, nvml_index

__all__ = [
    "WORKLOADS",
    "GpuSampler",
    "Result",
    "Workload",
    "lookup_tool",
    "make_model",
    "mark_cut",
    "observation_text",
    "pinned_versions",
    "prompt_texts",
    "reply_reward",
    "stop_on_sigterm",
    "workload",
    "write_result",
]

# When the runner's process imported this (its start, near enough): close_result's start-up figure.
_STARTED = time.monotonic()

# The versions the harness was written against and measured with; the runners refuse others.
PINNED = {"trl": "1.16.0", "verl": "0.9.1", "vllm": "0.26.0"}


@dataclass(frozen=True)
class Workload:
    """One workload, the same for every system."""

    name: str
    prompt_tokens: int
    """Tokens of the user prompt (before the chat template)."""
    new_tokens: int
    """Tokens per reply (min = max)."""
    group_size: int
    """Samples per prompt (GRPO's G)."""
    prompts_per_step: int
    """Prompts (groups) per optimizer step."""
    tool_calls: int = 0
    """Tool calls per episode: replies 1..tool_calls are calls, reply tool_calls+1 ends it."""
    tool_latency_s: float = 0.0
    obs_tokens: int = 0
    """Tokens of each tool answer."""

    @property
    def episode_tokens(self) -> int:
        """Approximate tokens of one finished episode (prompt, replies, tool answers)."""
        return self.prompt_tokens + (self.tool_calls + 1) * self.new_tokens + self.tool_calls * (self.obs_tokens + 12)

    def scaled(self, factor: float) -> Workload:
        """A smaller copy for CPU checks of the harness itself (same shape, fewer tokens)."""
        s = lambda n: max(1, int(round(n * factor)))
        return replace(self, prompt_tokens=s(self.prompt_tokens), new_tokens=s(self.new_tokens),
                       prompts_per_step=max(2, s(self.prompts_per_step)), group_size=max(2, s(self.group_size)),
                       obs_tokens=s(self.obs_tokens) if self.obs_tokens else 0,
                       tool_latency_s=self.tool_latency_s * factor)


WORKLOADS: dict[str, Workload] = {
    # What every peer is built for: one prompt, one long reply.
    "single": Workload("single", prompt_tokens=256, new_tokens=512, group_size=8, prompts_per_step=64),
    # bench/gpu_e2e.py's setting: 3 tool calls, a 0.5 s tool, ~96 new tokens per turn.
    "multi": Workload("multi", prompt_tokens=64, new_tokens=96, group_size=8, prompts_per_step=4,
                      tool_calls=3, tool_latency_s=0.5, obs_tokens=200),
    # 4 turns whose tool answers bring the episode to ~16k tokens.
    "long": Workload("long", prompt_tokens=64, new_tokens=96, group_size=8, prompts_per_step=2,
                     tool_calls=3, tool_latency_s=0.5, obs_tokens=5200),
}

def workload(name: str) -> Workload:
    """``WORKLOADS[name]``, or ``longNk`` (N in 4..512): the long workload with tool answers sized so
    that an episode holds about N × 1,024 tokens, to find where each system stops fitting
    (``long16k`` is within a few tokens of ``long``)."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    m = re.fullmatch(r"long(\d+)k", name)
    if not m or not 4 <= int(m.group(1)) <= 512:
        raise ValueError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}, or longNk with N in 4..512")
    base = WORKLOADS["long"]
    fixed = base.prompt_tokens + (base.tool_calls + 1) * base.new_tokens + base.tool_calls * 12
    obs = (int(m.group(1)) * 1024 - fixed) // base.tool_calls
    return replace(base, name=name, obs_tokens=obs)


def workload_arg(name: str) -> str:
    """argparse's check of --workload (a clear error for a name :func:`workload` does not know)."""
    try:
        workload(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


SHAPES = {
    # Qwen2.5-1.5B: hidden 1536, 28 layers, 12 heads (2 KV), MLP 8960, vocab 151936, tied embeddings.
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2),
    # For CPU checks of the harness: the same vocabulary, a few small layers.
    "cpu": dict(vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2),
}


MAX_POSITIONS = 525312
"""The context every system may serve and train (``max_position_embeddings``): room for every
``longNk`` up to ``long512k`` (524,287 tokens) with the runners' margins (agentrl's and TRL's
engines take the episode + 512, verl's prompt and response budgets the episode + 768). It was
131,072 until 2026-11-29 (short of ``long128k``), then 266,240 (``long256k``), raised when TRL
with its engine asleep could reach past 256k. The weights do not depend on it (RoPE has no
parameters); vLLM's rotary table grows with it (0.1-0.3 GB), in TRL's engine as in agentrl's."""


PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "H20": 148e12, "A100": 312e12, "A800": 312e12,
                   "L40S": 362e12, "B200": 2250e12}
"""Dense bf16 tensor-core peak per GPU (the vendors' data sheets, no sparsity), by a name in the GPU's
NVML name (``NVIDIA H100 80GB HBM3``); SXM parts (the H100 PCIe's is 756e12)."""


def peak_flops(device: str) -> float | None:
    """The bf16 peak of ``device`` (a result's ``device``), or None where it is not a known GPU."""
    if "PCIe" in device and "H100" in device:
        return 756e12
    for name, flops in PEAK_BF16_FLOPS.items():
        if re.search(rf"\b{name}\b", device):
            return flops
    return None


def train_flops(tokens: float, episode_tokens: float, shape: str = "1.5b") -> float:
    """FLOPs of one training pass (forward and backward) over ``tokens`` in sequences of
    ``episode_tokens`` each: 6·N·tokens + 6·L·d·s·tokens.

    N is the parameters every token multiplies (each layer's q, k, v, o and MLP matrices, and the LM
    head; not the embedding lookup), L the layers, d the hidden size, s a sequence's length: causal
    attention's two matmuls (QKᵀ, AV) take 2·2·s²·d / 2 FLOPs a layer forward, 3× that with the
    backward, so 6·L·d·s² a sequence = 6·L·d·s a token. The harness's episodes all have one length
    (every reply min = max tokens), so the mean length stands for each one's."""
    c = SHAPES[shape]
    d, L, ff, v = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    kv = d // c["num_attention_heads"] * c["num_key_value_heads"]
    n = L * (2 * d * d + 2 * d * kv + 3 * d * ff) + d * v
    return 6.0 * n * tokens + 6.0 * L * d * episode_tokens * tokens


def harness_mfu(row: dict) -> float | None:
    """A result's model FLOPs utilization, the same formula for every system: :func:`train_flops` of
    the trained tokens of the timed steps at the run's mean episode length, over the timed steps'
    wall time (i.e. of ``trained_tokens_per_s_per_gpu`` tokens a second), over the GPU's bf16 peak
    (:func:`peak_flops`). It counts the trained tokens' training pass only: generation and extra
    log-prob passes are time spent, not FLOPs counted (verl's own ``perf/mfu/actor`` counts its
    actor's update only, over the update's own time, so it reads higher)."""
    peak = peak_flops(row.get("device") or "")
    tput, ep = row.get("trained_tokens_per_s_per_gpu"), row.get("episode_tokens")
    if not (peak and tput and ep) or row.get("status") != "ok":
        return None
    return train_flops(tput, ep) / peak


def make_model(out: Path, shape: str = "1.5b", max_position_embeddings: int = MAX_POSITIONS) -> str:
    """Random weights of ``shape`` (bf16 on CUDA, fp32 on CPU) with the tiny tokenizer, in HF format.

    On a GPU the weights are made in a child process: a CUDA context made here would stay in the
    runner's process for the whole run (~0.6 GiB on an H200, counted in the run's peak memory).
    A model made before with another ``max_position_embeddings`` gets the new one in its config
    (its weights stay: they are the same). Runners of two queues (one GPU each, device.sh ``GPU=N``)
    may start at once on a fresh machine: a lock file beside ``out`` lets one make it and the other
    find it made."""
    out = Path(out)
    if os.environ.get("AGENTRL_PEERS_MAKE_MODEL_HERE"):  # the child a locked call below started
        return _make_model(out, shape, max_position_embeddings)
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        return _make_model(out, shape, max_position_embeddings)


def _make_model(out: Path, shape: str, max_position_embeddings: int) -> str:
    import torch

    if (out / "config.json").is_file() and (out / "peer_shape.txt").is_file() \
            and (out / "peer_shape.txt").read_text() == shape:
        config = json.loads((out / "config.json").read_text())
        if config.get("max_position_embeddings") != max_position_embeddings:
            config["max_position_embeddings"] = max_position_embeddings
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return str(out)
    if _nvml_gpu_count() > 0 and not os.environ.get("AGENTRL_PEERS_MAKE_MODEL_HERE"):
        import subprocess
        import sys

        code = ("import sys; sys.path[:0] = sys.argv[4:]; from bench.peers.common import make_model; "
                "make_model(sys.argv[1], sys.argv[2], int(sys.argv[3]))")
        env = dict(os.environ, AGENTRL_PEERS_MAKE_MODEL_HERE="1")
        subprocess.run([sys.executable, "-c", code, str(out), shape, str(max_position_embeddings),
                        str(Path(__file__).resolve().parents[2])], check=True, env=env)
        return str(out)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentrl.model.tiny import bootstrap_tiny

    bootstrap_tiny(out, log=lambda *a, **k: None)  # tokenizer + chat template; the weights are replaced
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=max_position_embeddings, rope_theta=1_000_000.0,
                         tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
                         pad_token_id=0)
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    with torch.device("cuda" if cuda else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16 if cuda else torch.float32)
    for f in out.glob("model*.safetensors"):
        f.unlink()
    model.save_pretrained(out, safe_serialization=True)
    (out / "peer_shape.txt").write_text(shape)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return str(out)


def _text_of_tokens(tokenizer: Any, rng: random.Random, num_tokens: int, words: list[str]) -> str:
    """Words drawn with ``rng`` until the text is ``num_tokens`` tokens long (never more).

    The text is the longest run of drawn words that still fits; ``rng`` ends where one word past it
    was drawn (the next call, e.g. the next prompt, goes on from there). The length is found by
    bisection over a run of words drawn from a copy of ``rng``: the token count of a space-joined
    prefix only grows with the prefix, so this is the text a word-by-word loop would stop at, with
    O(log n) tokenizations instead of n (a 96k episode's 32.6k-token tool answer: minutes -> seconds).
    """

    def count(k: int) -> int:
        return len(tokenizer(" ".join(drawn[:k]), add_special_tokens=False)["input_ids"])

    ahead = random.Random()
    ahead.setstate(rng.getstate())
    drawn = [ahead.choice(words) for _ in range(num_tokens + 1)]  # enough where every word is >= 1 token
    while count(len(drawn)) <= num_tokens:  # a tokenizer that merges words: draw more
        if len(drawn) > 64 * (num_tokens + 1):
            raise ValueError(f"{len(drawn)} words of {words} come to <= {num_tokens} tokens")
        drawn += [ahead.choice(words) for _ in range(len(drawn))]
    lo, hi = 0, len(drawn)  # count(lo) <= num_tokens < count(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= num_tokens else (lo, mid)
    for _ in range(lo + 1):  # the words a word-by-word loop draws: the text's, and the one that did not fit
        rng.choice(words)
    return " ".join(drawn[:lo])


_WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "seven", "eight", "nine", "apples", "books", "coins", "left", "right"]


def prompt_texts(tokenizer: Any, workload: Workload, num: int, seed: int = 0) -> list[str]:
    """``num`` distinct user prompts of ``workload.prompt_tokens`` tokens each."""
    rng = random.Random(seed)
    head = "Use the lookup tool until it says stop. " if workload.tool_calls else "Write. "
    base = len(tokenizer(head, add_special_tokens=False)["input_ids"])
    return [head + _text_of_tokens(tokenizer, rng, max(1, workload.prompt_tokens - base), _WORDS) for _ in range(num)]


def observation_text(tokenizer: Any, workload: Workload) -> str:
    """The tool's answer: a fixed text of ``workload.obs_tokens`` tokens."""
    return _text_of_tokens(tokenizer, random.Random(1), workload.obs_tokens, _WORDS) if workload.obs_tokens else ""


def reply_reward(replies: list[str], new_tokens: int) -> float:
    """Mean over the policy's replies of (characters of text it decodes to) / (4 * tokens), capped at 1.

    With random weights ~0.5 % of sampled ids decode to text; GRPO raises that share when it trains.
    """
    if not replies:
        return 0.0
    return statistics.fmean(min(1.0, len(r.strip()) / (4.0 * new_tokens)) for r in replies)


def lookup_tool(observation: str, latency_s: float):
    """The workload's tool, as a plain typed function (TRL and verl read its schema from the hints)."""

    def lookup(query: str) -> str:
        """Look something up.

        Args:
            query: What to look up.
        """
        time.sleep(latency_s)
        return observation

    return lookup


@dataclass
class Result:
    """One system on one workload: what the table prints."""

    system: str
    setting: str
    workload: str
    status: str = "ok"
    """ok | oom | unsupported | error"""
    reason: str = ""
    steps: int = 0
    """Timed steps (after warm-up)."""
    step_time_s: float | None = None
    """Median wall time of a timed step."""
    trained_tokens_per_step: float | None = None
    trained_tokens_per_s_per_gpu: float | None = None
    """Trained tokens (prompt + replies + tool answers of every trained sequence) / wall / GPUs."""
    generated_tokens_per_s: float | None = None
    """Sampled tokens / wall time of the timed steps."""
    weight_sync_s: float | None = None
    peak_gpu_gib: float | None = None
    """Peak device memory in use (NVML, all processes), GiB."""
    gpu_busy: float | None = None
    reward_curve: list[float] = field(default_factory=list)
    """Mean batch reward per step, warm-up included."""
    episode_tokens: float | None = None
    """Mean tokens of one trained episode."""
    extra: dict[str, Any] = field(default_factory=dict)
    workload_spec: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    device: str = ""
    date: str = ""


def pinned_versions(*names: str) -> dict[str, str]:
    """Installed versions of torch, transformers and ``names``."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for n in ("torch", "transformers", "vllm", *names):
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = "missing"
    return out


def write_result(res: Result, out: Path) -> None:
    """Append one result to ``out`` (a JSON list) and print it."""
    res.device = res.device or device_name()
    res.date = res.date or time.strftime("%Y-%m-%d")
    out = Path(out)
    rows = json.loads(out.read_text()) if out.is_file() else []
    rows.append(asdict(res))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")  # whole or not at all: device.sh's `wait` may read it now
    tmp.write_text(json.dumps(rows, indent=2))
    tmp.replace(out)
    print("RESULT " + json.dumps(asdict(res)), flush=True)


def step_intervals(t0: float, stamps: list[float]) -> list[float]:
    """Each step's wall time as every runner measures it: the interval between consecutive step ends
    (``stamps``), the first from ``t0``. A timed step's interval therefore starts where the step
    before it ended (its refit or weight sync included, as every later step's is), never at a time
    the runner chose: agentrl's rollouts run before its first step ends, TRL's and verl's do not, so
    only the steps after a warm-up step compare."""
    return [b - a for a, b in zip([t0, *stamps[:-1]], stamps)]


STEADY_FIRST_STEP = 0.6
"""A run whose first timed step took less than this share of its timed steps' median did not start
timing in its steady state (an async pipeline that filled during the warm-up: agentrl's first
step after one warm-up step took 0.4-0.6 of its median, H100/H200 2026-11-25..27); the table
marks it."""


def steady_state(walls: list[float], warmup: int) -> dict[str, float | bool]:
    """The first timed step against the timed steps' median: ``first_over_median`` and ``steady``
    (False where the first is below :data:`STEADY_FIRST_STEP` of the median)."""
    timed = walls[warmup:]
    if len(timed) < 2:
        return {}
    ratio = timed[0] / (statistics.median(timed) or 1e-9)
    return {"first_over_median": round(ratio, 3), "steady": ratio >= STEADY_FIRST_STEP}


def timed_summary(step_walls: list[float], tokens: list[float], generated: list[float], warmup: int) -> dict[str, float]:
    """Median step time and throughputs over the steps after ``warmup``."""
    walls, toks, gens = step_walls[warmup:], tokens[warmup:], generated[warmup:]
    span = sum(walls) or 1e-9
    return {"steps": len(walls), "step_time_s": statistics.median(walls) if walls else None,
            "trained_tokens_per_step": statistics.fmean(toks) if toks else None,
            "trained_tokens_per_s_per_gpu": sum(toks) / span, "generated_tokens_per_s": sum(gens) / span}


def harness_parser(doc: str, settings: str = "recommended") -> argparse.ArgumentParser:
    """The options every system's runner takes: workload, settings, timed steps, warm-up, lr, output."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--workload", type=workload_arg, required=True,
                   help=f"{', '.join(WORKLOADS)}, or longNk: the long workload at ~N x 1,024 tokens an episode")
    p.add_argument("--settings", default=settings)
    p.add_argument("--steps", type=int, default=8, help="timed steps after the warm-up")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps first: the engines' first batches, compiles, and an async pipeline's "
                        "fill (agentrl's first step after one warm-up step ran on rollouts made during it)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--out", default="peers.json")
    p.add_argument("--workdir", default="/tmp/peers")
    p.add_argument("--scale", type=float, default=1.0, help="scale the workload's sizes (CPU checks)")
    p.add_argument("--group-size", type=int, default=0, help="samples per prompt instead of the workload's")
    p.add_argument("--prompts-per-step", type=int, default=0, help="prompts per step instead of the workload's")
    p.add_argument("--tool-latency", type=float, default=None, metavar="S",
                   help="seconds each tool call sleeps (0, 0.1, 0.5, ...) instead of the workload's (0.5 for "
                        "multi and long); recorded in the result's workload_spec.tool_latency_s")
    return p


def run_workload(args: argparse.Namespace) -> Workload:
    """The workload a runner runs: ``--workload``, scaled by ``--scale``, with ``--group-size`` and
    ``--prompts-per-step`` where given. An episode's length stays the workload's; a changed batch is
    named in the result (``long64k-g4p1``: 4 samples of 1 prompt a step), so it is never read as the
    workload itself. What it is for: a fit probe (device.sh ``fit:``), where one step of a few
    episodes answers "does an episode this long fit" at a fraction of a full step's time, since every
    system here trains one long episode per micro-batch (agentrl's ``micro_batch_tokens``, TRL's
    ``per_device_train_batch_size`` 1, verl's ``ppo_max_token_len_per_gpu``) and sizes its engine's
    KV cache by a memory fraction, neither by the episodes in a step."""
    wl = workload(args.workload)
    wl = wl.scaled(args.scale) if args.scale != 1.0 else wl
    group = getattr(args, "group_size", 0) or wl.group_size
    prompts = getattr(args, "prompts_per_step", 0) or wl.prompts_per_step
    if group < 2 or prompts < 1:
        raise SystemExit(f"--group-size must be >= 2 (GRPO's groups) and --prompts-per-step >= 1: got {group}, {prompts}")
    if (group, prompts) != (wl.group_size, wl.prompts_per_step):
        wl = replace(wl, name=f"{wl.name}-g{group}p{prompts}", group_size=group, prompts_per_step=prompts)
    latency = getattr(args, "tool_latency", None)
    if latency is not None:
        if latency < 0:
            raise SystemExit(f"--tool-latency must be >= 0 seconds: got {latency}")
        if not wl.tool_calls and latency:
            raise SystemExit(f"--tool-latency {latency}: workload {wl.name!r} calls no tool")
        # the name stays the workload's: the table pairs rows by workload_spec.tool_latency_s too
        wl = replace(wl, tool_latency_s=float(latency))
    return wl


def tool_latency(row: dict) -> float | None:
    """The tool latency a result ran with (its workload_spec; None for a workload without tools)."""
    spec = row.get("workload_spec") or {}
    return float(spec.get("tool_latency_s", 0.0)) if spec.get("tool_calls") else None


def stop_on_sigterm() -> None:
    """From here on a SIGTERM (``timeout`` ending a run step at RUN_TIMEOUT) raises KeyboardInterrupt
    in the main thread, as Ctrl-C does, so a runner can still write what its finished steps measured
    (status ``cut``) in the seconds before ``timeout -k`` kills it."""
    import signal

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"stopped by signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, stop)


def mark_cut(res: Result, exc: BaseException, done: int, wanted: int) -> None:
    """``res`` of a run stopped by ``exc`` (KeyboardInterrupt: SIGTERM or Ctrl-C) after ``done`` of
    ``wanted`` steps: status ``cut``; its figures are those of the timed steps it finished."""
    res.status, res.reason = "cut", f"{str(exc) or 'interrupted'} after {done} of {wanted} steps"


def close_result(res: Result, sampler: Any, busy_from: float | None, wanted_steps: int) -> Result:
    """Peak memory and busy share from the NVML sampler; a run short of its timed steps is an error."""
    if busy_from is not None:
        res.gpu_busy = sampler.busy(busy_from)
    res.peak_gpu_gib = sampler.peak_gib()
    if sampler.process_peak_gib:  # who held the memory (the peak-memory goal's profile)
        res.extra["gpu_processes_gib"] = sampler.processes()
    # where a run's time goes beside its steps (making the model and texts, the engine's start,
    # compiles): what a device call must leave room for
    res.extra["runner_s"] = round(time.monotonic() - _STARTED, 1)
    if (gpus := _nvml_gpu_count()) > 1:  # which GPU of a host of several (device.sh GPU=N: one queue each)
        res.extra["gpu"] = {"nvml_index": nvml_index(), "host_gpus": gpus}
    if res.extra.get("step_walls_s"):
        res.extra["outside_steps_s"] = round(res.extra["runner_s"] - sum(res.extra["step_walls_s"]), 1)
    if res.status == "ok" and res.steps < wanted_steps:
        res.status, res.reason = "error", f"only {res.steps} timed steps ran"
    return res
