"""Sequence packing against padding: token efficiency and learner step time, side by side.

Run: ``python bench/packing.py`` (a few minutes on 2 CPU cores; ``--quick`` for a smoke run;
``--device cuda`` times a Qwen2.5-0.5B-shaped model in bf16 instead).

1. Token efficiency of the micro-batches built for many sampled steps, per length distribution
   and budget (``packing.max_tokens_per_microbatch``), for four ways of batching:
   ``padded_rows`` (the classic fixed micro-batch of 4 rows, right-padded to the longest; it
   ignores the budget), ``padded_budget`` (``packing.algorithm=none``: consecutive sequences as
   padded rows while rows x longest fits the budget), ``ffd`` and ``mffd`` (packed).
2. Learner step time (forward + backward over every micro-batch + AdamW step) of a random Qwen2,
   padded and packed (MFFD, document-masked attention, chunked logprobs), on the same batches,
   interleaved, in one run; plus the largest packed-vs-padded logprob difference.
"""

from __future__ import annotations

import argparse
import copy
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from agentrl.learner.hf_forward import packed_token_logprobs, padded_token_logprobs
from agentrl.learner.packing import (
    bin_lower_bound,
    make_microbatches,
    mffd,
    microbatch_slots,
    pack_sequences,
    unpack_padded,
)

