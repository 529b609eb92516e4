"""The flush inside the read launch, timed beside today's launches and the ReplaySSM authors'
kernels on one GPU: a decode step of a pair without an NVFP4 role (tp8_hi32: FP32 anchor, FP8
read copy; s32_rs: one FP32 anchor read and flushed) as one launch on the read's 64-row tiles, a
flushing row's program running the flush on its sub-tiles of the flush launch's rows (16; 32)
(override_replay_launch({'fused': 'read'}), at the read's register cap and at other caps),
against the flush launch then the read launch ({'fused': False}) and today's choice (one launch
on the flush's tiles at small batch; 'flush': at any batch, the one launch a step an NVFP4 role
can have, its flush tiles whole matrices). On `replayquant bench kernels`' shapes,
inputs and clock (its replay-window, replay-window-staggered, read and flush step rows), each
way on stores of its own from the same initial state; the authors' windows (in phase and
staggered) of the same batch in the same run with --authors. First a check on the device (the
interpreter never runs the tensor-core path): the one launch against the two over 2L + 1 steps
from one store, half the rows staggered.

The same for the one-pass verify (its pre-flushes inside its read program, {'fused': 'read'},
at ptxas's registers and capped at 128, against the flush launch first): bench kernels'
speculative rounds (verify of T drafts + accept, 'spec-replay-round', and with every draft
rejected, no pre-flush, 'spec-replay-round-no-flush') at --spec-batches beside the authors'
round, after a device check of the two from one store whose rows pre-flush or not. Each kind's
rounds come before its windows.

An NVFP4 read copy cast with a global scale carried from the previous flush (ways 'carried',
the launch table's choice, and 'carried-read', the flush inside the read's tiles; pairs tp4_hi32
/ tp4_hi16_sr; ReplayStore.from_state(..., nvfp4_scale='carried')): its flush tiles take 16 rows
instead of whole matrices; timed beside 'two' and 'today' (whole matrices), after a device check
of the two launches against the one and of the read copy against the format's cast; in the
rounds, spec ways 'carried' (the flush launch first) and 'carried-read128' (the pre-flushes
inside the one-pass read program at 128 registers).

    python evals/fused_read_bench.py OUT.json [--kinds gdn,mamba2] [--batches 1,32,256]
        [--pairs tp8_hi32,s32_rs] [--ways two,read,read168] [--authors PATH] [--budget-s 400]
        (NVFP4, carried: --pairs tp4_hi32 --ways two,today,carried,carried-read
         --spec-ways two,carried,carried-read128)
        [--spec-batches 512] [--T 4] [--spec-ways two,read,read128]

Writes OUT.json after every row (rows, checks, copy bandwidth, provenance)."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from replayquant.bench import authors as side
from replayquant.bench.kernels.grid import PAIR_L, SHAPES, kernel_inputs, load_pair
from replayquant.bench.kernels.rows import ReplayExtras, bench_replay, bench_spec, spec_accepts
from replayquant.bench.kernels.timing import copy_bandwidth_GBps, no_gpu
from replayquant.formats.casts import nvfp4_carried_scale_ref, nvfp4_quantize_ref
from replayquant.kernels.replay.decode import replay_gdn_step, replay_mamba2_step
from replayquant.kernels.replay.launch import override_replay_launch
from replayquant.kernels.replay.verify import (replay_accept, replay_gdn_verify,
                                               replay_mamba2_verify)
from replayquant.outputs import write_json
from replayquant.provenance import provenance
from replayquant.replay.stores import ReplayStore
from replayquant.testing import random_state

STEP = {"gdn": replay_gdn_step, "mamba2": replay_mamba2_step}
# the ways a step launches: override_replay_launch's mapping each
WAYS = {"two": {"fused": False}, "today": {}, "read": {"fused": "read"},
        "flush": {"fused": True},       # one launch on the flush's tiles at any batch (NVFP4 too)
        "read168": {"fused": "read", "read": (None, None, 168)},
        "read255": {"fused": "read", "read": (None, None, 255)},
        "carried": {}, "carried-read": {"fused": "read"}}
# the ways whose stores cast an NVFP4 read copy with a carried scale (16-row flush tiles; pairs
# tp4_hi32 / tp4_hi16_sr): ReplayStore.from_state's options
STORE = {"carried": {"nvfp4_scale": "carried"}, "carried-read": {"nvfp4_scale": "carried"},
         "carried-read128": {"nvfp4_scale": "carried"}}
VERIFY = {"gdn": replay_gdn_verify, "mamba2": replay_mamba2_verify}
# the ways a one-pass verify launches: its pre-flushes in a flush launch first, or inside
SPEC_WAYS = {"two": {"fused": False}, "read": {"fused": "read"},
             "read128": {"fused": "read", "read": (None, None, 128)},
             "carried": {"fused": False}, "carried-read128": {"fused": "read",
                                                             "read": (None, None, 128)}}


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def check(kind, pair, B, device) -> dict:
    """The one launch on the read's tiles against two launches over 2L + 1 steps from one store,
    half the rows staggered (their first steps alone): outputs, anchors, read copies, pointers."""
    S, L = SHAPES[kind], PAIR_L[kind]
    idx = torch.arange(B, dtype=torch.int32, device=device)
    init = random_state(B, S["H"], S["dv"], S["dk"], seed=B + 1, device=device)
    P = load_pair(pair, L)[0]
    two, one = (ReplayStore.from_state(init, P, kind, key_heads=S["HK"]) for _ in range(2))
    worst = 0.0
    for st, way in ((two, WAYS["two"]), (one, WAYS["read"])):
        for j in range(1, L):
            rows = idx[B // 2:][(idx[B // 2:] % L) >= j]
            kw = kernel_inputs(kind, S, B, seed=500 + j, device=device)
            sub = {k: (v[rows.long()] if v.dim() > 1 else v) for k, v in kw.items()}
            with override_replay_launch(way):
                STEP[kind](st, **sub, state_indices=rows)
    for n in range(2 * L + 1):
        kw = kernel_inputs(kind, S, B, seed=10 + n, device=device)
        with override_replay_launch(WAYS["two"]):
            y0 = STEP[kind](two, **kw, state_indices=idx)
        with override_replay_launch(WAYS["read"]):
            y1 = STEP[kind](one, **kw, state_indices=idx)
        worst = max(worst, _rel(y1, y0))
    r = dict(kind=kind, pair=pair, B=B, steps=2 * L + 1, max_rel_outputs=worst,
             anchor_max_rel=_rel(one.anchor.payload, two.anchor.payload),
             read_copy_codes_equal=bool(torch.equal(one.read_role.payload,
                                                    two.read_role.payload)) if not one.shared
             else None,
             pointers_equal=all(bool(torch.equal(getattr(one, p), getattr(two, p)))
                                for p in ("committed", "start", "n_flush")))
    print(f"check {kind} {pair} B={B}: {r}", flush=True)
    return r


def check_verify(kind, pair, B, T, device, store=None) -> dict:
    """The one-pass verify with its pre-flushes inside against the flush launch first, from one
    store advanced by 2L rounds (accept counts spec_accepts', so rows drift into different
    phases): outputs, roles, ring and pointers. store: ReplayStore.from_state's options."""
    S, L = SHAPES[kind], PAIR_L[kind]
    idx = torch.arange(B, dtype=torch.int32, device=device)
    st = ReplayStore.from_state(random_state(B, S["H"], S["dv"], S["dk"], seed=B + 2,
                                             device=device), load_pair(pair, L)[0], kind,
                                key_heads=S["HK"], max_drafts=T, **(store or {}))
    n = spec_accepts(B, T, device)
    for r in range(2 * L):
        kw = kernel_inputs(kind, S, B, T=T, seed=700 + r, device=device)
        with override_replay_launch(SPEC_WAYS["two"]):
            VERIFY[kind](st, **kw, state_indices=idx)
        replay_accept(st, (n + r) % (T + 1), idx)
    h = st.committed.long()
    pre = int(((h + T > L) & (h > 0)).sum())
    kw = kernel_inputs(kind, S, B, T=T, seed=9, device=device)
    ys, stores = [], []
    for way in ("two", "read"):
        one = st.clone()
        with override_replay_launch(SPEC_WAYS[way]):
            ys.append(VERIFY[kind](one, **kw, state_indices=idx))
        stores.append(one)
    one, two = stores[1], stores[0]
    r = dict(kind=kind, pair=pair, B=B, T=T, store=store or {}, rows_pre_flushing=pre,
             max_rel_outputs=_rel(ys[1], ys[0]),
             anchor_max_rel=_rel(one.anchor.dequantize(), two.anchor.dequantize()),
             roles_equal=all(bool(torch.equal(getattr(one, x).payload, getattr(two, x).payload))
                             for x in ("anchor", "read") if getattr(one, x) is not None),
             ring_equal=all(bool(torch.equal(getattr(one, x), getattr(two, x)))
                            for x in ("kbuf", "vbuf", "Gbuf", "bbuf")),
             pointers_equal=all(bool(torch.equal(getattr(one, p), getattr(two, p)))
                                for p in ("committed", "start", "n_flush")))
    print(f"check verify {kind} {pair} B={B}: {r}", flush=True)
    return r


