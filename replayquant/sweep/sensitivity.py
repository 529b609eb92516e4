"""`replayquant sensitivity`: how much KL each recurrent layer contributes when it alone holds a
pair.

For each pair P and each recurrent layer i, the variant `P@layerI` is a layer policy with P on
layer i and every other layer `exact` (exact FP32 state, computed as the reference computes it),
so its KL against the reference is what layer i's rounding costs on its own; the variant `P@all`
holds P on every layer. All variants are the pairs of one KL run (`replayquant kl`'s harness:
lockstep with the reference over the same documents, resumable); `--per-pass N` splits them
into runs of N variants where the caches of all variants at once do not fit in memory (each run
computes the reference again).

Writes NAME.json (kind `replayquant.sensitivity`): per pair the layers with their single-layer
KL figures and rank (1 = largest KL), the all-layers KL, and the sum of the single-layer means
against it (`sum_vs_all`: a ratio near 1 says the layers' errors add); NAME.png (bars by layer,
`replayquant.sweep.plot.plot_sensitivity`); the KL run's files NAME_kl.* (NAME_kl1.*, ... with
--per-pass). Run again with the same pairs, layers and --per-pass into its own NAME.json, it
resumes its KL runs and rewrites NAME.json and NAME.png; a file of another kind or of another
run at --out is refused before any work, as is a second run into an output while one runs
(`replayquant.outputs`).

The file records what `recommend --per-layer` must measure again: the model (`model`, with the
fingerprint of every byte of a local folder), the documents (`data`, the KL run's record of its
dataset with the sha256 of their tokens) and the KL options (`kl_args`, a local dataset or model
folder by its absolute path, so the file names the same data from any working folder).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table

from replayquant.kl.settings import KLSettings
from replayquant.outputs import check_out_given, check_owned, output_lock
from replayquant.pairs import PrecisionPair
from replayquant.policy import EXACT, LayerPolicy, Override, resolve_pair
from replayquant.provenance import describe_model, model_mismatch, provenance

from .common import (check_results_out, clean_name, kl_figures, kl_file_for, shapes_of_model,
                     write_json)
from .plot import plot_sensitivity

__all__ = ["SENS_KIND", "sensitivity_variants", "sensitivity_command", "print_sensitivity"]

SENS_KIND = "replayquant.sensitivity"


def _parse_layers(layers, shapes) -> list:
    if layers is None or (isinstance(layers, str) and not layers.strip()):
        return list(shapes)
    items = layers.split(",") if isinstance(layers, str) else list(layers)
    try:
        idx = [int(str(x).strip()) for x in items if str(x).strip()]
    except ValueError:
        raise ValueError(f"--layers {layers!r}: give comma-separated layer indices, e.g. 0,1,4") from None
    known = {s.index: s for s in shapes}
    bad = [i for i in idx if i not in known]
    if bad:
        raise ValueError(f"--layers {layers!r}: {bad} are not recurrent layers of this model; its "
                         f"recurrent layers are {', '.join(f'{s.index} ({s.name})' for s in shapes)}")
    if len(set(idx)) != len(idx):
        raise ValueError(f"--layers {layers!r}: a layer is given twice")
    return [known[i] for i in idx]


def sensitivity_variants(pairs, shapes, buffer_len: int | None = None) -> list[dict]:
    """[{"variant", "pair": name, "layer": index or None for all layers}] for each pair."""
    if not pairs:
        raise ValueError("give at least one --pair")
    out, seen = [], set()
    for spec in pairs:
        p = resolve_pair(spec)
        if not isinstance(p, PrecisionPair):
            raise ValueError(f"--pair {spec}: sensitivity measures one pair on one layer at a time; "
                             f"give a precision pair, not a layer policy")
        if buffer_len is not None:
            p = p.with_buffer_len(buffer_len)
        name = clean_name(p.label())
        if name in seen:
            raise ValueError(f"--pair {spec}: pair {name} is given twice")
        seen.add(name)
        p = PrecisionPair(p.read, p.anchor, p.buffer_len, name, p.description)
        for s in shapes:
            out.append({"variant": LayerPolicy(EXACT, (Override(p, (s.index,), None),),
                                               f"{name}@layer{s.index}"),
                        "pair": name, "layer": s.index, "record": p.to_dict()})
        out.append({"variant": PrecisionPair(p.read, p.anchor, p.buffer_len, f"{name}@all",
                                             p.description),
                    "pair": name, "layer": None, "record": p.to_dict()})
    return out


def default_out(model: str, names: list[str], context: int) -> Path:
    return Path("build/sensitivity") / f"{clean_name(Path(model).name)}_{'+'.join(names)}_ctx{context}.json"


def sensitivity_command(model: str, pairs: list, settings: KLSettings | None = None, *,
                        buffer_len: int | None = None, layers=None, per_pass: int = 0,
                        out: str | None = None, plot: bool = True) -> dict | None:
    """Everything `replayquant sensitivity` does; returns the sensitivity dict (None on ranks > 0).
    Its KL runs take `settings` (default: KLSettings()) whole
    (`replayquant.kl.command.kl_command`)."""
    if buffer_len is not None and (isinstance(buffer_len, bool) or not isinstance(buffer_len, int)
                                   or buffer_len < 1):
        raise ValueError(f"--buffer-len must be an integer >= 1, got {buffer_len!r}")
    if isinstance(per_pass, bool) or not isinstance(per_pass, int) or per_pass < 0:
        raise ValueError(f"--per-pass must be an integer >= 0 (0: every variant in one pass), got "
                         f"{per_pass!r}")
    check_out_given(out)
    settings = settings or KLSettings()
    settings.check()
    shapes, *_ = shapes_of_model(model, settings.revision)
    chosen = _parse_layers(layers, shapes)
    variants = sensitivity_variants(pairs, chosen, buffer_len)
    names = list(dict.fromkeys(v["pair"] for v in variants))
    out_path = check_results_out(out if out is not None else
                                 default_out(model, names, settings.context))
    n = per_pass or len(variants)
    chunks = [variants[i:i + n] for i in range(0, len(variants), n)]
    kl_paths = [kl_file_for(out_path, k if len(chunks) > 1 else None) for k in range(1, len(chunks) + 1)]
    png = out_path.with_suffix(".png")
    with output_lock(out_path):
        # the same pairs, layers and passes replace their own file (the KL runs resume); anything
        # else at --out is refused before any work
        check_owned(out_path, SENS_KIND, "replayquant sensitivity",
                    identity=_run_record(names, variants, chosen, per_pass), recorded=_recorded_run,
                    beside=(png,), fresh=(png, *(f"{p.with_suffix('')}.*" for p in kl_paths)))
        passes = _Passes(names, variants, shapes, chosen, chunks, kl_paths)
        sens = _measure(model, pairs, settings, buffer_len, per_pass, passes)
        if sens is None:
            return None
        write_json(out_path, sens)
        if plot:
            plot_sensitivity(sens, png)
    print_sensitivity(sens)
    Console(stderr=True).print(f"wrote {out_path} and {png}")
    return sens


def _run_record(names, variants, chosen, per_pass) -> dict:
    """What makes a sensitivity file the same run (beside its KL runs' configuration, which the
    KL runs check): its pairs, its layers and how the variants are split into passes."""
    return {"pairs": [next(v["record"] for v in variants if v["pair"] == nm) for nm in names],
            "layers": [s.index for s in chosen], "per_pass": per_pass}


def _recorded_run(old: dict) -> dict:
    return {"pairs": old["pairs"], "layers": old["settings"]["layers"],
            "per_pass": old["settings"]["per_pass"]}


def absolute_kl_args(model: str, kl_args: dict) -> dict:
    """The model and the KL options as a results file records them: a local model folder, a local
    dataset and the data files of a `datasets` builder by their absolute paths (relative ones
    would name other files from another working folder); short names, hub ids and patterns
    inside a dataset stay as given."""
    # transformers: reading results does not load it
    from replayquant.kl.data import builder_names
    from replayquant.models.names import resolve_model_name
    out = {"model": model, **{k: v for k, v in kl_args.items() if k != "progress"}}
    local = os.path.expanduser(model)
    if os.path.isdir(local) and resolve_model_name(model) == local:     # a folder, not a short name
        out["model"] = os.path.realpath(local)
    ds = out.get("dataset")
    if isinstance(ds, str) and os.path.exists(os.path.expanduser(ds)):
        out["dataset"] = str(Path(os.path.expanduser(ds)).resolve())
    elif ds in builder_names() and out.get("data_files"):
        files = [out["data_files"]] if isinstance(out["data_files"], str) else out["data_files"]
        out["data_files"] = [_absolute_pattern(f) for f in files]
    return out


def _absolute_pattern(item: str) -> str:
    """A --data-files value (PATTERN or SPLIT=PATTERN, as `kl.data.parse_data_files` reads it)
    with its pattern made absolute."""
    key, sep, pat = str(item).partition("=")
    if sep and key and "/" not in key and os.sep not in key and not Path(item).exists():
        return f"{key}={os.path.abspath(os.path.expanduser(pat))}"
    return os.path.abspath(os.path.expanduser(str(item)))


def _same_run_inputs(results: list[dict]) -> None:
    """One ValueError when the KL runs of one sensitivity file measured other models or other
    documents (a model or a dataset changed between its passes)."""
    first = results[0]["config"]["model"], results[0]["provenance"]["dataset"]
    for res in results[1:]:
        why = model_mismatch(first[0], res["config"]["model"])
        if why:
            raise ValueError(f"the passes of this sensitivity run measured two models, "
                             f"{describe_model(first[0])} and "
                             f"{describe_model(res['config']['model'])} ({why}); the model changed "
                             f"while it ran: run it again into a new --out")
        data = res["provenance"]["dataset"]
        if data.get("tokens_sha256") != first[1].get("tokens_sha256"):
            raise ValueError(f"the passes of this sensitivity run measured other documents of "
                             f"{first[1].get('source')} (tokens sha256 "
                             f"{first[1].get('tokens_sha256')} and {data.get('tokens_sha256')}); "
                             f"the data changed while it ran: run it again into a new --out")


@dataclasses.dataclass
class _Passes:
    """The variants of a sensitivity run and its KL passes: the pairs' names, every variant, the
    model's recurrent layers and those measured, the variants of each pass and its KL file."""
    names: list[str]
    variants: list[dict]
    shapes: list
    chosen: list
    chunks: list[list[dict]]
    kl_paths: list[Path]


