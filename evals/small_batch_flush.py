"""Launch configs of the small-batch decode step on a GPU: the conventional FP32 step and the
s32_rs forced flush (path='flush', the dispatch below DISPATCH_THRESHOLD) at batch 1 and 8, both
layer kinds, for several (rows, warps) blocks of the flush kernel. The config sweep of
`replayquant bench kernels` runs at B = 256 only; this is the batch-1 target's sweep (issue 4).

    python evals/small_batch_flush.py OUT.json [--batches 1,8]

Times as in the bench (CUDA graph, L2 flushed, state copies rotated). Writes OUT.json with
provenance and prints a markdown table."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from replayquant.bench import decode as bd
from replayquant.provenance import provenance

FLUSH_BLOCKS = [(8, 1), (16, 1), (16, 2), (32, 2), (32, 4)]
CONV_BLOCKS = [(8, 1), (16, 1), (16, 2), (32, 4)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--batches", default="1,8")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("small_batch_flush: needs a CUDA GPU (times are meaningless elsewhere)", file=sys.stderr)
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
            for bv, nw in FLUSH_BLOCKS:
                cfg = {"flush/s32_rs": dict(flush_config=(bv, nw))}
                got = bd.bench_replay(kind, B, "s32_rs", L, "cuda", copy_bw, cfg=cfg, forced=True)
                rows += [{**r, "block": [bv, nw]} for r in got
                         if r["kernel"] == "replay-forced-flush-layer"]
    res = {"provenance": provenance("cuda", script="evals/small_batch_flush.py", batches=batches,
                                    pair="s32_rs", L=dict(bd.PAIR_L), shapes=bd.SHAPES,
                                    flush_blocks=FLUSH_BLOCKS, conv_blocks=CONV_BLOCKS),
           "copy_GBps": copy_bw, "rows": rows}
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print("| kind | B | kernel | rows, warps | us |\n| --- | ---: | --- | --- | ---: |")
    for r in rows:
        print(f"| {r['kind']} | {r['B']} | {r['kernel']} | {tuple(r['block'])} | {r['us']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
