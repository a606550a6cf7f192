"""Print the peer harness's table from one or more result files (bench/peers/README.md).

One row per system, setting and workload; each peer row ends with agentrl/peer ratios of trained
tokens/s/GPU: agentrl's recommended setting over the peer's recommended one, agentrl's
like-for-like setting over the peer's row, and the best agentrl row that finished over the best
finished row of any peer (the goals' "agentrl vs the best peer"). A run that did not finish is
listed with the last line of its reason.

    python bench/peers/table.py peers.json [more.json ...] [--markdown]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(paths: list[str]) -> list[dict]:
    rows: list[dict] = []
    for p in paths:
        rows += json.loads(Path(p).read_text())
    return rows


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _tput(row: dict | None) -> float | None:
    return row.get("trained_tokens_per_s_per_gpu") if row and row.get("status") == "ok" else None


def table(rows: list[dict], markdown: bool = False) -> str:
    head = ["workload", "system", "setting", "status", "steps", "step s", "trained tok/s/GPU", "gen tok/s",
            "sync s", "peak GiB", "GPU busy", "episode tok", "reward first→last", "agentrl/peer (rec, like, best)"]
    out = []
    for wl in dict.fromkeys(r["workload"] for r in rows):
        mine = {r["setting"]: r for r in rows if r["workload"] == wl and r["system"] == "agentrl"}
        best_mine = max((_tput(r) or 0.0 for r in mine.values()), default=0.0)
        best_peer = max((_tput(r) or 0.0 for r in rows if r["workload"] == wl and r["system"] != "agentrl"), default=0.0)
        for r in [r for r in rows if r["workload"] == wl]:
            curve = r.get("reward_curve") or []
            ratio = ""
            if r["system"] != "agentrl" and _tput(r):
                rec, like = _tput(mine.get("recommended")), _tput(mine.get("like"))
                best = best_mine / best_peer if best_mine and _tput(r) == best_peer else None
                ratio = (f"{_f(rec and rec / _tput(r), '.2f')}×, {_f(like and like / _tput(r), '.2f')}×, "
                         f"{_f(best, '.2f')}×")
            reason = (r.get("reason") or "").strip().splitlines()
            status = r["status"] if r["status"] == "ok" else f"{r['status']}: {(reason[-1] if reason else '')[-90:]}"
            out.append([wl, r["system"], r["setting"], status, str(r.get("steps", 0)), _f(r.get("step_time_s"), ".1f"),
                        _f(r.get("trained_tokens_per_s_per_gpu"), ",.0f"), _f(r.get("generated_tokens_per_s"), ",.0f"),
                        _f(r.get("weight_sync_s"), ".2f"), _f(r.get("peak_gpu_gib"), ".1f"), _f(r.get("gpu_busy"), ".2f"),
                        _f(r.get("episode_tokens"), ",.0f"),
                        f"{curve[0]:.3f}→{curve[-1]:.3f}" if curve else "–", ratio])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in out])
    widths = [max(len(h), *(len(row[i]) for row in out)) if out else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))
    return "\n".join([fmt(head), *(fmt(row) for row in out)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    rows = load(args.files)
    meta = {(r.get("device"), r.get("date")) for r in rows}
    print(table(rows, args.markdown))
    print("\n" + "; ".join(f"{d} ({t})" for d, t in meta))
    versions = {}
    for r in rows:
        versions.update(r.get("versions", {}))
    print("versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))


if __name__ == "__main__":
    main()
