"""Question: what does a RepoFix-v0 policy write in its first turn on held-out seeds (no sandbox, no grading)?

    python tools/repofix_probe.py --model .cache/repofix-sft [--config configs/repofix_cpu.yaml]

For each held-out seed (``eval.seed_offset`` onward) the model sees the prompt the env's ``reset`` gives
(same messages, same tool schemas, same chat template) and writes its first message, greedily and with
``--samples`` draws at ``rollout.temperature``. Each message is parsed by the rollout's tool parser and
sorted into: gives up (an answer without a call), malformed (a call that does not parse), another
call, or a ``str_replace``; of those, how many have the right path, old and new text (the fix the hidden
tests would pass) and how many are well-formed but wrong. It measures whether SFT taught the tool-call
format; the reward of a whole episode is what ``agentrl train``'s evaluation measures.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter

from gymnasium.utils import seeding


def first_turn_prompts(cfg, num: int):
    """(seed, prompt messages, tool schemas, the expected str_replace arguments) of held-out seeds."""
    from agentrl.envs.repo_fix import RepoFixEnv

    env = RepoFixEnv(**cfg.env.kwargs)
    out = []
    for k in range(num):
        seed = cfg.eval.seed_offset + k
        np_random, _ = seeding.np_random(seed)  # as TextEnv.reset seeds new_task
        _, messages = env.new_repo(random.Random(int(np_random.integers(1 << 62))), {})
        task = env.task
        expected = {"path": f"{task.package}/{task.bugged.module}.py", "old": task.bugged.buggy,
                    "new": task.bugged.correct}
        out.append((seed, messages, env.tool_schemas(), expected))
    return out


def classify(parser, text: str, expected: dict) -> str:
    parse = parser.parse(text)
    if parse.errors:
        return "malformed"
    if not parse.calls:
        return "gives_up"
    call = parse.calls[0]
    if call.name != "str_replace":
        return "other_call"
    return "right_fix" if call.arguments == expected else "wrong_fix"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", default="configs/repofix_cpu.yaml")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4, help="sampled messages per prompt at rollout.temperature")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.rollout.chat import ChatRenderer
    from agentrl.config import load_config
    from agentrl.rollout.tool_calls import build_tool_parser

    cfg = load_config(args.config, [])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    renderer = ChatRenderer(tokenizer)
    parser = build_tool_parser(cfg.rollout.tool_parser, args.model, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    counts = {"greedy": Counter(), f"T={cfg.rollout.temperature}": Counter()}
    examples = {}
    prompts = first_turn_prompts(cfg, args.episodes)
    pad = tokenizer.pad_token_id
    for mode, n in (("greedy", 1), (f"T={cfg.rollout.temperature}", args.samples)):
        rows = [renderer.prompt_ids(messages, tools) for _, messages, tools, _ in prompts for _ in range(n)]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # left-padded: one batch
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        sampling = {"do_sample": False} if mode == "greedy" else {
            "do_sample": True, "temperature": cfg.rollout.temperature, "top_k": 0}
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=cfg.rollout.max_new_tokens,
                                 pad_token_id=pad, eos_token_id=renderer.end_of_turn_id, **sampling)
        for k, row in enumerate(out):
            seed, _, _, expected = prompts[k // n]
            new = [t for t in row[width:].tolist() if t != pad]
            if renderer.end_of_turn_id in new:
                new = new[:new.index(renderer.end_of_turn_id)]
            text = renderer.decode(new)
            kind = classify(parser, text, expected)
            counts[mode][kind] += 1
            examples.setdefault(kind, (seed, text[:300]))
    print(f"model {args.model}, {args.episodes} held-out seeds from {cfg.eval.seed_offset}, "
          f"{time.perf_counter() - t0:.0f} s")
    kinds = ("right_fix", "wrong_fix", "other_call", "malformed", "gives_up")
    print(f"{'':10s}" + "".join(f"{k:>12s}" for k in kinds) + f"{'calls well-formed':>20s}")
    for mode, c in counts.items():
        total = sum(c.values())
        calls = total - c["gives_up"]
        formed = (calls - c["malformed"]) / calls if calls else float("nan")
        print(f"{mode:10s}" + "".join(f"{c[k] / total:12.3f}" for k in kinds) + f"{formed:20.3f}")
    for kind, (seed, text) in examples.items():
        print(f"\n[{kind}] seed {seed}: {text!r}")


if __name__ == "__main__":
    main()
