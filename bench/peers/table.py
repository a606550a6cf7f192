"""Print the peer harness's table from one or more result files (bench/peers/README.md).

One row per run (or pooled run, ``--combine``); each peer row ends with agentrl/peer ratios of
trained tokens/s/GPU, each named by both settings and both modes: agentrl's setting of the same name
over it (``rec/rec``: agentrl async with max_staleness 2 over the peer's recommended, on-policy;
``like/like``: on-policy over on-policy), agentrl's ``like`` (on-policy) over it where its setting has
no namesake or is the peer's recommended one (``like/recommended``, on-policy over on-policy), and the
best agentrl row over the best peer row (``best``). TRL's GRPOTrainer and verl's sync trainer are
on-policy in every setting here.

Rows are paired only within one pairing group: the same workload, tool latency
(``workload_spec.tool_latency_s``) and device, and the same result file (one device call or queue)
unless ``--combine`` pools the files into one set. Two runs of one system and setting in a group are
both printed; repeated runs of a pair (an interleaved queue: agentrl, TRL, agentrl, TRL, ...) are
paired in order, each peer row with the agentrl run of the same place, and the block below the
table gives each repeated pair's ratios: min / median / max of >= 3 (``tie`` where they straddle
1.0). A run that did not finish is listed with the last line of its reason.

MFU is the same formula for every row (``common.harness_mfu``: 6·N·tokens + 6·L·d·s·tokens, the
trained tokens' forward and backward, over the timed wall time, over the GPU's bf16 peak); each
peer's own meter (TRL's tokens over its ``step_time``, verl's ``perf/mfu/actor`` and
``perf/throughput``) is printed beside it as the peer reports it.

    python bench/peers/table.py peers.json [more.json ...] [--markdown] [--combine]

``--combine`` pools the timed steps of the runs of one system, setting, workload and tool latency into one row
(each run after its own warm-up; trained tokens over wall time summed over every timed step): a
row of >= 5 timed steps from runs too long for one device allowance (TRL's steps at 256k), on one
kind of device and one set of versions, or it refuses. A run stopped by its limit (``cut``) brings
the timed steps it finished whole; the step it was in when stopped was never counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers.common import harness_mfu, steady_state, tool_latency


def load(paths: list[str]) -> list[dict]:
    """The rows of ``paths``, each tagged with the file it came from (``_set``: rows pair only
    within one file unless --combine makes them one set)."""
    rows: list[dict] = []
    for p in paths:
        rows += [{**r, "_set": p} for r in json.loads(Path(p).read_text())]
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
    out: list[dict] = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        walls = r.get("extra", {}).get("step_walls_s", [])
        if r.get("status") in ("ok", "cut") and r.get("steps") and len(walls) > r["steps"]:
            groups.setdefault((r["system"], r["setting"], r["workload"], f"tool {tool_latency(r)}",
                               *_overrides(r)), []).append(r)
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
                                   "steady": _steady(r),
                                   **({"gpu": r["extra"]["gpu"]} if "gpu" in r.get("extra", {}) else {})}
                                  for r in runs]}}
        out.append(row)
    return out


def _steady(row: dict) -> bool | None:
    """Whether a run's first timed step was a normal one (``common.steady_state``; worked out from
    its step walls for a result written before runners recorded it)."""
    extra = row.get("extra", {})
    if "steady" in extra:
        return (extra["steady"] or {}).get("steady")
    walls, steps = extra.get("step_walls_s") or [], row.get("steps") or 0
    return steady_state(walls, len(walls) - steps).get("steady") if steps and len(walls) >= steps else None


def _steps(row: dict) -> str:
    runs = row.get("extra", {}).get("runs")
    unsteady = any(r.get("steady") is False for r in runs) if runs else _steady(row) is False
    return f"{row.get('steps', 0)}" + (f" ({len(runs)} runs)" if runs else "") + ("*" if unsteady else "")


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
    """The setting with the run's overrides, its tool latency (tool workloads), and the GPU of a run
    on a host of several (device.sh GPU=N: another run may have shared the host's cores and memory)."""
    extra = row.get("extra", {})
    gpus = [g for g in [extra.get("gpu"), *(r.get("gpu") for r in extra.get("runs", []))] if g]  # pooled: each run's
    where = (f" (GPU {', '.join(str(i) for i in sorted({g['nvml_index'] for g in gpus}))} of {gpus[0]['host_gpus']})"
             if gpus else "")
    lat = tool_latency(row)
    return (row["setting"] + "".join(f" +{o}" for o in _overrides(row)) + (f", tool {lat:g} s" if lat is not None else "")
            + where)


def mode(row: dict) -> str:
    """How a row's system trains: agentrl's recommended setting is async (max_staleness 2, from its
    config where the result has it), its like and memory settings on-policy; TRL's GRPOTrainer is
    on-policy in every setting; verl's trainer runs its sync mode (on-policy)."""
    if row["system"] == "agentrl":
        staleness = (row.get("extra", {}).get("config") or {}).get("max_staleness")
        if staleness is None:
            staleness = 2 if row["setting"] == "recommended" else 0
        return f"async s≤{staleness}" if staleness else "on-policy"
    return "on-policy (sync)" if row["system"] == "verl" else "on-policy"


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _tput(row: dict | None) -> float | None:
    return row.get("trained_tokens_per_s_per_gpu") if row and row.get("status") == "ok" else None


def _run_tputs(row: dict) -> list[float]:
    """A row's throughput per run: a pooled row's runs (--combine), else the row's own."""
    runs = row.get("extra", {}).get("runs")
    if runs:
        return [r["trained_tokens_per_s_per_gpu"] for r in runs if r.get("trained_tokens_per_s_per_gpu")]
    return [_tput(row)] if _tput(row) else []


def group_key(row: dict) -> tuple:
    """Rows pair only within one group: one result file (or the --combine set), workload, tool
    latency and device."""
    return (row.get("_set"), row["workload"], tool_latency(row), row.get("device", ""))


def series_key(row: dict) -> tuple:
    """Runs of one series in a group: one system, setting, overrides and versions (repeats of one run)."""
    return (row["system"], row["setting"], *_overrides(row), json.dumps(row.get("versions") or {}, sort_keys=True))


def pairs(mine: list, peer: list) -> list[tuple]:
    """Repeated runs of a pair, matched: in order where both sides ran as often (an interleaved
    queue: each peer run with the agentrl run beside it); one run against each of the other side's;
    else in order as far as both go (the rest unpaired)."""
    if len(mine) == 1 or len(peer) == 1:
        return [(a, b) for a in mine for b in peer]
    return list(zip(mine, peer))


def spread(ratios: list[float]) -> str:
    """Ratios of repeated pairs: one as it is, two both, three or more as min / median / max; ``tie``
    where they straddle 1.0 (the repeats do not agree on which system is faster)."""
    if not ratios:
        return "–"
    tie = " tie" if min(ratios) < 1.0 < max(ratios) else ""
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}×"
    if len(ratios) == 2:
        return f"{ratios[0]:.2f}×, {ratios[1]:.2f}×{tie}"
    return f"{min(ratios):.2f}/{statistics.median(ratios):.2f}/{max(ratios):.2f}× (min/med/max of {len(ratios)}){tie}"


