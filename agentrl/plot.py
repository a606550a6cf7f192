"""`agentrl plot RUN_DIR`: PNGs of a run: reward/success curves, time breakdown, eval before/after."""

from __future__ import annotations

from pathlib import Path

from agentrl.driver.metrics import read_metrics

__all__ = ["plot_run"]

_TIMING = [("timing/waiting", "waiting for data"), ("timing/logprobs", "reference logprobs (KL)"),
           ("timing/training", "training"), ("timing/refit_wait", "waiting for refit")]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r and isinstance(r[key], (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _smooth(ys: list[float], k: int = 5) -> list[float]:
    return [sum(ys[max(0, i - k + 1): i + 1]) / len(ys[max(0, i - k + 1): i + 1]) for i in range(len(ys))]


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write ``learning.png`` and ``timing.png`` into ``run_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    rows = read_metrics(run)
    train = [r for r in rows if "train/loss" in r]
    if not train:
        raise ValueError(f"{run}/metrics.jsonl has no training steps to plot")
    out: list[Path] = []

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in zip(axes, ["rollout/reward", "rollout/success", "rollout/tool_use_rate"],
                              ["reward (batch mean)", "success rate (batch)", "episodes that call a tool"]):
        xs, ys = _series(train, key)
        ax.plot(xs, ys, alpha=0.35, color="tab:blue", label="per step")
        ax.plot(xs, _smooth(ys), color="tab:blue", label="moving mean (5)")
        ax.set_title(title)
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
    before = next((r for r in rows if "eval_before/success" in r), None)
    after = next((r for r in reversed(rows) if "eval_after/success" in r), None)
    if before and after:
        last = train[-1]["step"]
        for ax, key in ((axes[1], "success"), (axes[2], "tool_use_rate")):
            ax.scatter([0, last], [before[f"eval_before/{key}"], after[f"eval_after/{key}"]], color="tab:red",
                       zorder=5, label="held-out eval (greedy)")
    axes[1].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{run.name}: learning curves")
    fig.tight_layout()
    out.append(run / "learning.png")
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4))
    steps = [r["step"] for r in train]
    bottom = [0.0] * len(train)
    for key, label in _TIMING:
        vals = [float(r.get(key, 0.0)) for r in train]
        ax.bar(steps, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("learner step")
    ax.set_ylabel("seconds")
    ax.set_title("time per step (generation runs concurrently; 'waiting' is the learner idle for data)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    out.append(run / "timing.png")
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)
    return out
