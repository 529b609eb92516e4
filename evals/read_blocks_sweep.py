"""Read programs of several row blocks (`read_blocks`) and the packed-word read decode
(session 9), on a GPU: the 'dots' read step (h = L/2) at batch B for each read config
(block_v, num_warps, read_blocks), the 'dots' window in phase and staggered with the best, and
the conventional FP32 step beside them, both kinds, three pairs. The GPU checks run first:
kernel vs torch reference at the real head shapes (7 rows, one a padding row, L = 4 across a
flush), for one-block and many-block read programs.

    python evals/read_blocks_sweep.py OUT.json [--batch 256] [--pairs s32_rs,tp8_hi32,tp4_hi32]
        [--configs 16x1x1,16x1x2,...] [--kinds gdn,mamba2]

Times as in the bench (CUDA graph, L2 flushed; the windows rotate state copies). Writes OUT.json
with provenance and prints a markdown table."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from replayquant.bench import decode as bd
from replayquant.provenance import provenance

CONFIGS = "16x1x1,16x1x2,16x1x4,16x1x8,16x2x1,32x1x1,32x1x2,32x1x4,32x2x1,32x2x2,64x2x1,64x4x1"


def check(kind, pair, nts, device="cuda") -> dict:
    """Max relative output error of the split 'dots' step against the torch reference, 5 steps
    (L = 4: one flush per row), per read_blocks in nts; pointers equal."""
    from replayquant.kernels.replay_decode import ReplayStore
    from replayquant.pairs import PrecisionPair
    S = bd.SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    f = bd._fns(kind)
    idx = torch.tensor([5, -1, 0, 3, 1, 2, 4], dtype=torch.int32, device=device)
    init = bd.random_state(6, H, dv, dk, seed=1, device=device)
    P = PrecisionPair.load(pair).with_buffer_len(4)
    res = {}
    for nt in nts:
        st = ReplayStore.from_state(init, P, kind, key_heads=HK, seed=3)
        ref = st.clone()
        errs = []
        for i in range(5):
            kw = bd._kw(kind, S, idx.shape[0], seed=i, device=device)
            y = f["step"](st, **kw, state_indices=idx, path="replay", launch="split",
                          read_variant="dots", block_v=16, num_warps=1, read_blocks=nt)
            y2 = f["step_ref"](ref, **kw, state_indices=idx, path="replay")
            errs.append(bd._rel(y, y2) if torch.isfinite(y).all() else float("nan"))
        res[f"read_blocks={nt}"] = {
            "max_rel_y": max(errs),
            "pointers_equal": bool(torch.equal(st.committed, ref.committed)
                                   and torch.equal(st.n_flush, ref.n_flush)),
            "read": bd._state_cmp(st.read_role.dequantize(), ref.read_role.dequantize())}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--pairs", default="s32_rs,tp8_hi32,tp4_hi32")
    ap.add_argument("--kinds", default="gdn,mamba2")
    ap.add_argument("--configs", default=CONFIGS,
                    help="block_v x num_warps x read_blocks, comma-separated")
    a = ap.parse_args(argv)
    try:
        cfgs = [tuple(int(x) for x in c.split("x")) for c in a.configs.split(",")]
        assert all(len(c) == 3 for c in cfgs)
    except (ValueError, AssertionError):
        print(f"read_blocks_sweep: --configs {a.configs!r}: give block_v x num_warps x "
              "read_blocks triples such as 16x1x4,32x2x1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("read_blocks_sweep: needs a CUDA GPU (times are meaningless elsewhere)",
              file=sys.stderr)
        return 2
    kinds, pairs = a.kinds.split(","), a.pairs.split(",")
    checks = {}
    for kind in kinds:
        for pair in pairs:
            dv = bd.SHAPES[kind]["dv"]
            checks[f"{kind}/{pair}"] = check(kind, pair, (1, 2, dv // 16))
            print(kind, pair, checks[f"{kind}/{pair}"], flush=True)
    copy_bw = bd.copy_bandwidth_GBps("cuda")
    bd.VARIANT_CFGS["dots"] = cfgs
    rows = []
    for kind in kinds:
        got = bd.bench_conventional(kind, a.batch, "cuda", copy_bw)
        rows += got
        for pair in pairs:
            got = bd.bench_replay_variant(kind, a.batch, pair, bd.PAIR_L[kind], "cuda", copy_bw,
                                          detail=True)
            rows += got
            print(f"{kind} {pair}: " + ", ".join(
                f"{r['kernel']} {r.get('cfg', '')} {r['us']:.1f} us" for r in got), flush=True)
    res = {"provenance": provenance("cuda", script="evals/read_blocks_sweep.py", batch=a.batch,
                                    pairs=pairs, kinds=kinds, L=dict(bd.PAIR_L),
                                    configs=[list(c) for c in cfgs], shapes=bd.SHAPES),
           "copy_GBps": copy_bw, "checks": checks, "rows": bd._derive(rows)}
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print("| kind | kernel | pair | config | us | % copy | x conventional |\n"
          "| --- | --- | --- | --- | ---: | ---: | ---: |")
    for r in res["rows"]:
        cfg = r.get("cfg") or r.get("config") or ""
        pct, sp = r.get("pct_copy"), r.get("speedup_vs_conv_fp32")
        print(f"| {r['kind']} | {r['kernel']} | {r['variant']} | {cfg} | {r['us']:.1f} | "
              f"{'' if pct is None else f'{pct:.1f}'} | {'' if sp is None else f'{sp:.2f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
