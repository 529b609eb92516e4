"""Measured decode-kernel times for a sweep variant, from a kernels grid (`replayquant bench
kernels`, e.g. results/bench/kernels.json).

The grid times one layer of one shape per kind (its provenance's `shapes`: the Qwen3.5-4B GDN
layer, the Nemotron-H Mamba-2 layer, the Kimi-Linear-48B KDA layer) at a few batches. For each recurrent layer of the swept
model the time of the bench's layer of the same kind is taken (the nearest measured shape; the
times are not scaled to the model's own shape, and the record says which shape was timed), for
the same pair formats and L at the measured batch nearest to the one asked for (on a log
scale), and summed over the model's layers: microseconds per decode step of the whole batch.

Which row: the mean step over a window of L steps (one flush per row, rows in phase:
`replay-window`) for the replay pairs; the conventional step (`conventional`, fp32) for the FP32
baseline and for layers a policy keeps `exact`. Where the grid did not time that row (the
`targets` preset times each kind at its main L only), the time is None and `missing` says which
row is absent: a time of another L, batch row or pair is never put in its place. A kind the grid
has no shape for, or no replay rows of (a grid run without KDA), has no replay time either, and
`missing` names the kind: a GDN time is not taken for a KDA layer, whose gate is d_k wide.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from replayquant.pairs import PrecisionPair

from .common import pair_formats

__all__ = ["load_kernels", "variant_us", "conventional_us", "kernels_record"]

WINDOW_KERNELS = ("replay-window",)


# --kernels short name of the grid measured on one NVIDIA H200 that ships with replayquant
# (results/bench/kernels.json of the source tree; package data replayquant/data/kernels_h200.json)
SHIPPED_KERNELS = {"h200": Path(__file__).resolve().parents[1] / "data" / "kernels_h200.json"}


def load_kernels(path) -> dict:
    """A kernels grid (a file, or a name of SHIPPED_KERNELS where no file of that name exists):
    its rows, shapes and provenance; one ValueError for anything else."""
    p = Path(path)
    if str(path) in SHIPPED_KERNELS and not p.exists():
        p = SHIPPED_KERNELS[str(path)]
    if not p.is_file():
        raise ValueError(f"--kernels {path}: no such file (give the kernels.json that "
                         f"`replayquant bench kernels` writes, e.g. results/bench/kernels.json, "
                         f"or h200 for the grid measured on an H200 that ships with replayquant)")
    try:
        obj = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--kernels {path}: not JSON ({e})") from None
    shapes = (obj.get("provenance") or {}).get("shapes") if isinstance(obj, dict) else None
    if not isinstance(obj, dict) or not isinstance(obj.get("rows"), list) or not shapes:
        raise ValueError(f"--kernels {path}: not a kernels grid (no rows and provenance.shapes); "
                         f"give the kernels.json that `replayquant bench kernels` writes")
    return obj


def _bench_pairs(rows) -> dict:
    """{shipped pair name in the grid: its formats}."""
    out = {}
    for name in sorted({r["variant"] for r in rows if r.get("kernel") in WINDOW_KERNELS}):
        try:
            out[name] = pair_formats(PrecisionPair.load(name))
        except ValueError:
            continue            # a pair the grid timed that this installation does not ship
    return out


def _nearest_batch(batches, batch: int) -> int:
    return min(batches, key=lambda b: (abs(math.log(b) - math.log(batch)), -b))


def _window_row(kern, kind, pair, L, batch):
    """(the grid's window row for one layer kind, pair formats and L at the nearest batch, or
    None; what was looked for)."""
    rows = kern["rows"]
    fm = pair_formats(pair)
    names = [n for n, f in _bench_pairs(rows).items() if f == fm]
    cand = [r for r in rows if r.get("kind") == kind and r.get("kernel") in WINDOW_KERNELS
            and r.get("variant") in names and r.get("L") == L and r.get("us")]
    if not any(r.get("kind") == kind and r.get("kernel") in WINDOW_KERNELS for r in rows):
        return None, f"{pair.label()} (the grid has no replay rows of the kind)"
    if not names:
        return None, f"{pair.label()} (no pair with its formats in the grid)"
    if not cand:
        return None, f"{pair.label()} L={L} (not in the grid)"
    B = _nearest_batch(sorted({r["B"] for r in cand}), batch)
    return next(r for r in cand if r["B"] == B), ""


def _conv_row(kern, kind, batch):
    cand = [r for r in kern["rows"] if r.get("kind") == kind and r.get("kernel") == "conventional"
            and r.get("variant") == "fp32" and r.get("us")]
    if not cand:
        return None
    B = _nearest_batch(sorted({r["B"] for r in cand}), batch)
    return next(r for r in cand if r["B"] == B)


def _summed(parts, kern, batch, shapes_used) -> dict:
    missing = [p for p in parts if p["row"] is None]
    groups = {}
    for p in parts:
        if p["row"] is None:
            continue
        r = p["row"]
        key = (p["kind"], r["kernel"], r["variant"], r.get("L"), r["B"])
        g = groups.setdefault(key, {"kind": p["kind"], "kernel": r["kernel"], "bench_pair": r["variant"],
                                    "L": r.get("L"), "B": r["B"], "us_per_layer": r["us"], "layers": 0,
                                    "bench_shape": kern["provenance"]["shapes"][p["kind"]]})
        g["layers"] += 1
    rec = {"batch_requested": batch, "parts": list(groups.values()),
           "model_shapes": sorted(shapes_used), "scaled_to_model_shape": False}
    if missing:
        rec["us_per_step"] = None
        rec["missing"] = sorted({f"{p['kind']} {p['what']}" for p in missing})
    else:
        rec["us_per_step"] = sum(g["us_per_layer"] * g["layers"] for g in groups.values())
        Bs = sorted({g["B"] for g in groups.values()})
        rec["batch"] = Bs[0] if len(Bs) == 1 else Bs
    return rec


def variant_us(kern: dict, layer_pairs, batch: int) -> dict:
    """Measured microseconds per decode step of a batch for a model whose layers hold
    `layer_pairs`: [(LayerShape, PrecisionPair or None for the FP32 conventional step)]."""
    parts, shapes_used = [], set()
    for shape, pair in layer_pairs:
        if shape.kind not in kern["provenance"]["shapes"]:
            parts.append({"kind": shape.kind, "row": None, "what": "(kind not in the grid)"})
            continue
        shapes_used.add(f"{shape.kind} H={shape.H} HK={shape.HK} dv={shape.dv} dk={shape.dk}")
        if pair is None:
            parts.append({"kind": shape.kind, "row": _conv_row(kern, shape.kind, batch),
                          "what": "conventional fp32"})
        else:
            row, what = _window_row(kern, shape.kind, pair, pair.buffer_len, batch)
            parts.append({"kind": shape.kind, "row": row, "what": what})
    return _summed(parts, kern, batch, shapes_used)


def conventional_us(kern: dict, shapes, batch: int) -> dict:
    """Measured microseconds per decode step of the FP32 conventional step, all layers."""
    return variant_us(kern, [(s, None) for s in shapes], batch)


def kernels_record(kern: dict, path) -> dict:
    prov = kern.get("provenance", {})
    return {"file": str(path), "git_commit": prov.get("git_commit"), "device": prov.get("device"),
            "date": prov.get("date"), "shapes": prov.get("shapes"), "batches": prov.get("batches"),
            "L": prov.get("L"), "pairs": prov.get("pairs")}
