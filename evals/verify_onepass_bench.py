"""The speculative verify round of both read launches side by side on one GPU: replay.decode's
step kernel (design='step-kernel') and verify_onepass (design='onepass', the default, at its
launch table's config and at the variants given), on `replayquant bench kernels`' shapes,
inputs, accept counts and clock (bench_spec's rounds: verify + accept of n, CUDA graphs of 8
rounds, triton.testing.do_bench median), each design on a store of its own from the same
initial state. Before the times, a check on the device (the interpreter never runs the GPU's
tensor-core path): from one store advanced by rounds of the step kernel, both designs' outputs
and stores, and the one-pass verify against the torch reference on 8 rows.

    python evals/verify_onepass_bench.py OUT.json [--kinds gdn,mamba2] [--batches 512]
        [--pairs s32_rs,tp8_hi32,tp4_hi32] [--T 4] [--variants 32x1,64x1]

Writes OUT.json after every row (rows, checks, copy bandwidth, provenance)."""

from __future__ import annotations

import argparse
import sys

import torch

from replayquant.testing import random_state
from replayquant.bench.kernels.grid import PAIR_L, SHAPES, kernel_fns, kernel_inputs, load_pair
from replayquant.bench.kernels.rows import spec_accepts
from replayquant.bench.kernels.timing import (copy_bandwidth_GBps, empty_cache, no_gpu,
                                              time_calls, timed_row)
from replayquant.replay.stores import ReplayStore
from replayquant.kernels.replay.launch import override_replay_launch
from replayquant.kernels.replay.verify import replay_accept
from replayquant.outputs import write_json
from replayquant.provenance import provenance

CHECK_ROUNDS = 6           # step-kernel rounds before the check: rows in different phases
REF_ROWS = 8               # rows of the check against the torch reference


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def _store_diff(a: ReplayStore, b: ReplayStore) -> dict:
    """How the stores of the two designs differ after one verify from the same store."""
    out = {f: bool(torch.equal(getattr(a, f), getattr(b, f)))
           for f in ("kbuf", "vbuf", "Gbuf", "bbuf", "committed", "start", "n_flush")}
    out["roles_equal"] = all(torch.equal(getattr(a, r).payload, getattr(b, r).payload)
                             for r in ("anchor", "read") if getattr(a, r) is not None)
    for f in ("ubuf", "Tbuf"):
        if getattr(a, f) is not None:
            out[f"{f}_max_rel"] = _rel(getattr(a, f), getattr(b, f))
    return out


def check(kind, pair, B, T, device) -> dict:
    """Both designs from one store (advanced by CHECK_ROUNDS rounds of the step kernel), and the
    one-pass verify against the torch reference on REF_ROWS rows of it."""
    S, L, f = SHAPES[kind], PAIR_L[kind], kernel_fns(kind)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    st = ReplayStore.from_state(random_state(B, S["H"], S["dv"], S["dk"], seed=B + 1,
                                             device=device), load_pair(pair, L)[0], kind,
                                key_heads=S["HK"], max_drafts=T)
    for r in range(CHECK_ROUNDS):
        f["verify"](st, **kernel_inputs(kind, S, B, T=T, seed=10 + r, device=device),
                    state_indices=idx, design="step-kernel")
        g = torch.Generator().manual_seed(r)
        replay_accept(st, torch.randint(0, T + 1, (B,), generator=g).to(device), idx)
    kw = kernel_inputs(kind, S, B, T=T, seed=3, device=device)
    h = st.committed.long()
    one, two = st.clone(), st.clone()
    out = torch.full((B, T, S["H"], S["dv"]), float("nan"), device=device)
    y1 = f["verify"](one, **kw, state_indices=idx, out=out, design="onepass")
    y0 = f["verify"](two, **kw, state_indices=idx, design="step-kernel")
    rows = torch.arange(REF_ROWS, dtype=torch.int32, device=device)
    sub = {k: (v[:REF_ROWS] if v.dim() > 1 else v) for k, v in kw.items()}
    ref, three = st.clone(), st.clone()
    yr = f["verify_ref"](ref, **sub, state_indices=rows)
    y3 = f["verify"](three, **sub, state_indices=rows, design="onepass")
    r = dict(kind=kind, pair=pair, B=B, T=T, pre_flush_rows=int(((h + T > L) & (h > 0)).sum()),
             finite=bool(torch.isfinite(y1).all()), max_rel_vs_step_kernel=_rel(y1, y0),
             frac_over_1e5=float(((y1 - y0).abs() > 1e-5 * y0.abs().max()).float().mean()),
             max_rel_vs_ref=_rel(y3, yr), step_kernel_max_rel_vs_ref=_rel(y0[:REF_ROWS], yr),
             **_store_diff(one, two))
    print(f"check {kind} {pair} B={B}: {r}", flush=True)
    return r


