"""`replayquant sweep`: every (pair, L) in one KL run, with the bytes and memory each one costs.

Variants: each `--pair` (a pair or a layer policy) at each `--buffer-len` L is one variant named
`PAIR@LL` (e.g. `tp4_hi32@L8`; a policy gets L in every pair). All variants run as the pairs of
one `replayquant kl` run (`kl_command`): the FP32-state reference and every variant in lockstep
over the same documents, the reference's forward computed once per segment for all of them;
the run is resumable as `kl` is (its files are NAME_kl.json, NAME_kl.kl/ and NAME_kl.png).

Per variant the sweep file (NAME.json, kind `replayquant.sweep`) holds:
* `kl`: the headline statistics of the KL run (`common.KL_FIGURES`) with `kl_unc` and
  `kl_upper` (`common.kl_bound`: mean + the larger of the token-level and per-document
  uncertainty);
* `bytes_per_step`: HBM bytes per decode step of one sequence, summed over the model's
  recurrent layers (`replayquant.statebytes`: read copy + ring entries + amortised flush =
  `state`, plus the inputs / output `io` every step moves alike); a layer a policy keeps
  `exact` counts as the FP32 conventional step;
* `memory`: state memory per sequence (anchor + read copy + ring buffer of L entries);
* `vs_fp32_conventional`: the FP32 conventional step's state bytes and memory over the
  variant's (above 1: the variant moves / holds less);
* `kernel` (with `--kernels`): measured microseconds per step (`replayquant.sweep.measured`);
* `on_front`: on the Pareto front of state bytes per step against mean KL.
NAME.png plots mean KL against state bytes per step (log-log; `replayquant.sweep.plot`).

A sweep run again with the same variants into its own NAME.json resumes its KL run and rewrites
NAME.json and NAME.png; a file of another kind or of other variants at --out is refused before
any work, as is a second run into an output while one runs (`replayquant.outputs`).
"""

from __future__ import annotations

import csv
import dataclasses
import io
from pathlib import Path

from rich.console import Console

from replayquant import statebytes as sb
from replayquant.kl.report import fit_table, model_label
from replayquant.kl.settings import KLSettings
from replayquant.kl.stats import KL_ZERO_SE, kl_text
from replayquant.outputs import check_out_given, check_owned, output_lock
from replayquant.pairs import PrecisionPair
from replayquant.policy import EXACT, LayerPolicy, resolve_pair
from replayquant.provenance import provenance

from . import measured
from .common import (check_results_out, clean_name, fmt_bytes, front_kl, kl_figures, kl_file_for,
                     pareto_front, shapes_of_model, write_json)
from .plot import plot_sweep

__all__ = ["SWEEP_KIND", "parse_buffer_lens", "sweep_variants", "layer_pairs", "variant_costs",
           "front_kl", "pareto_front", "build_sweep", "variants_record", "sweep_command",
           "print_sweep", "render_sweep"]

SWEEP_KIND = "replayquant.sweep"
SWEEP_VERSION = 1


