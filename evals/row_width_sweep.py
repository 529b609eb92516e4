"""Row width of the read kernel's FP32 read-copy tile (session 11), on a GPU.

`_tile_raw` loads a 16- / 32-bit read copy as [d_k / RW, rows, RW]: RW / 4 lanes share a row,
so every row sum (GDN: R k and R q per draft; Mamba-2: R C per draft) ends in log2(RW / 4)
shuffle rounds. RW = d_k = 128 is the layout before session 11 (a row on all 32 lanes, five
rounds; Nsight Compute, results/bench/ncu/: the T = 4 verify reads at B = 512 reached 31-44%
of DRAM bandwidth, and about a third of their instructions were those shuffles). For each RW and kind, the pair s32_rs: GPU checks first
(kernel vs torch reference, decode steps across a flush and verify rounds with random accepts),
then the 'dots' read step (h = L / 2) and 'dots' windows (in phase, staggered) at --batch, and
the speculative round (T = 4, with its snapshot baseline) at --verify-batch.

    python evals/row_width_sweep.py OUT.json [--widths 128,32,16] [--batch 256]
        [--verify-batch 512] [--pair s32_rs]

Times as in the bench (CUDA graph, L2 flushed, state copies rotated for the windows). Writes
OUT.json with provenance and prints a markdown table."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from replayquant.bench import decode as bd
from replayquant.kernels import replay_decode as rd
from replayquant.provenance import provenance


def check(kind, pair, device="cuda") -> dict:
    """Max relative error against the torch reference: 6 decode steps (L = 4, 7 rows, one a
    padding row: every row crosses a flush), then 3 verify rounds of T = 4 with random accepts."""
    from replayquant.kernels.replay_decode import ReplayStore
    from replayquant.kernels.verify import replay_accept
    from replayquant.pairs import PrecisionPair
    S = bd.SHAPES[kind]
    f = bd._fns(kind)
    idx = torch.tensor([5, -1, 0, 3, 1, 2, 4], dtype=torch.int32, device=device)
    init = bd.random_state(6, S["H"], S["dv"], S["dk"], seed=1, device=device)
    P = PrecisionPair.load(pair).with_buffer_len(4)
    st = ReplayStore.from_state(init, P, kind, key_heads=S["HK"], seed=3, max_drafts=4)
    ref = st.clone()
    step, ver = [], []
    for i in range(6):
        kw = bd._kw(kind, S, idx.shape[0], seed=i, device=device)
        y = f["step"](st, **kw, state_indices=idx, path="replay", read_variant="dots")
        y2 = f["step_ref"](ref, **kw, state_indices=idx, path="replay")
        step.append(bd._rel(y, y2))
    g = torch.Generator().manual_seed(7)
    for i in range(3):
        kw = bd._kw(kind, S, idx.shape[0], T=4, seed=20 + i, device=device)
        y = f["verify"](st, **kw, state_indices=idx, read_variant="dots")
        y2 = f["verify_ref"](ref, **kw, state_indices=idx)
        ver.append(bd._rel(y, y2))
        n = torch.randint(0, 5, (idx.shape[0],), generator=g, dtype=torch.int32).to(device)
        replay_accept(st, n, idx)
        replay_accept(ref, n, idx)
    return {"max_rel_step": max(step), "max_rel_verify": max(ver),
            "pointers_equal": bool(torch.equal(st.committed, ref.committed)
                                   and torch.equal(st.start, ref.start))}


def timed(kind, pair, B, Bv, copy_bw, rw, conv=False, device="cuda") -> list:
    L = bd.PAIR_L[kind]
    rows = bd.bench_conventional(kind, B, device, copy_bw) if conv else []
    H, HK, dv, dk, f, idx, kw, out, af, rf, c, R, sts = bd._replay_setup(
        kind, B, pair, L, device, None, None, "dots")
    st = sts[0]
    st.committed.fill_(L // 2)
    ms = bd.time_calls(lambda: f["step"](st, **kw, state_indices=idx, out=out, path="replay",
                                         advance=False, launch="split", read_variant="dots"), 8)
    rows += [bd._row(kind, "replay-read-step-dots", pair, B, ms,
                    bd.replay_read_step_bytes(kind, rf or af, L // 2, B, H, HK, dv, dk), copy_bw,
                    L=L, h=L // 2)]
    del sts, st
    rows += bd.bench_replay_variant(kind, B, pair, L, device, copy_bw)
    rows += bd.bench_spec(kind, Bv, 4, device, copy_bw, pairs=(pair,))
    rows = bd._derive(rows)
    for r in rows:
        r["row_width"] = rw
    print(f"{kind} {pair} RW={rw}: " + ", ".join(
        f"{r['kernel']} {r['us']:.1f} us" for r in rows), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--widths", default="128,32,16")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--verify-batch", type=int, default=512)
    ap.add_argument("--pair", default="s32_rs")
    ap.add_argument("--kinds", default="gdn,mamba2")
    a = ap.parse_args(argv)
    try:
        widths = [int(w) for w in a.widths.split(",") if w]
        assert widths and all(w >= 4 and w & (w - 1) == 0 for w in widths)
    except (ValueError, AssertionError):
        print(f"row_width_sweep: --widths {a.widths!r}: give powers of two from 4, such as "
              "128,32,16", file=sys.stderr)
        return 2
    if bd.no_gpu("row_width_sweep"):
        return 2
    copy_bw = bd.copy_bandwidth_GBps("cuda")
    kinds = a.kinds.split(",")
    saved = dict(rd.READ_ROW_WIDTH)
    checks, rows = {}, []
    try:
        for rw in widths:
            rd.READ_ROW_WIDTH.update({k: rw for k in rd.READ_ROW_WIDTH})
            for kind in kinds:
                checks[f"{kind}/{a.pair}/RW={rw}"] = check(kind, a.pair)
                print(kind, rw, checks[f"{kind}/{a.pair}/RW={rw}"], flush=True)
        for rw in widths:
            rd.READ_ROW_WIDTH.update({k: rw for k in rd.READ_ROW_WIDTH})
            for kind in kinds:
                rows += timed(kind, a.pair, a.batch, a.verify_batch, copy_bw, rw,
                              conv=rw == widths[0])
    finally:
        rd.READ_ROW_WIDTH.update(saved)
    res = {"provenance": provenance("cuda", script="evals/row_width_sweep.py", batch=a.batch,
                                    verify_batch=a.verify_batch, pair=a.pair, widths=widths,
                                    L=dict(bd.PAIR_L), shapes=bd.SHAPES),
           "copy_GBps": copy_bw, "checks": checks, "rows": rows}
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(bd.rows_table(rows, extra=("row_width",)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
