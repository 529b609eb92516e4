"""Tables of KL results, rendered from results files only (never typed).

* `render_table(loaded, fmt)` (loaded: `load_results` or `results.load_scored`): md (one row per
  pair, value ± uncertainty in a cell), csv (one row per pair, every value and its uncertainty
  in separate numeric columns) or llama (per pair, the per-chunk table and statistics block
  `llama-perplexity --kl-divergence` prints, for side-by-side comparison);
* `print_summary(res)`: the terminal tables of one run, fitted to the console's width (80 columns
  through a pipe): columns that do not fit are left out, never a number split across lines.

Every table says which positions were scored (`scoring`: all, or llama's second half of each
window), and one table takes results of one scoring only: their means are over other tokens.
`scoring="llama"` re-scores runs that scored every position to llama.cpp's window from their
per-token values (`results.rescore`, `results.load_scored`), so `--format llama` compares with llama.cpp's numbers.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from replayquant.outputs import parse_json

from .stats import KL_ZERO_SE, kl_text, kl_vs_zero

RESULTS_KIND = "replayquant.kl"        # the "kind" of a KL results file (kl/results.py writes them)

COLUMNS = ("model", "pair", "prefill", "context", "docs", "mean KL", "median KL", "p99 KL", "max KL",
           "same top %", "PPL ratio", "dp RMS %", "KL last bucket")
# csv: plain numbers, each uncertainty in its own column (percentages in percent)
CSV_COLUMNS = ("model", "pair", "prefill", "scoring", "context", "documents_done", "documents_planned", "complete",
               "kl_mean", "kl_mean_unc", "kl_mean_unc_docs", "kl_median", "kl_p99", "kl_max",
               "same_top_pct", "same_top_pct_unc", "ppl_ref", "ppl_ref_unc", "ppl_test", "ppl_test_unc",
               "ppl_ratio", "ppl_ratio_unc", "ln_ppl_ratio", "ln_ppl_ratio_unc", "dp_mean_pct",
               "dp_mean_pct_unc", "dp_rms_pct", "dp_rms_pct_unc", "last_bucket", "kl_last_bucket",
               "kl_last_bucket_unc", "n_tokens", "file")
FORMATS = ("md", "csv", "llama")
# what a results file must hold for a table (top level, and under "config")
_REQUIRED = ("config", "results", "documents_done", "documents_planned")
_REQUIRED_CONFIG = ("model", "pairs", "prefill", "context")
# a pair's statistics the tables read as numbers: always, and where a file holds them (an older
# file holds fewer)
_REQUIRED_STATS = ("n_tokens", "kl_mean", "kl_mean_unc", "kl_max", "same_top", "same_top_unc",
                   "ppl_ratio", "ppl_ratio_unc", "dp_rms", "dp_rms_unc")
_OPTIONAL_STATS = ("kl_min", "kl_median", "kl_mean_unc_docs", "ppl_ref", "ppl_ref_unc",
                   "ppl_test", "ppl_test_unc", "ln_ppl_ratio", "ln_ppl_ratio_unc", "ppl_diff",
                   "ppl_diff_unc", "ln_ppl_cor", "dp_mean", "dp_mean_unc", "dp_max", "dp_min",
                   "dp_median")


def _pm(v, u, fmt="{:.4g}"):
    if v is None:
        return "-"
    return fmt.format(v) + (" ± " + fmt.format(u) if u is not None else "")


def kl_cell(mean, unc, fmt="{:.4g}", sep=" ± ", ufmt=None) -> str:
    """A mean KL and its uncertainty as tables show it: "~0 ± u" where it is compatible with zero
    (`stats.kl_vs_zero`: float noise, counted as 0, whose sign means nothing), "m ± u (<0)"
    where it lies below zero beyond its uncertainty (a defect), else "m ± u"."""
    if mean is None:
        return "-"
    side = kl_vs_zero(mean, unc or 0.0)
    u = "" if unc is None else sep + (ufmt or fmt).format(unc)
    return "~0" + u if side == 0 else fmt.format(mean) + u + (" (<0)" if side < 0 else "")


def kl_notes(cells) -> list[str]:
    """What the marks of `kl_cell` in `cells` mean (none where none is there)."""
    text = " ".join(cells)
    notes = []
    if "~0" in text:
        notes.append(f"~0: a mean KL within {KL_ZERO_SE:g} standard errors of zero (float noise), "
                     f"counted as 0")
    if "(<0)" in text:
        notes.append("(<0): a mean KL below zero beyond its uncertainty, which no KL can be: "
                     "the run or the file is wrong")
    return notes


def model_label(model: dict) -> str:
    """A model's name in tables and titles: its hub id, or for a local folder the folder's name
    and the start of its fingerprint (absolute paths differ between machines; the fingerprint
    does not)."""
    mid = model.get("id") or ""
    if not Path(mid).is_absolute():
        return mid
    fp = (model.get("local_hash") or "").split(":")[-1][:8]
    return Path(mid).name + (f" ({fp})" if fp else "")


def _pct(v):
    return None if v is None else 100 * v


def scoring_of(res: dict) -> str:
    """The scoring of a results file (`stats.SCORINGS`); files written before the option
    existed scored every position."""
    return (res.get("config") or {}).get("scoring", "all")


def scoring_note(scoring: str) -> str:
    """How a scoring reads in titles: nothing for every position, else what was scored."""
    return "" if scoring == "all" else ", scoring=llama (second half of each window)"


def check_one_scoring(loaded: list[tuple[str, dict]]) -> None:
    """One ValueError when results files of different scorings would share a table."""
    by = {}
    for src, res in loaded:
        by.setdefault(scoring_of(res), []).append(src)
    if len(by) > 1:
        groups = "; ".join(f"--scoring {k}: {', '.join(v)}" for k, v in sorted(by.items()))
        raise ValueError(f"these results were scored over different positions ({groups}): their "
                         f"means are over other tokens and cannot share a table; render each "
                         f"scoring in its own `replayquant table` call")


def rows_of(res: dict, source: str = "") -> list[dict]:
    """One row per pair of a results dict (incomplete runs are marked): the md cells, and the
    plain values under "_values" for csv."""
    cfg = res["config"]
    rows = []
    for p in cfg["pairs"]:
        st = res["results"].get(p["name"])
        if not st:
            continue
        last = st["by_position"][-1] if st.get("by_position") else None
        pct = st.get("kl_percentiles") or {}
        rows.append({
            "model": model_label(cfg["model"]), "pair": p["name"], "prefill": cfg["prefill"],
            "context": cfg["context"],
            "docs": f"{res['documents_done']}" + ("" if res.get("complete") else f"/{res['documents_planned']}*"),
            "mean KL": kl_cell(st["kl_mean"], st["kl_mean_unc"]),
            "median KL": _pm(st.get("kl_median"), None),
            "p99 KL": _pm(pct.get("99"), None),
            "max KL": _pm(st["kl_max"], None),
            "same top %": _pm(100 * st["same_top"], 100 * st["same_top_unc"], "{:.3f}"),
            "PPL ratio": _pm(st["ppl_ratio"], st["ppl_ratio_unc"], "{:.5f}"),
            "dp RMS %": _pm(100 * st["dp_rms"], 100 * st["dp_rms_unc"], "{:.3g}"),
            "KL last bucket": (kl_cell(last["kl_mean"], last["kl_mean_unc"]) + f" [{last['bucket']}]")
                              if last else "-",
            "_source": source, "_kl": st["kl_mean"],
            "_values": {
                "model": model_label(cfg["model"]), "pair": p["name"], "prefill": cfg["prefill"],
                "scoring": scoring_of(res),
                "context": cfg["context"], "documents_done": res["documents_done"],
                "documents_planned": res["documents_planned"], "complete": bool(res.get("complete")),
                "kl_mean": st["kl_mean"], "kl_mean_unc": st["kl_mean_unc"],
                "kl_mean_unc_docs": st.get("kl_mean_unc_docs"), "kl_median": st.get("kl_median"),
                "kl_p99": pct.get("99"), "kl_max": st["kl_max"],
                "same_top_pct": _pct(st["same_top"]), "same_top_pct_unc": _pct(st["same_top_unc"]),
                "ppl_ref": st.get("ppl_ref"), "ppl_ref_unc": st.get("ppl_ref_unc"),
                "ppl_test": st.get("ppl_test"), "ppl_test_unc": st.get("ppl_test_unc"),
                "ppl_ratio": st["ppl_ratio"], "ppl_ratio_unc": st["ppl_ratio_unc"],
                "ln_ppl_ratio": st.get("ln_ppl_ratio"), "ln_ppl_ratio_unc": st.get("ln_ppl_ratio_unc"),
                "dp_mean_pct": _pct(st.get("dp_mean")), "dp_mean_pct_unc": _pct(st.get("dp_mean_unc")),
                "dp_rms_pct": _pct(st["dp_rms"]), "dp_rms_pct_unc": _pct(st["dp_rms_unc"]),
                "last_bucket": last["bucket"] if last else None,
                "kl_last_bucket": last["kl_mean"] if last else None,
                "kl_last_bucket_unc": last["kl_mean_unc"] if last else None,
                "n_tokens": st.get("n_tokens"), "file": source,
            },
        })
    return rows


def _lm_eval_like(res) -> bool:
    return isinstance(res, dict) and isinstance(res.get("results"), dict) and isinstance(res.get("config"), dict) \
        and "model" in res["config"] and "kind" not in res


def check_results(res, path) -> None:
    """One ValueError naming the file when `res` is not a KL results file a table can be made of."""
    if not isinstance(res, dict) or res.get("kind") != RESULTS_KIND:
        if _lm_eval_like(res):
            raise ValueError(f"{path} is an lm-eval results file without replayquant's record "
                             f"(config.replayquant: the pair) of model "
                             f"{res['config'].get('model')!r}; `replayquant table` reads the lm-eval "
                             f"results that `replayquant lm-eval --model replayquant` or "
                             f"`replayquant gpqa` write, and those of lm-eval's hf model (the "
                             f"unpatched baseline)")
        raise ValueError(f"{path} is not a KL results file (written by `replayquant kl`), a GPQA "
                         f"summary or lm-eval results of `replayquant lm-eval`")
    missing = [k for k in _REQUIRED if k not in res]
    cfg = res.get("config")
    if isinstance(cfg, dict):
        missing += [f"config.{k}" for k in _REQUIRED_CONFIG if k not in cfg]
    elif "config" not in missing:
        missing.append("config (not an object)")
    if not missing and not isinstance(res["results"], dict):
        missing.append("results (not an object)")
    if not missing:
        missing += _stats_problems(res)
    if missing:
        raise ValueError(f"{path} says it is a KL results file (kind {RESULTS_KIND!r}) but has no "
                         f"{', '.join(missing)}; it was not written by `replayquant kl` (or was cut "
                         f"short or edited). Re-run the `replayquant kl` command that makes it")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _stats_problems(res: dict) -> list[str]:
    """What a table needs of the pairs and their statistics that `res` does not hold (each as
    `check_results` names a missing key, with what it should be)."""
    pairs = res["config"]["pairs"]
    if not isinstance(pairs, list) or not all(isinstance(p, dict) and isinstance(p.get("name"), str)
                                              for p in pairs):
        return ["config.pairs (a list of pair records, each with its name)"]
    for p in pairs:
        at, st = f"results.{p['name']}", res["results"].get(p["name"])
        if st is None:
            continue
        if not isinstance(st, dict):
            return [f"{at} (an object of statistics)"]
        bad = [k for k in _REQUIRED_STATS if not _number(st.get(k))]
        bad += [k for k in _OPTIONAL_STATS if st.get(k) is not None and not _number(st[k])]
        if bad:
            return [f"{at}.{bad[0]} (a number)"]
        rows = st.get("by_position") or []
        if not isinstance(rows, list) or not all(
                isinstance(r, dict) and isinstance(r.get("bucket"), str)
                and _number(r.get("kl_mean")) and _number(r.get("kl_mean_unc")) for r in rows):
            return [f"{at}.by_position (records of a bucket with its mean KL)"]
        docs = st.get("per_document") or []
        if not isinstance(docs, list) or not all(
                isinstance(d, dict) and isinstance(d.get("id"), str) and _number(d.get("kl_max"))
                and all(isinstance(d.get(k), int) and not isinstance(d.get(k), bool)
                        and d[k] >= 0 for k in ("index", "n_tokens")) for d in docs):
            return [f"{at}.per_document (records of a document with its index, id, tokens and "
                    f"largest KL)"]
        for k in ("kl_percentiles", "dp_percentiles"):
            if st.get(k) is not None and not (isinstance(st[k], dict)
                                              and all(map(_number, st[k].values()))):
                return [f"{at}.{k} (numbers by percentile)"]
    return []


def load_results(paths: list[str | Path]) -> list[tuple[str, dict]]:
    out = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            raise ValueError(f"{p} is a folder; give a results file (a KL run's NAME.json, a sweep "
                             f"file, lm-eval results) or a folder holding a GPQA SUMMARY.json")
        if not p.is_file():
            raise ValueError(f"results file {p} does not exist")
        try:
            res = parse_json(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{p} is not a JSON results file ({e})") from None
        check_results(res, p)
        from replayquant.policy import check_recorded   # pairs hold what their names say
        check_recorded(res, p)
        out.append((str(p), res))
    if not out:
        raise ValueError("give at least one results file")
    return out


# what a row's label (model, pair, prefill, context) leaves out of a run's configuration
_RUN_SETTINGS = {"dtype": lambda c: (c.get("model") or {}).get("dtype"),
                 "seed": lambda c: c.get("seed"), "segment": lambda c: c.get("segment"),
                 "reference": lambda c: (c.get("reference") or {}).get("mode"),
                 "dataset": lambda c: (c.get("dataset") or {}).get("name")}


def _tell_apart(rows: list[dict], results: dict) -> bool:
    """Where rows of several files share a label: each row's "run" cell, the settings of
    `_RUN_SETTINGS` that differ between them (else the file's name); every other row's is empty.
    Returns whether any row needed one (the table then has the column)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["pair"], r["prefill"], r["context"]), []).append(r)
    for r in rows:
        r["run"] = ""
    alike = [g for g in groups.values() if len(g) > 1]
    for g in alike:
        sets = [{k: get(results[r["_source"]]["config"]) for k, get in _RUN_SETTINGS.items()}
                for r in g]
        keys = [k for k in _RUN_SETTINGS if len({repr(s[k]) for s in sets}) > 1]
        for r, s in zip(g, sets):
            r["run"] = ", ".join(f"{k} {s[k]}" for k in keys) or Path(r["_source"]).name
    return bool(alike)


