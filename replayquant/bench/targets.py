"""The decode kernels' targets, computed from the rows of one `bench kernels` run (ratios of
rows of that run): each an entry {name, target, measured, unit, met, floor_us, detail}. A target
whose rows the run did not measure has met None and a `reason`.

Byte floors: the bytes a step must move (replayquant.statebytes, the count of our rows' `bytes`)
at the copy bandwidth measured in the same run. At 4218 GB/s and B = 256 that count gives GDN
(32 heads 128x128, L = 16) s32_rs 144 us, tp8_hi32 58 us, tp4_hi32 43 us and Mamba-2 (128 heads
64x128, L = 8) 296 / 139 / 109 us. Rounder counts of the state and ring alone read 141 / 59 / 44
and 288 / 140 / 109: the byte model also counts each step's inputs and FP32 output (about 2 us
for GDN, 8 us for Mamba-2 at B = 256) and the read copy written at the flush, and it keeps a
16-byte ring entry's G and beta in fp32 where a rounder count folds them.
"""

from __future__ import annotations

import ast
from pathlib import Path

from replayquant.statebytes import replay_window_bytes

MAIN_L = {"gdn": 16, "mamba2": 8}
PAIRS = ("s32_rs", "tp8_hi32", "tp4_hi32")
SMALL_B = (1, 8)
OTHER_B = (1, 8, 32, 128, 512)
# window times at B = 256 (us): the tp4_hi32 / tp8_hi32 targets
WINDOW_US = {"gdn": {"tp4_hi32": 80.0, "tp8_hi32": 95.0},
             "mamba2": {"tp4_hi32": 180.0, "tp8_hi32": 210.0}}
ANCHOR_TOL = 1e-5           # relative Frobenius error of an FP32 anchor after three windows
# outputs between flushes carry the ring's bf16 rounding (k, v; u beside a read copy): one bf16
# unit roundoff
BF16_RING_BOUND = 2.0 ** -8
LINE_BUDGET = 1500
_FORMATS = {"s32_rs": ("fp32", None), "tp8_hi32": ("fp32", "fp8"), "tp4_hi32": ("fp32", "nvfp4")}


def _rows(rows, **kv):
    return [r for r in rows if all(r.get(k) == v for k, v in kv.items())]


def _us(rows, **kv):
    m = _rows(rows, **kv)
    return m[0]["us"] if m else None


def _floor_us(kind, pair, B, S, bw):
    if not bw or kind not in S:
        return None
    af, rf = _FORMATS[pair]
    s = S[kind]
    return replay_window_bytes(kind, af, rf, MAIN_L[kind], B, s["H"], s["HK"], s["dv"],
                               s["dk"]) / bw / 1e3


def _entry(name, target, unit, measured=None, met=None, detail=None, floor_us=None,
           reason=None):
    e = dict(name=name, target=target, measured=measured, unit=unit, met=met, detail=detail or {})
    if floor_us is not None:
        e["floor_us"] = round(floor_us, 1)
    if measured is None:
        e["met"] = None
        e["reason"] = reason or "not measured in this run"
    return e


def _ratio_entry(name, target, pairs_of_us, need, reason):
    """An entry whose measured value is the smallest ratio baseline / ours over `pairs_of_us`
    {label: (baseline us, our us)}; labels with either side missing count as unmeasured."""
    detail, ratios, missing = {}, [], []
    for label, (base, ours) in pairs_of_us.items():
        if base is None or ours is None:
            missing.append(label)
            continue
        x = base / ours
        ratios.append(x)
        detail[label] = {"baseline_us": round(base, 2), "ours_us": round(ours, 2),
                         "ratio": round(x, 3)}
    if missing:
        detail["not_measured"] = missing
    if not ratios:
        return _entry(name, target, "x", detail=detail, reason=reason)
    m = min(ratios)
    e = _entry(name, target, "x", round(m, 3), m >= need, detail)
    if missing and m >= need:           # met where measured: the rest cannot be told
        e["met"] = None
        e["reason"] = "measured only in part: " + ", ".join(missing)
    return e


