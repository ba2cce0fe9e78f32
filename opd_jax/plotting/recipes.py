"""The recipes' result figures, written as PNG files (matplotlib's Agg backend: no screen):
held-out curves per cell, grouped bars per cell, and mean +- std lines over seeds.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from opd_jax.plotting.figures import _plt as _pyplot


def _plt():
    return _pyplot(agg=True)


def plot_curves(path: str, panels: Mapping[str, Sequence[dict]], *, title: str,
                ylabel: str = "held-out reward", xlabel: str = "iteration",
                xscale: str = "linear") -> str:
    """One panel per cell; each line {"x", "y", "label"}; each hline {"y", "label"} dashed."""
    plt = _plt()
    n = len(panels)
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (name, lines) in zip(axes.flat, panels.items()):
        for ln in lines:
            if "x" in ln:
                ax.plot(ln["x"], ln["y"], marker="o", ms=3, label=ln["label"])
            else:
                ax.axhline(ln["y"], ls="--", lw=1, color=ln.get("color", "k"), label=ln["label"])
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_xscale(xscale)
        ax.set_ylabel(ylabel)
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bars(path: str, groups: Sequence[str], series: Mapping[str, Sequence[float]], *,
              title: str, ylabel: str, hline: float | None = None,
              errors: Mapping[str, Sequence[float]] | None = None) -> str:
    """Grouped bars: one group per cell, one bar per series (e.g. student, merge)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(groups) * len(series)), 3.6))
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(groups))
    for i, (name, vals) in enumerate(series.items()):
        err = (errors or {}).get(name)
        ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, yerr=err, capsize=3,
               label=name)
    if hline is not None:
        ax.axhline(hline, ls="--", color="k", lw=1)
    ax.set_xticks(x, groups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_seed_lines(path: str, labels: Sequence[str], series: Mapping[str, np.ndarray], *,
                    title: str, ylabel: str = "held-out reward") -> str:
    """One line per series over the points `labels`: mean over seeds of its [seeds, points]
    values, with std error bars when there is more than one seed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    x = np.arange(len(labels))
    for name, ys in series.items():
        ys = np.asarray(ys)
        ax.errorbar(x, ys.mean(0), yerr=ys.std(0) if len(ys) > 1 else None, marker="o",
                    capsize=3, label=name)
    ax.set_xticks(x, labels, rotation=20)
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
