"""Launch configs of the flush kernel on a GPU, beside the conventional FP32 step: at small batch
the s32_rs forced flush (path='flush', the dispatch below DISPATCH_THRESHOLD; the batch-1
target), with --flush-step the replay flush step (h = L - 1) of --pairs, both layer kinds, for
several (rows, warps) blocks. The config sweep of `replayquant bench kernels` runs at B = 256
only, on three flush blocks (issue 4).

    python evals/small_batch_flush.py OUT.json [--batches 1,8]
    python evals/small_batch_flush.py OUT.json --batches 256 --flush-step --blocks 16x2,32x4,32x8

Times as in the bench (CUDA graph, L2 flushed, state copies rotated). Writes OUT.json with
provenance and prints a markdown table."""

from __future__ import annotations

import argparse
import json
import sys

from replayquant.bench import decode as bd
from replayquant.provenance import provenance

FLUSH_BLOCKS = [(8, 1), (16, 1), (16, 2), (32, 2), (32, 4)]
CONV_BLOCKS = [(8, 1), (16, 1), (16, 2), (32, 4)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--flush-step", action="store_true",
                    help="time the replay flush step (h = L - 1) instead of the forced flush")
    ap.add_argument("--pairs", default="s32_rs", help="pairs of the flush rows (comma list)")
    ap.add_argument("--blocks", default=None, help="flush blocks as ROWSxWARPS,... "
                    f"(default {','.join(f'{r}x{w}' for r, w in FLUSH_BLOCKS)})")
    a = ap.parse_args(argv)
    blocks = FLUSH_BLOCKS if a.blocks is None else \
        [tuple(int(x) for x in b.split("x")) for b in a.blocks.split(",")]
    kernel = "replay-flush-step" if a.flush_step else "replay-forced-flush-layer"
    if bd.no_gpu("small_batch_flush"):
        return 2
    batches = [int(x) for x in a.batches.split(",")]
    copy_bw = bd.copy_bandwidth_GBps("cuda")
    rows = []
    for kind in ("gdn", "mamba2"):
        L = bd.PAIR_L[kind]
        for B in batches:
            for bv, nw in CONV_BLOCKS:
                cfg = {"conventional/fp32": dict(block_v=bv, num_warps=nw)}
                for r in bd.bench_conventional(kind, B, "cuda", copy_bw, cfg=cfg):
                    if r["variant"] == "fp32":
                        rows.append({**r, "block": [bv, nw]})
            for pair in a.pairs.split(","):
                for bv, nw in blocks:
                    cfg = {f"flush/{pair}": dict(flush_config=(bv, nw))}
                    try:
                        got = bd.bench_replay(kind, B, pair, L, "cuda", copy_bw, cfg=cfg,
                                              forced=not a.flush_step, detail=a.flush_step)
                    except ValueError as e:         # a block the pair cannot take (NVFP4)
                        print(f"  {kind} {pair} {bv}x{nw}: {e}", flush=True)
                        continue
                    rows += [{**r, "block": [bv, nw]} for r in got if r["kernel"] == kernel]
    res = {"provenance": provenance("cuda", script="evals/small_batch_flush.py", batches=batches,
                                    pairs=a.pairs.split(","), kernel=kernel,
                                    L=dict(bd.PAIR_L), shapes=bd.SHAPES, flush_blocks=blocks,
                                    conv_blocks=CONV_BLOCKS),
           "copy_GBps": copy_bw, "rows": rows}
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print("| kind | B | kernel | pair | rows, warps | us |\n| --- | ---: | --- | --- | --- | ---: |")
    for r in rows:
        print(f"| {r['kind']} | {r['B']} | {r['kernel']} | {r['variant']} | {tuple(r['block'])} "
              f"| {r['us']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
