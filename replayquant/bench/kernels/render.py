"""The kernels table rendered: NAME.md (targets, accuracy, us per step per kind and batch,
speculative rounds, the launch-config sweep) and NAME_speedup.png (speedup over our conventional
FP32 step against batch)."""

from __future__ import annotations

from replayquant.bench.kernels.grid import PAIR_L, PAIRS, PEERS, SHAPES
from replayquant.outputs import save_figure


def find_rows(rows, **kv):
    """The rows whose entries equal every keyword's value."""
    return [r for r in rows if all(r.get(k) == v for k, v in kv.items())]


def _fmt(v, p=".2f"):
    return "" if v is None else format(v, p)


def render_markdown(res, shapes=None) -> str:
    """NAME.md of the table `res`: one per-step table per kind of `shapes` (default SHAPES, in
    its order) that has rows."""
    pv = res["provenance"]
    lines = [f"# Decode kernels on {pv['device']}", "",
             f"git {pv['git_commit']}, {pv['date']}; device copy bandwidth {res['copy_GBps']:.0f} "
             "GB/s (read + write, measured in this run). Times: CUDA graph of the steps, "
             "`triton.testing.do_bench` median, L2 flushed before each replay, and state copies "
             "rotated inside the graph so that every step finds its state cold (`rot` copies, "
             "2x L2). Bytes: what each kernel must move (state, buffer, inputs, output) as counted "
             "in `replayquant/statebytes.py`. Speedups are over our conventional FP32 step at "
             "the same batch.", ""]
    if res.get("copy_GBps_parts"):
        lines += _parts_lines(pv)
    if res.get("skipped"):
        lines += ["Not measured (time budget, or the reason given): " + ", ".join(res["skipped"]),
                  ""]
    lines += _targets_lines(res.get("targets") or [])
    for kind, a in (res.get("accuracy") or {}).items():
        lines += _accuracy_lines(kind, a)
    for kind in shapes or SHAPES:
        lines += _kind_lines(res["rows"], kind)
    lines += _spec_lines(res["rows"])
    lines += _sweep_lines(res["rows"])
    if res.get("errors"):
        lines += ["", "Sections that failed: " + ", ".join(res["errors"])]
    return "\n".join(lines) + "\n"


def _parts_lines(pv) -> list:
    lines = [f"Merged from {len(pv['parts'])} runs of this commit (`replayquant bench merge`),"
             " one device call each; the copy bandwidth above is their mean, each row's % of "
             "copy uses its own run's, and speedups compare rows of one run:", ""]
    lines += [f"* part {i}: {p['file']}, {p['date']}, kinds {p['kinds']}, copy "
              f"{_fmt(p['copy_GBps'], '.0f')} GB/s" for i, p in enumerate(pv["parts"])]
    lines.append("")
    return lines


def _targets_lines(tg) -> list:
    if not tg:
        return []
    lines = ["## Targets", "", "Ratios: the baseline's time over ours (the smallest over "
             "the entry's rows); floor: the counted bytes at this run's copy bandwidth.", "",
             "| target | measured | met | floor (us) |", "| --- | --- | --- | --- |"]
    for t in tg:
        m = (t.get("reason") or "not measured") if t["met"] is None else \
            ("yes" if t["met"] else "no")
        v = "" if t["measured"] is None else f"{t['measured']:.4g} {t['unit']}"
        lines.append(f"| {t['target']} | {v} | {m} | {t.get('floor_us', '')} |")
    lines.append("")
    return lines


def _accuracy_lines(kind, a) -> list:
    lines = [f"## {kind}: relative Frobenius error after {a['windows']} windows (B = "
             f"{a['B']}, L = {a['L']}) against a float64 recurrence", "",
             "| kernel | variant | state / anchor | outputs |", "| --- | --- | ---: | ---: |"]
    for who in ("ours", "authors", "ours_vs_authors"):
        for v, d in a.get(who, {}).items():
            st = d.get("anchor", d.get("state"))
            lines.append(f"| {who} | {v} | {st:.2e} | {d['outputs']:.2e} |")
    lines.append("")
    return lines


