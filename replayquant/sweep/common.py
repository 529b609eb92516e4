"""Pieces the sweep, sensitivity and recommend commands share."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from replayquant.kl.stats import KL_ZERO_SE, kl_vs_zero
from replayquant.outputs import check_writable_folder, parse_json, write_json
from replayquant.pairs import tidy_name as clean_name
from replayquant.policy import check_recorded

__all__ = ["kl_bound", "kl_figures", "kl_problem", "load_json_kind", "check_structure", "REAL",
           "SIZE", "POSITIVE", "shapes_of_model", "fmt_bytes", "pair_formats",
           "clean_name", "write_json", "check_results_out", "kl_file_for", "KL_FIGURES",
           "front_kl", "pareto_front", "check_budget"]

# the KL statistics a sweep / sensitivity file keeps per variant (the KL run's file has them all)
KL_FIGURES = ("n_tokens", "n_documents", "kl_mean", "kl_mean_unc", "kl_mean_unc_docs", "kl_median",
              "kl_max", "same_top", "same_top_unc", "ppl_ratio", "ppl_ratio_unc", "ln_ppl_ratio",
              "ln_ppl_ratio_unc", "dp_rms")


def kl_bound(stats: dict) -> tuple[float, float, float]:
    """(mean, uncertainty, upper bound) of a variant's mean KL. The uncertainty is the larger of
    the token-level one (tokens taken as independent, as llama.cpp does) and the standard error
    over documents (where there are two or more): the token-level figure alone is too small for
    long documents whose tokens are correlated. Budgets compare the upper bound."""
    mean = float(stats["kl_mean"])
    uncs = [stats.get("kl_mean_unc"), stats.get("kl_mean_unc_docs")]
    unc = max((float(u) for u in uncs if u is not None and math.isfinite(float(u))), default=0.0)
    return mean, unc, mean + unc


def kl_figures(stats: dict) -> dict:
    """The headline KL statistics of one variant plus its uncertainty and upper bound."""
    out = {k: stats.get(k) for k in KL_FIGURES}
    mean, unc, upper = kl_bound(stats)
    out.update(kl_unc=unc, kl_upper=upper)
    return out


def kl_problem(figures: dict) -> str | None:
    """Why a variant's KL figures cannot meet any budget, or None when they can: a mean or
    upper bound that is not a finite number (NaN from a diverged run, infinity), or a mean below
    zero beyond its uncertainty (`kl.stats.kl_vs_zero`: more than KL_ZERO_SE standard errors;
    a KL is never negative). A mean below zero within that band is float noise around an exact
    variant: it counts, as 0 (`front_kl`). The uncertainty is `kl_unc` (`kl_figures`), or the
    upper bound less the mean where a record has no `kl_unc`."""
    vals = {k: figures.get(k) for k in ("kl_mean", "kl_upper")}
    for k, v in vals.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return f"{k} {v!r} is not a finite number"
    mean, unc = vals["kl_mean"], _kl_unc(figures)
    if kl_vs_zero(mean, unc) < 0:
        return (f"kl_mean {mean:.3g} is below zero by more than {KL_ZERO_SE:g} times its "
                f"uncertainty {unc:.2g} (a KL is never negative: the run or the file is wrong)")
    return None


def _kl_unc(figures: dict) -> float:
    """The uncertainty of a record's mean KL: kl_unc, else kl_upper - kl_mean (0 where neither
    is a finite number >= 0)."""
    unc = figures.get("kl_unc")
    if isinstance(unc, bool) or not isinstance(unc, (int, float)):
        unc = figures["kl_upper"] - figures["kl_mean"]
    return unc if math.isfinite(unc) and unc >= 0 else 0.0


class _Real:
    """Schema marker: a JSON number (NaN and infinity included; bools are not numbers)."""
    what = "a number"

    def ok(self, v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Size(_Real):
    """Schema marker: a finite number >= 0 (bytes, counts)."""
    what = "a finite number >= 0"

    def ok(self, v):
        return super().ok(v) and math.isfinite(v) and v >= 0


class _Positive(_Real):
    """Schema marker: a finite number > 0 (a ratio of two byte counts)."""
    what = "a finite number > 0"

    def ok(self, v):
        return super().ok(v) and math.isfinite(v) and v > 0


REAL, SIZE, POSITIVE = _Real(), _Size(), _Positive()


def check_structure(obj, schema, source: str, writer: str, where: str = "") -> None:
    """One ValueError naming the file and the first place where `obj` (a parsed results file)
    does not have the structure `schema` describes, so that a damaged file stops at load and not
    in a KeyError deep in a command. A schema is a type (or tuple of types) the value must be,
    REAL / SIZE, a dict {key: schema} (the value a mapping holding those keys; a key ending in
    "?" may be missing or null), or a one-element list [schema] (a list whose items match;
    [schema, ...] the same, and not empty)."""
    def fail(what):
        got = repr(obj)
        got = got if len(got) <= 60 else got[:57] + "..."
        raise ValueError(f"{source}: {where or 'the file'} should be {what}, got {got}; the file "
                         f"is damaged or was not written by `{writer}`: run it again")
    if isinstance(schema, _Real):
        if not schema.ok(obj):
            fail(schema.what)
    elif isinstance(schema, dict):
        if not isinstance(obj, dict):
            fail("a mapping")
        for key, sub in schema.items():
            optional = key.endswith("?")
            key = key.rstrip("?")
            at = f"{where}.{key}" if where else key
            if optional and obj.get(key) is None:
                continue
            if key not in obj:
                raise ValueError(f"{source}: {at} is missing; the file is damaged or was not "
                                 f"written by `{writer}`: run it again")
            check_structure(obj[key], sub, source, writer, at)
    elif isinstance(schema, list):
        if not isinstance(obj, list):
            fail("a list")
        if len(schema) > 1 and not obj:
            fail("a non-empty list")
        for i, item in enumerate(obj):
            check_structure(item, schema[0], source, writer, f"{where}[{i}]")
    elif not isinstance(obj, schema) or (isinstance(obj, bool) and schema is not bool):
        names = schema if isinstance(schema, tuple) else (schema,)
        fail(" or ".join({str: "a string", int: "an integer", bool: "true or false",
                          dict: "a mapping", list: "a list"}.get(t, t.__name__) for t in names))


def load_json_kind(path, kind: str, writer: str) -> dict:
    """A results file of `kind`, with one ValueError naming the command that writes it, whose
    pair and policy records hold what their names say (`policy.check_recorded`)."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{path} is a folder; give the JSON file that `{writer}` writes")
    if not p.is_file():
        raise ValueError(f"{path}: no such file (give the JSON that `{writer}` writes)")
    try:
        obj = parse_json(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file ({e}); give the JSON that `{writer}` writes") from None
    if not isinstance(obj, dict) or obj.get("kind") != kind:
        got = obj.get("kind") if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{path}: not a {kind} file (kind {got!r}); give the JSON that "
                         f"`{writer}` writes")
    check_recorded(obj, path)
    return obj


