"""KL against position (log x), one line per pair, from the per-token KL files of a run."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def position_curve(per_doc: list[np.ndarray], bins_per_octave: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Mean KL over documents, averaged in log-spaced position bins.

    per_doc: one [T] array per document (KL at positions 0..T-1). Returns (x, y): x the geometric
    centre of each bin in tokens (position + 1), y the mean KL of the bin.
    """
    T = min(a.shape[-1] for a in per_doc)
    mean = np.mean([a[:T].astype(np.float64) for a in per_doc], axis=0)
    n_oct = np.log2(T + 1)
    nb = max(1, int(np.ceil(n_oct * bins_per_octave)))
    edges = np.unique(np.floor(2.0 ** np.linspace(0.0, n_oct, nb + 1)).astype(np.int64))
    edges[0], edges[-1] = 1, T + 1
    xs, ys = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):   # 1-based positions lo .. hi-1
        seg = mean[lo - 1:hi - 1]
        if seg.size:
            xs.append(np.sqrt(lo * max(lo, hi - 1)))
            ys.append(seg.mean())
    return np.asarray(xs), np.asarray(ys)


def plot_kl_vs_position(results: dict, arrays: dict, pair_names: list[str], png: Path):
    """Write a PNG: x = token position (log), y = mean KL(ref || test) (log where positive)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    docs = sorted(arrays)
    any_pos = False
    for j, name in enumerate(pair_names):
        x, y = position_curve([arrays[i][j] for i in docs])
        stats = results["results"].get(name) or {}
        label = f"{name} (mean {stats.get('kl_mean', float('nan')):.3g})"
        mask = y > 0
        any_pos |= bool(mask.any())
        ax.plot(x[mask] if mask.any() else x, y[mask] if mask.any() else y, label=label,
                marker=".", linewidth=1.2)
    ax.set_xscale("log")
    if any_pos:
        ax.set_yscale("log")
    cfg = results["config"]
    ax.set_xlabel("token position")
    ax.set_ylabel("KL(reference || pair), mean over documents")
    ax.set_title(f"{cfg['model'].get('id')}: {results['documents_done']} doc(s) x {cfg['context']} tokens, "
                 f"prefill={cfg['prefill']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
