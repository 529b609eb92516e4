"""Driver for tests/kernels/replay/test_compile_fold.py and evals/fold_sass.py (run under
`compile_check record`, so in the Triton interpreter): at tiny shapes, L + 1 steps of the
deferred-fold design (design='deferred-fold': a read step, then the fold) and of today's eager
step (its flush launch and read launch) per kind, GDN and Mamba-2 with a shared FP32 pair.

    python tests/kernels/replay/compile_drive_fold.py
"""

import sys

import torch

from replayquant.kernels.replay.fold import replay_gdn_step, replay_mamba2_step
from replayquant.kernels.replay.launch import override_replay_launch
from replayquant.pairs import PrecisionPair
from replayquant.replay.stores import ReplayStore
from replayquant.testing import (gdn_params, gdn_step_inputs, mamba2_params,
                                 mamba2_step_inputs, random_state)

B, H, D, L = 1, 2, 32, 2


# the step's launch options per design: the fold with q and k chunks from the front end's
# registers and loaded from the inputs (FOLD_TABLE's qload); today's two launches
LAUNCHES = (("deferred-fold", {"fold": (16, 1, None, None, False)}),
            ("deferred-fold", {"fold": (16, 1, None, None, True)}),
            ("eager-flush", {"read": (16, 1), "fused": False}))


def main() -> int:
    for kind in ("gdn", "mamba2"):
        for design, launch in LAUNCHES:
            st = ReplayStore.from_state(random_state(B, H, D, D),
                                        PrecisionPair.load("s32_rs").with_buffer_len(L), kind,
                                        key_heads=1, max_drafts=1, u_dtype=torch.float32)
            for step in range(L + 1):
                _step(kind, st, step, design, launch)
    print("fold drive done", flush=True)
    return 0


def _step(kind, st, step, design, launch):
    with override_replay_launch(launch):
        if kind == "gdn":
            q, k, v, a, b = gdn_step_inputs(B, 1, H, D, D, seed=step)
            replay_gdn_step(st, q, k, v, a, b, *gdn_params(H), design=design)
        else:
            x, dt, Bm, C, z = mamba2_step_inputs(B, 1, H, D, D, seed=step)
            A, Dp, dtb = mamba2_params(H)
            replay_mamba2_step(st, x, dt, A, Bm, C, D=Dp, z=z, dt_bias=dtb,
                               design=design)


if __name__ == "__main__":
    sys.exit(main())
