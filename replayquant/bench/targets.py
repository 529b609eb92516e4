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

from replayquant.pairs import PrecisionPair
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


def _rows(rows, **kv):
    return [r for r in rows if all(r.get(k) == v for k, v in kv.items())]


def _us(rows, **kv):
    m = _rows(rows, **kv)
    return m[0]["us"] if m else None


def _floor_us(kind, pair, B, S, bw):
    if not bw or kind not in S:
        return None
    p = PrecisionPair.load(pair)
    s = S[kind]
    read = None if p.read is None else p.read.format
    return replay_window_bytes(kind, p.anchor.format, read, MAIN_L[kind], B, s["H"], s["HK"],
                               s["dv"], s["dk"]) / bw / 1e3


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


# The modules kernel_lines counts: the replay decode kernel, its verifies (the step kernel's and
# the one-pass kernel) and launch table, the conventional kernel, its verify and launch table
# (paths under replayquant/kernels/)
COUNTED = ("replay/decode.py", "replay/launch.py", "replay/verify.py", "replay/verify_onepass.py",
           "conventional/kernel.py", "conventional/verify.py", "conventional/launch.py")


def kernel_lines() -> dict:
    """Lines of the decode, verify and conventional kernels with their launch code: their
    modules and launch tables (COUNTED, paths under kernels/) less their torch references
    (functions and classes whose name ends in '_ref' or holds '_ref_'), blank lines and comments
    counted as the file has them. The stored roles' casts in registers (kernels/quant/roles.py,
    shared with the chunk kernel), the format codecs (kernels/quant/kernel.py) and the stores with
    their input checks (replay/stores.py, shared with the references) are not counted: the
    target's detail gives stores.py's lines beside them."""
    root = Path(__file__).resolve().parents[1] / "kernels"
    out = {}
    for name in COUNTED:
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
        k = _KindRows(rows, kind)
        out += _authors_targets(k, S, bw, no_auth)
        out += _conventional_targets(k)
        out += _window_targets(k, S, bw)
        out.append(_spec_target(k, no_auth))
        out.append(_peer_target(k))
        out.append(_accuracy_target(kind, k.label, acc.get(kind)))
    out.append(_lines_target())
    return out


class _KindRows:
    """The rows of one layer kind at its main L: our windows, the authors' and our conventional
    FP32 step (us per step, None where not measured)."""

    def __init__(self, rows, kind):
        self.rows, self.kind, self.L = rows, kind, MAIN_L[kind]
        self.label = "GDN" if kind == "gdn" else "Mamba-2"

    def win(self, pair, B, stag=False):
        return _us(self.rows, kind=self.kind, B=B, L=self.L, variant=pair,
                   kernel="replay-window-staggered" if stag else "replay-window")

    def auth(self, B, stag=False):
        return _us(self.rows, kind=self.kind, B=B, L=self.L, variant="fp32",
                   kernel="authors-staggered" if stag else "authors")

    def conv(self, B):
        return _us(self.rows, kind=self.kind, B=B, kernel="conventional", variant="fp32")


def _authors_targets(k: _KindRows, S, bw, no_auth) -> list:
    """s32_rs windows against the authors' FP32 kernel: 1.05x at B = 256 (in phase and
    staggered, with the byte floor), 1.0x at the other batches."""
    cap = {"gdn": 153, "mamba2": 324}[k.kind]
    e = _ratio_entry(f"{k.kind}/s32_rs-vs-authors-B256",
                     f"{k.label} s32_rs window at least 1.05x the authors' FP32 kernel at "
                     f"B = 256, in phase and staggered (about <= {cap} us)",
                     {"in phase": (k.auth(256), k.win("s32_rs", 256)),
                      "staggered": (k.auth(256, True), k.win("s32_rs", 256, True))}, 1.05, no_auth)
    fl = _floor_us(k.kind, "s32_rs", 256, S, bw)
    if fl is not None:
        e["floor_us"] = round(fl, 1)
    return [e, _ratio_entry(
        f"{k.kind}/s32_rs-vs-authors-other-B",
        f"{k.label} s32_rs window at least 1.0x the authors' at B = 1, 8, 32, 128, 512",
        {f"B={B}": (k.auth(B), k.win("s32_rs", B)) for B in OTHER_B}, 1.0, no_auth)]


def _conventional_targets(k: _KindRows) -> list:
    """Every pair's window against our conventional FP32 step: 1.0x from B = 32 up, 0.9x at
    B = 1 and 8."""
    conv_big = {f"{p} B={B}": (k.conv(B), k.win(p, B)) for p in PAIRS
                for B in (32, 128, 256, 512)}
    return [_ratio_entry(f"{k.kind}/pairs-vs-conventional",
                         f"{k.label} every replay pair at least as fast as our conventional "
                         "FP32 step from B = 32 up", conv_big, 1.0,
                         "no conventional / replay rows at B >= 32"),
            _ratio_entry(f"{k.kind}/pairs-vs-conventional-small-B",
                         f"{k.label} every replay pair at least 0.9x our conventional FP32 "
                         "step at B = 1 and 8",
                         {f"{p} B={B}": (k.conv(B), k.win(p, B)) for p in PAIRS
                          for B in SMALL_B}, 0.9, "no rows at B = 1, 8")]


