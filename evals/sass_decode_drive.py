"""Driver for `compile_check record` (the Triton interpreter): decode kernels at the benchmark's
layer shapes, two rows, with the launch configuration the H200 runs at B = 256, so that
`compile_check sass` can count each kernel's SASS instructions (the read kernel has no runtime
loop: its static count is what one program executes).

* GDN, Qwen3.5-4B layer (16 key heads, 32 value heads, d_k = d_v = 128): two decode steps per
  read format with read_variant 'dots' (16 rows, 1 warp), then a verify of T = 4 drafts;
* Mamba-2, Nemotron-H layer (128 heads of 64, state 128, 8 groups): two decode steps per read
  format ('block' read, 32 rows, 4 warps);
* both kinds at batch 1: a forced step (path='flush', split and one launch) per pair, the
  small-batch dispatch whose flush kernel issues its anchor load before the pointers (FORCE).

    TRITON_INTERPRET=1 python -m replayquant.kernels.compile_check record /tmp/l.json -- \
        evals/sass_decode_drive.py
    python -m replayquant.kernels.compile_check sass /tmp/l.json --kernel _replay_read_kernel --ops 24
"""

import torch

from replayquant.bench.decode import (gdn_params, gdn_step_inputs, mamba2_params,
                                      mamba2_step_inputs)
from replayquant.kernels.replay_decode import ReplayStore, replay_gdn_step, replay_mamba2_step
from replayquant.kernels.verify import replay_accept, replay_gdn_verify

PAIRS = ("s32_rs", "tp8_hi32", "tp4_hi32", "tp4_hi16_sr")
B = 2
for pair in PAIRS:
    HK, H, D = 16, 32, 128
    init = torch.randn(B, H, D, D, generator=torch.Generator().manual_seed(0)) * 0.1
    store = ReplayStore.from_state(init, pair, "gdn", key_heads=HK, seed=3, layer=2,
                                   max_drafts=4)
    A_log, dt_bias = gdn_params(H, seed=1)
    for step in range(2):                       # the second step reads committed entries
        q, k, v, a, b = gdn_step_inputs(B, HK, H, D, D, seed=step)
        replay_gdn_step(store, q, k, v, a, b, A_log, dt_bias, path="replay", launch="split",
                        read_variant="dots", block_v=16, num_warps=1)
    q, k, v, a, b = gdn_step_inputs(B, HK, H, D, D, T=4, seed=9)
    replay_gdn_verify(store, q, k, v, a, b, A_log, dt_bias)
    replay_accept(store, torch.tensor([2, 4]))
    print("gdn", pair, "done", flush=True)
for pair in PAIRS:
    G, H, P, N = 8, 128, 64, 128
    init = torch.randn(B, H, P, N, generator=torch.Generator().manual_seed(0)) * 0.1
    store = ReplayStore.from_state(init, pair, "mamba2", key_heads=G, seed=3, layer=2)
    A, Dskip, dt_bias = mamba2_params(H, seed=1)
    for step in range(2):
        x, dt, Bm, C, z = mamba2_step_inputs(B, G, H, N, P, seed=step)
        replay_mamba2_step(store, x, dt, A, Bm, C, D=Dskip, z=z, dt_bias=dt_bias, path="replay",
                           launch="split", read_variant="block", block_v=32, num_warps=4)
    print("mamba2", pair, "done", flush=True)
for pair in ("s32_rs", "tp8_hi32"):                 # batch 1, forced steps
    init = torch.randn(1, 32, 128, 128, generator=torch.Generator().manual_seed(0)) * 0.1
    store = ReplayStore.from_state(init, pair, "gdn", key_heads=16, seed=3, layer=2)
    A_log, dt_bias = gdn_params(32, seed=1)
    q, k, v, a, b = gdn_step_inputs(1, 16, 32, 128, 128, seed=0)
    init = torch.randn(1, 128, 64, 128, generator=torch.Generator().manual_seed(0)) * 0.1
    m2 = ReplayStore.from_state(init, pair, "mamba2", key_heads=8, seed=3, layer=2)
    A, Dskip, dt_bias2 = mamba2_params(128, seed=1)
    x, dt, Bm, C, z = mamba2_step_inputs(1, 8, 128, 128, 64, seed=0)
    for launch in ("split", "fused"):
        replay_gdn_step(store, q, k, v, a, b, A_log, dt_bias, path="flush", launch=launch)
        replay_mamba2_step(m2, x, dt, A, Bm, C, D=Dskip, z=z, dt_bias=dt_bias2, path="flush",
                           launch=launch)
    print("batch 1 forced", pair, "done", flush=True)
