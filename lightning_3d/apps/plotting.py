"""Plots people would rather see than read (matplotlib is imported lazily: an optional extra)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional


def _read_series(metrics_csv: Path, key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            if row.get(key) not in (None, ""):
                steps.append(int(row["step"]))
                values.append(float(row[key]))
    return steps, values


def plot_loss_curve(metrics_csv: Path, out_png: Path) -> Optional[str]:
    """Train and validation loss against step, from a CSVLogger ``metrics.csv``; returns the PNG path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("lightning_3d: matplotlib is not installed (pip install 'lightning-3d[plot]'); no loss curve.")
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        steps, values = _read_series(metrics_csv, key)
        if steps:
            ax.plot(steps, values, style, label=key, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("lightning_3d training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return str(out_png)
