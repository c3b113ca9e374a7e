"""`plot`: a run's curves, or several runs' on one picture (an ablation): rewards, tool calls, eval metrics, loss.

    python mt_grpo_trainer.py plot RUN_DIR [RUN_DIR ...] [--out FILE]     (or: bash run.sh plot ...)

Each RUN_DIR is a run folder with its metrics.jsonl. FILE defaults to RUN_DIR/curves.png for one run and to
curves.png in the working folder for several. A run writes its own curves.png when it ends (`summarize`).
Per-step values are drawn faint, with their trailing mean over a twentieth of the run on top; eval points as dots,
from step 0 (the model before training) when the run evaluated it; an eval metric whose values all lie in [0, 1] (a
share, or a reward that is one) on an axis from 0 to 1.
"""

import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

PANELS = [
    ("reward/outcome", "outcome reward"),
    ("reward/turn", "turn reward"),
    ("rollout/tool_calls", "tool calls per episode"),
    ("loss/policy", "policy loss"),
]


class PlotError(ValueError):
    """A run folder without metrics: one line."""


def read_metrics(run_dir: str) -> list[dict]:
    """The run's logged steps (a torn last line, from a run killed mid-write, is skipped)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise PlotError(f"{run_dir} is not a run folder: no metrics.jsonl in it")
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def trailing_mean(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i + 1 - window) : i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def plot(run_dirs: list[str], out: str) -> str:
    """Draw the runs' curves into `out` (PNG); returns `out`."""
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    if len(set(names)) < len(names):  # runs/a/run and runs/b/run: their paths tell them apart
        names = [os.path.normpath(d) for d in run_dirs]
    runs = {name: read_metrics(d) for name, d in zip(names, run_dirs)}
    evals = sorted({k for rows in runs.values() for r in rows for k in r if k.startswith("eval/")})
    last = max((r["step"] for rows in runs.values() for r in rows), default=1)  # every panel spans the same steps
    panels = PANELS + [(k, f"eval: {k.removeprefix('eval/')}") for k in evals]  # at eval_temperature; greedy_*: greedy
    cols = 3
    n_rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(5 * cols, 3.2 * n_rows), squeeze=False)
    axes = list(axes.flat)
    for ax, (key, title) in zip(axes, panels):
        for i, (name, rows) in enumerate(runs.items()):
            steps = [r["step"] for r in rows if key in r]
            values = [r[key] for r in rows if key in r]
            color = f"C{i}"
            if key.startswith("eval/"):
                ax.plot(steps, values, "o-", color=color, label=name, clip_on=False)  # step 0's dot on the axis, whole
                continue
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, trailing_mean(values, max(1, len(values) // 20)), color=color, linewidth=2, label=name)
        drawn = [r[key] for rows in runs.values() for r in rows if key in r]
        if key.startswith("eval/") and drawn and all(0 <= v <= 1 for v in drawn):
            ax.set_ylim(0, 1)  # a rate, on its whole range: auto-scaled, 0.945 -> 0.969 would look like a leap
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_xlim(0, last + 1)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.axis("off")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.04 + 0.03 * math.ceil(len(labels) / 3), 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    out = None
    if "--out" in argv:
        i = argv.index("--out")
        out = argv[i + 1] if i + 1 < len(argv) else None
        argv = argv[:i] + argv[i + 2 :]
        if out is None:
            print("plot: error: --out needs a file name, e.g. --out ablation.png", file=sys.stderr)
            return 1
    if not argv or any(a.startswith("-") for a in argv):
        print("usage: python mt_grpo_trainer.py plot RUN_DIR [RUN_DIR ...] [--out FILE]", file=sys.stderr)
        return 1
    out = out or (os.path.join(argv[0], "curves.png") if len(argv) == 1 else "curves.png")
    try:
        print(f"[mt-grpo] curves of {len(argv)} run(s): {plot(argv, out)}")
    except PlotError as e:
        print(f"plot: error: {e}", file=sys.stderr)
        return 1
    return 0
