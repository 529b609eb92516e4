"""The one-pass verify kernel compiles for sm_90 (Triton's compiler and ptxas, no GPU) in every
specialization its formats and kinds reach: the interpreter, which runs its correctness tests,
accepts code that the compiler rejects. Records tests/kernels/replay/compile_drive_onepass.py's
launches in the interpreter, then compiles each distinct _onepass_kernel specialization once."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")
ROOT = Path(__file__).resolve().parents[3]


def _run(args, env, cwd):
    r = subprocess.run([sys.executable, "-m", "replayquant.kernels.compile_check", *args],
                       env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    return r.returncode, r.stdout + r.stderr


def test_onepass_kernel_compiles_for_sm90(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = tmp_path / "launches.json"
    drive = ROOT / "tests" / "kernels" / "replay" / "compile_drive_onepass.py"
    rc, log = _run(["record", str(out), "--", str(drive)], env, tmp_path)
    assert rc == 0, log[-3000:]
    launches = [ln for ln in json.loads(out.read_text()) if ln["kernel"] == "_onepass_kernel"]
    assert {(ln["constexprs"]["RFMT"], ln["constexprs"]["DELTA"], ln["constexprs"]["NQ"])
            for ln in launches} == {(f, d, nq) for f in (0, 1, 3, 4) for d in (True, False)
                                    for nq in ((1, 3) if f == 0 else (1,))}
    out.write_text(json.dumps(launches))
    env.pop("TRITON_INTERPRET")
    rc, log = _run(["compile", str(out), "--arch", "90"], env, tmp_path)
    assert rc == 0, log[-4000:]
    assert re.search(r"^compile_check: (\d+)/\1 specializations .* compile for sm_90$", log,
                     flags=re.M), log[-2000:]
