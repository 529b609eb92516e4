"""Tables of KL results, rendered from results files only (never typed)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from .runner import RESULTS_KIND

COLUMNS = ("model", "pair", "prefill", "context", "docs", "mean KL", "median KL", "p99 KL", "max KL",
           "same top %", "PPL ratio", "dp RMS %", "KL last bucket")


def _pm(v, u, fmt="{:.4g}"):
    if v is None:
        return "-"
    return fmt.format(v) + (" ± " + fmt.format(u) if u is not None else "")


def model_label(model: dict) -> str:
    """A model's name in tables: its hub id, or for a local folder the folder's name and the
    start of its fingerprint (absolute paths differ between machines; the fingerprint does not)."""
    mid = model.get("id") or ""
    if not Path(mid).is_absolute():
        return mid
    fp = (model.get("local_hash") or "").split(":")[-1][:8]
    return Path(mid).name + (f" ({fp})" if fp else "")


def rows_of(res: dict, source: str = "") -> list[dict]:
    """One row per pair of a results dict (incomplete runs are marked)."""
    cfg = res["config"]
    rows = []
    for p in cfg["pairs"]:
        st = res["results"].get(p["name"])
        if not st:
            continue
        last = st["by_position"][-1] if st.get("by_position") else None
        rows.append({
            "model": model_label(cfg["model"]), "pair": p["name"], "prefill": cfg["prefill"],
            "context": cfg["context"],
            "docs": f"{res['documents_done']}" + ("" if res.get("complete") else f"/{res['documents_planned']}*"),
            "mean KL": _pm(st["kl_mean"], st["kl_mean_unc"]),
            "median KL": _pm(st.get("kl_median"), None),
            "p99 KL": _pm((st.get("kl_percentiles") or {}).get("99"), None),
            "max KL": _pm(st["kl_max"], None),
            "same top %": _pm(100 * st["same_top"], 100 * st["same_top_unc"], "{:.3f}"),
            "PPL ratio": _pm(st["ppl_ratio"], st["ppl_ratio_unc"], "{:.5f}"),
            "dp RMS %": _pm(100 * st["dp_rms"], 100 * st["dp_rms_unc"], "{:.3g}"),
            "KL last bucket": (_pm(last["kl_mean"], last["kl_mean_unc"]) + f" [{last['bucket']}]") if last else "-",
            "_source": source, "_kl": st["kl_mean"],
        })
    return rows


def load_results(paths: list[str | Path]) -> list[tuple[str, dict]]:
    out = []
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise ValueError(f"results file {p} does not exist")
        try:
            res = json.loads(p.read_text())
        except json.JSONDecodeError:
            raise ValueError(f"{p} is not a JSON results file") from None
        if not isinstance(res, dict) or res.get("kind") != RESULTS_KIND:
            raise ValueError(f"{p} is not a KL results file (written by `replayquant kl`)")
        out.append((str(p), res))
    if not out:
        raise ValueError("give at least one results file")
    return out


def render_table(paths: list[str | Path], fmt: str = "md", by: str = "pair") -> str:
    """One table over results files: pairs as rows. fmt: md | csv; by: pair | model (row order)."""
    if fmt not in ("md", "csv"):
        raise ValueError(f"--format must be md or csv, got {fmt!r}")
    if by not in ("pair", "model"):
        raise ValueError(f"--by must be pair or model, got {by!r}")
    rows = [r for src, res in load_results(paths) for r in rows_of(res, src)]
    key = (lambda r: (r["pair"], r["model"], r["context"])) if by == "pair" else \
          (lambda r: (r["model"], r["context"], r["_kl"]))
    rows.sort(key=key)
    cols = list(COLUMNS)
    if by == "pair":
        cols.remove("pair")
        cols.insert(0, "pair")
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(cols)
        for r in rows:
            w.writerow([r[c] for c in cols])
        return buf.getvalue()
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(" --- " for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    if any(r["docs"].endswith("*") for r in rows):
        lines.append("\n\\* run not complete: documents done / planned")
    return "\n".join(lines) + "\n"


def _c(v, u=None, fmt="{:.3g}", ufmt="{:.2g}"):
    if v is None:
        return "-"
    return fmt.format(v) + ("±" + ufmt.format(u) if u is not None else "")


def print_summary(res: dict, console=None):
    """The terminal tables of one run (rich): statistics per pair, and mean KL by position."""
    from rich.console import Console
    from rich.table import Table
    console = console or Console()
    cfg = res["config"]
    done = f"{res['documents_done']}" + ("" if res.get("complete") else f" of {res['documents_planned']}")
    t = Table(title=f"KL(reference || pair), {cfg['model'].get('id')}: {done} doc(s) x {cfg['context']} "
                    f"tokens, prefill={cfg['prefill']}")
    cols = ["pair", "mean KL", "median", "p99", "max", "same top %", "ln PPL ratio", "dp RMS %"]
    for c in cols:
        t.add_column(c, justify="left" if c == "pair" else "right", no_wrap=(c == "pair"),
                     overflow="fold")
    for p in cfg["pairs"]:
        st = res["results"].get(p["name"])
        if not st:
            continue
        t.add_row(p["name"], _c(st["kl_mean"], st["kl_mean_unc"]), _c(st.get("kl_median")),
                  _c((st.get("kl_percentiles") or {}).get("99")), _c(st["kl_max"]),
                  _c(100 * st["same_top"], 100 * st["same_top_unc"], "{:.2f}"),
                  _c(st["ln_ppl_ratio"], st["ln_ppl_ratio_unc"]),
                  _c(100 * st["dp_rms"], 100 * st["dp_rms_unc"]))
    console.print(t)
    # error accumulation: mean KL per log-spaced position bucket
    names = [p["name"] for p in cfg["pairs"] if res["results"].get(p["name"])]
    if names and len(res["results"][names[0]]["by_position"]) > 1:
        b = Table(title="mean KL by token position")
        b.add_column("pair", no_wrap=True)
        for row in res["results"][names[0]]["by_position"]:
            b.add_column(row["bucket"], justify="right")
        for n in names:
            b.add_row(n, *[f"{row['kl_mean']:.3g}" for row in res["results"][n]["by_position"]])
        console.print(b)
    for n in res.get("notes", []):
        console.print(f"note: {n}")
