"""Time the tp4_hi16_sr flush step (every row flushes) and 'dots' read step at B = 256, both kinds,
with whichever replayquant is first on sys.path: an A/B of two code versions in one device call
(session 11: ab6637e's split-form Philox bits against its parent 1c0ff22, unpacked with
`git archive 1c0ff22 replayquant` plus configs/ into a folder run as PYTHONPATH=<folder>).
Times as in the bench (CUDA graph, L2 flushed; no state rotation: 1 GB of state per copy)."""
import sys, torch
import replayquant
from replayquant.bench import decode as bd
print(replayquant.__file__)
for kind in ("mamba2", "gdn"):
    L = bd.PAIR_L[kind]
    H, HK, dv, dk, f, idx, kw, out, af, rf, c, R, sts = bd._replay_setup(kind, 256, "tp4_hi16_sr", L, "cuda", None, None, "dots")
    st = sts[0]
    for fill, name in ((L - 1, "flush"), (L // 2, "read")):
        st.committed.fill_(fill)
        ms = bd.time_calls(lambda: f["step"](st, **kw, state_indices=idx, out=out, path="replay", advance=False, launch="split", read_variant="dots"), 4)
        print(kind, name, round(ms * 1e3, 1), "us", flush=True)
    del sts, st
    torch.cuda.empty_cache()
