"""`replayquant recommend`: the cheapest variant of a sweep within the budgets (a layer policy
from a sensitivity run, `recommend --per-layer`: `replayquant.sweep.per_layer`).

From a sweep (`recommend SWEEP.json --kl-budget B`): a variant fits when its KL upper bound
(`kl_bound`: mean + uncertainty) is at most B, and, where given, its state bytes per step at most
`--max-bytes`, its state memory per sequence at most `--max-memory`, and its GPQA-Diamond drop
against the GPQA run's first pair at most `--gpqa-budget` points at the upper end of its paired
uncertainty (`--gpqa SUMMARY.json`, matched to variants by formats and L, in every task of the
summary, which must have measured the sweep's model and asked every pair the same questions:
`check_gpqa_identity`). The cheapest fitting variant (fewest state bytes per step; then less
memory, then lower KL) is the recommendation, the next one the runner-up. When nothing fits,
`NoFit` names the closest variant (the one that misses its budgets by the smallest factor) and by
how much.
A variant whose KL mean or upper bound is not a finite number, or whose upper bound is below
zero, fits no budget: it is left out and listed (`kl_not_valid`). A sweep that did not finish
(`complete: false`) is refused, as is a damaged one (`check_sweep`: one error naming the place).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

from rich.console import Console

from replayquant.gpqa.summary import summary_model
from replayquant.kl.settings import KLSettings
from replayquant.outputs import check_out_given, check_owned, output_lock
from replayquant.provenance import describe_model, model_mismatch, provenance

from .command import SWEEP_KIND
from .common import (POSITIVE, REAL, SIZE, check_budget, check_results_out, check_structure,
                     fmt_bytes, kl_problem, load_json_kind, write_json)

__all__ = ["NoFit", "recommend", "print_recommendation", "check_sweep", "check_sweep_structure",
           "load_sweep", "check_sensitivity",
           "check_recommendation_out", "write_recommendation", "RECOMMEND_KIND"]

RECOMMEND_KIND = "replayquant.recommendation"


class NoFit(Exception):
    """No variant (or no layer policy) within the budgets; the message names the closest."""


# What recommend and `table` read of the files they are given (common.check_structure): a file
# that lacks it or holds other types is refused at load with one error naming the place.
_KL = {"kl_mean": REAL, "kl_unc": REAL, "kl_upper": REAL, "same_top?": REAL}
_SWEEP_SCHEMA = {
    "complete": bool,
    "layers": [dict],
    "conventional_fp32": {"bytes_per_step": {"state": SIZE}, "memory": {"total": SIZE},
                          "kernel?": {"us_per_step?": REAL, "missing?": [str]}},
    "kernels?": {"batch_requested": int},
    "variants": [{"name": str, "pair": dict, "kl?": _KL, "bytes_per_step": {"state": SIZE},
                  "memory": {"total": SIZE},
                  "vs_fp32_conventional": {"state_bytes?": POSITIVE, "total_bytes?": POSITIVE,
                                           "memory?": POSITIVE},
                  "kernel?": {"us_per_step?": REAL, "speedup_vs_fp32_conventional?": REAL},
                  "on_front": bool}, ...],
    "front": [str],
}
_SENS_SCHEMA = {
    "complete": bool,
    "model": {"id?": str, "local_hash?": str, "revision?": str},
    "kl_args": {"model": str, "context": int, "docs": int, "segment": int, "seed?": int,
                "dataset?": str, "split?": str, "text_field?": str, "prefill?": str,
                "dtype?": str, "reference?": str, "pack?": bool, "revision?": str,
                "device_map?": str, "dataset_config?": str, "data_files?": [str]},
    "layers": [{"kind": str, "H": int, "HK": int, "dv": int, "dk": int, "name": str,
                "index": int}, ...],
    "pairs": [{"name": str}, ...],
    "per_layer": dict,
    "all_layers": dict,
}
_SENS_ROWS = [{"index": int, "name": str, "kl": _KL}, ...]
_GPQA_SCHEMA = {"pairs": [{"label": str, "pair": dict}],
                "rows": [{"pair?": str, "task": str, "primary?": bool, "delta?": REAL,
                          "delta_stderr?": REAL, "questions_match_first?": bool}]}


def _incomplete(source: str, obj: dict, command: str) -> ValueError:
    done, planned = obj.get("documents_done"), obj.get("documents_planned")
    of = ("" if done is None else f" ({done} of {planned} documents done)" if planned is not None
          else f" ({done} documents done)")
    return ValueError(f"{source}: the run is not complete{of}: its KL figures "
                      f"do not cover the documents it planned, so they cannot be held against a "
                      f"budget; run the same `{command}` again to finish it (it resumes), then "
                      f"recommend from it")


def check_sweep_structure(sweep, source: str = "") -> None:
    """One ValueError naming the file for a sweep dict that cannot be read back: damaged
    structure (`_SWEEP_SCHEMA`; measured kernel times without the FP32 conventional step's) or
    two variants of one name."""
    src = source or "the sweep"
    check_structure(sweep, _SWEEP_SCHEMA, src, "replayquant sweep")
    if sweep.get("kernels") is not None and sweep["conventional_fp32"].get("kernel") is None:
        raise ValueError(f"{src}: conventional_fp32.kernel is missing (the file holds measured "
                         f"kernel times); the file is damaged or was not written by `replayquant "
                         f"sweep`: run it again")
    dup = sorted(n for n, k in Counter(v["name"] for v in sweep["variants"]).items() if k > 1)
    if dup:
        raise ValueError(f"{src}: variant(s) {', '.join(dup)} come more than once; the file is "
                         f"damaged or was not written by `replayquant sweep`: run it again")


def load_sweep(path) -> dict:
    """A sweep file, read back whole (`check_sweep_structure`), or one ValueError naming it."""
    sweep = load_json_kind(path, SWEEP_KIND, "replayquant sweep")
    check_sweep_structure(sweep, str(path))
    return sweep


def check_sweep(sweep, source: str = "") -> None:
    """One ValueError naming the file for a sweep dict recommend cannot use: one that cannot be
    read back (`check_sweep_structure`), or a run that did not finish."""
    src = source or "the sweep"
    check_sweep_structure(sweep, source)
    if not sweep["complete"]:
        raise _incomplete(src, sweep, "replayquant sweep")


def check_sensitivity(sens, source: str = "") -> None:
    """One ValueError naming the file for a sensitivity dict a layer policy cannot be built
    from: damaged structure (`_SENS_SCHEMA`), per-layer rows of a pair that are missing, empty
    or name other layers than the other pair's, or a run that did not finish."""
    src = source or "the sensitivity file"
    writer = "replayquant sensitivity"
    check_structure(sens, _SENS_SCHEMA, src, writer)
    takes = {"model", *(f.name for f in dataclasses.fields(KLSettings))} - {"progress"}
    extra = sorted(set(sens["kl_args"]) - takes)
    if extra:
        raise ValueError(f"{src}: kl_args holds {extra}, which no KL run takes; the file is "
                         f"damaged or was not written by `{writer}`: run it again")
    known = {p["name"] for p in sens["pairs"]}
    layers = {s["index"] for s in sens["layers"]}
    if not sens["per_layer"]:
        raise ValueError(f"{src}: per_layer holds no pair; the file is damaged or was not written "
                         f"by `{writer}`: run it again")
    first = None
    for name, rows in sens["per_layer"].items():
        check_structure(rows, _SENS_ROWS, src, writer, f"per_layer.{name}")
        check_structure(sens["all_layers"].get(name), _KL, src, writer, f"all_layers.{name}")
        idx = [r["index"] for r in rows]
        why = ("is not among its pairs" if name not in known else
               "names a layer twice" if len(set(idx)) != len(idx) else
               "names layers the file's layers do not hold" if not set(idx) <= layers else
               f"measured other layers than {first[0]}" if first and set(idx) != first[1] else None)
        if why:
            raise ValueError(f"{src}: per_layer.{name} {why}; the file is damaged or was not "
                             f"written by `{writer}`: run it again")
        first = first or (name, set(idx))
    _check_buffer_lens(sens, src, writer)
    if not sens["complete"]:
        raise _incomplete(src, sens, writer)


def _check_buffer_lens(sens: dict, src: str, writer: str) -> None:
    """One ValueError for a pair whose buffer length no run of `writer` measures: with prefill
    replay, L at or above kl_args.context - 1 (no flush reaches a scored token,
    `memory.check_kl_sizes`)."""
    if sens["kl_args"].get("prefill", "replay") != "replay":
        return
    context = sens["kl_args"]["context"]
    for i, p in enumerate(sens["pairs"]):
        L = p.get("buffer_len")
        if isinstance(L, int) and not isinstance(L, bool) and L >= context - 1:
            raise ValueError(f"{src}: pairs[{i}] ({p['name']}) has buffer length {L}, not below "
                             f"its kl_args.context {context} - 1: `{writer}` measures no such "
                             f"pair (no flush would reach a scored token); the file is damaged: "
                             f"run it again")


def _strip(d):
    """A pair / policy record without names and descriptions (what it stores, for matching)."""
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if k not in ("name", "description")}
    if isinstance(d, list):
        return [_strip(v) for v in d]
    return d