def kernel_lines() -> dict:
    """Lines of the decode, verify and conventional kernels with their launch code: the three
    modules less their torch references (functions and classes whose name ends in '_ref' or
    holds '_ref_'), blank lines and comments counted as the file has them. The stored roles and
    their casts in registers (kernels/roles.py, shared with the chunk kernel), the format
    codecs (kernels/quant.py) and the stores with their input checks (kernels/stores.py, shared
    with the references) are not counted: the target's detail gives stores.py's lines beside
    them."""
    root = Path(__file__).resolve().parents[1] / "kernels"
    out = {}
    for name in ("replay_decode.py", "verify.py", "conventional.py"):
        p = root / name
        if not p.is_file():
            continue
        src = p.read_text()
        n = len(src.splitlines())
        for node in ast.parse(src).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and \
                    (node.name.endswith("_ref") or "_ref_" in node.name):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                n -= node.end_lineno - start + 1
        out[name] = n
    return out


def targets(res) -> list:
    """Every target of the decode kernels, from the rows (and accuracy) of `res`."""
    rows = res.get("rows", [])
    bw = res.get("copy_GBps")
    S = (res.get("provenance") or {}).get("shapes") or {}
    acc = res.get("accuracy") or {}
    authors = (res.get("provenance") or {}).get("authors")
    no_auth = ("the authors' kernels were not measured (run with --authors PATH)" if not authors
               else "the authors' rows are missing at this batch")
    out = []
    for kind in ("gdn", "mamba2"):
        L = MAIN_L[kind]
        label = "GDN" if kind == "gdn" else "Mamba-2"
        win = lambda pair, B, stag=False: _us(rows, kind=kind, B=B, L=L, variant=pair,  # noqa: E731
                                              kernel="replay-window-staggered" if stag
                                              else "replay-window")
        auth = lambda B, stag=False: _us(rows, kind=kind, B=B, L=L, variant="fp32",  # noqa: E731
                                         kernel="authors-staggered" if stag else "authors")
        conv = lambda B: _us(rows, kind=kind, B=B, kernel="conventional", variant="fp32")  # noqa: E731
        cap = {"gdn": 153, "mamba2": 324}[kind]
        e = _ratio_entry(f"{kind}/s32_rs-vs-authors-B256",
                         f"{label} s32_rs window at least 1.05x the authors' FP32 kernel at "
                         f"B = 256, in phase and staggered (about <= {cap} us)",
                         {"in phase": (auth(256), win("s32_rs", 256)),
                          "staggered": (auth(256, True), win("s32_rs", 256, True))}, 1.05, no_auth)
        fl = _floor_us(kind, "s32_rs", 256, S, bw)
        if fl is not None:
            e["floor_us"] = round(fl, 1)
        out.append(e)
        out.append(_ratio_entry(
            f"{kind}/s32_rs-vs-authors-other-B",
            f"{label} s32_rs window at least 1.0x the authors' at B = 1, 8, 32, 128, 512",
            {f"B={B}": (auth(B), win("s32_rs", B)) for B in OTHER_B}, 1.0, no_auth))
        conv_big = {f"{p} B={B}": (conv(B), win(p, B)) for p in PAIRS
                    for B in (32, 128, 256, 512)}
        out.append(_ratio_entry(f"{kind}/pairs-vs-conventional",
                                f"{label} every replay pair at least as fast as our conventional "
                                "FP32 step from B = 32 up", conv_big, 1.0,
                                "no conventional / replay rows at B >= 32"))
        out.append(_ratio_entry(f"{kind}/pairs-vs-conventional-small-B",
                                f"{label} every replay pair at least 0.9x our conventional FP32 "
                                "step at B = 1 and 8",
                                {f"{p} B={B}": (conv(B), win(p, B)) for p in PAIRS
                                 for B in SMALL_B}, 0.9, "no rows at B = 1, 8"))
        for pair, cap_us in WINDOW_US[kind].items():
            us = win(pair, 256)
            st = win(pair, 256, True)
            fl = _floor_us(kind, pair, 256, S, bw)
            out.append(_entry(f"{kind}/{pair}-window-B256",
                              f"{label} {pair} window at B = 256 <= {cap_us:g} us",
                              "us", None if us is None else round(us, 2),
                              None if us is None else us <= cap_us,
                              {"staggered_us": None if st is None else round(st, 2),
                               "authors_us": auth(256)}, fl,
                              reason=f"no {pair} window row at B = 256"))
        spec = {p: (_us(rows, kind=kind, B=512, T=4, kernel="spec-authors-round"),
                    _us(rows, kind=kind, B=512, T=4, kernel="spec-replay-round", variant=p))
                for p in PAIRS}
        e = _ratio_entry(f"{kind}/spec-vs-authors-T4-B512",
                         f"{label} speculative verify + accept, T = 4, B = 512: every pair's "
                         "round faster than the authors' round", spec, 1.0, no_auth)
        snap = _us(rows, kind=kind, B=512, T=4, kernel="spec-snapshot-round")
        e["detail"]["snapshot_round_us"] = snap
        out.append(e)
        peer = "peer:fla" if kind == "gdn" else "peer:mamba_ssm"
        out.append(_ratio_entry(
            f"{kind}/conventional-vs-peer",
            f"{label} conventional FP32 step at least as fast as "
            f"{'fla' if kind == 'gdn' else 'mamba_ssm'}'s from B = 128 up",
            {f"B={B}": (_us(rows, kind=kind, B=B, kernel=peer, variant="float32"), conv(B))
             for B in (128, 256, 512)}, 1.0, "the peer was not measured (--peers, .gpu wheels)"))
        a = acc.get(kind)
        if a:
            an = {p: v["anchor"] for p, v in a.get("ours", {}).items()}
            outs = a.get("ours", {}).get("s32_rs", {}).get("outputs")
            detail = {"ours": a.get("ours"), "authors": a.get("authors"),
                      "ours_vs_authors": a.get("ours_vs_authors"), "B": a.get("B"),
                      "windows": a.get("windows")}
            worst = max(an.values()) if an else None
            met = None if worst is None else worst <= ANCHOR_TOL and \
                (outs is None or outs <= BF16_RING_BOUND)
            out.append(_entry(f"{kind}/accuracy",
                              f"{label} FP32 anchors within {ANCHOR_TOL:g} (relative Frobenius) "
                              "of a float64 recurrence after three windows; s32_rs outputs within "
                              f"the bf16 ring bound ({BF16_RING_BOUND:.2g})", "rel",
                              worst, met, {**detail, "s32_rs_outputs": outs}))
        else:
            out.append(_entry(f"{kind}/accuracy", f"{label} FP32 anchors within {ANCHOR_TOL:g} "
                              "of a float64 recurrence after three windows", "rel",
                              reason="the accuracy section did not run"))
    lines = kernel_lines()
    total = sum(lines.values())
    out.append(_entry("kernel-lines", f"decode, verify and conventional kernels with their launch "
                      f"code in at most {LINE_BUDGET} lines (references apart); launch configs "
                      "from one small table, no module-level switches (these two by review)",
                      "lines", total, total <= LINE_BUDGET,
                      {**lines, "stores.py (not counted)": len(
                          (Path(__file__).resolve().parents[1] / "kernels" / "stores.py")
                          .read_text().splitlines())}))
    return out


# grids of `bench kernels --preset NAME` (they replace the grid options): 'targets' times every
# row the targets read, in phase and staggered at every batch, and KDA's conventional, replay
# and peer rows, in one device call; 'probe' is the launch-config sweep of every kind at B = 256
# (bench.kernels_sweep.config_sweep: the read and the flush launch of each pair apart) with the
# windows of its picks beside the authors' at B = 256, and the speculative rounds at B = 512
PRESETS = {
    "targets": dict(batches=(1, 8, 32, 128, 256, 512), Ls=(8, 16), pairs=PAIRS, Ts=(4,),
                    spec_batches=(512,), peers=True, checks=True, sweep=False,
                    staggered_batches=(1, 8, 32, 128, 256, 512), main_L_only=True,
                    accuracy=True, kinds=("gdn", "mamba2", "kda")),
    "probe": dict(batches=(256,), Ls=(8, 16), pairs=PAIRS, Ts=(4,), spec_batches=(512,),
                  peers=False, checks=False, sweep=True, staggered_batches=(), main_L_only=True,
                  accuracy=False, kinds=("gdn", "mamba2", "kda")),
}
