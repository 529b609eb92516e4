"""Where the batch-1 gap comes from (issue 4): the conventional FP32 step timed three ways on one
GPU, alternating, at small batch, both layer kinds.

* conv-fresh: on ConventionalStore.from_state copies, as the bench's `conventional` row;
* conv-on-anchor: the same kernel on ConventionalStore views of ReplayStore anchors (the memory
  the replay path's forced step writes), rotated the same way;
* replay-forced-auto-layer: the replay step itself (path='flush', buffers known empty, no
  pointer kernel), as the bench's row of that name.

Session 7 found conv-fresh 3.1 us against replay-forced-auto-layer 3.5 us for GDN at B = 1 with
one identical compiled launch. If conv-on-anchor reads like the replay row, the gap is in the
memory the kernel touches, not in the path. Also records each anchor's offset in a 2 MiB page.

    python evals/batch1_gap.py OUT.json [--batches 1,8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from replayquant.bench import decode as bd
from replayquant.provenance import provenance

PAGE = 2 ** 21


def _setup(kind, B, device):
    from replayquant.kernels.conventional import ConventionalStore
    from replayquant.kernels.replay_decode import ReplayStore
    S = bd.SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    init = bd.random_state(B, H, dv, dk, seed=B, device=device)
    R = bd._rotations(B * H * bd.state_bytes("fp32", dv, dk), device)
    P, _, _ = bd._pair("s32_rs", bd.PAIR_L[kind])
    fresh = [ConventionalStore.from_state(init, "fp32") for _ in range(R)]
    sts = [ReplayStore.from_state(init, P, kind, key_heads=HK) for _ in range(R)]
    return S, R, fresh, sts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    if bd.no_gpu("batch1_gap"):
        return 2
    dev = "cuda"
    batches = [int(x) for x in a.batches.split(",")]
    copy_bw = bd.copy_bandwidth_GBps(dev)
    rows = []
    for kind in ("gdn", "mamba2"):
        f = bd._fns(kind)
        for B in batches:
            S, R, fresh, sts = _setup(kind, B, dev)
            kw = bd._kw(kind, S, B, seed=1, device=dev)
            idx = torch.arange(B, dtype=torch.int32, device=dev)
            out = torch.empty(B, S["H"], S["dv"], device=dev)
            ways = {"conv-fresh": bd.conv_calls(f, kw, idx, out, fresh),
                    **bd.anchor_ways(f, kw, idx, out, sts)}
            off = {"conv-fresh": [c.state.payload.data_ptr() % PAGE for c in fresh],
                   "anchor": [s.anchor.payload.data_ptr() % PAGE for s in sts]}

            def report(name, rep, ms, kind=kind, B=B, R=R):
                rows.append({"kind": kind, "B": B, "way": name, "repeat": rep, "rot": R,
                             "us": ms * 1e3})
                print(f"{kind} B={B} {name:26s} rep {rep}: {ms * 1e3:7.2f} us", flush=True)
            bd.alternate_ms(ways, R, a.repeats, report)
            rows.append({"kind": kind, "B": B, "way": "page-offsets", "offsets": off})
            del fresh, sts, ways
            torch.cuda.empty_cache()
    res = {"provenance": provenance(dev, script="evals/batch1_gap.py", batches=batches,
                                    repeats=a.repeats, shapes=bd.SHAPES),
           "copy_GBps": copy_bw, "rows": rows}
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
