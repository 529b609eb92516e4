"""One launch of each decode kernel worth profiling, for Nsight Compute (session 11): issue 4's
shapes, the B = 256 step (conventional FP32, the 'dots' read step at fill h = L/2, the flush
step with every row flushing) and the T = 4 verify read at B = 512. Every launch is compiled
and run once before the profiler starts, then run once inside cudaProfilerStart / Stop, so

    ncu --profile-from-start off --clock-control none --section ... \\
        python evals/ncu_decode_drive.py [--kinds gdn,mamba2] [--pairs s32_rs,tp4_hi32] \\
            [--only verify]

profiles exactly one launch of each kernel of each case (the case is printed before it runs;
ncu keeps the launch order). Nothing is timed here: ncu replays each kernel with cold caches."""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

from replayquant.bench import decode as bd


def cases(kinds, pairs, B, Bv, T):
    """(name, callable) per case: each callable runs one decode step or verify read."""
    out = []
    from replayquant.kernels.conventional import ConventionalStore
    from replayquant.kernels.replay_decode import ReplayStore
    from replayquant.kernels.verify import replay_accept
    for kind in kinds:
        S = bd.SHAPES[kind]
        H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
        L = bd.PAIR_L[kind]
        f = bd._fns(kind)
        init = bd.random_state(B, H, dv, dk, seed=B, device="cuda")
        idx = torch.arange(B, dtype=torch.int32, device="cuda")
        kw = bd._kw(kind, S, B, seed=1, device="cuda")
        o = torch.empty(B, H, dv, device="cuda")
        cs = ConventionalStore.from_state(init, "fp32")
        out.append((f"{kind} conventional fp32 B={B}",
                    lambda f=f, cs=cs, kw=kw, idx=idx, o=o:
                    f["conv"](cs, **kw, state_indices=idx, out=o)))
        for pair in pairs:
            P = bd._pair(pair, L)[0]
            st = ReplayStore.from_state(init, P, kind, key_heads=HK)

            def step(fill, f=f, st=st, kw=kw, idx=idx, o=o):    # fill L - 1: every row flushes
                st.committed.fill_(fill)
                f["step"](st, **kw, state_indices=idx, out=o, path="replay", advance=False,
                          read_variant="dots", launch="split")
            out.append((f"{kind} read step {pair} B={B} h={L // 2}", partial(step, L // 2)))
            out.append((f"{kind} flush step {pair} B={B}", partial(step, L - 1)))
        initv = bd.random_state(Bv, H, dv, dk, seed=Bv, device="cuda")
        idxv = torch.arange(Bv, dtype=torch.int32, device="cuda")
        kwv = bd._kw(kind, S, Bv, T=T, seed=3, device="cuda")
        ov = torch.empty(Bv, T, H, dv, device="cuda")
        for pair in pairs:
            stv = ReplayStore.from_state(initv, bd._pair(pair, L)[0], kind, key_heads=HK,
                                         max_drafts=T)

            def verify(f=f, st=stv, kw=kwv, idx=idxv, o=ov, L=L):
                st.committed.fill_(L // 2)
                f["verify"](st, **kw, state_indices=idx, out=o)
                replay_accept(st, torch.zeros_like(idx), idx, check=False)  # reject all
            out.append((f"{kind} verify T={T} {pair} B={Bv} h={L // 2}", verify))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="gdn,mamba2")
    ap.add_argument("--pairs", default="s32_rs,tp4_hi32")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--verify-batch", type=int, default=512)
    ap.add_argument("--T", type=int, default=4)
    ap.add_argument("--only", default="", help="profile only the cases whose name has this text")
    a = ap.parse_args(argv)
    if bd.no_gpu("ncu_decode_drive"):
        return 2
    cs = [c for c in cases(a.kinds.split(","), a.pairs.split(","), a.batch, a.verify_batch, a.T)
          if a.only in c[0]]
    for _, fn in cs:                      # compile and warm every launch outside the profiler
        fn()
    torch.cuda.synchronize()
    for name, fn in cs:
        print(f"== case: {name}", flush=True)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