def _measure(model, pairs, settings: KLSettings, buffer_len, per_pass,
             passes: _Passes) -> dict | None:
    """The KL runs of the variants and the sensitivity record (None on ranks > 0)."""
    from replayquant.kl.command import kl_command   # transformers: reading results does not load it
    names, variants, shapes, chosen = passes.names, passes.variants, passes.shapes, passes.chosen
    stats, kl_files, done = {}, [], []
    for chunk, kl_path in zip(passes.chunks, passes.kl_paths):
        res = kl_command(model, [v["variant"] for v in chunk], settings, out=str(kl_path))
        if res is None:
            return None
        stats.update(res["results"])
        kl_files.append(kl_path.name)
        done.append(res)
    _same_run_inputs(done)
    last = done[-1]
    per_layer, all_layers, cmp = {}, {}, {}
    for name in names:
        rows = []
        for v in variants:
            if v["pair"] == name and v["layer"] is not None:
                s = next(x for x in chosen if x.index == v["layer"])
                rows.append({"index": s.index, "name": s.name, "kl": kl_figures(stats[v["variant"].name])})
        for rank, r in enumerate(sorted(rows, key=lambda r: -r["kl"]["kl_mean"]), start=1):
            r["rank"] = rank
        per_layer[name] = rows
        all_layers[name] = kl_figures(stats[f"{name}@all"])
        total = sum(r["kl"]["kl_mean"] for r in rows)
        cmp[name] = {"sum": total, "all": all_layers[name]["kl_mean"],
                     "ratio": total / all_layers[name]["kl_mean"] if all_layers[name]["kl_mean"] else None,
                     "layers_measured": len(rows), "layers_in_model": len(shapes)}
    kl_args_rec = absolute_kl_args(model, dataclasses.asdict(settings))
    sens = {
        "kind": SENS_KIND, "version": 1,
        "complete": bool(last.get("complete")), "documents_done": last.get("documents_done"),
        "model": last["config"]["model"], "data": last["provenance"]["dataset"],
        "settings": {"model_arg": model, "pairs": [str(p) for p in pairs], "buffer_len": buffer_len,
                     "layers": [s.index for s in chosen], "per_pass": per_pass, **kl_args_rec},
        "kl_args": kl_args_rec,
        "layers": [s.to_dict() for s in shapes],
        "pairs": [next(v["record"] for v in variants if v["pair"] == nm) for nm in names],
        "per_layer": per_layer, "all_layers": all_layers, "sum_vs_all": cmp,
        "kl_results": kl_files,
        "provenance": provenance(kl_results=kl_files, kl_git_commit=last.get("provenance", {})
                                 .get("git_commit"), **kl_args_rec),
    }
    return sens


