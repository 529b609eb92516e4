"""Driver for `compile_check record` (the Triton interpreter) behind the static SASS counts that
session 6 quotes (evals/decode_kernels_notes.md, "Session 6"), at the benchmark's layer shapes,
two rows:

* the GDN 'dots' read step at committed = 8 (16 rows, 1 warp), FP32 and NVFP4 read copies;
* the flush step at h = L - 1 on 32-row, 4-warp blocks, both kinds, s32_rs and tp8_hi32;
* verify of T = 4 drafts, both kinds, FP32 and NVFP4 reads, with read_variant 'dots' (16 rows,
  1 warp) and 'block' (32 rows, 4 warps).

    TRITON_INTERPRET=1 python -m replayquant.kernels.compile_check record /tmp/s6.json -- \\
        evals/sass_session6_drive.py
    python -m replayquant.kernels.compile_check sass /tmp/s6.json --kernel _replay_read_kernel

With --session7, session 7's counts instead ("Session 7"): the 'dots' read step (committed 8 /
4) and the 'dots' verify of T = 4 drafts, both kinds, FP32 / FP8 / NVFP4 read copies (s32_rs,
tp8_hi32, tp4_hi32). Run it at two commits to compare (a `git worktree` of each); since session
7 the record keeps which arguments are 16-byte aligned, as Triton's launcher tells the compiler.
"""

import sys


import torch

from replayquant.bench.decode import (gdn_params, gdn_step_inputs, mamba2_params,
                                      mamba2_step_inputs)
from replayquant.kernels.replay_decode import ReplayStore, replay_gdn_step, replay_mamba2_step
from replayquant.kernels.verify import replay_gdn_verify, replay_mamba2_verify


def stores(pair, gdn_h, m2_h, drafts=0):
    """A GDN and a Mamba-2 store of two rows at the given committed lengths."""
    g = torch.Generator().manual_seed(0)
    gdn = ReplayStore.from_state(torch.randn(2, 32, 128, 128, generator=g) * 0.1, pair, "gdn",
                                 key_heads=16, seed=3, layer=2, max_drafts=drafts)
    m2 = ReplayStore.from_state(torch.randn(2, 128, 64, 128, generator=g) * 0.1, pair, "mamba2",
                                key_heads=8, seed=3, layer=2, buffer_len=8, max_drafts=drafts)
    gdn.committed.fill_(gdn_h)
    m2.committed.fill_(m2_h)
    return gdn, m2


A_log, dtb = gdn_params(32, seed=1)
A, D, dtb2 = mamba2_params(128, seed=1)


def session6():
    for pair in ("s32_rs", "tp4_hi32"):                 # the 'dots' read step
        gdn, _ = stores(pair, 8, 0)
        replay_gdn_step(gdn, *gdn_step_inputs(2, 16, 32, 128, 128, seed=0), A_log, dtb,
                        path="replay", launch="split", read_variant="dots", block_v=16, num_warps=1,
                        advance=False)
    for pair in ("s32_rs", "tp8_hi32"):                 # the flush step, full buffer
        gdn, m2 = stores(pair, 15, 7)
        replay_gdn_step(gdn, *gdn_step_inputs(2, 16, 32, 128, 128, seed=0), A_log, dtb,
                        path="replay", launch="split", read_variant="block", flush_config=(32, 4),
                        advance=False)
        x, dt, Bm, C, z = mamba2_step_inputs(2, 8, 128, 128, 64, seed=0)
        replay_mamba2_step(m2, x, dt, A, Bm, C, D=D, z=z, dt_bias=dtb2, path="replay",
                           launch="split", read_variant="block", flush_config=(32, 4),
                           advance=False)
    for pair in ("s32_rs", "tp4_hi32"):                 # verify, T = 4, both read variants
        for cfg in (dict(read_variant="dots"),
                    dict(read_variant="block", block_v=32, num_warps=4)):
            gdn, m2 = stores(pair, 8, 2, drafts=4)
            replay_gdn_verify(gdn, *gdn_step_inputs(2, 16, 32, 128, 128, T=4, seed=0), A_log, dtb,
                              **cfg)
            x, dt, Bm, C, z = mamba2_step_inputs(2, 8, 128, 128, 64, T=4, seed=0)
            replay_mamba2_verify(m2, x, dt, A, Bm, C, D=D, z=z, dt_bias=dtb2, **cfg)
        print(pair, "done", flush=True)


def session7():
    for pair in ("s32_rs", "tp8_hi32", "tp4_hi32"):
        gdn, m2 = stores(pair, 8, 4)                    # the 'dots' read step
        replay_gdn_step(gdn, *gdn_step_inputs(2, 16, 32, 128, 128, seed=0), A_log, dtb,
                        path="replay", launch="split", read_variant="dots", block_v=16,
                        num_warps=1, advance=False)
        x, dt, Bm, C, z = mamba2_step_inputs(2, 8, 128, 128, 64, seed=0)
        replay_mamba2_step(m2, x, dt, A, Bm, C, D=D, z=z, dt_bias=dtb2, path="replay",
                           launch="split", read_variant="dots", block_v=16, num_warps=1,
                           advance=False)
        gdn, m2 = stores(pair, 8, 2, drafts=4)          # the 'dots' verify, T = 4
        replay_gdn_verify(gdn, *gdn_step_inputs(2, 16, 32, 128, 128, T=4, seed=0), A_log, dtb,
                          read_variant="dots")
        x, dt, Bm, C, z = mamba2_step_inputs(2, 8, 128, 128, 64, T=4, seed=0)
        replay_mamba2_verify(m2, x, dt, A, Bm, C, D=D, z=z, dt_bias=dtb2, read_variant="dots")
        print(pair, "done", flush=True)


session7() if "--session7" in sys.argv else session6()
