"""Static figures of the deferred-fold step's launch against today's read and flush launches
(no GPU: Triton's compiler and ptxas for sm_90, `compile_check`): registers, spilled bytes,
SASS instructions and the commonest opcodes, at the GDN Qwen3.5-4B layer shape (H = 32, HK = 16,
d_v = d_k = 128, L = 16) and the Mamba-2 Nemotron-H shape (H = 128, HK = 8, d_v = 64, d_k = 128,
L = 8), for the fold's tile configurations. Records the tiny launches of
tests/kernels/replay/compile_drive_fold.py in the interpreter and compiles them with the layer shapes' constexprs.

    PYTHONPATH=. python evals/fold_sass.py [--arch 90]
"""

import itertools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRIVE = ROOT / "tests" / "kernels" / "replay" / "compile_drive_fold.py"
SHAPES = {True: dict(HK=16, HV=32, DK=128, DV=128, BUFFER_LEN=16),        # GDN (DELTA)
          False: dict(HK=8, HV=128, DK=128, DV=64, BUFFER_LEN=8)}         # Mamba-2
# rows, warps, chunk columns, stages, q and k chunks loaded (QLOAD)
FOLD_TILES = ((64, 2, 32, 3, False), (64, 2, 32, 3, True), (64, 2, 16, 3, False),
              (64, 1, 16, 3, True), (64, 1, 32, 3, True), (32, 1, 32, 3, False),
              (32, 1, 32, 3, True), (16, 1, 32, 3, True), (128, 4, 32, 3, False))
OPS = ("HMMA", "HGMMA", "LDG", "STG", "LDGSTS", "SHFL", "BAR")


def _variants(launches):
    """(name, launch) at the layer shapes: the fold's tiles, today's read (64 rows, 1 warp, 32
    columns a chunk) and flush (32 rows, 1 warp, 8 tiles a program) launches."""
    out = []
    for ln in launches:
        c = ln["constexprs"]
        kind = "gdn" if c["DELTA"] else "mamba2"
        shape = SHAPES[c["DELTA"]]
        L = shape["BUFFER_LEN"]
        if ln["kernel"] == "_fold_read_kernel":
            for (rows, warps, ck, stages, qload), folds in itertools.product(
                    FOLD_TILES, (True, False)):
                if rows > shape["DV"]:
                    continue
                v = json.loads(json.dumps(ln))
                v["constexprs"].update(shape, BV=rows, CAPACITY=L + 1, BUFFER_TILE=16, CK=ck,
                                       STAGES=stages, QLOAD=qload, FOLDS=folds)
                v["num_warps"] = warps
                how = ("q k chunks loaded" if qload else "q k chunks from registers") \
                    + ("" if folds else "; the read path alone (FOLDS False)")
                out.append((f"{kind} fold {rows}x{warps} chunk {ck} stages {stages} {how}", v))
        elif not c["FUSED"]:
            v = json.loads(json.dumps(ln))
            flush = c["FLUSHES"]
            v["constexprs"].update(shape, BV=32 if flush else 64, CAPACITY=L, BUFFER_TILE=16,
                                   TPP=8 if flush else 1)
            v["num_warps"] = 1
            out.append((f"{kind} today's {'flush 32x1' if flush else 'read 64x1'}", v))
    return out


def main(argv) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    from replayquant.kernels.compile_check import print_sass_table, recorded
    arch = int(argv[argv.index("--arch") + 1]) if "--arch" in argv else 90
    launches = [ln for ln in recorded([DRIVE], ROOT)
                if not ln["constexprs"].get("QLOAD")]           # FOLD_TILES set it
    print_sass_table(_variants(launches), arch, OPS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
