"""The deferred-fold step kernel compiles for sm_90 (Triton's compiler and ptxas, no GPU) in
both kinds it takes: the interpreter, which runs its correctness tests, accepts code that the
compiler rejects. Records tests/kernels/replay/compile_drive_fold.py's launches in the interpreter,
then compiles each distinct _fold_read_kernel specialization once."""

from pathlib import Path

import pytest

from _helpers import assert_compile_for_sm90, recorded_launches

pytest.importorskip("triton.backends.nvidia")


def test_fold_kernel_compiles_for_sm90(tmp_path):
    drive = Path(__file__).with_name("compile_drive_fold.py")
    launches = recorded_launches(drive, "_fold_read_kernel", tmp_path)
    assert {(ln["constexprs"]["DELTA"], ln["constexprs"]["QLOAD"]) for ln in launches} == \
        {(d, q) for d in (True, False) for q in (True, False)}
    assert_compile_for_sm90(launches, tmp_path)
