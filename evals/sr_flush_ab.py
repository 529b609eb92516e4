"""The flush step (every row flushes) and the 'dots' read step (h = L / 2) of one pair at batch B,
both kinds, timed with whichever replayquant comes first on sys.path: an A/B of two code versions
in one device call. Session 11 ran it on ab6637e's split-form Philox counters against its parent:

    git archive 1c0ff22 replayquant configs | tar -x -C .gpu/pre    (then drop replayquant/assets)
    (cd .gpu/pre && PYTHONPATH=$PWD python3 ../../evals/sr_flush_ab.py)    # version A
    PYTHONPATH=$PWD python3 evals/sr_flush_ab.py                           # version B

Times as in the bench (CUDA graph of 4 calls, L2 flushed before each replay); the state is not
rotated (one copy of 0.5-1 GB, larger than the L2 anyway). Prints which package it timed."""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="tp4_hi16_sr")
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args(argv)
    import replayquant                   # whichever comes first on sys.path: the version timed
    from replayquant.bench import decode as bd
    if bd.no_gpu("sr_flush_ab"):
        return 2
    from replayquant.kernels.replay_decode import ReplayStore
    print(replayquant.__file__)
    B = a.batch
    for kind in ("mamba2", "gdn"):
        S, L, f = bd.SHAPES[kind], bd.PAIR_L[kind], bd._fns(kind)
        init = bd.random_state(B, S["H"], S["dv"], S["dk"], seed=B, device="cuda")
        st = ReplayStore.from_state(init, bd._pair(a.pair, L)[0], kind, key_heads=S["HK"])
        del init
        idx = torch.arange(B, dtype=torch.int32, device="cuda")
        kw = bd._kw(kind, S, B, seed=1, device="cuda")
        out = torch.empty(B, S["H"], S["dv"], device="cuda")
        for fill, name in ((L - 1, "flush"), (L // 2, "read")):
            st.committed.fill_(fill)
            ms = bd.time_calls(lambda: f["step"](st, **kw, state_indices=idx, out=out,
                                                 path="replay", advance=False, launch="split",
                                                 read_variant="dots"), 4)
            print(kind, name, round(ms * 1e3, 1), "us", flush=True)
        del st
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