def parse_buffer_lens(text) -> list[int] | None:
    """'4,8,16' -> [4, 8, 16]; None or '' -> None (each pair's own L)."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    if isinstance(text, (list, tuple)):
        items = list(text)
    else:
        items = [x.strip() for x in str(text).split(",") if x.strip()]
    out = []
    for x in items:
        try:
            v = int(x)
        except (TypeError, ValueError):
            raise ValueError(f"--buffer-len {text!r}: give comma-separated integers >= 1, e.g. "
                             f"4,8,16,32") from None
        if v < 1 or str(v) != str(x).strip().lstrip("+"):
            raise ValueError(f"--buffer-len {text!r}: every L must be an integer >= 1 (got {x!r})")
        if v in out:
            raise ValueError(f"--buffer-len {text!r}: L = {v} is given twice")
        out.append(v)
    return out


def sweep_variants(pairs, buffer_lens) -> list[dict]:
    """[{"variant": pair or policy named BASE@LL, "base": BASE, "L": L, "spec": as given}]."""
    if not pairs:
        raise ValueError("give at least one --pair")
    out, names = [], set()
    for spec in pairs:
        p = resolve_pair(spec)
        base = clean_name(p.label() if hasattr(p, "label") else spec)
        Ls = buffer_lens or [p.buffer_len]
        if any(L is None for L in Ls):
            raise ValueError(f"--pair {spec}: the policy's pairs have different buffer lengths; "
                             f"give --buffer-len")
        for L in Ls:
            name = f"{base}@L{L}"
            if name in names:
                raise ValueError(f"variant {name} comes twice (a --pair given twice?)")
            names.add(name)
            if isinstance(p, LayerPolicy):
                v = p.with_buffer_len(L, name=name)
            else:
                v = PrecisionPair(p.read, p.anchor, L, name, p.description)
            out.append({"variant": v, "base": base, "L": L, "spec": str(spec)})
    return out


def layer_pairs(variant, shapes) -> list:
    """[(LayerShape, PrecisionPair or None)] of a variant: None where a policy keeps a layer
    `exact` (counted as the FP32 conventional step)."""
    if isinstance(variant, LayerPolicy):
        assigned = variant.assign([(s.name, s.index) for s in shapes])
        return [(s, None if p == EXACT else p) for s, p in zip(shapes, assigned)]
    return [(s, variant) for s in shapes]


def variant_costs(variant, shapes):
    """(StepBytes, MemoryBytes) per sequence of a variant, summed over the layers."""
    b, m = sb.StepBytes(), sb.MemoryBytes()
    for s, p in layer_pairs(variant, shapes):
        if p is None:
            b, m = b + sb.layer_conventional_bytes(s), m + sb.layer_conventional_memory(s)
        else:
            b, m = b + sb.layer_step_bytes(s, p), m + sb.layer_memory_bytes(s, p)
    return b, m


def build_sweep(kl_res: dict, variants: list[dict], shapes, kl_path: Path, settings: dict,
                kern: dict | None = None, kernels_path=None, batch: int = 256) -> dict:
    """The sweep record from a KL results dict and the variants it ran."""
    conv_b, conv_m = sb.model_conventional(shapes)
    conv = {"name": "fp32-conventional", "bytes_per_step": conv_b.to_dict(),
            "memory": conv_m.to_dict(),
            "note": "read-modify-write of an FP32 state every step: what serving engines do "
                    "today, and exact FP32 state (KL 0 against the reference)"}
    if kern is not None:
        conv["kernel"] = measured.conventional_us(kern, shapes, batch)
    rows = []
    for v in variants:
        var = v["variant"]
        name = var.name
        stats = (kl_res.get("results") or {}).get(name)
        b, m = variant_costs(var, shapes)
        row = {"name": name, "base": v["base"], "buffer_len": v["L"], "spec": v["spec"],
               "pair": var.to_dict(), "kl": None if stats is None else kl_figures(stats),
               "bytes_per_step": b.to_dict(), "memory": m.to_dict(),
               "vs_fp32_conventional": {"state_bytes": conv_b.state / b.state if b.state else None,
                                        "total_bytes": conv_b.total / b.total if b.total else None,
                                        "memory": conv_m.total / m.total if m.total else None}}
        if kern is not None:
            k = measured.variant_us(kern, layer_pairs(var, shapes), batch)
            cu = conv["kernel"].get("us_per_step")
            k["speedup_vs_fp32_conventional"] = (cu / k["us_per_step"] if cu and k.get("us_per_step")
                                                 else None)
            row["kernel"] = k
        rows.append(row)
    pts = [(r["name"], r["bytes_per_step"]["state"], r["kl"]["kl_mean"], r["kl"]["kl_unc"])
           for r in rows if r["kl"]]
    front = pareto_front(pts)
    for r in rows:
        r["on_front"] = r["name"] in front
    return {
        "kind": SWEEP_KIND, "version": SWEEP_VERSION,
        "complete": bool(kl_res.get("complete")),
        "documents_done": kl_res.get("documents_done"),
        "documents_planned": kl_res.get("documents_planned"),
        "model": kl_res["config"]["model"],
        "settings": settings,
        "layers": [s.to_dict() for s in shapes],
        "kl_results": kl_path.name,
        "conventional_fp32": conv,
        "kernels": None if kern is None else {**measured.kernels_record(kern, kernels_path),
                                              "batch_requested": batch},
        "front": front,
        "variants": rows,
        "provenance": provenance(kl_results=str(kl_path), kl_git_commit=kl_res.get("provenance", {})
                                 .get("git_commit"), **{k: v for k, v in settings.items()
                                                        if k not in ("progress",)}),
    }


def default_out(model: str, bases: list[str], buffer_lens, context: int) -> Path:
    pairs = "+".join(bases) if len(bases) <= 3 else f"{len(bases)}pairs"
    Ls = "-".join(map(str, buffer_lens)) if buffer_lens else "own"
    return Path("build/sweep") / f"{clean_name(Path(model).name)}_{pairs}_L{Ls}_ctx{context}.json"


def variants_record(variants: list[dict]) -> dict:
    """What makes a sweep file the same run (beside its KL run's configuration, which the KL run
    checks): its variants, by name and what each stores."""
    return {"variants": [{"name": v["variant"].name, "pair": v["variant"].to_dict()} for v in variants]}


def _recorded_variants(old: dict) -> dict:
    return {"variants": [{"name": r["name"], "pair": r["pair"]} for r in old["variants"]]}


def sweep_command(model: str, pairs: list, buffer_lens=None, settings: KLSettings | None = None,
                  *, kernels: str | None = None, batch: int = 256, out: str | None = None,
                  plot: bool = True, console=None) -> dict | None:
    """Everything `replayquant sweep` does; returns the sweep dict (None on ranks > 0). The KL run
    of the variants takes `settings` (default: KLSettings()) whole
    (`replayquant.kl.command.kl_command`)."""
    from replayquant.kl.command import kl_command   # transformers: reading results does not load it

    Ls = parse_buffer_lens(buffer_lens)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"--batch must be an integer >= 1, got {batch!r}")
    check_out_given(out)
    settings = settings or KLSettings()
    settings.check()
    variants = sweep_variants(pairs, Ls)
    kern = measured.load_kernels(kernels) if kernels else None
    bases = list(dict.fromkeys(v["base"] for v in variants))
    out_path = check_results_out(out if out is not None else
                                 default_out(model, bases, Ls, settings.context))
    png, kl_path = out_path.with_suffix(".png"), kl_file_for(out_path)
    with output_lock(out_path):
        # the same variants replace their own sweep file (the KL run resumes); anything else
        # at --out is refused before any work
        check_owned(out_path, SWEEP_KIND, "replayquant sweep", identity=variants_record(variants),
                    recorded=_recorded_variants, inputs=(kernels,), beside=(png,),
                    fresh=(png, kl_path, kl_path.with_suffix(".png"), f"{kl_path.with_suffix('.kl')}/"))
        shapes, *_ = shapes_of_model(model, settings.revision)
        for v in variants:                      # a policy's layer errors before any weights load
            layer_pairs(v["variant"], shapes)
        res = kl_command(model, [v["variant"] for v in variants], settings, out=str(kl_path))
        if res is None:
            return None
        settings = {"model_arg": model, "pairs": [str(p) for p in pairs], "buffer_lens": Ls,
                    "batch": batch, **dataclasses.asdict(settings)}
        sw = build_sweep(res, variants, shapes, kl_path, settings, kern, kernels, batch)
        write_json(out_path, sw)
        if plot:
            plot_sweep(sw, png)
    print_sweep(sw, console)
    Console(stderr=True).print(f"wrote {out_path} and {png}", soft_wrap=True)   # paths whole
    return sw


# The sweep table: its columns, and the order in which `print_sweep` leaves them out where the
# console is too narrow (the variant, its bytes per step, the KL upper bound that `recommend`
# decides by and the front mark always stay). "x fewer" and "x less" are the FP32 conventional
# step's state bytes per step and memory over the variant's (above 1: the variant moves / holds
# less).
SWEEP_COLUMNS = ("variant", "bytes/step", "x fewer", "memory", "x less", "KL mean", "KL upper",
                 "top-1 %", "us/step", "speedup", "front")
_SWEEP_DROP = ("x less", "memory", "speedup", "us/step", "top-1 %", "KL mean", "x fewer")
SWEEP_CSV = ("variant", "base", "buffer_len", "state_bytes_per_step", "total_bytes_per_step",
             "fewer_state_bytes", "memory_bytes", "less_memory", "kl_mean", "kl_unc", "kl_upper",
             "same_top_pct", "us_per_step", "speedup", "on_front")


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _sweep_rows(sw: dict) -> tuple[list[str], list[list[str]], list[dict]]:
    """(columns, cells, plain values for csv) of a sweep's variants in bytes order."""
    has_k = sw.get("kernels") is not None
    cols = [c for c in SWEEP_COLUMNS if has_k or c not in ("us/step", "speedup")]
    cells, values = [], []
    for r in sorted(sw["variants"], key=lambda r: (r["bytes_per_step"]["state"], r["name"])):
        kl, vs, k = r["kl"] or {}, r["vs_fp32_conventional"], r.get("kernel") or {}
        mean, unc = kl.get("kl_mean"), kl.get("kl_unc")
        top = None if kl.get("same_top") is None else 100 * kl["same_top"]
        v = {"variant": r["name"], "base": r.get("base"), "buffer_len": r.get("buffer_len"),
             "state_bytes_per_step": r["bytes_per_step"]["state"],
             "total_bytes_per_step": r["bytes_per_step"].get("total"),
             "fewer_state_bytes": vs.get("state_bytes"), "memory_bytes": r["memory"]["total"],
             "less_memory": vs.get("memory"), "kl_mean": mean, "kl_unc": unc,
             "kl_upper": kl.get("kl_upper"), "same_top_pct": top,
             "us_per_step": k.get("us_per_step"), "speedup": k.get("speedup_vs_fp32_conventional"),
             "on_front": bool(r["on_front"])}
        cell = {"variant": r["name"], "bytes/step": fmt_bytes(v["state_bytes_per_step"]),
                "x fewer": _fmt(v["fewer_state_bytes"], ".2f"), "memory": fmt_bytes(v["memory_bytes"]),
                "x less": _fmt(v["less_memory"], ".2f"),
                "KL mean": "-" if mean is None else kl_text(mean, unc or 0.0),
                "KL upper": _fmt(v["kl_upper"], ".3g"), "top-1 %": _fmt(top, ".1f"),
                "us/step": _fmt(v["us_per_step"], ".1f"), "speedup": _fmt(v["speedup"], ".2f"),
                "front": "*" if r["on_front"] else ""}
        cells.append([cell[c] for c in cols])
        values.append(v)
    return cols, cells, values