def rounds(kind, B, T, pair, design, launch, copy_bw, device) -> list:
    """bench_spec's speculative rounds of one design: 'spec-replay-round' (accept n) and
    'spec-replay-round-no-flush' (accept 0: no row ever flushes)."""
    S, L, f = SHAPES[kind], PAIR_L[kind], kernel_fns(kind)
    init = random_state(B, S["H"], S["dv"], S["dk"], seed=B + 1, device=device)
    kw = kernel_inputs(kind, S, B, T=T, seed=3, device=device)
    n = spec_accepts(B, T, device)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    out = torch.empty(B, T, S["H"], S["dv"], device=device)
    rows = []
    for kernel, acc in (("spec-replay-round", n), ("spec-replay-round-no-flush", n * 0)):
        st = ReplayStore.from_state(init, load_pair(pair, L)[0], kind, key_heads=S["HK"],
                                    max_drafts=T)

        def rnd():
            f["verify"](st, **kw, state_indices=idx, out=out, design=design)
            replay_accept(st, acc, idx, check=False)
        with override_replay_launch(launch):
            ms = time_calls(rnd, 8)
        rows.append(timed_row(kind, kernel, pair, B, ms, None, copy_bw, T=T, L=L, design=design,
                              launch=launch, mean_accept=float(acc.float().mean())))
        del st
    empty_cache()
    return rows


def _variants(text):
    """'64x2,32x1' -> [{'read': (64, 2)}, {'read': (32, 1)}]."""
    out = []
    for v in filter(None, (text or "").split(",")):
        rows, _, warps = v.partition("x")
        if not (rows.isdigit() and warps.isdigit()):
            raise SystemExit(f"--variants: '{v}' is not ROWSxWARPS (e.g. 32x1)")
        out.append({"read": (int(rows), int(warps))})
    return out


def summary(rows) -> None:
    """Each one-pass round against the step kernel's round of the same kind, pair, batch."""
    base = {(r["kind"], r["variant"], r["B"], r["kernel"]): r["us"] for r in rows
            if r["design"] == "step-kernel"}
    for r in rows:
        b = base.get((r["kind"], r["variant"], r["B"], r["kernel"]))
        if r["design"] == "onepass" and b:
            print(f"  {r['kind']:6s} {r['variant']:9s} B={r['B']:4d} {r['kernel']:27s} "
                  f"read {r['launch'] or 'table'}: {r['us']:8.1f} us, step kernel {b:8.1f} us, "
                  f"x{b / r['us']:.2f}", flush=True)


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--kinds", default="gdn")
    p.add_argument("--batches", default="512")
    p.add_argument("--pairs", default="s32_rs,tp8_hi32,tp4_hi32")
    p.add_argument("--T", type=int, default=4)
    p.add_argument("--variants", default="", help="one-pass read launches beside the table's")
    p.add_argument("--no-check", action="store_true")
    a = p.parse_args(argv)
    if no_gpu("verify_onepass_bench"):
        return 1
    kinds, pairs = a.kinds.split(","), a.pairs.split(",")
    batches = [int(b) for b in a.batches.split(",")]
    bad = [k for k in kinds if k not in ("gdn", "mamba2")]
    if bad:
        raise SystemExit(f"--kinds {bad}: the one-pass verify takes gdn and mamba2")
    variants = _variants(a.variants)
    dev = "cuda"
    res = dict(provenance(dev, T=a.T, kinds=kinds, pairs=pairs, batches=batches),
               copy_GBps=copy_bandwidth_GBps(dev), checks=[], rows=[])
    print(f"copy bandwidth {res['copy_GBps']:.0f} GB/s", flush=True)
    for kind in kinds:
        for pair in pairs:
            if not a.no_check:
                res["checks"].append(check(kind, pair, 64, a.T, dev))
                write_json(a.out, res)
            for B in batches:
                for design, launch in [("step-kernel", None), ("onepass", None)] \
                        + [("onepass", v) for v in variants]:
                    res["rows"] += rounds(kind, B, a.T, pair, design, launch, res["copy_GBps"],
                                          dev)
                    write_json(a.out, res)
    summary(res["rows"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
