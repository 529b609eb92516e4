"""Value heads per flush program (NH) for pairs that write an NVFP4 role, on a GPU.

Such a flush program holds a whole matrix (one FP32 scale per matrix) on 8 or 16 warps and so a
whole SM's registers. In a decode step where a row does not flush, each of its flush programs
reads the row's pointers and returns, beside the read kernel on its side stream; NH heads per
program means NH times fewer of them (B * HV / NH), each flushing row doing NH matrices one
after the other. For each pair, kind and NH: the 'dots' read step (h = L / 2, no row flushes),
the flush step (every row flushes), and the 'dots' windows in phase and staggered (row b starts
at fill b % L). GPU check first: a window crossing a flush with NH = 8 gives the outputs,
anchors and read copies of NH = 1 bit for bit.

    python evals/flush_heads_sweep.py OUT.json [--batch 256] [--pairs tp4_hi32,tp4_hi16_sr]
        [--heads 1,2,4,8]

Times as in the bench (CUDA graph, L2 flushed, state copies rotated). Writes OUT.json with
provenance and prints a markdown table."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from replayquant.bench import decode as bd
from replayquant.provenance import provenance


def _flush_cfg(kind, nh):
    dv, dk = bd.SHAPES[kind]["dv"], bd.SHAPES[kind]["dk"]
    from replayquant.kernels.replay_decode import _flush_warps
    return (dv, _flush_warps(dv, dk), 1, nh)


def check(kind, pair, nh, device="cuda") -> dict:
    """L + 2 steps from one state with NH = 1 and NH = nh: outputs, anchors, read copies equal."""
    from replayquant.kernels.replay_decode import ReplayStore
    S = bd.SHAPES[kind]
    L, B = bd.PAIR_L[kind], 8
    init = bd.random_state(B, S["H"], S["dv"], S["dk"], seed=5, device=device)
    P = bd._pair(pair, L)[0]
    idx = torch.arange(B, dtype=torch.int32, device=device)
    f = bd._fns(kind)
    sts = {n: ReplayStore.from_state(init, P, kind, key_heads=S["HK"]) for n in (1, nh)}
    for s_ in sts.values():
        s_.committed.copy_(torch.arange(B, dtype=torch.int32, device=device) % L)
    same = True
    for step in range(L + 2):
        kw = bd._kw(kind, S, B, seed=10 + step, device=device)
        ys = {n: f["step"](s_, **kw, state_indices=idx, path="replay", read_variant="dots",
                           flush_config=_flush_cfg(kind, n)) for n, s_ in sts.items()}
        same &= torch.equal(ys[1], ys[nh])
    a, b = sts[1], sts[nh]
    return {"outputs_equal": bool(same),
            "anchor_equal": bool(torch.equal(a.anchor.dequantize(), b.anchor.dequantize())),
            "read_equal": bool(torch.equal(a.read_role.dequantize(), b.read_role.dequantize())),
            "pointers_equal": bool(torch.equal(a.committed, b.committed))}


def sweep(kind, B, pair, heads, copy_bw, device="cuda") -> list:
    L = bd.PAIR_L[kind]
    rows = []
    for nh in heads:
        fc = _flush_cfg(kind, nh)
        cfg = {f"flush/{pair}": dict(flush_config=fc)}
        H, HK, dv, dk, f, idx, kw, out, af, rf, c, R, sts = bd._replay_setup(
            kind, B, pair, L, device, cfg, None)
        st = sts[0]
        step = dict(state_indices=idx, out=out, path="replay", advance=False, launch="split",
                    read_variant="dots", flush_config=fc)
        st.committed.fill_(L // 2)
        ms = bd.time_calls(lambda: f["step"](st, **kw, **step), 8)
        rows.append(bd._row(kind, "replay-read-step-dots", pair, B, ms,
                            bd.replay_read_step_bytes(kind, rf or af, L // 2, B, H, HK, dv, dk),
                            copy_bw, L=L, h=L // 2, config={"flush_config": fc}))
        st.committed.fill_(L - 1)
        ms = bd.time_calls(lambda: f["step"](st, **kw, **step), 4)
        rows.append(bd._row(kind, "replay-flush-step", pair, B, ms, None, copy_bw, L=L,
                            config={"flush_config": fc}))
        del sts, st
        rows += bd.bench_replay_variant(kind, B, pair, L, device, copy_bw, cfg=cfg)
        for r in rows[-4:]:
            r["nh"] = nh
        print(f"{kind} {pair} NH={nh}: " + ", ".join(f"{r['kernel']} {r['us']:.1f} us"
                                                      for r in rows[-4:]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--pairs", default="tp4_hi32,tp4_hi16_sr")
    ap.add_argument("--heads", default="1,2,4,8")
    a = ap.parse_args(argv)
    try:
        heads = [int(h) for h in a.heads.split(",") if h]
        assert heads and all(h >= 1 for h in heads)
    except (ValueError, AssertionError):
        print(f"flush_heads_sweep: --heads {a.heads!r}: give positive integers such as 1,2,4,8",
              file=sys.stderr)
        return 2
    if bd.no_gpu("flush_heads_sweep"):
        return 2
    copy_bw = bd.copy_bandwidth_GBps("cuda")
    pairs = a.pairs.split(",")
    checks = {f"{k}/{p}/NH={max(heads)}": check(k, p, max(heads))
              for k in ("gdn", "mamba2") for p in pairs}
    print("checks", checks, flush=True)
    rows = []
    for kind in ("gdn", "mamba2"):
        for pair in pairs:
            rows += sweep(kind, a.batch, pair, heads, copy_bw)
    res = {"provenance": provenance("cuda", script="evals/flush_heads_sweep.py", batch=a.batch,
                                    pairs=pairs, heads=heads, L=dict(bd.PAIR_L),
                                    shapes=bd.SHAPES),
           "copy_GBps": copy_bw, "checks": checks, "rows": rows}
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print("| kind | pair | NH | kernel | us |\n| --- | --- | ---: | --- | ---: |")
    for r in rows:
        print(f"| {r['kind']} | {r['variant']} | {r['nh']} | {r['kernel']} | {r['us']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