def _sweep_title(sw: dict) -> str:
    conv = sw["conventional_fp32"]
    return (f"sweep of {model_label(sw.get('model') or {}) or '?'}: state bytes per decode step "
            f"and sequence ({len(sw['layers'])} recurrent layers) against KL; FP32 conventional "
            f"step {fmt_bytes(conv['bytes_per_step']['state'])}, memory "
            f"{fmt_bytes(conv['memory']['total'])}")


def _sweep_notes(sw: dict, cells: list[list[str]]) -> list[str]:
    """What the table's marks and measured times mean, and the front."""
    notes = ["x fewer / x less: the FP32 conventional step's state bytes per step / memory over "
             "the variant's (above 1: the variant moves / holds less)"]
    if any("~0" in c for row in cells for c in row):
        notes.append(f"KL mean ~0: within {KL_ZERO_SE:g} standard errors of zero (float noise), "
                     f"counted as 0")
    if sw.get("kernels") is not None:
        ks, conv = sw["kernels"], sw["conventional_fp32"]
        cu = conv["kernel"].get("us_per_step")
        base = (f"speedup over the FP32 conventional step's {cu:.1f} us" if cu is not None else
                f"no speedup: the FP32 conventional step is not timed for "
                f"{'; '.join(conv['kernel'].get('missing', []))}")
        notes.append(f"us/step: {ks.get('device')} kernels grid {ks.get('file')} at the batch "
                     f"nearest {ks['batch_requested']}, each layer timed at the grid's shape of "
                     f"its kind (not scaled to this model's); {base}")
    notes.append("Pareto front (fewest bytes first): " + " -> ".join(sw["front"]))
    return notes


