"""Print the peer harness's table from one or more result files (bench/peers/README.md).

One row per system, setting and workload; each peer row ends with agentrl/peer ratios of trained
tokens/s/GPU: agentrl's recommended setting over the peer's recommended one, agentrl's
like-for-like setting over the peer's row, and the best agentrl row that finished over the best
finished row of any peer (the goals' "agentrl vs the best peer"). A run that did not finish is
listed with the last line of its reason.

    python bench/peers/table.py peers.json [more.json ...] [--markdown] [--combine]

``--combine`` pools the timed steps of the runs of one system, setting and workload into one row
(each run after its own warm-up; trained tokens over wall time summed over every timed step): a
row of >= 5 timed steps from runs too long for one device allowance (TRL's steps at 256k), on one
kind of device and one set of versions, or it refuses. A run stopped by its limit (``cut``) brings
the timed steps it finished whole; the step it was in when stopped was never counted.
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


def combine(rows: list[dict]) -> list[dict]:
    """``rows`` with the runs of each (system, setting, workload) that timed a step, finished (``ok``)
    or stopped by their limit (``cut``: its whole timed steps), pooled into one row: throughputs are
    totals over every timed step (tokens / seconds), the step time the median of every timed step's
    wall, the peak the largest, the reward curves one after another, and ``extra.runs`` the runs it
    pooled (date, status, steps, step time). A lone run passes through as it is (a cut run stays
    cut). Runs with other config overrides (``--set``) are other rows; a run that timed its first
    step (no warm-up: a probe) is never pooled. Runs on other devices or versions are not pooled: a
    ValueError says which."""
    import statistics

    out: list[dict] = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        walls = r.get("extra", {}).get("step_walls_s", [])
        if r.get("status") in ("ok", "cut") and r.get("steps") and len(walls) > r["steps"]:
            groups.setdefault((r["system"], r["setting"], r["workload"], *_overrides(r)), []).append(r)
        else:  # nothing timed, or no warm-up before the timed steps (a probe): its own row
            out.append(r)
    for key, runs in groups.items():
        if len(runs) == 1:
            out.append(runs[0])
            continue
        for field in ("device", "versions"):
            if len({json.dumps(r.get(field), sort_keys=True) for r in runs}) > 1:
                raise ValueError(f"{':'.join(key)}: runs differ in {field}, not pooled: "
                                 + "; ".join(json.dumps(r.get(field), sort_keys=True) for r in runs))
        tokens = [r["steps"] * r["trained_tokens_per_step"] for r in runs]
        walls_s = [t / r["trained_tokens_per_s_per_gpu"] for t, r in zip(tokens, runs)]  # one GPU a run
        timed = [w for r in runs for w in r.get("extra", {}).get("step_walls_s", [])[-r["steps"]:]]
        steps = sum(r["steps"] for r in runs)
        syncs = [(r["weight_sync_s"], r["steps"]) for r in runs if r.get("weight_sync_s") is not None]
        row = {**runs[0], "status": "ok", "reason": "", "steps": steps, "trained_tokens_per_step": sum(tokens) / steps,
               "trained_tokens_per_s_per_gpu": sum(tokens) / sum(walls_s),
               "generated_tokens_per_s": sum((r.get("generated_tokens_per_s") or 0.0) * w
                                             for r, w in zip(runs, walls_s)) / sum(walls_s),
               "step_time_s": statistics.median(timed) if len(timed) == steps else runs[0]["step_time_s"],
               "weight_sync_s": (sum(v * n for v, n in syncs) / sum(n for _, n in syncs)) if syncs else None,
               "peak_gpu_gib": max((r.get("peak_gpu_gib") or 0.0) for r in runs),
               "reward_curve": [x for r in runs for x in r.get("reward_curve", [])],
               "date": " / ".join(dict.fromkeys(r.get("date", "?") for r in runs)),
               "extra": {"set": _overrides(runs[0]), "runs": [{"date": r.get("date"), "status": r["status"], "steps": r["steps"],
                                   "step_time_s": r["step_time_s"],
                                   "trained_tokens_per_s_per_gpu": r["trained_tokens_per_s_per_gpu"],
                                   **({"gpu": r["extra"]["gpu"]} if "gpu" in r.get("extra", {}) else {})}
                                  for r in runs]}}
        out.append(row)
    return out


def _steps(row: dict) -> str:
    runs = row.get("extra", {}).get("runs")
    return f"{row.get('steps', 0)}" + (f" ({len(runs)} runs)" if runs else "")


def _why(reason: str) -> str:
    """A failed run's reason in a table cell: for CUDA's out-of-memory message, what was asked and
    what was free (its last line's tail is a documentation link); else its last line's tail."""
    import re

    asked = re.search(r"Tried to allocate ([\d.]+ [GMK]iB)", reason)
    free = re.search(r"of which ([\d.]+ [GMK]iB) is free", reason)
    if asked or free:
        return ", ".join([*([f"asked {asked[1]}"] if asked else []), *([f"{free[1]} free"] if free else [])])
    lines = reason.strip().splitlines()
    return (lines[-1] if lines else "")[-90:]


def _overrides(row: dict) -> list[str]:
    """The config overrides a run was given beside its setting (the runners' ``--set``)."""
    extra = row.get("extra", {})
    return list((extra.get("config") or {}).get("set") or extra.get("set") or [])


def _setting(row: dict) -> str:
    """The setting with the run's overrides, and the GPU of a run on a host of several (device.sh
    GPU=N: another run may have shared the host's cores and memory meanwhile)."""
    extra = row.get("extra", {})
    gpus = [g for g in [extra.get("gpu"), *(r.get("gpu") for r in extra.get("runs", []))] if g]  # pooled: each run's
    where = (f" (GPU {', '.join(str(i) for i in sorted({g['nvml_index'] for g in gpus}))} of {gpus[0]['host_gpus']})"
             if gpus else "")
    return row["setting"] + "".join(f" +{o}" for o in _overrides(row)) + where


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _tput(row: dict | None) -> float | None:
    return row.get("trained_tokens_per_s_per_gpu") if row and row.get("status") == "ok" else None


def table(rows: list[dict], markdown: bool = False) -> str:
    head = ["workload", "system", "setting", "status", "steps", "step s", "trained tok/s/GPU", "gen tok/s",
            "sync s", "peak GiB", "GPU busy", "episode tok", "reward first→last", "agentrl/peer (rec, like, best)"]
    out = []
    for wl in dict.fromkeys(r["workload"] for r in rows):
        # the rec and like columns: agentrl's settings as they are (a run with overrides counts in best)
        mine = {r["setting"]: r for r in rows if r["workload"] == wl and r["system"] == "agentrl" and not _overrides(r)}
        best_mine = max((_tput(r) or 0.0 for r in rows if r["workload"] == wl and r["system"] == "agentrl"), default=0.0)
        best_peer = max((_tput(r) or 0.0 for r in rows if r["workload"] == wl and r["system"] != "agentrl"), default=0.0)
        for r in [r for r in rows if r["workload"] == wl]:
            curve = r.get("reward_curve") or []
            ratio = ""
            if r["system"] != "agentrl" and _tput(r):
                rec, like = _tput(mine.get("recommended")), _tput(mine.get("like"))
                best = best_mine / best_peer if best_mine and _tput(r) == best_peer else None
                ratio = (f"{_f(rec and rec / _tput(r), '.2f')}×, {_f(like and like / _tput(r), '.2f')}×, "
                         f"{_f(best, '.2f')}×")
            status = r["status"] if r["status"] == "ok" else f"{r['status']}: {_why(r.get('reason') or '')}"
            out.append([wl, r["system"], _setting(r), status, _steps(r), _f(r.get("step_time_s"), ".1f"),
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
    p.add_argument("--combine", action="store_true", help="pool finished runs of one system, setting and workload")
    args = p.parse_args()
    rows = load(args.files)
    if args.combine:
        rows = combine(rows)
    meta = {(r.get("device"), r.get("date")) for r in rows}
    print(table(rows, args.markdown))
    print("\n" + "; ".join(f"{d} ({t})" for d, t in meta))
    versions = {}
    for r in rows:
        versions.update(r.get("versions", {}))
    print("versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))


if __name__ == "__main__":
    main()