def gpqa_drops(summary: dict) -> dict:
    """{canonical pair record: {"label", "drop_pts", "drop_upper_pts", "tasks"}} from a GPQA
    summary's primary rows: the largest drop over its tasks, in percentage points, against the
    summary's first pair, at the upper end of the paired uncertainty."""
    check_structure(summary, _GPQA_SCHEMA, "the GPQA summary", "replayquant gpqa")
    by_label = {p["label"]: p for p in summary["pairs"]}
    out = {}
    for label, p in by_label.items():
        rows = [r for r in summary["rows"] if r.get("pair") == label and r.get("primary")]
        if not rows or any(r.get("delta") is None for r in rows):
            continue
        drops = [(-100 * r["delta"], 100 * (r.get("delta_stderr") or 0.0), r["task"]) for r in rows]
        worst = max(drops, key=lambda t: t[0] + t[1])
        out[json.dumps(_strip(p["pair"]), sort_keys=True)] = {
            "label": label, "drop_pts": worst[0], "drop_upper_pts": worst[0] + worst[1],
            "tasks": sorted(t for _, _, t in drops), "reference_pair": summary.get("reference_pair")}
    return out


def check_gpqa_identity(sweep: dict, summary: dict, source: str = "") -> None:
    """One ValueError naming both sides when a GPQA summary cannot gate a sweep: it measured
    another model than the sweep (`provenance.model_mismatch`: a local folder by the
    fingerprint of every byte), or one of its pairs was asked other questions than its first
    pair (its drop would not be a paired difference)."""
    src = source or "the sweep"
    then, now = summary_model(summary), sweep.get("model") or {}
    why = model_mismatch(then, now)
    if why:
        raise ValueError(f"the GPQA summary measured the model {describe_model(then)}; {src} "
                         f"measured {describe_model(now)} ({why}): a GPQA result gates only the "
                         f"model it measured; run `replayquant gpqa` on the sweep's model")
    other = sorted({(r["pair"], r["task"]) for r in summary["rows"]
                    if r.get("primary") and r.get("questions_match_first") is False})
    if other:
        raise ValueError(f"the GPQA summary asked {', '.join(f'{p} ({t})' for p, t in other)} "
                         f"other questions than its first pair {summary.get('reference_pair')}: "
                         f"their drops are not paired differences; run `replayquant gpqa` with "
                         f"every pair in one run")


