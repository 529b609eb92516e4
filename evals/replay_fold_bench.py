"""The decode step's two designs side by side on one GPU, GDN and Mamba-2 s32_rs: today's
(design='eager-flush': a flush launch, then the read launch; one launch at small batch) and the
deferred fold (design='deferred-fold', kernels/replay/fold.py: one launch, a full window folded
by the next step's read), at its launch table's tile and at the variants given. On `replayquant
bench kernels`' shapes, inputs and clock (CUDA graphs, triton.testing.do_bench median, state
copies rotated so every step finds its state cold), each design on stores of its own from the
same initial state (ring of L + 1 entries for both). Rows: 'replay-window' (the mean step over
L steps, rows in phase), 'replay-window-staggered' (row b starts at fill b mod L),
'replay-read-step' (h = L / 2, pointers held), 'replay-flush-step' (eager: h = L - 1; deferred:
the fold step, h = L; pointers held). Before the times, a check on the device (the interpreter
never runs the tensor-core path): both designs over 2L + 1 steps from one store, rows in phase
and staggered (outputs each step), and the deferred fold against its torch reference on 8 rows.

    python evals/replay_fold_bench.py OUT.json [--kinds gdn,mamba2] [--batches 1,32,256]
        [--variants 64x1:16,64x2:16,32x1]
    python evals/replay_fold_bench.py --predict [--GBps 3000]   (the byte model, no GPU)

Writes OUT.json after every row (rows, checks, predictions, copy bandwidth, provenance)."""

from __future__ import annotations

import argparse
import sys

import torch

from replayquant.bench.kernels.grid import PAIR_L, SHAPES, kernel_inputs, load_pair
from replayquant.bench.kernels.timing import (copy_bandwidth_GBps, empty_cache, no_gpu,
                                              rotations, time_calls, timed_row)
from replayquant.kernels.replay.fold import replay_gdn_step, replay_mamba2_step
from replayquant.kernels.replay.launch import override_replay_launch
from replayquant.kernels.replay.reference import (replay_gdn_fold_step_ref,
                                                  replay_mamba2_fold_step_ref)
from replayquant.outputs import write_json
from replayquant.provenance import provenance
from replayquant.replay.stores import ReplayStore
from replayquant.statebytes import (entry_bytes, io_bytes, replay_flush_step_bytes,
                                    replay_read_step_bytes, replay_window_bytes, state_bytes)
from replayquant.testing import random_state

PAIR = "s32_rs"
REF_ROWS = 8
STEP = {"gdn": replay_gdn_step, "mamba2": replay_mamba2_step}     # with the design switch


# ---------------------------------------------------------------------------- bytes

