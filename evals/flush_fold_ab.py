"""The flush kernel's two folds on a GPU (replay_decode.FLUSH_FOLD 'seq' vs 'dots'): for each
layer kind and pair at batch B, the same flush step (a full buffer, h = L - 1) under both folds,
compared (outputs, anchor) and timed with the bench's rows (window, read step, flush step).

    python evals/flush_fold_ab.py OUT.json [--batch 256] [--pairs s32_rs,tp8_hi32,tp4_hi32]

Writes OUT.json with provenance and prints a markdown table (issue 4)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from replayquant.bench import decode as bd
from replayquant.kernels import replay_decode as rd
from replayquant.provenance import provenance


def flush_outputs(kind, B, pair, L, fold, device="cuda"):
    """y and anchor after one flush step from a buffer filled by L - 1 read steps."""
    rd.FLUSH_FOLD = fold
    S = bd.SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    st = rd.ReplayStore.from_state(bd.random_state(B, H, dv, dk, seed=7, device=device),
                                   bd._pair(pair, L)[0], kind, key_heads=HK, seed=3)
    f = bd._fns(kind)
    for s in range(L):
        y = f["step"](st, **bd._kw(kind, S, B, seed=10 + s, device=device), path="replay",
                      launch="split")
    assert int(st.n_flush.min()) == 1
    return y.float(), st.anchor.dequantize().float()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--pairs", default="s32_rs,tp8_hi32,tp4_hi32")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("flush_fold_ab: needs a CUDA GPU", file=sys.stderr)
        return 2
    copy_bw = bd.copy_bandwidth_GBps("cuda")
    rows, checks = [], {}
    for kind in ("gdn", "mamba2"):
        L = bd.PAIR_L[kind]
        for pair in a.pairs.split(","):
            (ys, As), (yd, Ad) = (flush_outputs(kind, 32, pair, L, f) for f in ("seq", "dots"))
            checks[f"{kind}/{pair}"] = dict(
                max_rel_y=float((ys - yd).abs().max() / ys.abs().max()),
                max_rel_anchor=float((As - Ad).abs().max() / As.abs().max()))
            print(kind, pair, checks[f"{kind}/{pair}"], flush=True)
            for fold in ("seq", "dots"):
                rd.FLUSH_FOLD = fold
                got = bd.bench_replay(kind, a.batch, pair, L, "cuda", copy_bw, detail=True)
                rows += [{**r, "fold": fold} for r in got]
    rd.FLUSH_FOLD = "seq"
    res = {"provenance": provenance("cuda", script="evals/flush_fold_ab.py", batch=a.batch,
                                    pairs=a.pairs.split(","), L=dict(bd.PAIR_L),
                                    shapes=bd.SHAPES, check_batch=32),
           "copy_GBps": copy_bw, "checks": checks, "rows": rows}
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print("| kind | pair | kernel | seq us | dots us |\n| --- | --- | --- | ---: | ---: |")
    key = lambda r: (r["kind"], r["variant"], r["kernel"])  # noqa: E731
    seq = {key(r): r["us"] for r in rows if r["fold"] == "seq"}
    for r in rows:
        if r["fold"] == "dots":
            print(f"| {r['kind']} | {r['variant']} | {r['kernel']} | {seq[key(r)]:.1f} | "
                  f"{r['us']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