def _gpqa_of(variant: dict, drops: dict):
    return drops.get(json.dumps(_strip(variant["pair"]), sort_keys=True))


def _summary(v: dict, conv: dict, gq=None) -> dict:
    mean, unc, upper = v["kl"]["kl_mean"], v["kl"]["kl_unc"], v["kl"]["kl_upper"]
    out = {"name": v["name"], "kl_mean": mean, "kl_unc": unc, "kl_upper": upper,
           "same_top": v["kl"].get("same_top"),
           "bytes_per_step": v["bytes_per_step"]["state"], "memory": v["memory"]["total"],
           "fp32_conventional_bytes_per_step": conv["bytes_per_step"]["state"],
           "fp32_conventional_memory": conv["memory"]["total"],
           "bytes_saving": v["vs_fp32_conventional"].get("state_bytes"),
           "memory_saving": v["vs_fp32_conventional"].get("memory"), "pair": v["pair"]}
    k = v.get("kernel")
    if k is not None:
        out["kernel_us_per_step"] = k.get("us_per_step")
        out["kernel_speedup"] = k.get("speedup_vs_fp32_conventional")
        out["kernel_batch"] = k.get("batch")
    if gq is not None:
        out["gpqa"] = gq
    return out


def recommend(sweep: dict, kl_budget: float, max_bytes: float | None = None,
              max_memory: float | None = None, gpqa: dict | None = None,
              gpqa_budget: float | None = None, source: str = "") -> dict:
    """The recommendation dict for a sweep dict; raises NoFit when nothing fits."""
    check_budget("--kl-budget", kl_budget)
    check_budget("--max-bytes", max_bytes)
    check_budget("--max-memory", max_memory)
    check_budget("--gpqa-budget", gpqa_budget, zero_ok=True)
    if (gpqa is None) != (gpqa_budget is None):
        raise ValueError("--gpqa and --gpqa-budget go together: give the GPQA summary and the "
                         "largest accuracy drop in points you accept (e.g. --gpqa-budget 1.0)")
    check_sweep(sweep, source)
    conv = sweep["conventional_fp32"]
    measured = [v for v in sweep["variants"] if v.get("kl")]
    if not measured:
        raise ValueError(f"{source or 'the sweep'} holds no measured variant (no document finished); "
                         f"run the sweep to the end first")
    # a KL that is NaN, infinite or below zero fits no budget: such variants are left out
    invalid = {v["name"]: kl_problem(v["kl"]) for v in measured if kl_problem(v["kl"])}
    drops = gpqa_drops(gpqa) if gpqa is not None else None
    if gpqa is not None:
        check_gpqa_identity(sweep, gpqa, source)
    no_gpqa = [v["name"] for v in measured if drops is not None and _gpqa_of(v, drops) is None]
    pool = [v for v in measured if v["name"] not in no_gpqa and v["name"] not in invalid]

    _below_every_variant(pool, source, kl_budget, max_bytes, max_memory)

    def misses(v) -> dict:
        """{constraint: value / limit} for every limit the variant exceeds."""
        m = {}                      # `not x <= limit`: a value that is not a number never fits
        if not v["kl"]["kl_upper"] <= kl_budget:
            m["kl"] = v["kl"]["kl_upper"] / kl_budget
        if max_bytes is not None and not v["bytes_per_step"]["state"] <= max_bytes:
            m["bytes"] = v["bytes_per_step"]["state"] / max_bytes
        if max_memory is not None and not v["memory"]["total"] <= max_memory:
            m["memory"] = v["memory"]["total"] / max_memory
        if drops is not None:
            g = _gpqa_of(v, drops)
            if not g["drop_upper_pts"] <= gpqa_budget:
                m["gpqa"] = (g["drop_upper_pts"] - gpqa_budget)
        return m

    def cost(v):
        return (v["bytes_per_step"]["state"], v["memory"]["total"], v["kl"]["kl_upper"], v["name"])

    fits = sorted((v for v in pool if not misses(v)), key=cost)
    budgets = {"kl_budget": kl_budget, "max_bytes": max_bytes, "max_memory": max_memory,
               "gpqa_budget_pts": gpqa_budget}
    if not fits:
        if not pool and invalid and not no_gpqa:
            raise NoFit(f"no variant of {source or 'the sweep'} has a KL that can meet a budget: "
                        + "; ".join(f"{n}: {why}" for n, why in invalid.items()))
        if not pool:
            raise NoFit(f"no variant of {source or 'the sweep'} has a GPQA result in the summary "
                        f"given ({', '.join(no_gpqa)}); run `replayquant gpqa` with the swept "
                        f"pairs and buffer lengths")
        closest = min(pool, key=lambda v: (max(_excess(k, x) for k, x in misses(v).items()), cost(v)))
        raise NoFit(_no_fit_message(closest, misses(closest), budgets, gpqa_of=(
            None if drops is None else _gpqa_of(closest, drops))))
    best = fits[0]
    gq = (lambda v: None if drops is None else _gpqa_of(v, drops))
    return {
        "kind": RECOMMEND_KIND, "version": 1, "sweep": source, "model": sweep.get("model"),
        "budgets": budgets,
        "recommended": _summary(best, conv, gq(best)),
        "runner_up": None if len(fits) < 2 else _summary(fits[1], conv, gq(fits[1])),
        "fitting": [v["name"] for v in fits],
        "not_fitting": {v["name"]: misses(v) for v in pool if misses(v)},
        "without_gpqa_result": no_gpqa,
        "kl_not_valid": invalid,
        "front": sweep.get("front"),
        "provenance": provenance(sweep=source, **budgets),
    }


