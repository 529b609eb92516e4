"""GPQA summaries (build/gpqa/<model>/SUMMARY.json by default), and the tables rendered from them and from
the lm-eval results files of replayquant runs (`replayquant lm-eval --model replayquant`, the pair
files of `replayquant gpqa`: lm-eval's results dict, its config.replayquant naming the pair).

A summary row is one (pair, task, metric): accuracy and lm-eval's stderr, and the difference from
the run's first pair with a *paired* stderr (the same questions were asked of every pair, so the
per-question differences d_i = x_i(pair) - x_i(first) give stderr = std(d, ddof=1) / sqrt(n)).
Tables are rendered from summary files only, never typed.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from replayquant.outputs import parse_json
from replayquant.provenance import model_identity

__all__ = ["SUMMARY_KIND", "build_summary", "load_summary", "is_gpqa_summary", "render_table",
           "primary_metric", "is_lm_eval_results", "render_lm_eval_table", "table_for_files",
           "summary_model"]

SUMMARY_KIND = "replayquant/gpqa-summary"
SUMMARY_VERSION = 1
# The metric each kind of task is reported by: loglikelihood tasks by accuracy, generative tasks by
# the answer letter extracted anywhere in the output (lm-eval's "flexible-extract" filter).
_PRIMARY = ("acc,none", "exact_match,flexible-extract")
_SKIP_KEYS = {"alias", "name", "sample_len", " "}


def primary_metric(keys) -> str | None:
    keys = list(keys)
    for k in _PRIMARY:
        if k in keys:
            return k
    return keys[0] if keys else None


def _metric_keys(task_results: dict) -> list[str]:
    return [k for k, v in task_results.items()
            if "," in k and "_stderr," not in k and k not in _SKIP_KEYS and isinstance(v, (int, float))]


def _num(x):
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _paired(x: dict, y: dict) -> tuple[float | None, int]:
    common = sorted(set(x) & set(y), key=lambda k: int(k) if str(k).isdigit() else k)
    n = len(common)
    if n < 2:
        return None, n
    d = [x[k] - y[k] for k in common]
    mean = sum(d) / n
    var = sum((v - mean) ** 2 for v in d) / (n - 1)
    return math.sqrt(var / n), n


def build_summary(per_pair: list[dict], *, model: str, tasks: list[str], limit, seed: int, prefill: str,
                  data: dict, provenance: dict) -> dict:
    """per_pair: [{"label", "file", "results"}] in run order; results = lm-eval's dict with our
    `replayquant` block (per-question scores and question digests)."""
    first = per_pair[0]
    rows = []
    for entry in per_pair:
        res, rq = entry["results"], entry["results"]["replayquant"]
        ref_rq = first["results"]["replayquant"]
        for task in tasks:
            tr = res["results"].get(task, {})
            keys = _metric_keys(tr)
            prim = primary_metric(keys)
            n_eff = (res.get("n-samples", {}).get(task, {}) or {}).get("effective")
            same = rq["questions_digest"].get(task) == ref_rq["questions_digest"].get(task)
            for key in keys:
                metric, filt = key.split(",", 1)
                acc = _num(tr[key])
                se = _num(tr.get(f"{metric}_stderr,{filt}"))
                ref = _num(first["results"]["results"].get(task, {}).get(key))
                dse, n_pairs = _paired(rq["per_doc"].get(task, {}).get(key, {}),
                                       ref_rq["per_doc"].get(task, {}).get(key, {}))
                rows.append({
                    "pair": entry["label"], "task": task, "metric": metric, "filter": filt,
                    "primary": key == prim, "n": n_eff, "accuracy": acc, "stderr": se,
                    "delta": None if acc is None or ref is None else acc - ref,
                    "delta_stderr": 0.0 if entry is first else dse,
                    "questions_match_first": same,
                })
    revision = (first["results"].get("config") or {}).get("model_revision")
    return {
        "kind": SUMMARY_KIND, "format_version": SUMMARY_VERSION,
        "model": model, "tasks": tasks, "limit": limit, "seed": seed, "prefill": prefill, "data": data,
        "model_identity": model_identity(model, revision),
        "reference_pair": first["label"],
        "pairs": [{"label": e["label"], "pair": e["results"]["replayquant"]["pair"], "file": e["file"]}
                  for e in per_pair],
        "rows": rows,
        "provenance": provenance,
    }


def summary_model(summary: dict) -> dict:
    """The identity of the model a summary measured (`provenance.model_identity`: a local folder
    with the fingerprint of every byte, a hub id with its commit); one ValueError for a summary
    that does not record it."""
    rec = summary.get("model_identity")
    if not isinstance(rec, dict) or not rec.get("id"):
        raise ValueError(f"the GPQA summary of {summary.get('model')!r} does not record which "
                         f"model it measured (no model_identity: written by an earlier "
                         f"replayquant); run `replayquant gpqa` again")
    return rec


def is_gpqa_summary(obj) -> bool:
    return isinstance(obj, dict) and obj.get("kind") == SUMMARY_KIND


def load_summary(path) -> dict:
    """A summary from SUMMARY.json or a folder holding one; one clear ValueError otherwise."""
    p = Path(path)
    if p.is_dir():
        p = p / "SUMMARY.json"
    if not p.is_file():
        raise ValueError(f"{path}: no GPQA summary there (expected a SUMMARY.json written by `replayquant gpqa`)")
    try:
        obj = parse_json(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not JSON ({e})") from None
    if not is_gpqa_summary(obj):
        raise ValueError(f"{p}: not a GPQA summary (no \"kind\": \"{SUMMARY_KIND}\"); "
                         "give the SUMMARY.json that `replayquant gpqa` writes")
    return obj


def _pts(x, sign=False):
    if x is None:
        return "-"
    s = f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}"
    return s.replace("-", "\u2212") if sign else s


def render_table(summaries: list[dict], fmt: str = "md", metrics: str = "primary") -> str:
    """Markdown (one table per task and metric: pairs as rows, one accuracy and one difference
    column per model, plus the mean difference over models when there are several) or CSV (one
    line per model, task, metric and pair). Accuracies and differences in percentage points."""
    if fmt not in ("md", "csv"):
        raise ValueError(f"--format {fmt!r}: use md or csv")
    if metrics not in ("primary", "all"):
        raise ValueError(f"metrics={metrics!r}: use primary or all")
    if not summaries:
        raise ValueError("no GPQA summaries given")
    rows = [(s, r) for s in summaries for r in s["rows"] if metrics == "all" or r["primary"]]

    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["model", "task", "metric", "filter", "pair", "reference_pair", "n", "accuracy",
                    "stderr", "delta", "delta_stderr", "questions_match_first", "data"])
        for s, r in rows:
            w.writerow([s["model"], r["task"], r["metric"], r["filter"], r["pair"], s["reference_pair"],
                        r["n"], r["accuracy"], r["stderr"], r["delta"], r["delta_stderr"],
                        r["questions_match_first"], s["data"].get("source")])
        return buf.getvalue()

    models = []
    for s in summaries:
        if s["model"] not in models:
            models.append(s["model"])
    groups: dict[tuple, dict] = {}
    for s, r in rows:
        g = groups.setdefault((r["task"], r["metric"], r["filter"]), {"pairs": [], "cells": {}})
        if r["pair"] not in g["pairs"]:
            g["pairs"].append(r["pair"])
        g["cells"][(r["pair"], s["model"])] = (r, s)
    out = []
    for (task, metric, filt), g in groups.items():
        refs = sorted({s["reference_pair"] for (_, s) in g["cells"].values()})
        ns = sorted({r["n"] for (r, _) in g["cells"].values() if r["n"] is not None})
        out.append(f"**{task}** ({metric}" + ("" if filt == "none" else f", {filt}") +
                   f"; n = {', '.join(map(str, ns)) or '?'}; \u0394 vs {', '.join(refs)}, paired stderr; "
                   "percentage points)\n")
        head = ["pair"]
        for m in models:
            short = str(m).rstrip("/").split("/")[-1]
            head += [f"{short} acc", f"{short} \u0394"]
        if len(models) > 1:
            head.append("mean \u0394")
        out.append("| " + " | ".join(head) + " |")
        out.append("| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |")
        for pair in g["pairs"]:
            line, deltas = [pair], []
            for m in models:
                cell = g["cells"].get((pair, m))
                if cell is None:
                    line += ["", ""]
                    continue
                r, _ = cell
                acc = _pts(r["accuracy"]) + ("" if r["stderr"] is None else f" \u00b1 {_pts(r['stderr'])}")
                d = _pts(r["delta"], sign=True)
                if r["delta_stderr"] is not None and r["delta"] is not None and r["delta_stderr"] > 0:
                    d += f" \u00b1 {_pts(r['delta_stderr'])}"
                if not r["questions_match_first"]:
                    d += " (questions differ!)"
                line += [acc, d]
                if r["delta"] is not None:
                    deltas.append(r["delta"])
            if len(models) > 1:
                line.append(_pts(sum(deltas) / len(deltas), sign=True) if len(deltas) == len(models) else "")
            out.append("| " + " | ".join(line) + " |")
        out.append("")
    return "\n".join(out)


UNPATCHED = "unpatched (hf)"     # the pair column of lm-eval's plain `hf` model: the baseline


def is_lm_eval_results(obj) -> bool:
    """lm-eval's results dict of a `replayquant` model run (`replayquant lm-eval --model
    replayquant ...` or a pair file of `replayquant gpqa`: config.replayquant holds the pair), or
    of lm-eval's plain `hf` model (config.model "hf": the unpatched baseline beside the pairs)."""
    if not (isinstance(obj, dict) and isinstance(obj.get("results"), dict)
            and isinstance(obj.get("config"), dict)):
        return False
    cfg = obj["config"]
    return isinstance(cfg.get("replayquant"), dict) or (cfg.get("model") == "hf" and "replayquant" not in cfg)


def _model_args(cfg: dict) -> dict:
    args = cfg.get("model_args")
    if isinstance(args, dict):
        return args
    if isinstance(args, str):      # older lm-eval: "k=v,k=v"
        return dict(kv.split("=", 1) for kv in args.split(",") if "=" in kv)
    return {}


def _short_model(name) -> str:
    return str(name).rstrip("/").split("/")[-1] if name else "?"


def lm_eval_rows(res: dict, source: str = "") -> list[dict]:
    """One row per (task, metric, filter) of an lm-eval results dict of a replayquant run, or of
    the plain `hf` model (pair `UNPATCHED`, no prefill)."""
    cfg = res["config"]
    rq = cfg.get("replayquant")
    if rq is None:
        pair, rq = UNPATCHED, {}
    else:
        pair = rq.get("pair_label") or (rq.get("pair") or {}).get("name") or "?"
    # lm-eval's command line names the model in model_args; `replayquant gpqa` passes lm-eval
    # the model object, so its per-pair files name it in their own provenance
    model = _short_model(_model_args(cfg).get("pretrained") or res.get("model_name")
                         or ((res.get("replayquant") or {}).get("provenance") or {}).get("model"))
    rows = []
    for task, tr in sorted(res["results"].items()):
        n = ((res.get("n-samples") or {}).get(task) or {}).get("effective", tr.get("sample_len"))
        for key in _metric_keys(tr):
            metric, filt = key.split(",", 1)
            rows.append({"model": model, "pair": pair, "prefill": rq.get("prefill"), "task": task,
                         "metric": metric, "filter": filt, "n": n, "value": _num(tr[key]),
                         "stderr": _num(tr.get(f"{metric}_stderr,{filt}")),
                         "limit": cfg.get("limit"), "file": source})
    return rows


def render_lm_eval_table(files, fmt: str = "md") -> str:
    """lm-eval results of replayquant runs and of the plain `hf` model (the unpatched baseline,
    pair "unpatched (hf)"): md (one row per model, pair, task and metric, value ± stderr as
    lm-eval prints them) or csv (value and stderr in separate numeric columns)."""
    if fmt not in ("md", "csv"):
        raise ValueError(f"--format {fmt!r}: lm-eval results render as md or csv")
    rows = []
    for f in files:
        p = Path(f)
        rows += lm_eval_rows(parse_json(p.read_text()), str(p))
    if not rows:
        raise ValueError(f"{[str(f) for f in files]}: the lm-eval results hold no metrics")
    cols = ["model", "pair", "prefill", "task", "metric", "filter", "n", "value", "stderr", "limit", "file"]
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(cols)
        for r in rows:
            w.writerow(["" if r[c] is None else r[c] for c in cols])
        return buf.getvalue()
    out = ["| model | pair | prefill | task | metric | n | value | stderr |",
           "| --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        metric = r["metric"] + ("" if r["filter"] == "none" else f" ({r['filter']})")
        val = "-" if r["value"] is None else f"{r['value']:.4f}"
        se = "-" if r["stderr"] is None else f"{r['stderr']:.4f}"
        out.append(f"| {r['model']} | {r['pair']} | {r['prefill'] or '-'} | {r['task']} | {metric} | "
                   f"{'' if r['n'] is None else r['n']} | {val} | {se} |")
    if any(r["limit"] for r in rows):
        out.append("\n(with --limit: not the whole task)")
    return "\n".join(out) + "\n"


def _file_kind(f) -> str:
    p = Path(f)
    p = p / "SUMMARY.json" if p.is_dir() else p
    try:
        obj = parse_json(p.read_text()) if p.is_file() else None
    except (OSError, ValueError):
        return "other"
    if is_gpqa_summary(obj):
        return "gpqa"
    return "lm-eval" if is_lm_eval_results(obj) else "other"


def table_for_files(files, fmt: str = "md") -> str | None:
    """The table for `files` when they are GPQA summaries (SUMMARY.json or folders holding one)
    or lm-eval results of replayquant runs; None when none of them is (KL results); one
    ValueError when kinds are mixed."""
    kinds = [_file_kind(f) for f in files]
    if all(k == "other" for k in kinds):
        return None
    if len(set(kinds)) > 1:
        names = {"gpqa": "GPQA summaries", "lm-eval": "lm-eval results", "other": "other files"}
        groups = "; ".join(f"{names[k]}: {[str(f) for f, kk in zip(files, kinds) if kk == k]}"
                           for k in ("gpqa", "lm-eval", "other") if k in kinds)
        raise ValueError(f"one table takes one kind of file ({groups}); render each kind in its own "
                         f"`replayquant table` call")
    if kinds[0] == "lm-eval":
        return render_lm_eval_table(files, fmt=fmt)
    return render_table([load_summary(f) for f in files], fmt=fmt)