def render_table(loaded: list[tuple[str, dict]], fmt: str = "md", by: str = "pair",
                 running: dict | None = None) -> str:
    """One table over results: pairs as rows. loaded: (source, results) of each file, as
    `load_results` gives them (or `results.load_scored`, re-scored); fmt: md | csv | llama;
    by: pair | model (row order); running: llama's per-chunk statistics (`render_llama`)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if by not in ("pair", "model"):
        raise ValueError(f"--by must be pair or model, got {by!r}")
    check_one_scoring(loaded)
    if fmt == "llama":
        return render_llama(loaded, running)
    rows = [r for src, res in loaded for r in rows_of(res, src)]
    key = (lambda r: (r["pair"], r["model"], r["context"])) if by == "pair" else \
          (lambda r: (r["model"], r["context"], r["_kl"]))
    rows.sort(key=key)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(CSV_COLUMNS)
        for r in rows:
            w.writerow(["" if r["_values"][c] is None else r["_values"][c] for c in CSV_COLUMNS])
        return buf.getvalue()
    cols = list(COLUMNS)
    if by == "pair":
        cols.remove("pair")
        cols.insert(0, "pair")
    if _tell_apart(rows, dict(loaded)):
        cols.insert(cols.index("context") + 1, "run")
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(" --- " for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    if scoring_of(loaded[0][1]) != "all":
        lines.append("\nscored as llama.cpp's --kl-divergence: positions n/2 ... n-2 of each "
                     "n-token document (--scoring llama)")
    if any(r["docs"].endswith("*") for r in rows):
        lines.append("\n\\* run not complete: documents done / planned")
    notes = kl_notes(r[c] for r in rows for c in ("mean KL", "KL last bucket"))
    if notes:
        lines.append("\n" + "\n".join(notes))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# llama.cpp's text block (llama-perplexity --kl-divergence): Q is the pair, base the reference.

def _num(v, spec: str) -> str:
    return format(float("nan") if v is None else v, spec)


def _pc(v):
    return None if v is None else 100.0 * v


def llama_block(st: dict) -> str:
    """The statistics of one pair laid out as llama.cpp prints them (same labels, order and
    number formats). Values a results file does not hold (an older file: Δp percentiles, the
    correlation) print as nan."""
    kp = st.get("kl_percentiles") or {}
    dq = st.get("dp_percentiles") or {}
    cor = st.get("ln_ppl_cor")
    lines = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {_num(st.get('ppl_test'), '10.6f')} ± {_num(st.get('ppl_test_unc'), '10.6f')}",
        f"Mean PPL(base)                : {_num(st.get('ppl_ref'), '10.6f')} ± {_num(st.get('ppl_ref_unc'), '10.6f')}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {_num(_pc(cor), '6.2f')}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {_num(st.get('ln_ppl_ratio'), '10.6f')} ± {_num(st.get('ln_ppl_ratio_unc'), '10.6f')}",
        f"Mean PPL(Q)/PPL(base)         : {_num(st.get('ppl_ratio'), '10.6f')} ± {_num(st.get('ppl_ratio_unc'), '10.6f')}",
        f"Mean PPL(Q)-PPL(base)         : {_num(st.get('ppl_diff'), '10.6f')} ± {_num(st.get('ppl_diff_unc'), '10.6f')}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {_num(st.get('kl_mean'), '10.6f')} ± {_num(st.get('kl_mean_unc'), '10.6f')}",
        f"Maximum KLD: {_num(st.get('kl_max'), '10.6f')}",
    ]
    for q in (99.9, 99.0, 95.0, 90.0):
        lines.append(f"{q:4.1f}%   KLD: {_num(kp.get(f'{q:g}'), '10.6f')}")
    lines.append(f"Median  KLD: {_num(st.get('kl_median'), '10.6f')}")
    for q in (10.0, 5.0, 1.0, 0.1):
        lines.append(f"{q:4.1f}%   KLD: {_num(kp.get(f'{q:g}'), '10.6f')}")
    lines += [
        f"Minimum KLD: {_num(st.get('kl_min'), '10.6f')}",
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {_num(_pc(st.get('dp_mean')), '6.3f')} ± {_num(_pc(st.get('dp_mean_unc')), '5.3f')} %",
        f"Maximum Δp: {_num(_pc(st.get('dp_max')), '6.3f')}%",
    ]
    for q in (99.9, 99.0, 95.0, 90.0, 75.0):
        lines.append(f"{q:4.1f}%   Δp: {_num(_pc(dq.get(f'{q:g}')), '6.3f')}%")
    lines.append(f"Median  Δp: {_num(_pc(st.get('dp_median')), '6.3f')}%")
    for q in (25.0, 10.0, 5.0, 1.0, 0.1):
        lines.append(f"{q:4.1f}%   Δp: {_num(_pc(dq.get(f'{q:g}')), '6.3f')}%")
    lines += [
        f"Minimum Δp: {_num(_pc(st.get('dp_min')), '6.3f')}%",
        f"RMS Δp    : {_num(_pc(st.get('dp_rms')), '6.3f')} ± {_num(_pc(st.get('dp_rms_unc')), '5.3f')} %",
        f"Same top p: {_num(_pc(st.get('same_top')), '6.3f')} ± {_num(_pc(st.get('same_top_unc')), '5.3f')} %",
    ]
    return "\n".join(lines) + "\n"


# llama.cpp's per-chunk table (perplexity.cpp, kl_divergence): its header, and below it one line
# per chunk with the running statistics of the chunks so far; a chunk here is one document (one
# window of --context tokens). Below LLAMA_MIN_TOKENS scored positions llama.cpp prints the
# table only ("we do not wish to do statistics on so few values").
CHUNK_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
                "              Δp RMS            Same top p")
LLAMA_MIN_TOKENS = 100


def _chunk_line(i: int, st: dict) -> str:
    return (f"{i:4d}    {st['ppl_test']:9.4f} ± {st['ppl_test_unc']:9.4f}"
            f"    {st['ln_ppl_ratio']:10.5f} ± {st['ln_ppl_ratio_unc']:10.5f}"
            f"    {st['kl_mean']:10.5f} ± {st['kl_mean_unc']:10.5f}"
            f"    {100 * st['dp_rms']:6.3f} ± {100 * st['dp_rms_unc']:6.3f} %"
            f"    {100 * st['same_top']:6.3f} ± {100 * st['same_top_unc']:6.3f} %")


def render_llama(loaded: list[tuple[str, dict]], running: dict | None = None) -> str:
    """Per results file and pair: one header line (what Q and base are, and which positions were
    scored), llama.cpp's per-chunk table from `running` ({source: `results.running_statistics`
    of that file}), then `llama_block` where at least LLAMA_MIN_TOKENS positions were scored, as
    llama.cpp. The numbers compare with llama.cpp's only under --scoring llama (its window:
    positions n/2 ... n-2 of each n-token chunk); a file that scored every position says so in
    its header."""
    out = []
    for src, res in loaded:
        cfg = res["config"]
        scoring = scoring_of(res)
        scored = ("scoring=llama (positions n/2 ... n-2 of each window, as llama.cpp"
                  + ("; re-scored from the per-token values of a run that scored every position)"
                     if res.get("rescored_from") else ")")
                  if scoring == "llama" else
                  "scoring=all (every position; llama.cpp scores only the second half of each "
                  "window: `replayquant table --format llama --scoring llama` for its numbers)")
        ref = (cfg.get("reference") or {}).get("mode", "reference")
        done = f"{res['documents_done']}" + ("" if res.get("complete") else f" of {res['documents_planned']}")
        chunks = (running or {}).get(src)
        for p in cfg["pairs"]:
            st = res["results"].get(p["name"])
            if not st:
                continue
            out.append(f"# {model_label(cfg['model'])}: Q = pair {p['name']}, base = reference "
                       f"({ref}); {done} doc(s) x {cfg['context']} tokens, prefill={cfg['prefill']}; "
                       f"{st['n_tokens']} tokens scored, {scored} ({src})\n")
            if chunks is None:
                out.append(f"# no per-chunk table: it is built from the run's per-token values "
                           f"({res.get('kl_tokens_dir')}/ beside the results file)\n")
            else:
                out.append("\n".join([CHUNK_HEADER, *(_chunk_line(i, c) for i, c in
                                                        enumerate(chunks[p["name"]], start=1)),
                                       "", ""]))
            if st["n_tokens"] < LLAMA_MIN_TOKENS:
                out.append(f"# fewer than {LLAMA_MIN_TOKENS} positions scored: llama.cpp prints "
                           f"no statistics for so few values\n")
            else:
                out.append(llama_block(st))
            out.append("\n")
    return "".join(out)


# ----------------------------------------------------------------------------------------------
# Terminal tables.

def _c(v, u=None, fmt="{:.3g}", ufmt="{:.2g}"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v) + ("±" + ufmt.format(u) if u is not None else "")


# columns of the statistics table, and the order in which they are left out when the console is
# too narrow (the pair and mean KL always stay)
_SUMMARY_COLS = ("pair", "mean KL", "median", "p99", "max", "same top %", "ln PPL ratio", "dp RMS %")
_DROP_ORDER = ("max", "dp RMS %", "p99", "ln PPL ratio", "same top %", "median")


def _width(console, table) -> int:
    """The width `table` needs with no cell wrapped or cut (rich clamps to the console otherwise)."""
    return Measurement.get(console, console.options.update(max_width=1 << 16), table).maximum


def _table(title, cols, rows, first_left=True):
    """Numbers never wrap; the first column (names) folds onto more lines where even the fewest
    columns do not fit, rather than being cut."""
    t = Table(title=title)
    for i, c in enumerate(cols):
        name = i == 0 and first_left
        t.add_column(c, justify="left" if name else "right", no_wrap=not name,
                     overflow="fold" if name else "ellipsis")
    for r in rows:
        t.add_row(*r)
    return t


def fit_table(console, title, cols, rows, drop_order=_DROP_ORDER):
    """A rich table of `cols` that fits the console's width: columns named in `drop_order` are
    left out in that order until it fits. Returns (table, the columns left out)."""
    keep = list(cols)
    dropped = []
    while True:
        idx = [cols.index(c) for c in keep]
        t = _table(title, keep, [[r[i] for i in idx] for r in rows])
        if _width(console, t) <= console.width:
            return t, dropped
        left = [c for c in drop_order if c in keep]
        if not left:
            return t, dropped
        keep.remove(left[0])
        dropped.append(left[0])


def print_summary(res: dict, console=None):
    """The terminal tables of one run (rich): statistics per pair, and mean KL by position, each
    fitted to the console's width (columns left out are named; `replayquant table` has them all)."""
    console = console or Console()
    cfg = res["config"]
    done = f"{res['documents_done']}" + ("" if res.get("complete") else f" of {res['documents_planned']}")
    title = (f"KL(reference || pair), {model_label(cfg['model'])}: {done} doc(s) x {cfg['context']} "
             f"tokens, prefill={cfg['prefill']}{scoring_note(scoring_of(res))}")
    rows = []
    for p in cfg["pairs"]:
        st = res["results"].get(p["name"])
        if not st:
            continue
        rows.append([p["name"], kl_cell(st["kl_mean"], st["kl_mean_unc"], "{:.3g}", "±", "{:.2g}"),
                     _c(st.get("kl_median")),
                     _c((st.get("kl_percentiles") or {}).get("99")), _c(st["kl_max"]),
                     _c(100 * st["same_top"], 100 * st["same_top_unc"], "{:.2f}"),
                     _c(st["ln_ppl_ratio"], st["ln_ppl_ratio_unc"]),
                     _c(100 * st["dp_rms"], 100 * st["dp_rms_unc"])])
    t, dropped = fit_table(console, title, list(_SUMMARY_COLS), rows)
    console.print(t)
    if dropped:
        console.print(f"(left out at {console.width} columns: {', '.join(dropped)}; "
                      f"`replayquant table FILE` shows all)", highlight=False)
    # error accumulation: mean KL per log-spaced position bucket, buckets as rows and pairs as
    # columns, as many pairs per table as fit
    names = [p["name"] for p in cfg["pairs"] if res["results"].get(p["name"])]
    vals = {}
    if names and len(res["results"][names[0]]["by_position"]) > 1:
        buckets = [row["bucket"] for row in res["results"][names[0]]["by_position"]]
        vals = {n: [kl_text(row["kl_mean"], row["kl_mean_unc"])
                    for row in res["results"][n]["by_position"]] for n in names}
        i = 0
        while i < len(names):
            j = i + 1
            while j < len(names):
                trial = _table("mean KL by token position", ["position", *names[i:j + 1]],
                               [[b, *[vals[n][k] for n in names[i:j + 1]]] for k, b in enumerate(buckets)])
                if _width(console, trial) > console.width:
                    break
                j += 1
            console.print(_table("mean KL by token position", ["position", *names[i:j]],
                                 [[b, *[vals[n][k] for n in names[i:j]]] for k, b in enumerate(buckets)]))
            i = j
    marked = [r[1] for r in rows]                  # the mean KLs, and those by position
    for n in kl_notes(marked + [v for n in vals for v in vals[n]]):
        console.print(n, highlight=False)
    for n in res.get("notes", []):
        console.print(f"note: {n}", highlight=False)