def _own(row: dict) -> str:
    """The peer's own meter, as it reports it (run_trl / run_verl ``extra.own``)."""
    own = row.get("extra", {}).get("own") or {}
    if row["system"] == "verl" and own:
        return f"mfu/actor {_f(own.get('mfu_actor'), '.3f')}, {_f(own.get('tokens_per_s'), ',.0f')} tok/s/GPU"
    if row["system"] == "trl" and own.get("tokens_per_s"):
        return f"{own['tokens_per_s']:,.0f} tok/s over step_time {_f(own.get('step_time_median_s'), '.1f')} s"
    return "–"


def ratios(rows: list[dict]) -> tuple[dict[int, str], list[str]]:
    """The ratio cell of each peer row (by ``id``) and the lines of repeated pairs (module docstring)."""
    cells: dict[int, list[str]] = {}
    repeats: list[str] = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(group_key(r), []).append(r)
    for key, grp in groups.items():
        mine: dict[str, list[dict]] = {}
        for r in grp:
            if r["system"] == "agentrl" and not _overrides(r) and _tput(r):
                mine.setdefault(r["setting"], []).append(r)
        peers: dict[tuple, list[dict]] = {}
        for r in grp:
            if r["system"] != "agentrl" and _tput(r):
                peers.setdefault(series_key(r), []).append(r)
        for series in peers.values():
            setting = series[0]["setting"]
            wanted = [s for s in (setting, "like") if s in mine]
            for mset in dict.fromkeys(wanted):
                a_units = [(id(a), t, a) for a in mine[mset] for t in _run_tputs(a)]
                p_units = [(id(p), t, p) for p in series for t in _run_tputs(p)]
                matched = pairs(a_units, p_units)
                label = (f"{'rec' if mset == 'recommended' else mset}/{'rec' if setting == 'recommended' else setting} "
                         f"({mode(mine[mset][0])} / {mode(series[0])})")
                for p in series:
                    mine_r = [a[1] / b[1] for a, b in matched if b[0] == id(p)]
                    cells.setdefault(id(p), []).append(f"{label}: {spread(mine_r)}" if mine_r else f"{label}: unpaired")
                if len(matched) > 1:
                    wl, lat, device = key[1], key[2], key[3]
                    repeats.append(f"{wl}{'' if lat is None else f', tool {lat:g} s'}, {device or '?'}: "
                                   f"agentrl {mset} ({mode(mine[mset][0])}) / {series[0]['system']} {setting} "
                                   f"({mode(series[0])}), {len(matched)} pairs: "
                                   f"{spread([a[1] / b[1] for a, b in matched])}")
        best_mine = max((_tput(r) or 0.0 for r in grp if r["system"] == "agentrl"), default=0.0)
        peer_rows = [r for r in grp if r["system"] != "agentrl" and _tput(r)]
        if best_mine and peer_rows:
            top = max(peer_rows, key=_tput)
            best_a = max((r for r in grp if r["system"] == "agentrl" and _tput(r)), key=_tput)
            cells.setdefault(id(top), []).append(f"best {best_a['setting']}/{top['setting']}: {best_mine / _tput(top):.2f}×")
    return {k: "; ".join(v) for k, v in cells.items()}, repeats


