"""Acceptance as a constraint of `replayquant recommend --spec SPEC.json --min-accept X`.

A sweep variant (a pair at a buffer length L) is considered only where the spec run measured
that pair at that L on the sweep's model and its speculative decode accepted at least X drafts
per verify round with drafts (`report.method_summary`'s mean_accepted; of prompt lookup where the
run measured it, else of the assistant model). The others are left out before the budgets are
applied, and listed with their acceptance (None: not measured).
"""

from __future__ import annotations

import math

from replayquant.outputs import parse_json
from replayquant.provenance import describe_model, model_mismatch

from .command import SPEC_KIND


def load_spec(path) -> dict:
    """A complete `replayquant spec` results file, or one ValueError naming it."""
    try:
        with open(path, encoding="utf-8") as fh:
            spec = parse_json(fh.read())
    except (OSError, ValueError) as e:
        raise ValueError(f"--spec {path}: cannot be read as JSON ({e}); give the results file "
                         f"`replayquant spec` writes") from None
    if not isinstance(spec, dict) or spec.get("kind") != SPEC_KIND:
        raise ValueError(f"--spec {path} is not a `replayquant spec` results file (kind "
                         f"{spec.get('kind') if isinstance(spec, dict) else None!r})")
    if not spec.get("complete"):
        raise ValueError(f"--spec {path} is not complete: run the same `replayquant spec` "
                         f"command again, it resumes")
    return spec


def acceptance(spec: dict) -> dict[tuple[str, int], float | None]:
    """(pair name without its @L suffix, L) -> drafts accepted per verify round."""
    cfg = spec["config"]
    method = "lookup" if "lookup" in cfg["methods"] else cfg["methods"][0]
    return {(p["name"].split("@")[0], int(p["buffer_len"])):
            spec["results"][p["name"]][method]["mean_accepted"] for p in cfg["pairs"]}


def accepting_variants(sweep: dict, spec: dict, min_accept: float, sources=("", "")):
    """(the sweep with only its variants that accept at least `min_accept` drafts per round,
    {left-out variant: its acceptance, None where the spec run did not measure it}); one
    ValueError where the two files measured other models or `min_accept` is no number >= 0."""
    if isinstance(min_accept, bool) or not isinstance(min_accept, (int, float)) \
            or not math.isfinite(min_accept) or min_accept < 0:
        raise ValueError(f"--min-accept must be a number >= 0 (drafts accepted per verify "
                         f"round), got {min_accept!r}")
    why = model_mismatch(sweep.get("model") or {}, spec["config"]["model"])
    if why:
        names = (sources[0] or "the sweep", sources[1] or "the spec run")
        raise ValueError(f"{names[0]} measured {describe_model(sweep.get('model') or {})}, "
                         f"{names[1]} {describe_model(spec['config']['model'])} ({why}): give "
                         f"a spec run of the sweep's model")
    acc = acceptance(spec)
    keep, out = [], {}
    for v in sweep["variants"]:
        a = acc.get((v["base"], int(v["buffer_len"])))
        if a is not None and a >= min_accept:
            keep.append(v)
        else:
            out[v["name"]] = a
    return dict(sweep, variants=keep), out