def _kind_lines(rows, kind) -> list:
    """The us-per-step table of one kind: a line per (kernel, variant, L), a column per batch
    (sweep and speculative rows apart)."""
    Bs = sorted({r["B"] for r in find_rows(rows, kind=kind)
                 if not r["kernel"].startswith(("sweep", "spec"))})
    if not Bs:
        return []
    lines = [f"## {kind}: us per step (x conventional FP32)", "",
             "| kernel | variant | L | " + " | ".join(f"B={B}" for B in Bs) + " |",
             "| --- | --- | ---: | " + " | ".join("---:" for _ in Bs) + " |"]
    keys = []
    for r in find_rows(rows, kind=kind):
        if r["kernel"].startswith(("sweep", "spec")):
            continue
        k = (r["kernel"], r["variant"], r.get("L"))
        if k not in keys:
            keys.append(k)
    for k in keys:
        cells = [_cell(rows, kind, k, B) for B in Bs]
        lines.append(f"| {k[0]} | {k[1]} | {'' if k[2] is None else k[2]} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _cell(rows, kind, k, B) -> str:
    """us of row (kernel, variant, L) = k at batch B, its speedup and (steps bound by bytes,
    peers) its % of the copy bandwidth; empty where not measured."""
    m = [r for r in find_rows(rows, kind=kind, kernel=k[0], variant=k[1], B=B)
         if r.get("L") == k[2]]
    if not m:
        return ""
    r = m[0]
    c = f"{r['us']:.1f}"
    if r.get("speedup_vs_conv_fp32") is not None:
        c += f" ({r['speedup_vs_conv_fp32']:.2f}x)"
    if r.get("pct_copy") is not None and k[0].startswith(
            ("conventional", "replay-read-step", "replay-flush-step")) \
            or k[0].startswith("peer"):
        c += f" {_fmt(r.get('pct_copy'), '.0f')}%"
    return c


def _spec_lines(rows) -> list:
    spec = [r for r in rows if r["kernel"].startswith("spec")]
    if not spec:
        return []
    lines = ["## Speculative decoding (T drafts per round, fixed random accept counts)", "",
             "| kind | kernel | variant | B | T | L | us/round | tokens/s | x snapshot round |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in spec:
        lines.append(f"| {r['kind']} | {r['kernel']} | {r['variant']} | {r['B']} | {r['T']} | "
                     f"{r.get('L', '')} | {r['us']:.1f} | {_fmt(r.get('tokens_per_s'), '.3g')} | "
                     f"{_fmt(r.get('speedup_vs_snapshot_round'))} |")
    lines.append("")
    return lines


def _sweep_lines(rows) -> list:
    sweep = [r for r in rows if r["kernel"].startswith("sweep")]
    if not sweep:
        return []
    lines = ["## Launch-config sweep", "", "| kind | kernel | variant | B | block_v | warps | us/step |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in sweep:
        c = r["cfg"]
        bv, nw = (tuple(next(iter(c["launch"].values())))[:2] if "launch" in c
                  else (c.get("block_v"), c.get("num_warps")))
        lines.append(f"| {r['kind']} | {r['kernel']} | {r['variant']} | {r['B']} | {bv} | "
                     f"{nw} | {r['us']:.1f} |")
    return lines


def plot_kernels(res, png: str, shapes=None) -> None:
    """NAME_speedup.png of the table `res` (`kernels_figure`); none from a run of kinds without
    replay rows alone (KDA)."""
    import matplotlib.pyplot as plt   # matplotlib: loaded when a plot is drawn
    fig = kernels_figure(res, shapes)
    if fig is None:
        return
    try:
        save_figure(fig, png, dpi=110)
    finally:
        plt.close(fig)


def kernels_figure(res, shapes=None):
    """Per-step speedup over our conventional FP32 step against batch (its time over the
    kernel's: above 1 is faster): one panel per (kind, pair), one line per L (replay window),
    plus the forced flush (s32_rs), the peer's FP32 step named (fla, mamba_ssm) and, beside
    s32_rs, the ReplaySSM authors' FP32 replay. Kinds in the order of `shapes` (default SHAPES);
    None when no kind has replay rows."""
    # matplotlib: imported when a plot is drawn, its Agg backend chosen before pyplot loads (a
    # device has no display)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # matplotlib: loaded when a plot is drawn
    rows = res["rows"]
    # kinds with replay rows
    kinds = [k for k in shapes or SHAPES if find_rows(rows, kind=k, kernel="replay-window")]
    if not kinds:
        return None
    pairs = list(res["provenance"].get("pairs") or PAIRS)
    fig, axes = plt.subplots(len(kinds), len(pairs), figsize=(3.6 * len(pairs), 3.1 * len(kinds)),
                             sharey=True, squeeze=False)
    for i, kind in enumerate(kinds):
        for j, pair in enumerate(pairs):
            ax = axes[i][j]
            _speedup_panel(ax, rows, kind, pair)
            ax.set_title(f"{kind} {pair}", fontsize=9)
            if i == len(kinds) - 1:
                ax.set_xlabel("batch")
            if j == 0:
                ax.set_ylabel("speedup over our conventional\nFP32 step (> 1: faster)", fontsize=9)
            ax.legend(fontsize=5.5)
    pv = res["provenance"]
    fig.suptitle(f"Decode step time of our conventional FP32 step over each kernel's (> 1: the "
                 f"kernel is faster), {pv['device']}, git {str(pv['git_commit'])[:8]}", fontsize=9)
    fig.tight_layout()
    return fig


def _speedups(rows, **kv) -> list:
    """(B, speedup over conventional FP32) of the rows matching kv that have one, by batch."""
    return sorted((r["B"], r["speedup_vs_conv_fp32"]) for r in find_rows(rows, **kv)
                  if "speedup_vs_conv_fp32" in r)


def _speedup_panel(ax, rows, kind, pair) -> None:
    """One (kind, pair) panel: a line per replay window L, the staggered window and the forced
    flush at the kind's main L, the FP32 peer; log2 batch axis, 1x marked."""
    base = {r["B"]: r["us"] for r in find_rows(rows, kind=kind, kernel="conventional",
                                               variant="fp32")}
    for L in sorted({r.get("L") for r in find_rows(rows, kind=kind, kernel="replay-window",
                                                   variant=pair)}):
        pts = _speedups(rows, kind=kind, kernel="replay-window", variant=pair, L=L)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                    label=f"ours, L={L}")
    L0 = PAIR_L[kind]
    pts = _speedups(rows, kind=kind, kernel="replay-window-staggered", variant=pair, L=L0)
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls="--", marker="d", ms=3,
                label=f"ours, L={L0}, rows out of phase")
    pts = _speedups(rows, kind=kind, kernel="replay-forced-flush-layer", variant=pair, L=L0)
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=":", marker="s", ms=3,
                label="ours, flush every step")
    peer_kernel, peer_name = PEERS[kind]
    peer = sorted((r["B"], base[r["B"]] / r["us"]) for r in rows
                  if r["kind"] == kind and r["kernel"] == peer_kernel
                  and r["variant"] == "float32" and r["B"] in base)
    if peer:
        ax.plot([p[0] for p in peer], [p[1] for p in peer], ls="--", marker="x", ms=3,
                color="gray", label=f"{peer_name}, FP32")
    pts = _speedups(rows, kind=kind, kernel="authors", variant="fp32") if pair == "s32_rs" else []
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls="-.", marker="^", ms=3,
                color="black", label=f"ReplaySSM authors' replay, L={L0}, FP32 state")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