def table(rows: list[dict], markdown: bool = False) -> str:
    head = ["workload", "system", "setting", "mode", "status", "steps", "step s", "trained tok/s/GPU", "MFU",
            "own meter", "gen tok/s", "sync s", "peak GiB", "GPU busy", "episode tok", "reward first→last",
            "agentrl/peer (agentrl/peer settings, modes)"]
    cells, repeats = ratios(rows)
    out = []
    for wl in dict.fromkeys(r["workload"] for r in rows):
        for r in [r for r in rows if r["workload"] == wl]:
            curve = r.get("reward_curve") or []
            status = r["status"] if r["status"] == "ok" else f"{r['status']}: {_why(r.get('reason') or '')}"
            mfu = harness_mfu(r)
            out.append([wl, r["system"], _setting(r), mode(r), status, _steps(r), _f(r.get("step_time_s"), ".1f"),
                        _f(r.get("trained_tokens_per_s_per_gpu"), ",.0f"), _f(mfu and 100 * mfu, ".1f") + ("%" if mfu else ""),
                        _own(r), _f(r.get("generated_tokens_per_s"), ",.0f"),
                        _f(r.get("weight_sync_s"), ".2f"), _f(r.get("peak_gpu_gib"), ".1f"), _f(r.get("gpu_busy"), ".2f"),
                        _f(r.get("episode_tokens"), ",.0f"),
                        f"{curve[0]:.3f}→{curve[-1]:.3f}" if curve else "–", cells.get(id(r), "")])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        text = "\n".join(lines + ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in out])
    else:
        widths = [max(len(h), *(len(row[i]) for row in out)) if out else len(h) for i, h in enumerate(head)]
        fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))
        text = "\n".join([fmt(head), *(fmt(row) for row in out)])
    if repeats:
        text += "\n\nRepeated pairs (agentrl/peer of each pair of runs):\n" + "\n".join(f"  {line}" for line in repeats)
    return text


NOTES = ("MFU: 6·N·tokens + 6·L·d·s·tokens (N = 1.54e9 matmul parameters with the LM head, L = 28 layers, d = 1536, "
         "s = the mean episode length; the trained tokens' forward and backward) over the timed wall time, over the "
         "GPU's dense bf16 peak (989 TFLOP/s on H100 SXM and H200); the same for every system. own meter: the peer's "
         "own figures (TRL: its num_tokens over its step_time; verl: perf/mfu/actor, its actor update only, and "
         "perf/throughput). * the run's first timed step took < 0.6 of its median: not timed in steady state.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--combine", action="store_true",
                   help="pool finished runs of one system, setting, workload and tool latency; pair across the files")
    args = p.parse_args()
    rows = load(args.files)
    if args.combine:
        rows = [{**r, "_set": "combined"} for r in combine(rows)]
    meta = {(r.get("device"), r.get("date")) for r in rows}
    print(table(rows, args.markdown))
    print("\n" + NOTES)
    print("\n" + "; ".join(f"{d} ({t})" for d, t in meta))
    versions = {}
    for r in rows:
        versions.update(r.get("versions", {}))
    print("versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))


if __name__ == "__main__":
    main()
