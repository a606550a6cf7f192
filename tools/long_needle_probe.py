"""Question: does a LongNeedle-v0 policy copy the code word where the answer needs it?
A teacher-forced probe of an SFT or RL checkpoint in HF format; a minute on CPU; run it before any RL run.

For held-out episodes rendered as chat exactly as rollouts are (the demonstrator's calls, the
pages as tool outputs, the answer ``The code word is W.``), it reports at the answer word:
P(code word W), P(unknown) (the give-up habit), P(any of the 12 code words), P(the decoy's note
word) and how often W is the argmax; and inside the pages, P(W) at the 2nd and later needle
repeats (the in-page copy that the observation loss teaches). An answer-position P(W) near
1/12 of P(any code word) means the model knows a code word comes but does not copy it.

    python tools/long_needle_probe.py --model .cache/long-context-sft --episodes 24 \
        --env-kwargs '{"num_pages": 4, "page_words": [1750, 1850], "repeats": 4}'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def probe(model_path: str, env_kwargs: dict[str, Any], episodes: int, seed_offset: int = 10_000_000) -> dict[str, Any]:
    import agentrl.envs  # noqa: F401
    import torch
    from agentrl.envs.long_needle import CODE_WORDS, NOTE_WORDS, LongNeedleEnv
    from transformers import AutoTokenizer

    from agentrl.rollout.chat import ChatRenderer
    from agentrl.model.loading import load_hf_model
    from agentrl.driver.sft import build_demonstrations
    from agentrl.rollout.tool_calls import build_tool_parser

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = load_hf_model(model_path, "float32").eval()
    renderer = ChatRenderer(tokenizer)
    parser = build_tool_parser("auto", model_path, tokenizer)

    def one_token(word: str) -> int:
        ids = tokenizer.encode(" " + word, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{word!r} is {len(ids)} tokens for this tokenizer; the probe needs one")
        return ids[0]

    code_ids = {w: one_token(w) for w in CODE_WORDS}
    note_ids = {w: one_token(w) for w in NOTE_WORDS}
    unknown_id = one_token("unknown")
    seeds = [seed_offset + k for k in range(episodes)]
    demos = build_demonstrations("agentrl/LongNeedle-v0", renderer, seeds, env_kwargs, parser, give_up_prob=0.0)
    rows = []
    for seed, (ids, mask) in zip(seeds, demos):
        env = LongNeedleEnv(**env_kwargs)
        env.reset(seed=seed)
        w = code_ids[env.code]
        with torch.no_grad():
            probs = model(torch.tensor([ids])).logits[0].float().softmax(-1)  # probs[t] predicts ids[t + 1]
        answer = max(t for t in range(len(ids)) if mask[t] and ids[t] == w)
        p = probs[answer - 1]
        in_page = [t for t in range(len(ids)) if not mask[t] and ids[t] == w]
        rows.append({
            "tokens": len(ids), "needle_page": env.needle_page + 1,
            "p_code": float(p[w]), "p_unknown": float(p[unknown_id]),
            "p_any_code": float(p[list(code_ids.values())].sum()), "p_note": float(p[note_ids[env.note]]),
            "argmax_code": int(p.argmax()) == w,
            "p_code_in_page": [float(probs[t - 1, w]) for t in in_page[1:]],
        })
    mean = lambda key: sum(r[key] for r in rows) / len(rows)
    in_page = [x for r in rows for x in r["p_code_in_page"]]
    return {
        "model": model_path, "episodes": len(rows), "tokens_mean": mean("tokens"),
        "answer_p_code": mean("p_code"), "answer_p_unknown": mean("p_unknown"),
        "answer_p_any_code": mean("p_any_code"), "answer_p_note": mean("p_note"),
        "answer_argmax_code": sum(r["argmax_code"] for r in rows) / len(rows),
        "in_page_p_code": sum(in_page) / len(in_page) if in_page else None, "in_page_repeats_scored": len(in_page),
        "answer_p_code_by_page": {
            page: sum(r["p_code"] for r in rows if r["needle_page"] == page)
            / max(1, sum(r["needle_page"] == page for r in rows))
            for page in sorted({r["needle_page"] for r in rows})},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model directory (an SFT output or a checkpoint)")
    ap.add_argument("--episodes", type=int, default=24)
    ap.add_argument("--env-kwargs", default='{"num_pages": 4, "page_words": [1750, 1850], "repeats": 4}',
                    help="LongNeedle-v0 settings, JSON (default: the recipe's RL episodes)")
    args = ap.parse_args()
    print(json.dumps(probe(args.model, json.loads(args.env_kwargs), args.episodes), indent=1))


if __name__ == "__main__":
    main()
