"""KL against position (log x), one line per pair, from the per-token KL files of a run.

The title names the model as the tables do (hub id, or a local folder's name and fingerprint).
Each pair has its own colour, marker and line style, so curves that lie on top of each other stay
apart; the legend sits outside the axes, where it covers no curve. On the log y axis a bin whose
mean KL is at or below zero (a pair identical to the reference gives exactly 0; float rounding can
give a tiny negative mean) is drawn as a down-pointing triangle at the axis floor (one row per
pair), and a note under the plot says so, instead of vanishing from a log axis.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from replayquant.outputs import save_figure

from .report import model_label, scoring_note, scoring_of

MARKERS = ("o", "s", "^", "D", "P", "X", "*", "h")
LINESTYLES = ("-", "--", "-.", ":")


def position_curve(per_doc: list[np.ndarray], bins_per_octave: int = 8,
                   first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Mean KL over documents, averaged in log-spaced position bins.

    per_doc: one [n] array per document (KL at positions first .. first+n-1). Returns (x, y): x the
    geometric centre of each bin in tokens (position + 1), y the mean KL of the bin.
    """
    n = min(a.shape[-1] for a in per_doc)
    T = first + n
    mean = np.concatenate([np.full(first, np.nan),
                           np.mean([a[:n].astype(np.float64) for a in per_doc], axis=0)])
    n_oct = np.log2(T + 1)
    nb = max(1, int(np.ceil(n_oct * bins_per_octave)))
    edges = np.unique(np.floor(2.0 ** np.linspace(0.0, n_oct, nb + 1)).astype(np.int64))
    edges[0], edges[-1] = 1, T + 1
    xs, ys = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):   # 1-based positions lo .. hi-1
        lo = max(lo, first + 1)                  # positions before `first` are not scored
        if hi <= lo:
            continue
        seg = mean[lo - 1:hi - 1]
        if seg.size:
            xs.append(np.sqrt(lo * max(lo, hi - 1)))
            ys.append(seg.mean())
    return np.asarray(xs), np.asarray(ys)


def curve_style(j: int) -> dict:
    """Colour, marker and line style of the j-th pair (all three change from pair to pair)."""
    return {"color": f"C{j % 10}", "marker": MARKERS[j % len(MARKERS)],
            "linestyle": LINESTYLES[j % len(LINESTYLES)]}


def log_floor(curves: list[np.ndarray]) -> float | None:
    """The y value below every positive value of `curves` (a decade under the smallest), where
    values at or below zero are drawn; None when no value is positive (a linear axis then)."""
    pos = [float(y[y > 0].min()) for y in curves if np.any(y > 0)]
    if not pos:
        return None
    return 10.0 ** (math.floor(math.log10(min(pos))) - 1)


def plot_kl_vs_position(results: dict, arrays: dict, pair_names: list[str], png: Path,
                        first: int = 0):
    """Write a PNG: x = token position (log), y = mean KL(ref || test) (log where any is positive).
    `first`: the first scored position (the arrays hold positions first ... on)."""
    import matplotlib.pyplot as plt   # matplotlib: loaded when a plot is drawn

    fig = kl_figure(results, arrays, pair_names, first)
    try:
        save_figure(fig, png, bbox_inches="tight")
    finally:
        plt.close(fig)


def kl_figure(results: dict, arrays: dict, pair_names: list[str], first: int = 0):
    """The matplotlib figure `plot_kl_vs_position` saves (Agg backend)."""
    import matplotlib   # matplotlib: loaded when a plot is drawn
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # matplotlib: loaded when a plot is drawn

    docs = sorted(arrays)
    curves = [position_curve([arrays[i][j] for i in docs], first=first) for j in range(len(pair_names))]
    floor = log_floor([y for _, y in curves])
    fig, ax = plt.subplots(figsize=(9.0, 4.8), dpi=120)
    n_floor = 0          # pairs drawn on the floor so far: each one a step higher, none hidden
    for j, (name, (x, y)) in enumerate(zip(pair_names, curves)):
        stats = results["results"].get(name) or {}
        st = curve_style(j)
        label = f"{name} (mean {stats.get('kl_mean', float('nan')):.3g})"
        if floor is None:
            ax.plot(x, y, label=label, linewidth=1.2, markersize=4, markerfacecolor="none", **st)
            continue
        low = y <= 0
        if low.all():
            label += ", every bin <= 0"
        ax.plot(x, np.where(low, np.nan, y), label=label, linewidth=1.2, markersize=4,
                markerfacecolor="none", **st)
        if low.any():
            ax.plot(x[low], np.full(int(low.sum()), floor * 1.6 ** n_floor), linestyle="none",
                    marker="v", markersize=6, color=st["color"], markerfacecolor=st["color"])
            n_floor += 1
    ax.set_xscale("log")
    if floor is not None:
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor / 2)
    cfg = results["config"]
    ax.set_xlabel("token position")
    ax.set_ylabel("KL(reference || pair), mean over documents")
    ax.set_title(f"{model_label(cfg['model'])}: {results['documents_done']} doc(s) x {cfg['context']} "
                 f"tokens, prefill={cfg['prefill']}{scoring_note(scoring_of(results))}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    if n_floor:
        fig.text(0.01, 0.01, f"\u25bc at the floor (from {floor:.0e}, one row per pair): bins whose "
                 f"mean KL is <= 0 (0 = identical to the reference; below 0 = float rounding)",
                 fontsize=7)
    fig.tight_layout(rect=(0, 0.03 if n_floor else 0, 1, 1))
    return fig