def spec_rows(kind, pair, B, T, way, copy_bw, device) -> list:
    """One way's speculative rounds (bench kernels' bench_spec, the replay rounds alone)."""
    return bench_spec(kind, B, T, device, copy_bw,
                      cfg={f"replay/{pair}": {"launch": SPEC_WAYS[way],
                                              "store": STORE.get(way, {})}}, pairs=(pair,),
                      snapshots=False)


def rows_of(kind, pair, B, way, copy_bw, device) -> list:
    """One way's rows at batch B: window in phase (and at B >= 128 the read and flush steps)
    through bench_replay, and the staggered window."""
    S, L = SHAPES[kind], PAIR_L[kind]
    cfg = {"launch": WAYS[way], "store": STORE.get(way, {})}
    rows = bench_replay(kind, B, pair, L, device, copy_bw, cfg=cfg,
                        extras=ReplayExtras(detail=B >= 128), S=S)
    with override_replay_launch(WAYS[way]):
        rows += side.bench_ours_staggered(kind, B, pair, L, device, copy_bw, S,
                                          store=STORE.get(way))
    return rows


def check_carried(kind, pair, B, device) -> dict:
    """A carried scale's stores over one window in phase (every row flushes at step L), two
    launches and the flush inside the read: the same bytes, and the read copy the format's cast
    of the FP32 anchor with the scale carried from the initial state's amax (casts, on the
    device)."""
    S, L = SHAPES[kind], PAIR_L[kind]
    idx = torch.arange(B, dtype=torch.int32, device=device)
    init = random_state(B, S["H"], S["dv"], S["dk"], seed=B + 3, device=device)
    P = load_pair(pair, L)[0]
    two, one = (ReplayStore.from_state(init, P, kind, key_heads=S["HK"], **STORE["carried"])
                for _ in range(2))
    for n in range(L):
        kw = kernel_inputs(kind, S, B, seed=30 + n, device=device)
        for st, way in ((two, WAYS["two"]), (one, WAYS["read"])):
            with override_replay_launch(way):
                STEP[kind](st, **kw, state_indices=idx)
    A = two.anchor.dequantize()
    pay, bs, gs = nvfp4_quantize_ref(A.flatten(0, 1), gs=nvfp4_carried_scale_ref(
        init.abs().amax(dim=(-2, -1)).flatten()))
    r = dict(kind=kind, pair=pair, B=B, steps=L, flushes=int(two.n_flush.min()),
             read_equals_two_launches=all(bool(torch.equal(getattr(one.read, t), getattr(
                 two.read, t))) for t in ("payload", "scale", "gscale")) and
             bool(torch.equal(one.carried, two.carried)),
             read_is_format_cast=bool(torch.equal(two.read.payload.flatten(0, 1), pay)) and
             bool(torch.equal(two.read.scale.flatten(0, 1), bs)) and
             bool(torch.equal(two.read.gscale.flatten(), gs)))
    print(f"check carried {kind} {pair} B={B}: {r}", flush=True)
    return r