def _window_targets(k: _KindRows, S, bw) -> list:
    """The tp8_hi32 / tp4_hi32 windows at B = 256 within WINDOW_US, with their byte floors."""
    out = []
    for pair, cap_us in WINDOW_US[k.kind].items():
        us = k.win(pair, 256)
        st = k.win(pair, 256, True)
        fl = _floor_us(k.kind, pair, 256, S, bw)
        out.append(_entry(f"{k.kind}/{pair}-window-B256",
                          f"{k.label} {pair} window at B = 256 <= {cap_us:g} us",
                          "us", None if us is None else round(us, 2),
                          None if us is None else us <= cap_us,
                          {"staggered_us": None if st is None else round(st, 2),
                           "authors_us": k.auth(256)}, fl,
                          reason=f"no {pair} window row at B = 256"))
    return out


def _spec_target(k: _KindRows, no_auth) -> dict:
    """Every pair's speculative round (T = 4, B = 512) faster than the authors' round."""
    rows, kind = k.rows, k.kind
    spec = {p: (_us(rows, kind=kind, B=512, T=4, kernel="spec-authors-round"),
                _us(rows, kind=kind, B=512, T=4, kernel="spec-replay-round", variant=p))
            for p in PAIRS}
    e = _ratio_entry(f"{kind}/spec-vs-authors-T4-B512",
                     f"{k.label} speculative verify + accept, T = 4, B = 512: every pair's "
                     "round faster than the authors' round", spec, 1.0, no_auth)
    e["detail"]["snapshot_round_us"] = _us(rows, kind=kind, B=512, T=4,
                                           kernel="spec-snapshot-round")
    return e


def _peer_target(k: _KindRows) -> dict:
    """Our conventional FP32 step at least as fast as the peer's from B = 128 up."""
    peer = "peer:fla" if k.kind == "gdn" else "peer:mamba_ssm"
    return _ratio_entry(
        f"{k.kind}/conventional-vs-peer",
        f"{k.label} conventional FP32 step at least as fast as "
        f"{'fla' if k.kind == 'gdn' else 'mamba_ssm'}'s from B = 128 up",
        {f"B={B}": (_us(k.rows, kind=k.kind, B=B, kernel=peer, variant="float32"), k.conv(B))
         for B in (128, 256, 512)}, 1.0, "the peer was not measured (--peers, .gpu wheels)")


def _accuracy_target(kind, label, a) -> dict:
    """FP32 anchors within ANCHOR_TOL of the float64 recurrence after three windows and s32_rs
    outputs within BF16_RING_BOUND, from the run's accuracy section `a` (None: not run)."""
    if not a:
        return _entry(f"{kind}/accuracy", f"{label} FP32 anchors within {ANCHOR_TOL:g} "
                      "of a float64 recurrence after three windows", "rel",
                      reason="the accuracy section did not run")
    an = {p: v["anchor"] for p, v in a.get("ours", {}).items()}
    outs = a.get("ours", {}).get("s32_rs", {}).get("outputs")
    detail = {"ours": a.get("ours"), "authors": a.get("authors"),
              "ours_vs_authors": a.get("ours_vs_authors"), "B": a.get("B"),
              "windows": a.get("windows")}
    worst = max(an.values()) if an else None
    met = None if worst is None else worst <= ANCHOR_TOL and \
        (outs is None or outs <= BF16_RING_BOUND)
    return _entry(f"{kind}/accuracy",
                  f"{label} FP32 anchors within {ANCHOR_TOL:g} (relative Frobenius) "
                  "of a float64 recurrence after three windows; s32_rs outputs within "
                  f"the bf16 ring bound ({BF16_RING_BOUND:.2g})", "rel",
                  worst, met, {**detail, "s32_rs_outputs": outs})


def _lines_target() -> dict:
    """The decode, verify and conventional kernels within LINE_BUDGET lines (kernel_lines)."""
    lines = kernel_lines()
    total = sum(lines.values())
    return _entry("kernel-lines", f"decode, verify and conventional kernels with their launch "
                  f"code in at most {LINE_BUDGET} lines (references apart); launch configs "
                  "from one small table, no module-level switches (these two by review)",
                  "lines", total, total <= LINE_BUDGET,
                  {**lines, "stores.py (not counted)": len(
                      (Path(__file__).resolve().parents[1] / "replay" / "stores.py")
                      .read_text().splitlines())})


# grids of `bench kernels --preset NAME` (they replace the grid options): 'targets' times every
# row the targets read, in phase and staggered at every batch, and KDA's conventional, replay
# and peer rows, in one device call; 'probe' is the launch-config sweep of every kind at B = 256
# (bench.kernels.sweep.config_sweep: the read and the flush launch of each pair apart) with the
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
