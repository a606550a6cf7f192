"""Question: on a student's own held-out Calculator episodes, where does it part from a teacher, and does the teacher know better there?

    python tools/distill_diag.py --student .cache/seed1-sft --teacher .cache/seed1-ind-sft [--episodes 128] [--temperature 0]

Runs the student's held-out episodes (seeds from 1,000,000, the quickstart's evaluation settings)
with one local vLLM engine, then scores every token the student wrote with both models in Hugging
Face (full distributions, float32). Per kind of policy token (digits of the tool call, digits of
the answer, the rest) it prints: how many, the mean full reverse KL(student || teacher) in nats,
how often the two models' argmax differ, and the mean teacher logprob of the student's token. For
failed episodes it also counts where the first argmax disagreement falls: the positions at which
a per-token teacher signal can turn a failure around.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _segments(tok, traj) -> list[str]:
    """Per token of the trajectory: 'call' or 'answer' (policy tokens of turn 1 / later turns), '' elsewhere."""
    seg = [""] * len(traj.token_ids)
    for i, (a, b) in enumerate(traj.turn_spans):
        for j in range(a, b):
            seg[j] = "call" if i == 0 else "answer"
    return seg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed-offset", type=int, default=1_000_000)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.learner.distill import check_teacher
    from agentrl.driver.evaluate import run_episodes

    check_teacher(args.teacher, args.student)
    trajs = asyncio.run(run_episodes(args.student, "agentrl/Calculator-v0", args.episodes, args.seed_offset,
                                     args.temperature, {"max_new_tokens": 40, "max_turns": 3, "max_total_tokens": 512}))
    tok = AutoTokenizer.from_pretrained(args.student)
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
    digit_ids = {i for t, i in tok.get_vocab().items() if tok.decode([i]).strip().isdigit()}

    stats: dict[str, list[float]] = {}
    first: dict[str, int] = {}
    num_failed = 0
    for traj in trajs:
        ids = torch.tensor([traj.token_ids])
        with torch.no_grad():
            s_lp = torch.log_softmax(student(ids).logits[0].float(), -1)  # [T, V]
            t_lp = torch.log_softmax(teacher(ids).logits[0].float(), -1)
        seg = _segments(tok, traj)
        seen_disagreement = False
        for pos in range(1, len(traj.token_ids)):
            if not traj.loss_mask[pos]:
                continue
            y = traj.token_ids[pos]
            p, q = s_lp[pos - 1], t_lp[pos - 1]  # the distributions the token was drawn from
            kind = f"{seg[pos]} {'digit' if y in digit_ids else 'other'}"
            kl = float((p.exp() * (p - q)).sum())
            disagree = int(p.argmax()) != int(q.argmax())
            stats.setdefault(kind, []).append((kl, float(disagree), float(q[y])))
            if not traj.success and disagree and not seen_disagreement:
                seen_disagreement = True
                first[kind] = first.get(kind, 0) + 1
        num_failed += not traj.success

    succ = sum(t.success for t in trajs) / max(len(trajs), 1)
    print(f"student {args.student} (held-out success {succ:.3f} over {len(trajs)} episodes, temperature "
          f"{args.temperature}), teacher {args.teacher}")
    print(f"{'policy tokens':16s}{'tokens':>8s}{'KL(s||t)':>10s}{'argmax differs':>16s}{'teacher logprob':>17s}"
          f"{'first difference in a failed episode':>38s}")
    for kind in sorted(stats):
        rows = stats[kind]
        n = len(rows)
        print(f"{kind:16s}{n:8d}{sum(r[0] for r in rows) / n:10.3f}{sum(r[1] for r in rows) / n:16.3f}"
              f"{sum(r[2] for r in rows) / n:17.3f}{first.get(kind, 0):38d}")
    print(f"failed episodes: {num_failed}; with no argmax difference at all: {num_failed - sum(first.values())}")


if __name__ == "__main__":
    main()