# per budget option: what it limits, and what else gives a fit than raising it
_LIMITS = (("--kl-budget", lambda v: v["kl"]["kl_upper"], "KL upper bound",
            "sweep higher-precision pairs or other buffer lengths"),
           ("--max-bytes", lambda v: v["bytes_per_step"]["state"],
            "state bytes per decode step and sequence", "sweep cheaper pairs or shorter buffer "
            "lengths"),
           ("--max-memory", lambda v: v["memory"]["total"], "state memory per sequence",
            "sweep cheaper pairs or shorter buffer lengths"))


def _below_every_variant(pool: list, source: str, *limits) -> None:
    """NoFit, saying what to give, for a limit below every variant's value on its own (a
    --max-bytes of 1, a --kl-budget below the best KL): no other budget can make up for it."""
    for (flag, value, what, other), limit in zip(_LIMITS, limits):
        if limit is None or not pool:
            continue
        best = min(pool, key=value)
        least = value(best)
        if least <= limit:
            continue
        if flag == "--kl-budget":      # three digits, rounded up: the variant fits the one given
            step = 10.0 ** (math.floor(math.log10(least)) - 2) if least > 0 else 1.0
            shown, give = f"{least:.3g}", f"{math.ceil(least / step) * step:.3g}"
        else:
            shown, give = f"{fmt_bytes(least)} ({least:.0f} bytes)", f"{math.ceil(least)}"
        raise NoFit(f"{flag} {limit:g} is below every variant of {source or 'the sweep'}: the "
                    f"least {what} is {shown}, {best['name']}'s; give {flag} {give} or more, or "
                    f"{other}")


