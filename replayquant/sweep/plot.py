"""Plots of a sweep (KL against state bytes per step, Pareto front) and of a sensitivity run
(KL by layer).

Both use log axes for KL. A KL at or below the axis floor is drawn at the floor and named, never
dropped; in the sweep plot so is a KL that is float noise around 0 (`front_kl`: within three
standard errors of 0, e.g. the shared FP32 pair, whose mean can come out negative), on a grey band
that says so. The floor is one decade below the smallest KL drawn at its value.

The sweep plot gives every variant its own colour and marker (`kl.plot.series_styles`: a pair's
hue in one shade per buffer length), all of them in the legend; the front's variants are also
labelled beside their points, each label at the first of a few places around its point where it
stays inside the axes and overlaps no other label (`_place_labels`; one with no such place is
left to the legend). Bytes are in KiB, as the tables give them.
"""

from __future__ import annotations

import math
from pathlib import Path

from replayquant.kl.plot import series_styles
from replayquant.kl.report import model_label
from replayquant.outputs import save_figure

from .common import front_kl

__all__ = ["plot_sweep", "sweep_figure", "plot_sensitivity", "axis_floor"]

# where a front label may go, in points from its point, tried in this order: beside it (right,
# then left), then a line further up or down each time
_OFFSETS = [(dx, dy, ha) for k in range(6) for dy in (3 + 10 * k, -10 - 10 * k)
            for dx, ha in ((6, "left"), (-6, "right"))]


def axis_floor(values) -> float:
    """One decade below the smallest positive value (1e-12 when none is positive)."""
    pos = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not pos:
        return 1e-12
    return 10.0 ** (math.floor(math.log10(min(pos))) - 1)


def _plt():
    import matplotlib   # matplotlib: loaded when a plot is drawn
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # matplotlib: loaded when a plot is drawn
    return plt


def _save(fig, png: Path) -> None:
    """Write the figure atomically (`replayquant.outputs.save_figure`) and close it."""
    try:
        save_figure(fig, png)
    finally:
        _plt().close(fig)


def _title(sw) -> str:
    s = sw["settings"]
    return (f"{model_label(sw['model'])}: {sw.get('documents_done')} doc(s) x {s.get('context')} "
            f"tokens, prefill={s.get('prefill', 'replay')}")


def plot_sweep(sw: dict, png: Path) -> list[tuple[str, float, float]]:
    """Write the sweep's PNG (`sweep_figure`); returns the points drawn [(name, bytes, y)]."""
    fig, drawn = sweep_figure(sw)
    _save(fig, png)
    return drawn


