"""The wave model of the replay launches (launch.programs_per_sm / waves)."""

import pytest

from replayquant.kernels.replay.launch import programs_per_sm, waves


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