def _excess(kind: str, x: float) -> float:
    """How far over a limit, comparable across kinds: a factor for KL, bytes and memory, and
    1 + points over for GPQA."""
    return 1.0 + x if kind == "gpqa" else x


def _no_fit_message(v, miss, budgets, gpqa_of=None) -> str:
    parts = []
    if "kl" in miss:
        parts.append(f"its KL upper bound {v['kl']['kl_upper']:.3g} (mean {v['kl']['kl_mean']:.3g} "
                     f"+ {v['kl']['kl_unc']:.2g}) is {miss['kl']:.3g}x the budget "
                     f"{budgets['kl_budget']:.3g}")
    if "bytes" in miss:
        parts.append(f"its {fmt_bytes(v['bytes_per_step']['state'])} per step are {miss['bytes']:.3g}x "
                     f"--max-bytes {budgets['max_bytes']:.6g}")
    if "memory" in miss:
        parts.append(f"its {fmt_bytes(v['memory']['total'])} of state memory are {miss['memory']:.3g}x "
                     f"--max-memory {budgets['max_memory']:.6g}")
    if "gpqa" in miss:
        parts.append(f"its GPQA drop reaches {gpqa_of['drop_upper_pts']:.2f} points (budget "
                     f"{budgets['gpqa_budget_pts']:.2f})")
    todo = [f"raise {flag} or {other}" for (flag, _, _, other), key in zip(_LIMITS, ("kl", "bytes",
                                                                                    "memory"))
            if key in miss]
    if "gpqa" in miss:
        todo.append("raise --gpqa-budget or sweep higher-precision pairs")
    return (f"no variant fits the budgets; the closest is {v['name']}: " + "; ".join(parts) +
            ". To fit: " + "; ".join(todo))


