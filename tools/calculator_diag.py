"""Question: where does a Calculator policy fail (one-step vs two-step problems, tool use, call and answer copying)?

    python tools/calculator_diag.py --model .cache/quickstart-sft [--episodes 256] [--temperature 0]

Runs held-out episodes (seeds from 1,000,000, as the quickstart's evaluation) with one local vLLM
engine and splits them by problem kind (one-step: ``n + n``, ``n - n``, ``n * n``; the rest two-step,
also shown shape by shape).
Per kind: success, tool use, and for episodes that called the tool, how often the call's
expression equals the problem's and how often the answer after a right call is right (the two
number-copying skills the tiny model has to learn).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed-offset", type=int, default=1_000_000)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from agentrl.rollout.chat import parse_tool_calls
    from agentrl.envs.calculator import EASY_SHAPES, CalculatorEnv
    from agentrl.driver.evaluate import run_episodes

    trajs = asyncio.run(run_episodes(args.model, "agentrl/Calculator-v0", args.episodes, args.seed_offset,
                                     args.temperature, {"max_new_tokens": 40, "max_turns": 3, "max_total_tokens": 512}))
    tok = AutoTokenizer.from_pretrained(args.model)
    rows: dict[str, list[dict]] = {"one-step": [], "two-step": []}
    for t in trajs:
        env = CalculatorEnv()
        env.reset(seed=t.seed)
        shape = re.sub(r"\d+", "n", env.expression)
        kind = "one-step" if shape in EASY_SHAPES else "two-step"
        turns = [tok.decode(t.token_ids[a:b]) for a, b in t.turn_spans]  # <tool_call> may be a special token
        calls = [c for text in turns for c in parse_tool_calls(text).calls]
        exprs = [str(c.arguments.get("expression", "")).strip() for c in calls]
        right_call = bool(exprs) and exprs[0] == env.expression
        rows[kind].append({"success": t.success, "tool": bool(calls), "right_call": right_call,
                           "after_right": t.success if right_call else None, "shape": shape})
    print(f"model {args.model}, {len(trajs)} held-out episodes, temperature {args.temperature}")
    print(f"{'kind':16s}{'episodes':>9s}{'success':>9s}{'tool use':>10s}{'call right':>12s}{'answer right|call right':>25s}")
    # the two-step shapes one by one: a policy that learned to put some of them whole into the call
    # but not others shows it here
    shapes = sorted({r["shape"] for r in rows["two-step"]})
    by_shape = [(f"  {s}", [r for r in rows["two-step"] if r["shape"] == s]) for s in shapes]
    for kind, rs in [("one-step", rows["one-step"]), ("two-step", rows["two-step"]), *by_shape,
                     ("all", rows["one-step"] + rows["two-step"])]:
        n = max(len(rs), 1)
        tool = [r for r in rs if r["tool"]]
        right = [r for r in rs if r["right_call"]]
        print(f"{kind:16s}{len(rs):9d}{sum(r['success'] for r in rs) / n:9.3f}{len(tool) / n:10.3f}"
              f"{len(right) / max(len(tool), 1):12.3f}{sum(r['after_right'] for r in right) / max(len(right), 1):25.3f}")


if __name__ == "__main__":
    main()
