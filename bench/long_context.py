"""How cost grows with trajectory length, side by side in one run: rollout and learner tokens/s
at 1k, 4k, 8k and 16k tokens, and the learner's peak memory at each.

* rollout: ``--tokens / L`` concurrent requests (at least 2) to one vLLM engine, each a distinct
  random prompt of ``L - 32`` tokens plus 32 sampled tokens (prefix caching cannot help: as in a
  multi-turn episode, each trajectory's context is prefilled once). Tokens/s counts trajectory
  tokens, ``requests * L / wall``; every length processes about the same number of tokens.
* learner: one torch-learner step (forward, backward, AdamW) on a group of two trajectories of
  ``L`` tokens (half of them sampled, rewards 0 and 1), packed into micro-batches of 16384 tokens;
  run in a fresh child process per length, so its peak RSS (``ru_maxrss``) is that length's alone.
  At the longest length it is also run with ``packing.logprob_chunk_size`` = L (one chunk: a full
  [tokens, vocab] float32 logits tensor and its gradient), to show what the chunked head saves,
  with the model's own vocabulary and with a ``--head-vocab`` one (the same model, its embedding
  resized, random weights): the head's share of memory grows with the vocabulary.
* fit: seconds per token ``t(L)/L = a + b*L``; the quadratic share at length L is ``b*L / (a + b*L)``
  (attention's L^2 work against the per-token work of every other layer).

    python bench/long_context.py [--model DIR] [--lengths 1024 4096 8192 16384] [--out results.json]

Figures taken on the shared 2-core machine are noisy; compare rows of one run, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import resource
import tempfile
import time
from pathlib import Path

GEN = 32
RECIPE_MODEL = dict(max_position_embeddings=16384, rope_theta=1e6, hidden_size=64, num_layers=3, num_heads=2,
                    num_kv_heads=1, intermediate_size=192)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _learner_child(model: str, length: int, chunk: int, out: mp.Queue) -> None:
    import torch

    from agentrl.config import load_config
    from agentrl.learner.base import build_learner
    from agentrl.rollout.trajectory import Trajectory, TrajectoryGroup

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    cfg = load_config(None, [f"model.path={model}", "packing.max_tokens_per_microbatch=16384",
                             f"packing.logprob_chunk_size={chunk}", "learner.lr=1e-4"])
    learner = build_learner(cfg, model_path=model)
    vocab = learner.model.config.vocab_size
    rng = random.Random(length)
    trajs = []
    for reward in (0.0, 1.0):
        ids = [rng.randrange(8, vocab) for _ in range(length)]
        mask = [i % 2 for i in range(length)]  # half the tokens sampled, half observation
        trajs.append(Trajectory(ids, mask, [-3.0 * m for m in mask], [0 if m else -1 for m in mask],
                                [(0, length)], [reward]))
    group = TrajectoryGroup("bench", trajs)
    base = _rss_mib()
    times = []
    for _ in range(2):  # the first step allocates; the second is the figure
        t0 = time.perf_counter()
        metrics = learner.train_step([group])
        times.append(time.perf_counter() - t0)
    out.put({"seconds": times[-1], "peak_rss_mib": _rss_mib(), "rss_before_step_mib": base,
             "microbatches": metrics["train/num_microbatches"]})


def _resized(model: str, vocab: int) -> str:
    """``model`` with a ``vocab``-token embedding and head, random weights, in a temp directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    config.vocab_size = vocab
    torch.manual_seed(0)
    out = Path(tempfile.mkdtemp()) / f"vocab{vocab}"
    AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    return str(out)


def learner_row(model: str, length: int, chunk: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_learner_child, args=(model, length, chunk, q))
    p.start()
    res = q.get()
    p.join()
    res["tokens_per_s"] = 2 * length / res["seconds"]
    return res