def _ratio_text(saving: float | None, what: str) -> str:
    if saving is None:              # a file that does not record the ratio
        return f"against the FP32 conventional step's {what}"
    if saving >= 1:
        return f"{saving:.2f}x less {what} than the FP32 conventional step"
    return f"{1 / saving:.2f}x the FP32 conventional step's {what}"


def _line(s: dict) -> str:
    text = (f"{s['name']}: KL {s['kl_mean']:.3g} ± {s['kl_unc']:.2g} (upper {s['kl_upper']:.3g}); "
            f"{fmt_bytes(s['bytes_per_step'])} of state per decode step and sequence, "
            f"{_ratio_text(s['bytes_saving'], 'traffic')} "
            f"({fmt_bytes(s['fp32_conventional_bytes_per_step'])}); memory "
            f"{fmt_bytes(s['memory'])}, {_ratio_text(s['memory_saving'], 'memory')} "
            f"({fmt_bytes(s['fp32_conventional_memory'])})")
    if s.get("kernel_us_per_step") is not None:
        text += (f"; measured {s['kernel_us_per_step']:.1f} us per step at B = {s['kernel_batch']}"
                 + ("" if s.get("kernel_speedup") is None
                    else f", {s['kernel_speedup']:.2f}x the FP32 conventional step's speed"))
    if s.get("gpqa"):
        g = s["gpqa"]
        text += (f"; GPQA drop {g['drop_pts']:+.2f} points (upper {g['drop_upper_pts']:.2f}) "
                 f"against {g['reference_pair']}")
    return text


def print_recommendation(rec: dict, console=None) -> None:
    console = console or Console(width=max(Console().width, 124))
    b = rec["budgets"]
    lim = [f"KL upper bound <= {b['kl_budget']:.3g}"]
    if b.get("max_bytes") is not None:
        lim.append(f"<= {fmt_bytes(b['max_bytes'])} per step")
    if b.get("max_memory") is not None:
        lim.append(f"<= {fmt_bytes(b['max_memory'])} memory")
    if b.get("gpqa_budget_pts") is not None:
        lim.append(f"GPQA drop <= {b['gpqa_budget_pts']:.2f} points")
    console.print(f"{len(rec['fitting'])} variant(s) fit ({', '.join(lim)}).", soft_wrap=True)
    console.print("[bold]recommended[/bold] " + _line(rec["recommended"]), soft_wrap=True)
    if rec["runner_up"] is not None:
        console.print("runner-up " + _line(rec["runner_up"]), soft_wrap=True)
    if rec.get("without_gpqa_result"):
        console.print(f"not considered (no GPQA result): {', '.join(rec['without_gpqa_result'])}",
                      soft_wrap=True)
    if rec.get("kl_not_valid"):
        console.print("not considered (KL fits no budget): " + "; ".join(
            f"{n}: {why}" for n, why in rec["kl_not_valid"].items()), soft_wrap=True)



# ============================================================ writing

def check_recommendation_out(out, sources=()) -> Path:
    """The path of a recommendation file (`recommend SWEEP.json --out`), checked before any work:
    a .json in a writable folder, not one of the files read (`sources`), not a file of another
    kind. Returns it as a Path; one ValueError saying what to give instead."""
    check_out_given(out)
    path = check_results_out(out)
    check_owned(path, RECOMMEND_KIND, "replayquant recommend", inputs=sources)
    return path


def write_recommendation(path: Path, rec: dict, sources=()) -> None:
    """Write a recommendation file, holding its lock: it replaces a recommendation for the same
    budgets of a sweep of the same model only."""
    with output_lock(path):
        check_owned(path, RECOMMEND_KIND, "replayquant recommend", inputs=sources,
                    identity={"model": rec.get("model"), "budgets": rec["budgets"]},
                    recorded=lambda old: {"model": old["model"], "budgets": old["budgets"]})
        write_json(path, rec)
