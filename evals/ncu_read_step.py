"""One replay step under Nsight Compute (the `ncu` job of evals/gpu_runs.sh): three steps at
committed fill h (default L/2, a read step; L - 1: a flush step), pointers held, of one layer
kind and pair at a batch, on the bench's shapes and inputs; ncu profiles the second step's
launches (the first step compiles): the flush launch (on a read step its programs all return),
then the read launch. The counters are ncu's.

    ncu -k regex:_replay_kernel --launch-skip 2 --launch-count 2 python3 evals/ncu_read_step.py \
        [KIND [PAIR [B [H]]]]
"""

import sys

import torch

from replayquant.testing import random_state
from replayquant.bench.kernels.grid import PAIR_L, SHAPES, kernel_fns, kernel_inputs, load_pair
from replayquant.bench.kernels.timing import no_gpu
from replayquant.replay.stores import ReplayStore


def main(argv) -> int:
    kind = argv[0] if argv else "gdn"
    pair = argv[1] if len(argv) > 1 else "tp4_hi32"
    B = int(argv[2]) if len(argv) > 2 else 256
    if no_gpu("ncu_read_step"):
        return 1
    S = SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    L = PAIR_L[kind]
    h = int(argv[3]) if len(argv) > 3 else L // 2
    f = kernel_fns(kind)
    kw = kernel_inputs(kind, S, B, seed=1, device="cuda")
    idx = torch.arange(B, dtype=torch.int32, device="cuda")
    st = ReplayStore.from_state(random_state(B, H, dv, dk, seed=B, device="cuda"),
                                load_pair(pair, L)[0], kind, key_heads=HK)
    for _ in range(3):
        st.committed.fill_(h)
        f["step"](st, **kw, state_indices=idx, path="replay", advance=False)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
