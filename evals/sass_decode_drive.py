"""Driver for `compile_check record` (the Triton interpreter): one GDN replay decode step at the
Qwen3.5-4B layer shape (16 key heads, 32 value heads, d_k = d_v = 128) for each read format, with
the launch configuration the H200 runs at B = 256 (read_variant 'dots', 16 rows, 1 warp), two
rows, so that `compile_check sass` can count each kernel's SASS instructions.

    TRITON_INTERPRET=1 python -m replayquant.kernels.compile_check record /tmp/l.json -- \
        evals/sass_decode_drive.py
    python -m replayquant.kernels.compile_check sass /tmp/l.json --kernel _replay_read_kernel --ops 24
"""

import torch

from replayquant.bench.decode import gdn_params, gdn_step_inputs
from replayquant.kernels.replay_decode import ReplayStore, replay_gdn_step

B, HK, H, D = 2, 16, 32, 128
for pair in ("s32_rs", "tp8_hi32", "tp4_hi32", "tp4_hi16_sr"):
    init = torch.randn(B, H, D, D, generator=torch.Generator().manual_seed(0)) * 0.1
    store = ReplayStore.from_state(init, pair, "gdn", key_heads=HK, seed=3, layer=2)
    A_log, dt_bias = gdn_params(H, seed=1)
    for step in range(2):                       # the second step reads committed entries
        q, k, v, a, b = gdn_step_inputs(B, HK, H, D, D, seed=step)
        replay_gdn_step(store, q, k, v, a, b, A_log, dt_bias, path="replay", launch="split",
                        read_variant="dots", block_v=16, num_warps=1)
    print(pair, "done", flush=True)
