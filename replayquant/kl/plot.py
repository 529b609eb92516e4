"""KL against position (log x), one line per pair, from the per-token KL files of a run.

The title names the model as the tables do (hub id, or a local folder's name and fingerprint).
Each pair has its own colour, marker and line style (`series_styles`: no two colours alike up to
20 pairs; the buffer lengths of one pair, PAIR@L8 and PAIR@L16 as a sweep names them, share a
hue in two shades with a marker each), and the legend sits outside the axes, where it covers no
curve. A bin whose mean KL is 0, or float noise around 0 (`zero_bins`), is a gap in its curve, its
count in the legend ("~0", as the tables write it): such bins have no place on a log axis, and a
noise bin whose mean came out at 1e-24 would otherwise stretch the axis over 15 decades. A plot
made for a KL budget (`recommend --per-layer`) draws it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from replayquant.outputs import save_figure

from . import stats as S
from .files import kl_shape, load_document_kl
from .report import load_results, model_label, scoring_note, scoring_of

MARKERS = ("o", "s", "^", "D", "P", "X", "*", "h", "p", "<")
HUES = ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C8", "C9")   # tab10 without its grey
LINESTYLES = ("-", "--", "-.", ":")


def position_bins(per_doc: list[np.ndarray], bins_per_octave: int = 8,
                  first: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """KL of every document averaged in log-spaced position bins.

    per_doc: one [n] array per document (KL at positions first .. first+n-1). Returns (x, y, zero):
    x the geometric centre of each bin in tokens (position + 1), y the mean KL over the bin's
    tokens of every document, zero whether the bin reads as KL 0 (`zero_bins`).
    """
    n = min(a.shape[-1] for a in per_doc)
    T = first + n
    vals = np.concatenate([np.full((len(per_doc), first), np.nan),
                           np.stack([a[:n].astype(np.float64) for a in per_doc])], axis=1)
    n_oct = np.log2(T + 1)
    nb = max(1, int(np.ceil(n_oct * bins_per_octave)))
    edges = np.unique(np.floor(2.0 ** np.linspace(0.0, n_oct, nb + 1)).astype(np.int64))
    edges[0], edges[-1] = 1, T + 1
    xs, ys, zero = [], [], []
    for lo, hi in zip(edges[:-1], edges[1:]):   # 1-based positions lo .. hi-1
        lo = max(lo, first + 1)                  # positions before `first` are not scored
        if hi <= lo:
            continue
        seg = vals[:, lo - 1:hi - 1].ravel()
        if seg.size:
            xs.append(np.sqrt(lo * max(lo, hi - 1)))
            ys.append(seg.mean())
            zero.append(zero_bins(seg))
    return np.asarray(xs), np.asarray(ys), np.asarray(zero, dtype=bool)


def zero_bins(values: np.ndarray) -> bool:
    """Whether a bin's per-token KL values read as KL 0: a mean at or below 0, or per-token values
    of both signs (float rounding: a KL of real error is never below 0) whose mean is compatible
    with 0 (`stats.kl_vs_zero`, three standard errors). A bin of a few positive values with a
    large spread is not zero, however far its mean is from its standard error."""
    mean = float(values.mean())
    if mean <= 0:
        return True
    if values.min() >= 0 or values.size < 2:
        return False
    return S.kl_vs_zero(mean, float(values.std(ddof=1)) / math.sqrt(values.size)) == 0


def _base_and_len(name: str) -> tuple[str, int | None]:
    base, sep, L = name.rpartition("@L")
    return (base, int(L)) if sep and L.isdigit() else (name, None)


def series_styles(names: list[str]) -> dict[str, dict]:
    """Colour, marker and line style of each series, no two colours alike. Where every name is
    PAIR@L<n> with at most 9 pairs, a pair keeps one hue of tab10 (`HUES`: grey reads as no data)
    and each buffer length a shade of it (lighter for longer), a marker and a line style; else
    the j-th name takes tab10's j-th colour (tab20's past 10 names, evenly spaced colours of
    'turbo' past 20), with marker and line style changing as well."""
    import matplotlib   # matplotlib: loaded when a plot is drawn
    from matplotlib.colors import to_hex, to_rgb   # matplotlib: as above

    parts = [_base_and_len(n) for n in names]
    bases = list(dict.fromkeys(b for b, _ in parts))
    lens = sorted({L for _, L in parts if L is not None})
    if names and all(L is not None for _, L in parts) and len(bases) <= len(HUES):
        out = {}
        for n, (b, L) in zip(names, parts):
            li = lens.index(L)
            light = 0.55 * li / max(1, len(lens) - 1) if len(lens) > 1 else 0.0
            rgb = [c + (1 - c) * light for c in to_rgb(HUES[bases.index(b)])]
            out[n] = {"color": to_hex(rgb), "marker": MARKERS[li % len(MARKERS)],
                      "linestyle": LINESTYLES[li % len(LINESTYLES)]}
        return out
    k = len(names)
    if k <= 10:
        colours = [f"C{j}" for j in range(k)]
    elif k <= 20:
        colours = [matplotlib.colormaps["tab20"](j) for j in range(k)]
    else:
        colours = [matplotlib.colormaps["turbo"](j / (k - 1)) for j in range(k)]
    return {n: {"color": to_hex(colours[j]), "marker": MARKERS[j % len(MARKERS)],
                "linestyle": LINESTYLES[j % len(LINESTYLES)]} for j, n in enumerate(names)}


def plot_kl_vs_position(results: dict, arrays: dict, pair_names: list[str], png: Path,
                        first: int = 0, budget: float | None = None):
    """Write a PNG: x = token position (log), y = mean KL(ref || test) (log where any is positive).
    `first`: the first scored position (the arrays hold positions first ... on); `budget`: the KL
    budget the run was made for, drawn as a line."""
    import matplotlib.pyplot as plt   # matplotlib: loaded when a plot is drawn

    fig = kl_figure(results, arrays, pair_names, first, budget=budget)
    try:
        save_figure(fig, png, bbox_inches="tight")
    finally:
        plt.close(fig)


def plot_results_file(path: str | os.PathLike, png: str | os.PathLike | None = None,
                      budget: float | None = None) -> Path:
    """Draw the plot of a KL results file (NAME.json) from the per-token KL files beside it
    (NAME.kl/, as the run wrote them) into `png` (default NAME.png); returns the PNG's path."""
    path = Path(path)
    ((_, res),) = load_results([path])
    cfg = res["config"]
    run_dir = path.parent / res.get("kl_tokens_dir", path.with_suffix(".kl").name)
    docs = next((st["per_document"] for st in res["results"].values() if st), [])
    if not docs:
        raise ValueError(f"{path} holds no finished document: there is nothing to plot")
    arrays = {d["index"]: load_document_kl(run_dir / f"doc{d['index']:05d}.npy", kl_shape(cfg),
                                           d["index"]) for d in docs}
    png = Path(png) if png is not None else path.with_suffix(".png")
    plot_kl_vs_position(res, arrays, [p["name"] for p in cfg["pairs"]], png,
                        first=S.scored_range(cfg["context"], scoring_of(res))[0], budget=budget)
    return png