def render_sweep(sw: dict, fmt: str = "md") -> str:
    """A sweep file as text with every column: md (the table, then what its marks mean and the
    front) or csv (plain numbers, one row per variant)."""
    cols, cells, values = _sweep_rows(sw)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(SWEEP_CSV)
        w.writerows([["" if v[c] is None else v[c] for c in SWEEP_CSV] for v in values])
        return buf.getvalue()
    if fmt != "md":
        raise ValueError(f"--format {fmt} takes KL results files; a sweep renders as md or csv "
                         f"(its KL run, NAME_kl.json beside it, renders as llama)")
    lines = [_sweep_title(sw), "", "| " + " | ".join(cols) + " |",
             "| --- |" + " ---: |" * (len(cols) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines + [""] + _sweep_notes(sw, cells)) + "\n"


def print_sweep(sw: dict, console=None) -> None:
    """The sweep table (bytes order) fitted to the console's width (80 columns through a pipe):
    columns that do not fit are left out and named, never a number cut; `replayquant table
    SWEEP.json` prints them all."""
    console = console or Console()
    cols, cells, _ = _sweep_rows(sw)
    t, dropped = fit_table(console, _sweep_title(sw), cols, cells, _SWEEP_DROP)
    t.title_justify = "left"
    console.print(t)
    if dropped:
        console.print(f"(left out at {console.width} columns: {', '.join(dropped)}; "
                      f"`replayquant table SWEEP.json` shows all)", highlight=False)
    for note in _sweep_notes(sw, cells):
        console.print(note, highlight=False)