def sweep_figure(sw: dict):
    """Mean KL (with its uncertainty) against state KiB per decode step and sequence, log-log;
    the Pareto front as a staircase with its variants labelled; the FP32 conventional step
    marked at the floor (it is the reference: KL 0). Returns (figure, the points drawn as
    [(name, bytes, y)], y the floor for variants at or below it)."""
    plt = _plt()
    from matplotlib.ticker import FuncFormatter, LogLocator   # matplotlib: as above
    rows = [r for r in sw["variants"] if r.get("kl")]      # the sweep's order: pair, then L
    floor = axis_floor([front_kl(r["kl"]["kl_mean"], r["kl"]["kl_unc"]) for r in rows])
    styles = series_styles([r["name"] for r in rows])
    fig, ax = plt.subplots(figsize=(11.0, 5.5), dpi=120)
    drawn, labels, points = [], [], []
    for r in rows:
        x, (m, unc) = r["bytes_per_step"]["state"], (r["kl"]["kl_mean"], r["kl"]["kl_unc"])
        low = front_kl(m, unc) <= floor
        y, st = (floor if low else m), styles[r["name"]]
        drawn.append((r["name"], x, y))
        if not low:
            ax.errorbar([x / 1024], [y], yerr=[[min(unc, 0.999 * (m - floor))], [unc]],
                        fmt="none", ecolor=st["color"], capsize=2, lw=0.8)
        points += ax.plot([x / 1024], [y], ls="none", marker=st["marker"], color=st["color"],
                          ms=7 if r["on_front"] else 5,
                          mec="black" if r["on_front"] else st["color"],
                          label=r["name"] + (" (~0)" if low else ""))
        if r["on_front"]:
            labels.append((x, ax.annotate(r["name"] + (" (~0)" if low else ""), (x / 1024, y),
                                          textcoords="offset points", xytext=_OFFSETS[0][:2],
                                          fontsize=6.5, fontweight="bold",
                                          arrowprops={"arrowstyle": "-", "lw": 0.5,
                                                      "color": "0.4", "shrinkB": 4})))
    front = sorted((r for r in rows if r["on_front"]), key=lambda r: r["bytes_per_step"]["state"])
    if front:
        ax.plot([r["bytes_per_step"]["state"] / 1024 for r in front],
                [max(front_kl(r["kl"]["kl_mean"], r["kl"]["kl_unc"]), floor) for r in front],
                drawstyle="steps-post", color="black", lw=1.2, alpha=0.7,
                label="Pareto front (fewer bytes, lower KL;\nits variants edged black, labelled)")
    cx = sw["conventional_fp32"]["bytes_per_step"]["state"] / 1024
    ax.plot([cx], [floor], marker="*", ms=14, color="crimson", ls="none",
            label=f"FP32 conventional step\n(the reference, KL 0): {cx:.1f} KiB")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=2, subs=(1.0, 1.5)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor / 2)
    ax.margins(x=0.08)
    ax.axhspan(floor / 2, floor * 1.6, color="0.92", zorder=0)
    band = ax.text(0.01, floor * 0.8, "~0: KL within 3 standard errors of 0, drawn at this floor",
                   transform=ax.get_yaxis_transform(), fontsize=6.5, color="0.35", va="center")
    ax.set_xlabel("state KiB moved per decode step and sequence, all recurrent layers "
                  "(read copy + ring buffer + amortised flush)", fontsize=8)
    ax.set_ylabel("mean KL(reference || variant), nats per token (bar: ± uncertainty)",
                  fontsize=8)
    ax.set_title(_title(sw), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside
    fig.tight_layout()
    _place_labels(fig, ax, [a for _, a in sorted(labels, key=lambda xa: xa[0])],
                  keep_clear=[band, *points])
    return fig, drawn


def _place_labels(fig, ax, labels, keep_clear=()) -> None:
    """Move each label, in order, to the first place of `_OFFSETS` where it lies inside the axes
    and overlaps no label placed before it nor the artists `keep_clear` (texts, points); a label
    with no such place is removed (the legend still names its point)."""
    from matplotlib.text import Text   # matplotlib: as in sweep_figure
    r = fig.canvas.get_renderer()
    box = ax.get_window_extent(r)
    placed = [t.get_window_extent(r) for t in keep_clear]
    for a in labels:
        for dx, dy, ha in _OFFSETS:
            a.xyann = (dx, dy)
            a.set_horizontalalignment(ha)
            a.update_positions(r)
            bb = Text.get_window_extent(a, r)       # the text, without its leader line
            inside = box.x0 <= bb.x0 and bb.x1 <= box.x1 and box.y0 <= bb.y0 and bb.y1 <= box.y1
            if inside and not any(bb.overlaps(p) for p in placed):
                placed.append(bb)
                break
        else:
            a.remove()


def plot_sensitivity(sens: dict, png: Path) -> None:
    """Bars by recurrent layer: the KL when only that layer holds the pair (one group of bars
    per pair, log y), with the sum over layers and the all-layers KL in the legend."""
    plt = _plt()
    pairs = list(sens["per_layer"])
    layers = [row["index"] for row in sens["per_layer"][pairs[0]]]
    vals = [row["kl"]["kl_mean"] for p in pairs for row in sens["per_layer"][p]]
    floor = axis_floor(vals)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(layers) * len(pairs) + 2), 4.5), dpi=120)
    w = 0.8 / len(pairs)
    for j, p in enumerate(pairs):
        rows = sens["per_layer"][p]
        xs = [i + (j - (len(pairs) - 1) / 2) * w for i in range(len(rows))]
        ys = [max(r["kl"]["kl_mean"], floor) for r in rows]
        cmp = sens["sum_vs_all"][p]
        ax.bar(xs, [y - floor / 2 for y in ys], w, bottom=floor / 2,
               label=f"{p}: sum over layers {cmp['sum']:.3g}, all layers at once {cmp['all']:.3g}")
        for x, r in zip(xs, rows):
            if r["kl"]["kl_mean"] <= floor:
                ax.annotate(f"{r['kl']['kl_mean']:.0e}", (x, floor), ha="center", fontsize=6,
                            xytext=(0, 2), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor / 2, top=30 * max(max(vals), floor))   # room for the legend
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels([str(i) for i in layers])
    ax.set_xlabel("recurrent layer (decoder layer index); every other layer keeps exact FP32 state",
                  fontsize=8)
    ax.set_ylabel("mean KL(reference || one layer with the pair)", fontsize=8)
    ax.set_title(_title(sens), fontsize=9)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    _save(fig, png)
