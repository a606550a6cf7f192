"""Held-out learning curves of finished runs, side by side: greedy success at every evaluation
(``eval.interval``), the first learner step at which each run reaches a threshold, wall time, and
what dynamic sampling and distillation cost or measured (dropped groups, extra episodes, reverse KL).

    python bench/learning_curves.py runs/ds_off runs/ds_on --threshold 0.9

Used for the dynamic-sampling and on-policy-distillation runs of bench/history/distillation.md; it reads
``metrics.jsonl`` only, so it runs on any machine after the runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve(run_dir: Path) -> dict:
    temperature = json.loads((run_dir / "config.json").read_text())["eval"]["temperature"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    points: dict[int, float] = {}
    last: dict = {}
    for row in rows:
        step = int(row.get("step", 0))
        for prefix in ("eval_before", "eval_step", "eval_after"):
            if f"{prefix}/success" in row:
                points[step] = row[f"{prefix}/success"]
        if "train/version" in row:
            last = row
    return {"points": dict(sorted(points.items())), "last": last, "temperature": temperature}


def first_step(points: dict[int, float], threshold: float) -> int | None:
    return next((s for s, v in points.items() if v >= threshold), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--threshold", type=float, nargs="+", default=[0.5, 0.9], help="held-out success to reach")
    args = ap.parse_args()
    curves = {r: curve(r) for r in args.runs}
    steps = sorted({s for c in curves.values() for s in c["points"]})
    temps = sorted({c["temperature"] for c in curves.values()})
    print(f"held-out success by learner step (eval temperature {', '.join(map(str, temps))}; 0 = greedy)")
    print("step  " + "".join(f"{r.name:>16s}" for r in args.runs))
    for s in steps:
        print(f"{s:4d}  " + "".join(f"{c['points'][s]:16.3f}" if s in c["points"] else f"{'':16s}"
                                    for c in curves.values()))
    print(f"\nfirst evaluated step at >= {', '.join(map(str, args.threshold))} (None: not reached):")
    for r, c in curves.items():
        last = c["last"]
        reached = " ".join(f"{first_step(c['points'], t)!s:>5s}" for t in args.threshold)
        extra = {k.split("/")[-1]: last[k] for k in ("replay/dynamic_dropped", "replay/dynamic_dropped_frac",
                                                      "replay/dynamic_extra_trajectories", "distill/reverse_kl")
                 if k in last}
        print(f"  {r.name:16s} {reached}   steps {int(last.get('train/version', 0))}, "
              f"wall {last.get('timing/elapsed', 0):.0f} s  {json.dumps(extra)}")


if __name__ == "__main__":
    main()
