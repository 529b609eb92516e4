"""Read programs of several row blocks (`read_blocks`) and the packed-word read decode
(session 9), on a GPU: the 'dots' read step (h = L/2) at batch B for each read config
(block_v, num_warps, read_blocks), the 'dots' window in phase and staggered with the best, and
the conventional FP32 step beside them, both kinds, three pairs. The GPU checks run first:
kernel vs torch reference at the real head shapes (7 rows, one a padding row, L = 4 across a
flush), for one-block and many-block read programs. With --verify-batches, the speculative
rounds (T = 4, the bench's rounds and snapshot baseline) for each of --verify-configs instead
of the decode step (the verify read's configs were never timed with read_blocks).

    python evals/read_blocks_sweep.py OUT.json [--batch 256] [--pairs s32_rs,tp8_hi32,tp4_hi32]
        [--configs 16x1x1,16x1x2,...] [--kinds gdn,mamba2]
        [--verify-batches 32,512 --verify-configs 16x1x1,16x2x1,...]

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
VERIFY_CONFIGS = "16x1x1,16x2x1,16x1x2,32x1x1,32x2x1"


def parse_configs(text: str) -> list:
    """'16x1x4,32x2x1' -> [(16, 1, 4), (32, 2, 1)] (block_v, num_warps, read_blocks)."""
    cfgs = [tuple(int(x) for x in c.split("x")) for c in text.split(",")]
    if not cfgs or any(len(c) != 3 for c in cfgs):
        raise ValueError(text)
    return cfgs


def step_rows(kinds, B, pairs, cfgs, device, copy_bw) -> list:
    """The conventional steps and, per pair, the 'dots' read step for each read config (block_v,
    num_warps, read_blocks) and the windows with the best (the bench's detail sweep)."""
    rows = []
    saved = bd.VARIANT_CFGS["dots"]
    bd.VARIANT_CFGS["dots"] = cfgs
    try:
        for kind in kinds:
            rows += bd.bench_conventional(kind, B, device, copy_bw)
            for pair in pairs:
                got = bd.bench_replay_variant(kind, B, pair, bd.PAIR_L[kind], device, copy_bw,
                                              detail=True)
                rows += got
                print(f"{kind} {pair}: " + ", ".join(
                    f"{r['kernel']} {r.get('cfg', '')} {r['us']:.1f} us" for r in got), flush=True)
    finally:
        bd.VARIANT_CFGS["dots"] = saved
    return rows


def verify_rows(kinds, batches, pairs, cfgs, device, copy_bw, T=4) -> list:
    """The bench's speculative rounds (replay verify + accept, its no-flush and block-read
    variants, once the snapshot baseline per (kind, batch)) for each read config (block_v,
    num_warps, read_blocks), each row tagged with its 'cfg'."""
    rows = []
    for kind in kinds:
        dv = bd.SHAPES[kind]["dv"]
        for B in batches:
            base = False
            for pair in pairs:
                for bv, nw, nt in cfgs:
                    if bv * nt > dv:
                        continue
                    c = {f"verify/{pair}": dict(block_v=bv, num_warps=nw, read_blocks=nt)}
                    for r in bd.bench_spec(kind, B, T, device, copy_bw, cfg=c, pairs=(pair,)):
                        if r["kernel"].startswith("spec-snapshot"):
                            if base:
                                continue
                            rows.append(r)
                        else:
                            rows.append({**r, "cfg": [bv, nw, nt]})
                    base = True
    return rows


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
    ap.add_argument("--verify-batches", default="",
                    help="time the speculative rounds (T = 4) at these batches instead")
    ap.add_argument("--verify-configs", default=VERIFY_CONFIGS)
    a = ap.parse_args(argv)
    try:
        cfgs = parse_configs(a.configs)
        vcfgs = parse_configs(a.verify_configs)
        vbatches = [int(b) for b in a.verify_batches.split(",") if b]
    except ValueError:
        print(f"read_blocks_sweep: --configs {a.configs!r} / --verify-configs "
              f"{a.verify_configs!r} / --verify-batches {a.verify_batches!r}: give block_v x "
              "num_warps x read_blocks triples such as 16x1x4,32x2x1 and batches such as 32,512",
              file=sys.stderr)
        return 2
    if bd.no_gpu("read_blocks_sweep"):
        return 2
    kinds, pairs = a.kinds.split(","), a.pairs.split(",")
    checks = {}
    for kind in kinds:
        for pair in pairs:
            dv = bd.SHAPES[kind]["dv"]
            checks[f"{kind}/{pair}"] = check(kind, pair, (1, 2, dv // 16))
            print(kind, pair, checks[f"{kind}/{pair}"], flush=True)
    copy_bw = bd.copy_bandwidth_GBps("cuda")
    if vbatches:
        rows = verify_rows(kinds, vbatches, pairs, vcfgs, "cuda", copy_bw)
    else:
        rows = step_rows(kinds, a.batch, pairs, cfgs, "cuda", copy_bw)
    res = {"provenance": provenance("cuda", script="evals/read_blocks_sweep.py", batch=a.batch,
                                    pairs=pairs, kinds=kinds, L=dict(bd.PAIR_L),
                                    configs=[list(c) for c in (vcfgs if vbatches else cfgs)],
                                    verify_batches=vbatches, shapes=bd.SHAPES),
           "copy_GBps": copy_bw, "checks": checks, "rows": bd._derive(rows)}
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(bd.rows_table([{**r, "cfg": r.get("cfg") or r.get("config") or ""}
                         for r in res["rows"]], extra=("cfg",)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
