"""Statistics of a `replayquant spec` run from its per-document records, its table and its plot.

Per pair and method (lookup: prompt lookup; assistant: a draft model), over all documents:
* `mean_accepted`: drafts accepted per verify round that had drafts (a round without drafts, where
  prompt lookup found no match, is one plain decode step);
* `tokens_per_forward`: new tokens per forward of the target model (the prompt's included), which
  is 1 + accepted drafts per round;
* `acceptance_by_position[i]`: of the rounds that proposed a draft at position i + 1, the share
  that accepted it (HF accepts drafts up to the first mismatch);
* `agree_ref_prefix` / `agree_ref`: the share of new tokens equal to the reference pair's plain
  greedy tokens before the first divergence (mean over documents) and at all positions;
  `agree_plain_*` the same against the pair's own plain greedy tokens; a sampled run compares
  with the reference's tokens of the same method and random draws, and has no `agree_plain_*`;
* `tok_s` / `plain_tok_s`: new tokens per second after the first forward (which holds the
  prompt), speculative and plain decode of the same pair; `speedup` their ratio.
"""

from __future__ import annotations

import math
from pathlib import Path

from replayquant.kl.plot import series_styles    # one look for a pair across the plots
from replayquant.outputs import save_figure

METHODS = ("lookup", "assistant")
TABLE_WIDTH = 80


def _rate(recs: list[dict]) -> float | None:
    s = sum(r["decode_s"] for r in recs)
    return sum(r["decode_tokens"] for r in recs) / s if s > 0 else None


def _share(num: int, den: int) -> float | None:
    return num / den if den else None


def method_summary(recs: list[dict], plain: list[dict], draft_tokens: int) -> dict:
    """The statistics of one pair and method from its per-document records `recs` and the
    pair's plain-decode records `plain` (module docstring)."""
    rounds = [r for rec in recs for r in rec["rounds"]]
    drafted = [r for r in rounds if r[0] > 0]
    by_pos = [_share(sum(a > i for d, a in drafted if d > i), sum(d > i for d, _ in drafted))
              for i in range(draft_tokens)]
    n = sum(len(rec["tokens"]) for rec in recs)
    out = {"documents": len(recs), "generated": n, "forwards": sum(r["forwards"] for r in recs),
           "rounds": len(rounds), "rounds_with_drafts": len(drafted),
           "drafted": sum(d for d, _ in drafted), "accepted": sum(a for _, a in rounds),
           "acceptance_by_position": by_pos}
    out["mean_accepted"] = _share(out["accepted"], len(drafted))
    out["tokens_per_forward"] = _share(n, out["forwards"])
    out["acceptance_rate"] = _share(out["accepted"], out["drafted"])
    for key in ("ref", "plain"):
        pairs = [rec[f"agree_{key}"] for rec in recs if f"agree_{key}" in rec]
        lengths = [len(rec["tokens"]) for rec in recs if f"agree_{key}" in rec]
        out[f"agree_{key}_prefix"] = (sum(p / m for (p, _), m in zip(pairs, lengths)) / len(pairs)
                                      if pairs else None)
        out[f"agree_{key}"] = _share(sum(e for _, e in pairs), sum(lengths))
    out["tok_s"], out["plain_tok_s"] = _rate(recs), _rate(plain)
    out["speedup"] = (out["tok_s"] / out["plain_tok_s"]
                      if out["tok_s"] and out["plain_tok_s"] else None)
    return out


def summarize(documents: list[dict], names: list[str], methods: list[str],
              draft_tokens: int) -> dict:
    """{pair: {"plain": {...}, method: method_summary}} over the finished `documents`."""
    out = {}
    for name in names:
        plain = [d["pairs"][name]["plain"] for d in documents]
        row = {"plain": {"documents": len(plain), "generated": sum(len(r["tokens"]) for r in plain),
                         "tok_s": _rate(plain), "wall_s": sum(r["wall_s"] for r in plain),
                         "agree_ref": _share(sum(r["agree_ref"][1] for r in plain),
                                             sum(len(r["tokens"]) for r in plain))}}
        for m in methods:
            row[m] = method_summary([d["pairs"][name][m] for d in documents], plain, draft_tokens)
        out[name] = row
    return out


def _f(x, spec: str, width: int) -> str:
    return ("-" if x is None or (isinstance(x, float) and math.isnan(x)) else
            format(x, spec)).rjust(width)


_COLUMNS = (("pair", 12), ("method", 6), ("acc/rd", 6), ("tok/fw", 6), ("acc%", 5),
            ("ref1st", 6), ("refall", 6), ("plain=", 6), ("plain", 6), ("spec", 6), ("x", 5))
_SHORT = {"lookup": "lookup", "assistant": "assist"}


def render_table(results: dict) -> str:
    """The run's statistics per pair and method, one row each, at most 80 columns: accepted
    drafts per round (acc/rd), tokens per target forward (tok/fw), acceptance % of the drafts,
    agreement with the reference's greedy tokens before the first divergence (ref1st) and
    overall (refall), overall agreement with the pair's own plain greedy (plain=), plain and
    speculative decode tokens/s, and their ratio (x)."""
    head = " ".join(n.ljust(w) if i < 2 else n.rjust(w) for i, (n, w) in enumerate(_COLUMNS))
    lines = [head, "-" * len(head)]
    for name, row in results.items():
        for m in (k for k in METHODS if k in row):
            s = row[m]
            label = name if len(name) <= 12 else name[:11] + "~"
            acc = None if s["acceptance_rate"] is None else 100 * s["acceptance_rate"]
            cells = [label.ljust(12), _SHORT[m].ljust(6), _f(s["mean_accepted"], ".2f", 6),
                     _f(s["tokens_per_forward"], ".2f", 6), _f(acc, ".0f", 5),
                     _f(s["agree_ref_prefix"], ".3f", 6), _f(s["agree_ref"], ".3f", 6),
                     _f(s["agree_plain"], ".3f", 6), _f(s["plain_tok_s"], ".1f", 6),
                     _f(s["tok_s"], ".1f", 6), _f(s["speedup"], ".2f", 5)]
            lines.append(" ".join(cells))
    return "\n".join(lines) + "\n"


def plot_acceptance(results: dict, title: str, path: Path) -> Path:
    """Acceptance rate by draft position, one line per pair, one panel per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    methods = [m for m in METHODS if any(m in row for row in results.values())]
    styles = series_styles(list(results))
    fig, axes = plt.subplots(1, len(methods), figsize=(6 * len(methods), 4), squeeze=False)
    for ax, m in zip(axes[0], methods):
        for name, row in results.items():
            rates = row[m]["acceptance_by_position"]
            xs = [i + 1 for i, r in enumerate(rates) if r is not None]
            ax.plot(xs, [r for r in rates if r is not None], label=name, markerfacecolor="none",
                    **styles[name])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # draft positions 1, 2, ...
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{title}: {'prompt lookup' if m == 'lookup' else 'assistant model'}",
                     fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        return save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)