def kl_figure(results: dict, arrays: dict, pair_names: list[str], first: int = 0,
              budget: float | None = None):
    """The matplotlib figure `plot_kl_vs_position` saves (Agg backend)."""
    import matplotlib   # matplotlib: loaded when a plot is drawn
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # matplotlib: loaded when a plot is drawn
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter   # matplotlib: as above

    docs = sorted(arrays)
    bins = [position_bins([arrays[i][j] for i in docs], first=first)
            for j in range(len(pair_names))]
    drawn = [y[~zero] for _, y, zero in bins]
    floor = log_floor(drawn + ([np.array([budget])] if budget else []))
    styles = series_styles(pair_names)
    fig, ax = plt.subplots(figsize=(9.0, 4.8), dpi=120)
    n_zero = 0
    for name, (x, y, zero) in zip(pair_names, bins):
        st = results["results"].get(name) or {}
        m, u = st.get("kl_mean", float("nan")), st.get("kl_mean_unc") or 0.0
        label = f"{name}: mean " + (f"~0 ({m:.2g} ± {u:.2g})" if S.kl_text(m, u) == "~0"
                                    else f"{m:.3g}")
        if zero.any():
            n_zero += 1
            label += f", {int(zero.sum())}/{zero.size} bins ~0"
        ax.plot(x, np.where(zero, np.nan, y), label=label, linewidth=1.2, markersize=4,
                markerfacecolor="none", **styles[name])
    if budget:
        ax.axhline(budget, color="crimson", lw=1.2, ls=(0, (6, 3)),
                   label=f"KL budget {budget:.3g} (on the mean over all positions)")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 3.0)))    # 1, 3, 10, 30, ... tokens
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    if floor is not None:
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor / 2)
    cfg = results["config"]
    ax.set_xlabel("token position")
    ax.set_ylabel("KL(reference || pair), nats per token, mean over documents", fontsize=9)
    ax.set_title(f"{model_label(cfg['model'])}: {results['documents_done']} doc(s) x "
                 f"{cfg['context']} tokens, prefill={cfg['prefill']}"
                 f"{scoring_note(scoring_of(results))}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7 if len(pair_names) > 10 else 8, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    if n_zero:
        fig.text(0.01, 0.01, "~0: bins whose mean KL is 0, or float noise around 0 (per-token "
                 "values of both signs, mean within 3 standard errors of 0); gaps in the curves, "
                 "a log axis has no 0", fontsize=7)
    fig.tight_layout(rect=(0, 0.03 if n_zero else 0, 1, 1))
    return fig


def log_floor(curves: list[np.ndarray]) -> float | None:
    """The y value a decade under the smallest positive value of `curves`, the log axis's lower
    end; None when no value is positive (a linear axis then)."""
    pos = [float(y[y > 0].min()) for y in curves if np.any(y > 0)]
    if not pos:
        return None
    return 10.0 ** (math.floor(math.log10(min(pos))) - 1)
