"""The notebooks' figures: each ``plot_*`` takes the arrays of :mod:`opd_jax.plotting.toys`
and returns a matplotlib Figure. matplotlib is imported inside the functions only, so this
module imports without it (``pip install -e '.[notebooks]'``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from opd_jax.plotting.toys import history_series, running_mean

# ----------------------------------------------------------------------------------------
# Plots (matplotlib imported lazily)
# ----------------------------------------------------------------------------------------

def _plt(agg: bool = False):
    """matplotlib.pyplot, imported on first use; ``agg``: files only, no screen (Agg)."""
    if agg:
        import matplotlib   # lazy: start-up time (plots are drawn at the end of a run)
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # lazy: start-up time
    return plt


def plot_mode_seeking(grid_V, target_logp_V, fits: Mapping[str, np.ndarray],
                      styles: Mapping[str, Mapping] | None = None):
    """Target distribution (filled) and each fitted distribution (lines) over the grid.

    `styles` maps a fit's label to extra `ax.plot` keywords (e.g. {"ls": "--"}).
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    grid_V = np.asarray(grid_V)
    ax.fill_between(grid_V, np.exp(np.asarray(target_logp_V)), color="0.8",
                    label="target (bimodal)")
    for label, logp_V in fits.items():
        ax.plot(grid_V, np.exp(np.asarray(logp_V)), lw=2, label=label,
                **dict((styles or {}).get(label, {})))
    ax.set_xlabel("x (grid point = vocabulary entry)")
    ax.set_ylabel("probability")
    ax.set_title("A unimodal student fitted to a bimodal teacher")
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def plot_estimator_convergence(sample_counts, results: Mapping[str, Mapping[str, np.ndarray]]):
    """Cosine and relative error (median, 10-90% band) of sampled-token gradients vs N."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    n_N = np.asarray(sample_counts)
    for label, res in results.items():
        for ax, key in zip(axes, ("cosine", "rel_err")):
            lo, mid, hi = np.percentile(res[key], [10, 50, 90], axis=1)
            line, = ax.plot(n_N, mid, marker="o", ms=3, label=label)
            ax.fill_between(n_N, lo, hi, color=line.get_color(), alpha=0.2)
    axes[0].set_ylabel("cos(sampled grad, full-vocab grad)")
    axes[0].axhline(1.0, color="0.5", lw=0.8, ls=":")
    axes[1].set_ylabel("||sampled - full|| / ||full||")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("sampled tokens N")
    axes[0].legend(frameon=False)
    fig.suptitle("Kimi's clipped sampled-token signal vs the exact reverse-KL gradient")
    fig.tight_layout()
    return fig


def plot_icepop(noise_scales, masked: Mapping[str, np.ndarray], log_k=None,
                bounds: tuple[float, float] = (0.5, 5.0), log_k_label: str = ""):
    """Masked fraction vs mismatch noise (one line per bounds), and optionally a histogram
    of log k at one noise level with the bounds marked."""
    plt = _plt()
    ncols = 2 if log_k is not None else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5 * ncols, 3.6), squeeze=False)
    ax = axes[0, 0]
    for label, frac in masked.items():
        ax.plot(noise_scales, frac, marker="o", ms=3, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("train/inference logit noise scale")
    ax.set_ylabel("fraction of tokens IcePop masks")
    ax.legend(frameon=False)
    if log_k is not None:
        ax = axes[0, 1]
        ax.hist(np.asarray(log_k).ravel(), bins=60, color="0.6")
        for b in bounds:
            ax.axvline(np.log(b), color="C3", ls="--")
        ax.set_xlabel("log k = log p_train(y) - log p_sampler(y)")
        ax.set_ylabel("tokens")
        ax.set_title(log_k_label or f"kept between the dashed lines {tuple(bounds)}")
    fig.tight_layout()
    return fig


def plot_kernel_memory(sweeps: Mapping[str, Sequence[Mapping]]):
    """Temporary MiB against the swept size, one panel per sweep.

    `sweeps` maps "v" or "n" (the size that varies) to rows of `kernel_memory_sweep`; each
    panel has one line per (kind, implementation): blue for the full-logits reference,
    orange for the fused implementation; solid reverse KL, dashed clipped log-ratio.
    """
    for x in sweeps:
        if x not in ("v", "n"):
            raise ValueError(f"sweep key {x!r}, expected 'v' or 'n'")
    plt = _plt()
    fig, axes = plt.subplots(1, len(sweeps), figsize=(5.5 * len(sweeps), 3.8), squeeze=False)
    for ax, (x, rows) in zip(axes[0], sweeps.items()):
        series = {}
        for r in rows:
            series.setdefault((r["kind"], r["implementation"]), []).append(
                (r[x], r["temp_bytes"]))
        for (kind, impl), pts in sorted(series.items()):
            pts = sorted(pts)
            clipped = kind == "clipped_log_ratio"
            ax.plot([p[0] for p in pts], [p[1] / 2 ** 20 for p in pts],
                    color="C0" if impl == "reference" else "C1", ls="--" if clipped else "-",
                    marker="s" if clipped else "o", ms=9 if clipped else 5,
                    mfc="none" if clipped else None, label=f"{kind} / {impl}")
        fixed = "n" if x == "v" else "v"
        fixed_vals = sorted({r[fixed] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("vocabulary V" if x == "v" else "tokens N")
        ax.set_ylabel("compiled temp memory (MiB)")
        ax.set_title(f"{fixed.upper()} = {', '.join(map(str, fixed_vals))}")
        ax.legend(frameon=False, fontsize=8)
    fig.suptitle("value + grad temporary memory: full logits vs fused (chunked over V)")
    fig.tight_layout()
    return fig


def plot_cell_rewards(history: Sequence[Mapping[str, float]], cells: Sequence[str], *,
                      teacher: Mapping[str, float] | None = None,
                      start: Mapping[str, float] | None = None, window: int = 5):
    """Per-cell reward of the student's rollouts per iteration (dots) and its running mean
    (line), with each cell's teacher reward and the student's starting reward as dashed
    and dotted levels."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 3.6), squeeze=False,
                             sharey=True)
    it_N = np.arange(1, len(history) + 1)
    for ax, cell in zip(axes[0], cells):
        r_N = history_series(history, f"reward/{cell}")
        ax.plot(it_N, r_N, "o", ms=3, alpha=0.4, color="C0")
        ax.plot(it_N, running_mean(r_N, window), color="C0", lw=2,
                label=f"student (mean of last {window})")
        if teacher is not None and cell in teacher:
            ax.axhline(teacher[cell], color="C2", ls="--", label="teacher")
        if start is not None and cell in start:
            ax.axhline(start[cell], color="0.4", ls=":", label="student before OPD")
        ax.set_title(cell)
        ax.set_xlabel("OPD iteration")
    axes[0, 0].set_ylabel("task reward")
    axes[0, 0].legend(frameon=False, fontsize=8)
    fig.suptitle("reward of the student's own rollouts, per cell")
    fig.tight_layout()
    return fig


def plot_teacher_signal(history: Sequence[Mapping[str, float]], names: Sequence[str],
                        metric: str, *, ylabel: str = "", window: int = 5):
    """`teacher/<name>/<metric>` per iteration (running mean), one line per teacher key."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    it_N = np.arange(1, len(history) + 1)
    for name in names:
        x_N = history_series(history, f"teacher/{name}/{metric}")
        line, = ax.plot(it_N, x_N, "o", ms=3, alpha=0.35)
        ax.plot(it_N, running_mean(x_N, window), color=line.get_color(), lw=2, label=name)
    ax.set_xlabel("OPD iteration")
    ax.set_ylabel(ylabel or metric)
    ax.set_title(f"teacher/<key>/{metric} on the student's own samples")
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig
