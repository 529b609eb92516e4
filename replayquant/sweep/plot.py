"""Plots of a sweep (KL against state bytes per step, Pareto front) and of a sensitivity run
(KL by layer).

Both use log axes for KL. A KL at or below the axis floor is drawn at the floor with a downward
triangle and its value in the label, never dropped; in the sweep plot so is a KL that is not
above its uncertainty (float noise around 0, e.g. the shared FP32 pair, whose mean can come out
negative). The floor is one decade below the smallest KL drawn at its value.
"""

from __future__ import annotations

import math
from pathlib import Path

from replayquant.kl.report import model_label
from replayquant.outputs import save_figure

from .common import front_kl

__all__ = ["plot_sweep", "plot_sensitivity", "axis_floor"]


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
    """Mean KL (with its upper bound) against state bytes per decode step and sequence,
    log-log; the Pareto front as a staircase with its variants labelled; the FP32 conventional
    step marked at the floor (it is the reference: KL 0). Returns the points drawn
    [(name, x, y)], the floor's y for variants at or below it."""
    plt = _plt()
    rows = [r for r in sw["variants"] if r.get("kl")]
    conv = sw["conventional_fp32"]
    floor = axis_floor([front_kl(r["kl"]["kl_mean"], r["kl"]["kl_unc"]) for r in rows])
    fig, ax = plt.subplots(figsize=(11.0, 5.5), dpi=120)
    bases = list(dict.fromkeys(r["base"] for r in rows))
    cmap = plt.get_cmap("tab10")
    colour = {b: cmap(i % 10) for i, b in enumerate(bases)}
    n_low, n_front, drawn = 0, 0, []
    for r in sorted(rows, key=lambda r: r["bytes_per_step"]["state"]):
        x = r["bytes_per_step"]["state"]
        m, unc = r["kl"]["kl_mean"], r["kl"]["kl_unc"]
        low = front_kl(m, unc) <= floor
        y = floor if low else m
        n_low += low
        drawn.append((r["name"], x, y))
        ax.errorbar([x], [y], yerr=None if low else [[min(unc, 0.999 * (m - floor))], [unc]],
                    fmt="v" if low else "o", color=colour[r["base"]], ms=6 if r["on_front"] else 4,
                    mec="black" if r["on_front"] else colour[r["base"]], capsize=2, lw=0.8,
                    label=r["base"] if r is next(q for q in rows if q["base"] == r["base"]) else None)
        text = r["name"] + (f" (KL {m:.1e} ± {unc:.0e}, drawn at the floor)" if low else "")
        # floor labels stacked upwards; front labels alternately above right and below left (front
        # points close in bytes would overlap), the others below right
        if low:
            off, ha = (4, 4 + 9 * (n_low - 1)), "left"
        elif r["on_front"]:
            n_front += 1
            off, ha = ((4, 5), "left") if n_front % 2 else ((-5, -11), "right")
        else:
            off, ha = (4, -9), "left"
        ax.annotate(text, (x, y), textcoords="offset points", xytext=off, ha=ha, fontsize=6.5,
                    color="black" if r["on_front"] else "0.45",
                    fontweight="bold" if r["on_front"] else "normal")
    front = [r for r in sorted(rows, key=lambda r: r["bytes_per_step"]["state"]) if r["on_front"]]
    if front:
        xs = [r["bytes_per_step"]["state"] for r in front]
        ys = [max(front_kl(r["kl"]["kl_mean"], r["kl"]["kl_unc"]), floor) for r in front]
        ax.plot(xs, ys, drawstyle="steps-post", color="black", lw=1.2, alpha=0.7,
                label="Pareto front (fewer bytes, lower KL)")
    cx = conv["bytes_per_step"]["state"]
    ax.plot([cx], [floor], marker="*", ms=14, color="crimson", ls="none",
            label=f"FP32 conventional step\n(the reference, KL 0): {cx / 1024:.1f} KiB")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor / 2)
    ax.margins(x=0.08)
    ax.set_xlabel("state bytes moved per decode step and sequence, all recurrent layers "
                  "(read copy + ring buffer + amortised flush)", fontsize=8)
    ax.set_ylabel("mean KL(reference || variant) per token (bar: + uncertainty)", fontsize=8)
    ax.set_title(_title(sw), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside
    fig.tight_layout()
    _save(fig, png)
    return drawn


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
