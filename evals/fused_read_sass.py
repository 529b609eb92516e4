"""Static figures of the decode step's flush inside the read launch ({'fused': 'read'}: one launch
on the read's 64-row tiles, a flushing row's program running the flush on its 16-row sub-tiles)
against today's read and flush launches (no GPU: Triton's compiler and ptxas for sm_90,
`compile_check`): registers, spilled bytes, SASS instructions and the commonest opcodes, for the
separate-copy pair tp8_hi32 (FP32 anchor, FP8 read copy) at the GDN Qwen3.5-4B layer (H = 32,
HK = 16, d_v = d_k = 128, L = 16) and
the Mamba-2 Nemotron-H layer (H = 128, HK = 8, d_v = 64, d_k = 128, L = 8), at register caps
None (ptxas's choice), 168 and 128. Records this script's own tiny steps in the interpreter
(`--drive`) and compiles them with the layer shapes' constexprs.

--pair tp4_hi32 (an NVFP4 read copy): today's flush takes whole matrices (GDN 8 warps, Mamba-2 4
at 168 registers, LAUNCH_TABLE) and no flush runs inside the read; with --carried the copy is
cast with a carried scale (ReplayStore.from_state(..., nvfp4_scale='carried')), the flush on
16-row tiles of one warp and inside the read's tiles as for tp8_hi32.

    PYTHONPATH=. python evals/fused_read_sass.py [--arch 90] [--pair tp4_hi32 [--carried]]
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {True: dict(HK=16, HV=32, DK=128, DV=128, BUFFER_LEN=16),        # GDN (DELTA)
          False: dict(HK=8, HV=128, DK=128, DV=64, BUFFER_LEN=8)}         # Mamba-2
CAPS = (None, 168, 128)
OPS = ("HMMA", "LDG", "STG", "SHFL", "BAR", "LDL", "STL")


def _options(argv) -> tuple:
    """(pair, carried) of the command line."""
    pair = argv[argv.index("--pair") + 1] if "--pair" in argv else "tp8_hi32"
    return pair, "--carried" in argv


def drive(pair: str, carried: bool) -> int:
    """Tiny GDN and Mamba-2 steps of `pair`: two launches, and one launch on the read's tiles
    (an NVFP4 role with a carried scale only); the one-pass verify with a pre-flush."""
    import torch

    from replayquant.kernels.replay.decode import replay_gdn_step, replay_mamba2_step
    from replayquant.kernels.replay.launch import override_replay_launch
    from replayquant.kernels.replay.verify import replay_gdn_verify, replay_mamba2_verify
    from replayquant.pairs import PrecisionPair
    from replayquant.replay.stores import ReplayStore
    from replayquant.testing import (gdn_params, gdn_step_inputs, mamba2_params,
                                     mamba2_step_inputs, random_state)
    B, H, D, L = 1, 2, 32, 2
    P = PrecisionPair.load(pair).with_buffer_len(L)
    opts = {"nvfp4_scale": "carried"} if carried else {}
    ways = (False, "read") if carried or "nvfp4" not in (P.anchor.format, P.read_spec.format) \
        else (False,)
    for kind in ("gdn", "mamba2"):
        for fused in ways:
            st = ReplayStore.from_state(random_state(B, H, D, D), P, kind, key_heads=1, **opts)
            for step in range(L):
                with override_replay_launch({"fused": fused}):
                    if kind == "gdn":
                        q, k, v, a, b = gdn_step_inputs(B, 1, H, D, D, seed=step)
                        replay_gdn_step(st, q, k, v, a, b, *gdn_params(H))
                    else:
                        x, dt, Bm, C, z = mamba2_step_inputs(B, 1, H, D, D, seed=step)
                        A, Dp, dtb = mamba2_params(H)
                        replay_mamba2_step(st, x, dt, A, Bm, C, D=Dp, z=z, dt_bias=dtb)
        for fused in ways:                      # the one-pass verify, T = 2, a pre-flush
            st = ReplayStore.from_state(random_state(B, H, D, D), P, kind, key_heads=1,
                                        max_drafts=2, **opts)
            st.committed.fill_(1)
            with override_replay_launch({"fused": fused}):
                if kind == "gdn":
                    q, k, v, a, b = gdn_step_inputs(B, 1, H, D, D, T=2, seed=9)
                    replay_gdn_verify(st, q, k, v, a, b, *gdn_params(H))
                else:
                    x, dt, Bm, C, z = mamba2_step_inputs(B, 1, H, D, D, T=2, seed=9)
                    A, Dp, dtb = mamba2_params(H)
                    replay_mamba2_verify(st, x, dt, A, Bm, C, D=Dp, z=z, dt_bias=dtb)
    del torch
    return 0


def _variants(launches, pair: str, carried: bool):
    """(name, launch) at the layer shapes: the fused read launch at each cap, today's read
    (64 rows, LAUNCH_TABLE's cap) and flush (16 rows, 8 tiles a program; an NVFP4 role without
    a carried scale: whole matrices) launches."""
    from replayquant.pairs import PrecisionPair
    P = PrecisionPair.load(pair)
    rfmt = P.read_spec.format
    whole = "nvfp4" in (P.anchor.format, rfmt) and not carried
    from replayquant.kernels.replay.launch import LAUNCH_TABLE, ONEPASS_TABLE
    out = []
    for ln in launches:
        c = ln["constexprs"]
        if ln["kernel"] == "_onepass_kernel":     # T = 4 drafts, bf16 q: 16 columns
            rows, warps, chunk, stages = next(r[1:5] for r in ONEPASS_TABLE if r[0] == "*")
            v = json.loads(json.dumps(ln))
            kind = "gdn" if c["DELTA"] else "mamba2"
            v["constexprs"].update(SHAPES[c["DELTA"]], CAPACITY=SHAPES[c["DELTA"]]["BUFFER_LEN"]
                                   + 4, BUFFER_TILE=16, T=4, TP=4, NCOL=16, BV=rows,
                                   FBV=16 if c["FUSED"] else rows, CK=chunk, STAGES=stages)
            v["num_warps"] = warps
            where = "inside, 16-row sub-tiles" if c["FUSED"] else "in a flush launch"
            for cap in (None, 128) if c["FUSED"] else (None,):
                w = dict(v, maxnreg=cap)
                out.append((f"{kind} one-pass verify T = 4, {rows}x{warps}, pre-flush {where}"
                            f"{'' if cap is None else f', cap {cap}'}", w))
            continue
        if ln["kernel"] != "_replay_kernel" or c["T"] != 1:
            continue
        kind = "gdn" if c["DELTA"] else "mamba2"
        shape = SHAPES[c["DELTA"]]
        read = next(r for r in LAUNCH_TABLE if r[0] == "read" and r[1] in ("*", kind)
                    and r[2] in ("*", rfmt))
        warps = max(1, 64 * shape["DK"] // (32 * read[4]))
        v = json.loads(json.dumps(ln))
        v["constexprs"].update(shape, CAPACITY=shape["BUFFER_LEN"], BUFFER_TILE=16,
                               PCK=read[6])
        v["num_warps"] = warps if not c["FLUSHES"] else 1
        if c["FUSED"]:
            for cap in CAPS:
                w = json.loads(json.dumps(v))
                w["constexprs"].update(BV=64, FBV=16, TPP=1)
                w["maxnreg"] = cap
                out.append((f"{kind} fused read 64x{warps}, flush 16-row sub-tiles, "
                            f"cap {cap}", w))
        elif c["FLUSHES"] and whole:
            flush = next(r for r in LAUNCH_TABLE if r[0] == "flush" and r[1] in ("*", kind)
                         and r[2] == "nvfp4")
            fw = shape["DV"] * shape["DK"] // (32 * flush[4])
            v["constexprs"].update(BV=shape["DV"], FBV=shape["DV"], TPP=1)
            v["num_warps"], v["maxnreg"] = fw, flush[5]
            out.append((f"{kind} today's flush, whole matrices {shape['DV']}x{fw} cap "
                        f"{flush[5]}", v))
        elif c["FLUSHES"]:
            v["constexprs"].update(BV=16, FBV=16, TPP=8)
            out.append((f"{kind} {'carried-scale' if carried else 'today' + chr(39) + 's'} "
                        f"flush 16x1", v))
        else:
            v["constexprs"].update(BV=64, FBV=64, TPP=1)
            v["maxnreg"] = read[5]
            out.append((f"{kind} today's read 64x{warps} cap {read[5]}", v))
    return out


def main(argv) -> int:
    pair, carried = _options(argv)
    if "--drive" in argv:
        return drive(pair, carried)
    os.environ.pop("TRITON_INTERPRET", None)
    from replayquant.kernels.compile_check import print_sass_table, recorded
    arch = int(argv[argv.index("--arch") + 1]) if "--arch" in argv else 90
    given = ["--pair", pair] + (["--carried"] if carried else [])
    print(f"pair {pair}{', carried scale' if carried else ''}")
    print_sass_table(_variants(recorded([__file__, "--drive", *given], ROOT), pair, carried),
                     arch, OPS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