def summary(rows) -> None:
    """Each way's windows and rounds against the authors' (their time over ours: > 1, ours
    faster) and against two launches."""
    ours = {"spec-authors-round": "spec-replay-round", "authors": "replay-window",
            "authors-staggered": "replay-window-staggered"}
    auth = {(r["kind"], r["B"], ours.get(r["kernel"], r["kernel"])): r["us"]
            for r in rows if r.get("way") == "authors"}
    two = {(r["kind"], r["variant"], r["B"], r["kernel"]): r["us"] for r in rows
           if r.get("way") == "two"}
    for r in rows:
        if r.get("way") in (None, "authors") or not r["kernel"].startswith(("replay-window",
                                                                            "spec-replay")):
            continue
        a = auth.get((r["kind"], r["B"], r["kernel"]))
        t = two.get((r["kind"], r["variant"], r["B"], r["kernel"]))
        print(f"  {r['kind']:6s} {r['variant']:8s} B={r['B']:4d} {r['kernel']:24s} {r['way']:8s} "
              f"{r['us']:8.2f} us"
              + (f", authors x{a / r['us']:.2f}" if a else "")
              + (f", two launches x{t / r['us']:.2f}" if t else ""), flush=True)


def _ways(res, a, t0, runs, A, label, authors, ours) -> None:
    """The authors' rows (authors(), with --authors) and ours of each (pair, way) in `runs`
    (ours(pair, way)) into res, written after each; past the time budget each is listed as
    skipped instead."""
    for pair, way in ([(None, "authors")] if A is not None else []) + runs:
        if time.time() - t0 > a.budget_s:
            res["skipped"].append(f"{label} {pair} {way}")
            continue
        new = authors() if way == "authors" else ours(pair, way)
        for r in new:
            r["way"] = way
        res["rows"] += new
        write_json(a.out, res)


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--kinds", default="gdn,mamba2")
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--pairs", default="tp8_hi32,s32_rs")
    p.add_argument("--ways", default="two,read,read168")
    p.add_argument("--authors", default=None, help="checkout of the authors' kernels")
    p.add_argument("--budget-s", type=float, default=400.0)
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--spec-batches", default="512", help="'' for none")
    p.add_argument("--T", type=int, default=4)
    p.add_argument("--spec-ways", default="two,read,read128")
    a = p.parse_args(argv)
    kinds, ways, pairs = a.kinds.split(","), a.ways.split(","), a.pairs.split(",")
    spec_ways = a.spec_ways.split(",")
    bad = [w for w in ways if w not in WAYS] + [k for k in kinds if k not in STEP] + \
        [w for w in spec_ways if w not in SPEC_WAYS]
    if bad:
        raise SystemExit(f"fused_read_bench: unknown {bad}; ways {sorted(WAYS)}, spec ways "
                         f"{sorted(SPEC_WAYS)}, kinds gdn, mamba2")
    batches = [int(b) for b in a.batches.split(",")]
    spec_batches = [int(b) for b in a.spec_batches.split(",") if b]
    if no_gpu("fused_read_bench"):
        return 1
    A = side.load(a.authors) if a.authors else None
    dev, t0 = "cuda", time.time()
    res = dict(provenance(dev, kinds=kinds, batches=batches, pairs=pairs, ways=ways),
               copy_GBps=copy_bandwidth_GBps(dev), checks=[], rows=[], skipped=[])
    if A is not None:
        res["authors"] = A.provenance()
    print(f"copy bandwidth {res['copy_GBps']:.0f} GB/s", flush=True)
    for kind in kinds:
        for pair in pairs if not a.no_check else ():
            if "tp4" in pair:         # an NVFP4 role flushes inside the read with a carried scale
                if any(w in STORE for w in ways):
                    res["checks"].append(check_carried(kind, pair, 64, dev))
                if spec_batches and any(w in STORE for w in spec_ways):
                    res["checks"].append(check_verify(kind, pair, 64, a.T, dev, STORE["carried"]))
            else:
                res["checks"].append(check(kind, pair, 64, dev))
                if spec_batches:
                    res["checks"].append(check_verify(kind, pair, 64, a.T, dev))
            write_json(a.out, res)
        bw = res["copy_GBps"]
        for B in spec_batches:
            _ways(res, a, t0, [(p, w) for p in pairs for w in spec_ways], A,
                  f"{kind} B={B} T={a.T}",
                  lambda: side.bench_spec(kind, B, a.T, PAIR_L[kind], dev, bw, SHAPES[kind], A),
                  lambda pair, way: spec_rows(kind, pair, B, a.T, way, bw, dev))
        for B in batches:
            _ways(res, a, t0, [(p, w) for p in pairs for w in ways], A, f"{kind} B={B}",
                  lambda: side.bench_window(kind, B, PAIR_L[kind], dev, bw, SHAPES[kind], A,
                                            staggered=True),
                  lambda pair, way: rows_of(kind, pair, B, way, bw, dev))
    summary(res["rows"])
    if res["skipped"]:
        print(f"skipped past the budget: {res['skipped']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
