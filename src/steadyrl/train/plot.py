"""The run's picture: a 2×2 PNG of reward, eval accuracy, ESS ratio and k3 mismatch KL against the learner step."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PLOT_FILE = "plot.png"
#: (metric key, panel title) of the four panels, row by row.
PANELS: tuple[tuple[str, str], ...] = (
    ("reward/mean", "batch reward (mean)"),
    ("eval/acc", "held-out accuracy"),
    ("is/ess_ratio", "ESS ratio of the sequence weights"),
    ("kl/k3", "mismatch KL(μ‖π_prox), k3"),
)
FIG_SIZE = (10.0, 7.0)
DPI = 100


def write_plot(records: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Draw the four panels from metric records (one dict per line of metrics.jsonl) into ``path`` (atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=FIG_SIZE, sharex=True)
    for ax, (key, label) in zip(axes.flat, PANELS, strict=True):
        pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if key == "eval/acc" else None, markersize=3, linewidth=1)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(f"{label}  [{key}]", fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("learner step")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, dpi=DPI, format="png")
    plt.close(fig)
    os.replace(tmp, out)
    return out