def shapes_of_model(model: str, revision: str | None = None):
    """(LayerShapes of the recurrent layers, meta model, tokenizer, config, resolved name) of a
    model without loading its weights (`models.shapes.config_shapes`); one ValueError for a model without
    a recurrent layer."""
    # transformers: reading results does not load it
    from replayquant.kl.command import load_tokenizer_and_config
    from replayquant.models.families import KIND_NAMES
    tok, cfg, resolved = load_tokenizer_and_config(model, revision)
    # transformers: reading results does not load it
    from replayquant.models.shapes import config_shapes
    shapes, meta = config_shapes(cfg)
    if not shapes:
        raise ValueError(f"{model}: the model has no recurrent layer replayquant can patch "
                         f"({', '.join(KIND_NAMES.values())}); there is no recurrent state to sweep")
    return shapes, meta, tok, cfg, resolved


def fmt_bytes(b) -> str:
    """Bytes with a binary prefix (B, KiB, MiB, GiB)."""
    if b is None:
        return "-"
    b = float(b)
    for unit, div in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(b) >= div:
            x = b / div
            return f"{x:.3g} {unit}" if abs(x) < 1000 else f"{x:.0f} {unit}"   # 1020 KiB, not 1.02e+03
    return f"{b:.0f} B"


def pair_formats(pair) -> tuple:
    """What a pair stores, without its name and L: ((read format, rounding) or None, (anchor
    format, rounding))."""
    r = None if pair.read is None else (pair.read.format, pair.read.rounding)
    return r, (pair.anchor.format, pair.anchor.rounding)


def kl_file_for(out: Path, k: int | None = None) -> Path:
    """Where the KL run of a sweep / sensitivity file NAME.json writes: NAME_kl.json (pass k:
    NAME_klK.json)."""
    return out.with_name(f"{out.stem}_kl{'' if k is None else k}.json")


def check_results_out(out) -> Path:
    """A sweep / sensitivity / recommendation file's path, checked before any work: NAME.json
    (its plot, policy and KL run's files go beside it), not a folder, in a folder that can be
    written (created if missing)."""
    p = Path(os.path.expanduser(str(out)))
    if p.suffix.lower() != ".json":
        raise ValueError(f"--out {out}: the results file must end in .json (NAME.png and the KL "
                         f"run's NAME_kl.* go beside it); give e.g. --out {p.with_suffix('.json')}")
    if p.is_dir():
        raise ValueError(f"--out {out} is a folder; give a file name, e.g. --out {p / 'results.json'}")
    if p.exists() and not p.is_file():
        raise ValueError(f"--out {out} exists and is not a regular file; give another --out")
    check_writable_folder(p.parent, out)
    return p


def front_kl(mean: float, unc: float = 0.0) -> float:
    """The KL a variant has on the front: 0 where the mean is compatible with zero
    (`kl.stats.kl_vs_zero`: within KL_ZERO_SE standard errors, float noise around an exact pair
    such as the shared FP32 one, whose mean can come out negative), else the mean."""
    return 0.0 if kl_vs_zero(mean, unc) == 0 else mean


def pareto_front(points) -> list[str]:
    """Names on the front of (name, bytes, KL mean[, KL uncertainty]): no other point has fewer
    or equal bytes and a lower KL (`front_kl`: noise-level KLs count as 0, so noise does not put
    a costlier exact variant on the front). A KL that fits no budget (`kl_problem`: NaN,
    infinite, below zero beyond its uncertainty) is on no front. In bytes order."""
    front, best = [], float("inf")
    pts = [(p[0], p[1], front_kl(p[2], p[3] if len(p) > 3 else 0.0)) for p in points
           if kl_problem({"kl_mean": p[2], "kl_unc": p[3] if len(p) > 3 else 0.0,
                          "kl_upper": p[2] + (p[3] if len(p) > 3 else 0.0)}) is None]
    for name, b, kl in sorted(pts, key=lambda t: (t[1], t[2])):
        if kl < best:
            front.append(name)
            best = kl
    return front


def check_budget(name, v, zero_ok=False):
    """A budget option (--kl-budget, --max-bytes, ...): None, or a finite number above zero (at
    or above with zero_ok); one ValueError naming the option otherwise."""
    if v is None:
        return
    try:
        ok = math.isfinite(float(v)) and (float(v) >= 0 if zero_ok else float(v) > 0)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a {'non-negative' if zero_ok else 'positive'} number, "
                         f"got {v!r}")
