"""The one-pass verify kernel compiles for sm_90 (Triton's compiler and ptxas, no GPU) in every
specialization its formats and kinds reach: the interpreter, which runs its correctness tests,
accepts code that the compiler rejects. Records tests/kernels/replay/compile_drive_onepass.py's
launches in the interpreter, then compiles each distinct _onepass_kernel specialization once."""

from pathlib import Path

import pytest

from _helpers import assert_compile_for_sm90, recorded_launches

pytest.importorskip("triton.backends.nvidia")


def test_onepass_kernel_compiles_for_sm90(tmp_path):
    drive = Path(__file__).with_name("compile_drive_onepass.py")
    launches = recorded_launches(drive, "_onepass_kernel", tmp_path)
    assert {(ln["constexprs"]["RFMT"], ln["constexprs"]["DELTA"], ln["constexprs"]["NQ"])
            for ln in launches} == {(f, d, nq) for f in (0, 1, 3, 4) for d in (True, False)
                                    for nq in ((1, 3) if f == 0 else (1,))}
    assert_compile_for_sm90(launches, tmp_path)
