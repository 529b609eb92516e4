"""How many row blocks one flush program takes (NT), on a GPU: the 'dots' replay window with
every row in phase (all rows flush in the same step, as `replayquant bench kernels` times it)
and staggered (row b starts at fill b % L, so about B / L rows flush in each step, as in
serving), for one-warp 16-row flush blocks at NT = 1, 2, 4, ... and the defaults
(replay_decode.FLUSH_BLOCK and _launch's rule for NT). NT trades the programs of
the rows that do not flush (each reads its pointers and returns: d_v / (16 NT) of them per
matrix in every step) against the latency of a program that does (NT folds one after the
other). With --side-stream both (default), each setting runs with the flush kernel on a side
stream beside the read kernels (replay_decode.FLUSH_SIDE_STREAM, the default) and without.

    python evals/flush_nt_stagger.py OUT.json [--batch 256] [--pairs s32_rs,tp8_hi32]
        [--side-stream both|on|off]

Times as in the bench (CUDA graph, L2 flushed, state copies rotated). Writes OUT.json with
provenance and prints a markdown table."""

from __future__ import annotations

import argparse
import json
import sys

from replayquant.bench import decode as bd
from replayquant.kernels import replay_decode as rd
from replayquant.provenance import provenance


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--pairs", default="s32_rs,tp8_hi32")
    ap.add_argument("--side-stream", choices=("both", "on", "off"), default="both")
    a = ap.parse_args(argv)
    sides = {"both": (True, False), "on": (True,), "off": (False,)}[a.side_stream]
    if bd.no_gpu("flush_nt_stagger"):
        return 2
    copy_bw = bd.copy_bandwidth_GBps("cuda")
    rows = []
    for side in sides:
        rd.FLUSH_SIDE_STREAM = side
        for kind in ("gdn", "mamba2"):
            L, dv = bd.PAIR_L[kind], bd.SHAPES[kind]["dv"]
            for pair in a.pairs.split(","):
                for nt in [None] + [n for n in (1, 2, 4, 8) if n <= dv // 16]:
                    cfg = {} if nt is None else {f"flush/{pair}": dict(flush_config=(16, 1, nt))}
                    got = bd.bench_replay_variant(kind, a.batch, pair, L, "cuda", copy_bw,
                                                  cfg=cfg)
                    rows += [{**r, "nt": nt or "default", "side_stream": side} for r in got]
                    print(f"{kind} {pair} NT={nt or 'default'} side={side}: " + ", ".join(
                        f"{r['kernel']} {r['us']:.1f} us" for r in got), flush=True)
    rd.FLUSH_SIDE_STREAM = True
    res = {"provenance": provenance("cuda", script="evals/flush_nt_stagger.py", batch=a.batch,
                                    pairs=a.pairs.split(","), L=dict(bd.PAIR_L),
                                    flush_block=str(rd.FLUSH_BLOCK), side_stream=a.side_stream,
                                    shapes=bd.SHAPES),
           "copy_GBps": copy_bw, "rows": rows}
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print("| side stream | kind | pair | NT | window | us per step |\n"
          "| --- | --- | --- | --- | --- | ---: |")
    for r in rows:
        print(f"| {r['side_stream']} | {r['kind']} | {r['variant']} | {r['nt']} | {r['kernel']} "
              f"| {r['us']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
