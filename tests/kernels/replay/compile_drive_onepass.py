"""Driver for tests/kernels/replay/test_compile_onepass.py (run under `compile_check record`, so
in the Triton interpreter): one verify of the one-pass design (design='onepass') per layer kind
and read format at tiny shapes with a bf16 q, and with a float32 q (three bf16 parts) on an FP32
copy.

    python tests/kernels/replay/compile_drive_onepass.py
"""

import sys

import torch

from replayquant.testing import (gdn_params, gdn_step_inputs, mamba2_params,
                                 mamba2_step_inputs, random_state)
from replayquant.replay.stores import ReplayStore
from replayquant.kernels.replay.verify import replay_gdn_verify, replay_mamba2_verify
from replayquant.pairs import PrecisionPair

PAIRS = ("s32_rs", "s16_sr", "tp8_hi32", "tp4_hi32")       # read copy FP32, FP16, FP8, NVFP4
B, H, D, T, L = 1, 2, 16, 2, 4


def main() -> int:
    for kind in ("gdn", "mamba2"):
        for pair in PAIRS:
            for qdtype in (torch.bfloat16,) + ((torch.float32,) if pair == "s32_rs" else ()):
                st = ReplayStore.from_state(random_state(B, H, D, D),
                                            PrecisionPair.load(pair).with_buffer_len(L), kind,
                                            key_heads=1, max_drafts=T)
                if kind == "gdn":
                    q, k, v, a, b = gdn_step_inputs(B, 1, H, D, D, T=T)
                    replay_gdn_verify(st, q.to(qdtype), k, v, a, b, *gdn_params(H),
                                      design="onepass")
                else:
                    x, dt, Bm, C, z = mamba2_step_inputs(B, 1, H, D, D, T=T)
                    A, Dp, dtb = mamba2_params(H)
                    replay_mamba2_verify(st, x, dt, A, Bm, C.to(qdtype), D=Dp, z=z, dt_bias=dtb,
                                         design="onepass")
    print("onepass drive done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