MIN_LEN, MAX_LEN = 100, 4096
PADDED_ROWS = 4
"""Rows per micro-batch of the classic padded baseline (a fixed micro-batch size)."""
MODES = ("padded_rows", "padded_budget", "ffd", "mffd")
TIMED = ("padded_rows", "padded_budget", "mffd")
MODELS: dict[str, dict] = {
    # ~7M parameters: what 2 CPU cores can train in seconds per step.
    "small": {
        "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 704,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    },
    # Qwen2.5-0.5B's shape (random weights), for --device cuda.
    "0.5b": {
        "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True,
    },
}  # fmt: skip


def lognormal_lengths(rng: random.Random, n: int) -> list[int]:
    """Long-tailed multi-turn lengths: median ~600 tokens, clipped to [100, 4096]."""
    return [min(MAX_LEN, max(MIN_LEN, round(rng.lognormvariate(6.4, 0.9)))) for _ in range(n)]


def uniform_lengths(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(MIN_LEN, MAX_LEN) for _ in range(n)]


DISTRIBUTIONS: dict[str, Callable[[random.Random, int], list[int]]] = {
    "lognormal": lognormal_lengths,
    "uniform": uniform_lengths,
}


def microbatches(mode: str, lengths: list[int], max_tokens: int) -> tuple[list[list[int]], int]:
    """Micro-batches of one step (indices) and the token slots their tensors occupy."""
    if mode == "padded_rows":
        n = len(lengths)
        mbs = [list(range(i, min(i + PADDED_ROWS, n))) for i in range(0, n, PADDED_ROWS)]
        algorithm = "none"
    else:
        algorithm = "none" if mode == "padded_budget" else mode
        mbs = make_microbatches(lengths, max_tokens, algorithm=algorithm)[0]
    return mbs, sum(microbatch_slots(mb, lengths, algorithm=algorithm) for mb in mbs)


def efficiency_table(budgets: list[int], batch: int, num_steps: int, seed: int) -> None:
    print(
        f"\n## Token efficiency ({num_steps} steps x {batch} sequences, lengths {MIN_LEN}..{MAX_LEN})"
    )
    print("tensor = real tokens / slots of the tensors run; fill = real / (micro-batches x budget)")
    print(
        "bound = the best fill any packing could reach: bins >= Martello-Toth L2 (>= ceil(tokens/budget))"
    )
    print(
        f"{'distribution':<12} {'budget':>6} {'mode':<14} {'micro-batches':>13} "
        f"{'tensor':>7} {'fill':>7} {'bound':>7}"
    )
    for dist, sample in DISTRIBUTIONS.items():
        rng = random.Random(seed)
        steps = [sample(rng, batch) for _ in range(num_steps)]
        real = sum(sum(lengths) for lengths in steps)
        for max_tokens in budgets:
            bound = real / (sum(bin_lower_bound(ls, max_tokens) for ls in steps) * max_tokens)
            for mode in MODES:
                built = [microbatches(mode, lengths, max_tokens) for lengths in steps]
                count = sum(len(mbs) for mbs, _ in built)
                tensor = real / sum(slots for _, slots in built)
                # The fixed-rows baseline ignores the budget, so its fill is not comparable.
                fill = "-" if mode == "padded_rows" else f"{real / (count * max_tokens):.1%}"
                print(
                    f"{dist:<12} {max_tokens:>6} {mode:<14} {count / num_steps:>13.1f} "
                    f"{tensor:>7.1%} {fill:>7} {bound:>7.1%}"
                )


def packing_time(seed: int, num_sequences: int = 10_000) -> None:
    print(f"\n## Time to pack {num_sequences} sequences with MFFD (best of 3)")
    for dist, sample in DISTRIBUTIONS.items():
        lengths = sample(random.Random(seed), num_sequences)
        for max_tokens in (4096, 32768):
            best = min(_seconds(mffd, lengths, max_tokens) for _ in range(3))
            print(f"{dist:<12} budget {max_tokens:>6}: {best * 1e3:.0f} ms")


def _seconds(fn: Callable, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def make_model(size: str, seed: int, device: str, dtype: torch.dtype) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        **MODELS[size], max_position_embeddings=MAX_LEN, attn_implementation="sdpa"
    )
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(dtype)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train_step(
    model, optimizer, seqs, adv, *, mode: str, max_tokens: int, chunk_size: int
) -> float:
    """One learner step over every micro-batch; returns seconds."""
    device = str(next(model.parameters()).device.type)
    lengths = [len(s) for s in seqs]
    num_tokens = sum(lengths)
    _sync(device)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    for mb in microbatches(mode, lengths, max_tokens)[0]:
        if mode in ("ffd", "mffd"):
            batch = pack_sequences(seqs, {"adv": adv}, indices=mb)
            logprobs = packed_token_logprobs(model, batch, chunk_size=chunk_size)
            advantages = batch.fields["adv"][0]
        else:
            logprobs = padded_token_logprobs(model, [seqs[i] for i in mb], chunk_size=chunk_size)
            rows = [torch.tensor(adv[i]) for i in mb]
            advantages = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        # Stand-in policy-gradient loss (logprobs are 0 on padding and first tokens).
        (-(advantages.to(logprobs.device) * logprobs).sum() / num_tokens).backward()
    optimizer.step()
    _sync(device)
    return time.perf_counter() - start


def max_logprob_gap(packed_model, padded_model, seqs, max_tokens: int) -> float:
    mb = make_microbatches([len(s) for s in seqs], max_tokens)[0][0]
    with torch.no_grad():
        batch = pack_sequences(seqs, indices=mb)
        packed = unpack_padded(packed_token_logprobs(packed_model, batch), batch)
        padded = padded_token_logprobs(padded_model, [seqs[i] for i in mb])
    return (packed - padded).abs().max().item()


def timing_table(args: argparse.Namespace, size: str, dtype: torch.dtype) -> None:
    vocab = MODELS[size]["vocab_size"]
    num_params = sum(p.numel() for p in make_model(size, args.seed, "meta", dtype).parameters())
    where = (
        f"CPU, {torch.get_num_threads()} threads"
        if args.device == "cpu"
        else torch.cuda.get_device_name()
    )
    print(
        f"\n## Learner step time: Qwen2 {num_params / 1e6:.1f}M params, {str(dtype)[6:]}, {where}; "
        f"{args.batch} sequences/step, budget {args.max_tokens}; same batches, modes interleaved, "
        f"1 warm-up + {args.steps} timed steps"
    )
    print("step = forward + backward over all micro-batches + AdamW; mean seconds per step")
    print(
        f"{'distribution':<12} {'tokens/step':>11} {'padded_rows':>12} {'padded_budget':>14} "
        f"{'mffd':>7} {'x vs rows':>10} {'x vs budget':>12} {'max |dlogp|':>12}"
    )
    for dist in args.distributions:
        sample = DISTRIBUTIONS[dist]
        rng = random.Random(args.seed + 1)
        steps = [sample(rng, args.batch) for _ in range(args.steps + 1)]
        models = {mode: make_model(size, args.seed, args.device, dtype) for mode in TIMED}
        optimizers = {
            mode: torch.optim.AdamW(m.parameters(), lr=1e-5) for mode, m in models.items()
        }
        reference = copy.deepcopy(models["padded_rows"])
        gap = max_logprob_gap(
            models["mffd"], reference, _tokens(rng, steps[0], vocab), args.max_tokens
        )
        del reference
        times: dict[str, list[float]] = {mode: [] for mode in TIMED}
        for k, lengths in enumerate(steps):
            seqs = _tokens(rng, lengths, vocab)
            adv = [[rng.choice([-1.0, 1.0])] * n for n in lengths]
            for mode in TIMED:
                t = train_step(
                    models[mode], optimizers[mode], seqs, adv,
                    mode=mode, max_tokens=args.max_tokens, chunk_size=args.chunk_size,
                )  # fmt: skip
                if k > 0:
                    times[mode].append(t)
        rows, budget, packed = (statistics.mean(times[m]) for m in TIMED)
        tokens = statistics.mean(sum(s) for s in steps[1:])
        print(
            f"{dist:<12} {tokens:>11.0f} {rows:>12.2f} {budget:>14.2f} {packed:>7.2f} "
            f"{rows / packed:>9.2f}x {budget / packed:>11.2f}x {gap:>12.1e}"
        )
        del models, optimizers


def _tokens(rng: random.Random, lengths: list[int], vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--max-tokens", type=int, default=4096, help="packing.max_tokens_per_microbatch"
    )
    parser.add_argument("--batch", type=int, default=16, help="sequences per timed learner step")
    parser.add_argument(
        "--steps", type=int, default=2, help="timed steps per distribution and mode"
    )
    parser.add_argument("--chunk-size", type=int, default=1024, help="packing.logprob_chunk_size")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--distributions",
        nargs="+",
        choices=sorted(DISTRIBUTIONS),
        default=list(DISTRIBUTIONS),
        help="length distributions of the timed steps",
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.steps = 4, 1
    print(
        f"# bench/packing.py  torch {torch.__version__}  {platform.machine()}  device={args.device}"
    )
    efficiency_table(
        sorted({args.max_tokens, 2 * args.max_tokens}), batch=64, num_steps=50, seed=args.seed
    )
    packing_time(args.seed)
    if args.device == "cuda":
        timing_table(args, "0.5b", torch.bfloat16)
    else:
        timing_table(args, "small", torch.float32)


if __name__ == "__main__":
    main()