async def _rollout(model: str, lengths: list[int], tokens: int) -> dict[int, dict]:
    from agentrl.config import EngineConfig
    from agentrl.engine.vllm_engine import VLLMEngine

    engine = VLLMEngine(model, EngineConfig(max_model_len=max(lengths), kv_cache_gib=2.0))
    await engine.start()
    rows = {}
    try:
        rng = random.Random(0)
        await engine.generate([rng.randrange(8, 500) for _ in range(256)], max_tokens=8)  # warm-up
        for length in lengths:
            requests = max(2, tokens // length)
            prompts = [[rng.randrange(8, 500) for _ in range(length - GEN)] for _ in range(requests)]
            t0 = time.perf_counter()
            outs = await asyncio.gather(*[engine.generate(p, max_tokens=GEN, ignore_eos=True) for p in prompts])
            wall = time.perf_counter() - t0
            assert all(len(o.token_ids) == GEN for o in outs)
            rows[length] = {"seconds": wall, "requests": requests, "tokens_per_s": requests * length / wall}
    finally:
        engine.shutdown()
    return rows


def fit(lengths: list[int], seconds_per_token: list[float]) -> tuple[float, float]:
    """Least squares of s/token = a + b*L."""
    n = len(lengths)
    mx, my = sum(lengths) / n, sum(seconds_per_token) / n
    sxx = sum((x - mx) ** 2 for x in lengths)
    b = sum((x - mx) * (y - my) for x, y in zip(lengths, seconds_per_token)) / sxx
    return my - b * mx, b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF model directory with a context >= the longest length (default: a tiny "
                                   "model of the long-context recipe's shape, made on the spot)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=65536, help="rollout tokens per length")
    p.add_argument("--head-vocab", type=int, default=32768, help="vocabulary of the head-memory rows (0: skip)")
    p.add_argument("--out")
    args = p.parse_args()
    model = args.model
    if model is None:
        from agentrl.model.tiny import bootstrap_tiny

        model = str(bootstrap_tiny(Path(tempfile.mkdtemp()) / "tiny16k", **RECIPE_MODEL))
    rollout = asyncio.run(_rollout(model, args.lengths, args.tokens))
    learner = {L: learner_row(model, L, 1024) for L in args.lengths}
    longest = max(args.lengths)
    unchunked = learner_row(model, longest, longest)
    head = {}
    if args.head_vocab:
        big = _resized(model, args.head_vocab)
        head = {"chunked": learner_row(big, longest, 1024), "one_chunk": learner_row(big, longest, longest)}

    print(f"{'length':>7} | {'rollout tok/s':>13} | {'learner tok/s':>13} | {'learner/rollout':>15} | "
          f"{'learner peak RSS MiB':>20} | {'RSS before step':>15}")
    for L in args.lengths:
        r, l = rollout[L], learner[L]
        print(f"{L:>7} | {r['tokens_per_s']:>13.0f} | {l['tokens_per_s']:>13.0f} | {l['tokens_per_s'] / r['tokens_per_s']:>15.2f} | "
              f"{l['peak_rss_mib']:>20.0f} | {l['rss_before_step_mib']:>15.0f}")
    print(f"{longest} tokens, logprob head in one chunk: peak RSS {unchunked['peak_rss_mib']:.0f} MiB "
          f"(chunked: {learner[longest]['peak_rss_mib']:.0f} MiB, "
          f"{unchunked['peak_rss_mib'] / learner[longest]['peak_rss_mib']:.2f}x)")
    if head:
        c, u = head["chunked"], head["one_chunk"]
        print(f"{longest} tokens, vocabulary {args.head_vocab}: peak RSS chunked {c['peak_rss_mib']:.0f} MiB, one chunk "
              f"{u['peak_rss_mib']:.0f} MiB ({u['peak_rss_mib'] / c['peak_rss_mib']:.2f}x); learner tok/s "
              f"{c['tokens_per_s']:.0f} / {u['tokens_per_s']:.0f}")
    fits = {}
    for name, rows in (("rollout", rollout), ("learner", learner)):
        a, b = fit(args.lengths, [1 / rows[L]["tokens_per_s"] for L in args.lengths])
        shares = {L: b * L / (a + b * L) for L in args.lengths}
        fits[name] = {"a_s_per_token": a, "b_s_per_token2": b, "quadratic_share": shares}
        print(f"{name}: s/token = {a:.3e} + {b:.3e} * L; quadratic share "
              + ", ".join(f"{L // 1024}k {100 * s:.0f}%" for L, s in shares.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"rollout": rollout, "learner": learner, "unchunked": unchunked,
                                              "head_vocab": head, "fit": fits}, indent=2, default=str))


if __name__ == "__main__":
    main()