def fold_window_bytes(kind, L, B, H, HK, dv, dk):
    """Mean HBM bytes per step of the deferred fold's window (shared FP32 pair): the fold step
    (anchor read and written, the L entries' k, u / x, G, beta read, its entry written) and L - 1
    read steps at h = 1 .. L - 1 (the eager window's read steps see h = 0 .. L - 2, and its
    flush step writes no entry)."""
    rd_nf, wr, rd_fl = entry_bytes(kind, H, HK, dv, dk, 4, True, L)
    A, io = state_bytes("fp32", dv, dk), io_bytes(kind, H, HK, dv, dk)
    fold = 2 * A + L * rd_fl + wr + io
    reads = (L - 1) * (A + wr + io) + (L * (L - 1) // 2) * rd_nf
    return B * H * (fold + reads) / L


def fold_step_bytes(kind, L, B, H, HK, dv, dk):
    """HBM bytes of the deferred fold's fold step (h = L)."""
    _, wr, rd_fl = entry_bytes(kind, H, HK, dv, dk, 4, True, L)
    return B * H * (2 * state_bytes("fp32", dv, dk) + L * rd_fl + wr
                    + io_bytes(kind, H, HK, dv, dk))


def predict(GBps, batches=(1, 32, 256)) -> list:
    """The byte model of both designs' windows, read and flush / fold steps at copy bandwidth
    GBps (floors: bytes / bandwidth, us)."""
    out = []
    for kind in ("gdn", "mamba2"):
        S, L = SHAPES[kind], PAIR_L[kind]
        shp = (S["H"], S["HK"], S["dv"], S["dk"])
        for B in batches:
            e = dict(window=replay_window_bytes(kind, "fp32", None, L, B, *shp),
                     read=replay_read_step_bytes(kind, "fp32", L // 2, B, *shp, 4, L),
                     flush=replay_flush_step_bytes(kind, "fp32", None, L, B, *shp))
            f = dict(window=fold_window_bytes(kind, L, B, *shp),
                     read=replay_read_step_bytes(kind, "fp32", L // 2, B, *shp, 4, L),
                     flush=fold_step_bytes(kind, L, B, *shp))
            for design, d in (("eager-flush", e), ("deferred-fold", f)):
                out.append(dict(kind=kind, B=B, L=L, design=design, GBps=GBps,
                                **{f"{k}_bytes": v for k, v in d.items()},
                                **{f"{k}_floor_us": v / GBps / 1e3 for k, v in d.items()}))
    return out


# ---------------------------------------------------------------------------- device

def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def _store(kind, B, init, L):
    S = SHAPES[kind]
    return ReplayStore.from_state(init, load_pair(PAIR, L)[0], kind, key_heads=S["HK"],
                                  max_drafts=1)


def check(kind, B, device) -> dict:
    """Both designs over 2L + 1 steps from one store, half the rows staggered (fill b mod L),
    outputs each step; the deferred fold against its torch reference on REF_ROWS rows over
    L + 2 steps."""
    S, L = SHAPES[kind], PAIR_L[kind]
    idx = torch.arange(B, dtype=torch.int32, device=device)
    init = random_state(B, S["H"], S["dv"], S["dk"], seed=B + 1, device=device)
    eager, fold = _store(kind, B, init, L), _store(kind, B, init, L)
    worst = 0.0
    for st in (eager, fold):                    # the staggered half: its first steps alone
        for j in range(1, L):
            rows = idx[B // 2:][(idx[B // 2:] % L) >= j]
            kw = kernel_inputs(kind, S, B, seed=500 + j, device=device)
            sub = {k: (v[rows.long()] if v.dim() > 1 else v) for k, v in kw.items()}
            STEP[kind](st, **sub, state_indices=rows,
                      design="deferred-fold" if st is fold else "eager-flush")
    for n in range(2 * L + 1):
        kw = kernel_inputs(kind, S, B, seed=10 + n, device=device)
        y0 = STEP[kind](eager, **kw, state_indices=idx)
        y1 = STEP[kind](fold, **kw, state_indices=idx, design="deferred-fold")
        worst = max(worst, _rel(y1, y0))
    n_ref = min(REF_ROWS, B)
    rows = torch.arange(n_ref, dtype=torch.int32, device=device)
    ref, mine = _store(kind, n_ref, init[:n_ref], L), _store(kind, n_ref, init[:n_ref], L)
    ref_fn = replay_gdn_fold_step_ref if kind == "gdn" else replay_mamba2_fold_step_ref
    worst_ref = 0.0
    for n in range(L + 2):
        kw = kernel_inputs(kind, S, n_ref, seed=20 + n, device=device)
        yr = ref_fn(ref, **kw, state_indices=rows)
        y1 = STEP[kind](mine, **kw, state_indices=rows, design="deferred-fold")
        worst_ref = max(worst_ref, _rel(y1, yr))
    r = dict(kind=kind, B=B, steps=2 * L + 1, max_rel_vs_eager=worst,
             max_rel_vs_ref=worst_ref, anchor_max_rel_vs_ref=_rel(mine.anchor.payload,
                                                                  ref.anchor.payload),
             pointers_equal_ref=all(bool(torch.equal(getattr(mine, p), getattr(ref, p)))
                                    for p in ("committed", "start", "n_flush")))
    print(f"check {kind} B={B}: {r}", flush=True)
    return r


def rows_of(kind, B, design, launch, copy_bw, device) -> list:
    """The four rows of one design at batch B (module docstring)."""
    S, L = SHAPES[kind], PAIR_L[kind]
    shp = (S["H"], S["HK"], S["dv"], S["dk"])
    fold = design == "deferred-fold"
    init = random_state(B, S["H"], S["dv"], S["dk"], seed=B, device=device)
    kw = kernel_inputs(kind, S, B, seed=1, device=device)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    out = torch.empty(B, S["H"], S["dv"], device=device)
    R = rotations(B * S["H"] * state_bytes("fp32", S["dv"], S["dk"]), device)
    opts = dict(design=design)
    wbytes = (fold_window_bytes(kind, L, B, *shp) if fold
              else replay_window_bytes(kind, "fp32", None, L, B, *shp))
    extra = dict(L=L, design=design, launch=launch, rot=R)
    rows = []
    for kernel, fill in (("replay-window", None), ("replay-window-staggered", "mod")):
        sts = [_store(kind, B, init, L) for _ in range(R)]
        if fill:
            for st in sts:
                st.committed.copy_(idx % L)

        def window(sts=sts):
            for st in sts:
                STEP[kind](st, **kw, state_indices=idx, out=out, **opts)
        ms = time_calls(window, L) / R
        rows.append(timed_row(kind, kernel, PAIR, B, ms, wbytes, copy_bw, **extra))
        del sts
    st = _store(kind, B, init, L)
    h = L // 2
    st.committed.fill_(h)
    ms = time_calls(lambda: STEP[kind](st, **kw, state_indices=idx, out=out, advance=False,
                                      **opts), 8)
    rows.append(timed_row(kind, "replay-read-step", PAIR, B, ms,
                          replay_read_step_bytes(kind, "fp32", h, B, *shp, 4, L), copy_bw, h=h,
                          **extra))
    st.committed.fill_(L if fold else L - 1)
    ms = time_calls(lambda: STEP[kind](st, **kw, state_indices=idx, out=out, advance=False,
                                      **opts), 4)
    rows.append(timed_row(kind, "replay-flush-step", PAIR, B, ms,
                          fold_step_bytes(kind, L, B, *shp) if fold else
                          replay_flush_step_bytes(kind, "fp32", None, L, B, *shp), copy_bw,
                          **extra))
    del st
    empty_cache()
    return rows


def _variants(text):
    """'64x2,64x1:16' -> [{'fold': (64, 2)}, {'fold': (64, 1, 16)}] (rows x warps, and columns
    a chunk after a colon)."""
    out = []
    for v in filter(None, (text or "").split(",")):
        tile, _, chunk = v.partition(":")
        rows, _, warps = tile.partition("x")
        if not (rows.isdigit() and warps.isdigit() and (chunk == "" or chunk.isdigit())):
            raise SystemExit(f"--variants: '{v}' is not ROWSxWARPS[:CHUNK] (e.g. 64x1:16)")
        out.append({"fold": (int(rows), int(warps)) + ((int(chunk),) if chunk else ())})
    return out


def summary(rows) -> None:
    """Each deferred-fold row against the eager row of the same kind, batch and kernel."""
    base = {(r["kind"], r["B"], r["kernel"]): r["us"] for r in rows
            if r["design"] == "eager-flush"}
    for r in rows:
        b = base.get((r["kind"], r["B"], r["kernel"]))
        if r["design"] == "deferred-fold" and b:
            print(f"  {r['kind']:6s} B={r['B']:4d} {r['kernel']:24s} "
                  f"{r['launch'] or 'table'}: {r['us']:8.1f} us, eager {b:8.1f} us, "
                  f"x{b / r['us']:.2f}", flush=True)


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?")
    p.add_argument("--kinds", default="gdn,mamba2")
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--variants", default="", help="deferred-fold tiles beside the table's")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--predict", action="store_true", help="print the byte model and exit")
    p.add_argument("--GBps", type=float, default=3000.0, help="copy bandwidth of --predict")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    if a.predict:
        for r in predict(a.GBps, batches):
            print(f"{r['kind']:6s} B={r['B']:4d} {r['design']:13s} window "
                  f"{r['window_floor_us']:8.2f} us, read step {r['read_floor_us']:8.2f}, "
                  f"flush / fold step {r['flush_floor_us']:8.2f}")
        return 0
    if a.out is None:
        raise SystemExit("replay_fold_bench: give OUT.json (or --predict)")
    if no_gpu("replay_fold_bench"):
        return 1
    kinds = a.kinds.split(",")
    bad = [k for k in kinds if k not in ("gdn", "mamba2")]
    if bad:
        raise SystemExit(f"--kinds {bad}: the deferred fold takes gdn and mamba2")
    variants = _variants(a.variants)
    dev = "cuda"
    res = dict(provenance(dev, kinds=kinds, batches=batches, pair=PAIR),
               copy_GBps=copy_bandwidth_GBps(dev), checks=[], rows=[])
    res["predictions"] = predict(res["copy_GBps"], batches)
    print(f"copy bandwidth {res['copy_GBps']:.0f} GB/s", flush=True)
    for kind in kinds:
        if not a.no_check:
            res["checks"].append(check(kind, 64, dev))
            write_json(a.out, res)
        for B in batches:
            for design, launch in [("eager-flush", None), ("deferred-fold", None)] \
                    + [("deferred-fold", v) for v in variants]:
                with override_replay_launch(launch):
                    res["rows"] += rows_of(kind, B, design, launch, res["copy_GBps"], dev)
                write_json(a.out, res)
    summary(res["rows"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
