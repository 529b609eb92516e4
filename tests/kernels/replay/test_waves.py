"""The wave model of the replay launches (launch.programs_per_sm / waves, the flush launch's tiles
a program) and WAVE_TABLE's rows behind override_replay_launch's 'waves' switch; a fused step
whose rows pre-flush (the read copy loaded before the pointers, loaded again after the flush)
against the two launches."""

import pytest
import torch

from replayquant.kernels.replay.decode import replay_gdn_step
from replayquant.kernels.replay.launch import (WAVE_TABLE, _max_regs, flush_tiles_per_program,
                                              override_replay_launch, programs_per_sm,
                                              replay_launch_config, waves)
from replayquant.kernels.replay.reference import replay_gdn_step_ref
from replayquant.policy import resolve_pair
from replayquant.replay.stores import ReplayStore
from replayquant.testing import gdn_params, gdn_step_inputs, random_state


def test_programs_per_sm_and_waves():
    """sm_90's limits: registers by warp in 256s on 4 sub-partitions, 64 warps, 32 programs,
    shared memory (the compile_check figures of docs/kernels.md's wave table)."""
    assert programs_per_sm(1, 255) == 8 and programs_per_sm(1, 157) == 12
    assert programs_per_sm(1, 128) == 16 and programs_per_sm(1, 168) == 12
    assert programs_per_sm(2, 137) == 6 and programs_per_sm(8, 255) == 1
    assert programs_per_sm(1, 32) == 32 and programs_per_sm(4, 32) == 16
    assert programs_per_sm(1, 125, 16384) == 13 and programs_per_sm(8, 252, 73728) == 1
    assert waves(2048, 1, 157) == pytest.approx(2048 / (132 * 12))
    assert waves(2048, 1, 128) < 1 < waves(2048, 1, 157) < 4


def test_flush_tiles_per_program():
    """A power of two, at most max_tiles unless that leaves between one and four waves, where
    the grid comes down to one wave; 'waves' False: capped as before."""
    t = 132 * 8
    assert flush_tiles_per_program(100, t, 8) == 1 and flush_tiles_per_program(4096, t, 8) == 4
    assert flush_tiles_per_program(16384, t, 8) == 16          # 2048 programs capped: 1.94
    assert flush_tiles_per_program(65536, t, 8) == 8           # 8192 programs: 7.76 waves
    with override_replay_launch({"waves": False}):
        assert flush_tiles_per_program(16384, t, 8) == 8
    assert flush_tiles_per_program(12, 1, 8, False) == 8     # the interpreter's grid
    assert flush_tiles_per_program(3, 1, 8, False) == 4


def test_wave_rows_switch():
    """WAVE_TABLE's rows apply at their batches only, and not with 'waves' False; a bad value
    is one error."""
    st = ReplayStore.from_state(random_state(1, 2, 128, 128), resolve_pair("tp8_hi32", 16),
                                "gdn", key_heads=1)
    assert any(r[:3] == ("read", "gdn", "fp8") for r in WAVE_TABLE)
    assert _max_regs(st, "read", 1, 128) == 168 and replay_launch_config(st, "read", 128) == (64, 1)
    assert _max_regs(st, "read", 1, 256) == 128 and _max_regs(st, "read") == 128
    assert _max_regs(st, "read", 4, 128) is None                # a verify: uncapped
    with override_replay_launch({"waves": False}):
        assert _max_regs(st, "read", 1, 128) == 128
    with pytest.raises(ValueError, match="waves"), override_replay_launch({"waves": 1}):
        pass


@pytest.mark.parametrize("waves_on", [True, False])
def test_fused_pre_flush_and_wave_rows_match_reference(waves_on):
    """Rows at h == L (accepted drafts filled the buffer) pre-flush inside the fused step's
    program, which loaded its read copy before the pointers and loads it again after the flush;
    outputs, roles and pointers against the torch reference (NaN-poisoned outputs, a padding
    row), with and without the wave rule."""
    B, HK, H, dk, dv, L = 25, 1, 2, 16, 16, 3
    pair = resolve_pair("s32_rs", L)
    st = ReplayStore.from_state(random_state(B, H, dv, dk, seed=11), pair, "gdn", key_heads=HK,
                                max_drafts=1, u_dtype=torch.float32)
    ref = st.clone()
    idx = torch.arange(B, dtype=torch.int32)
    idx[3] = -1
    for n in range(2 * L + 1):
        q, k, v, a, b = gdn_step_inputs(B, HK, H, dk, dv, seed=70 + n)
        if n == 2:                  # every row's h == L: each pre-flushes at the next step
            for s in (st, ref):
                s.committed.fill_(L)
        y = torch.full((B, H, dv), float("nan"))
        with override_replay_launch({"fused": True, "waves": waves_on}):
            replay_gdn_step(st, q, k, v, a, b, *gdn_params(H), state_indices=idx, out=y)
        yr = replay_gdn_step_ref(ref, q, k, v, a, b, *gdn_params(H), state_indices=idx)
        torch.testing.assert_close(y, yr, rtol=2e-5, atol=2e-6)
        for f in ("committed", "start", "n_flush"):
            assert torch.equal(getattr(st, f), getattr(ref, f)), f
        torch.testing.assert_close(st.anchor.payload, ref.anchor.payload, rtol=2e-5, atol=2e-6)