def print_sensitivity(sens: dict, console=None) -> None:
    console = console or Console(width=max(Console().width, 100))
    for name, rows in sens["per_layer"].items():
        c = sens["sum_vs_all"][name]
        t = Table(title=f"{name}: KL with only one layer holding the pair (others exact FP32), "
                        f"ranked", title_justify="left")
        for col in ("rank", "layer", "module", "KL mean", "± unc", "share of sum %", "top-1 %"):
            t.add_column(col, justify="left" if col == "module" else "right", no_wrap=True)
        for r in sorted(rows, key=lambda r: r["rank"]):
            k = r["kl"]
            t.add_row(str(r["rank"]), str(r["index"]), r["name"], f"{k['kl_mean']:.3g}",
                      f"{k['kl_unc']:.2g}",
                      f"{100 * k['kl_mean'] / c['sum']:.1f}" if c["sum"] else "-",
                      "-" if k.get("same_top") is None else f"{100 * k['same_top']:.1f}")
        console.print(t)
        console.print(f"sum of the single-layer KLs {c['sum']:.3g} vs all {c['layers_in_model']} layers "
                      f"at once {c['all']:.3g}" + ("" if c["ratio"] is None else
                                                  f" (sum / all = {c['ratio']:.2f})"), soft_wrap=True)
