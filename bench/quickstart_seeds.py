"""The quickstart from an empty cache, several seeds, on an idle machine and beside a CPU hog.

    python bench/quickstart_seeds.py --seeds 0 1 2 --hog 0          # idle
    python bench/quickstart_seeds.py --seeds 0 1 2 --hog 1          # one busy core beside each run
    python bench/quickstart_seeds.py --table bench/results/quickstart_seeds/*.json

Each run is ``agentrl train configs/quickstart.yaml seed=S`` with its own model and SFT cache
directories (so the seed makes the tiny model, the demonstrations' SFT and the RL run afresh, as on
a fresh clone), plus any ``--set key=value`` overrides. ``--hog N`` starts N processes that spin
on the CPU for the whole run (the slower, busier machine of a user's laptop or a shared CI box).
Every run is written to ``--out`` as one JSON file and printed in the table, failures included:
a learning goal is judged on all runs, not the best one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _spin() -> None:  # a CPU hog: one core, busy until killed
    while True:
        pass


def run_one(seed: int, hog: int, out: Path, work: Path, sets: list[str], timeout: float,
            cache_from: str | None = None) -> dict:
    tag = f"seed{seed}_hog{hog}" + ("_" + "_".join(s.replace("=", "-").replace(".", "-") for s in sets) if sets else "")
    run_dir = work / "runs" / tag
    # --cache-from: start from another run's tiny model and SFT of the same seed (neither depends on
    # timing: the same seed makes the same model and SFT at any speed), so only the RL part differs
    cache = work / "cache" / (f"seed{seed}_{cache_from}" if cache_from else tag)
    shutil.rmtree(run_dir, ignore_errors=True)
    if not cache_from:
        shutil.rmtree(cache, ignore_errors=True)
    elif not (cache / "sft").is_dir():
        raise SystemExit(f"--cache-from {cache_from}: {cache} holds no SFT model")
    cmd = [sys.executable, "-m", "agentrl.cli", "train", "--no-progress", str(ROOT / "configs/quickstart.yaml"), f"seed={seed}",
           f"run_dir={run_dir}", f"model.path={cache / 'tiny-model'}", f"sft.output_dir={cache / 'sft'}",
           *sets]
    hogs = [mp.Process(target=_spin, daemon=True) for _ in range(hog)]
    for p in hogs:
        p.start()
    t0 = time.monotonic()
    log = out / f"{tag}.log"
    try:
        with log.open("w") as fh:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    finally:
        for p in hogs:
            p.kill()
    wall = time.monotonic() - t0
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    before, after = summary.get("eval_before/success"), summary.get("eval_after/success")
    row = {
        "seed": seed, "hog": hog, "sets": sets, "rc": rc, "wall_s": round(wall, 1),
        "before": before, "after": after,
        "gain_points": None if before is None or after is None else round(100 * (after - before), 1),
        "cache": str(cache), "cache_from": cache_from, "run_dir": str(run_dir), "log": str(log), "load_avg_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M"), "commit": _commit(),
    }
    (out / f"{tag}.json").write_text(json.dumps(row, indent=2))
    return row


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, check=False,
                              text=True).stdout.strip()
    except OSError:
        return "?"


def table(rows: list[dict]) -> str:
    lines = ["| seed | CPU hog | overrides | before | after | gain (points) | wall | exit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["hog"], " ".join(r["sets"]), r["seed"])):
        num = (lambda v, fmt: "-" if v is None else format(v, fmt))
        lines.append(f"| {r['seed']} | {r['hog']} | {' '.join(r['sets']) or '-'} | {num(r['before'], '.3f')} "
                     f"| {num(r['after'], '.3f')} | {num(r['gain_points'], '+.1f')} "
                     f"| {r['wall_s'] / 60:.1f} min | {r['rc']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--hog", type=int, default=0, help="busy processes beside each run (0: idle)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a config override key=value")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/quickstart_seeds")
    ap.add_argument("--work", type=Path, default=ROOT / ".cache/quickstart_seeds",
                    help="where each run's run directory and caches go")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--cache-from", help="reuse the tiny model and SFT of the runs tagged seed<S>_<THIS> (e.g. hog0)")
    ap.add_argument("--table", type=Path, nargs="*", help="only print the table of these result files")
    args = ap.parse_args()
    if args.table is not None:
        print(table([json.loads(p.read_text()) for p in args.table]))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        row = run_one(seed, args.hog, args.out, args.work, args.sets, args.timeout, args.cache_from)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(table(rows))


if __name__ == "__main__":
    main()
