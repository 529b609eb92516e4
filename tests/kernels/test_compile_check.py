"""The kernels that the model paths launch compile for sm_90 (Triton's compiler and ptxas, no
GPU): the interpreter, which runs every other kernel test, accepts code that the compiler
rejects (a constexpr where a tensor is expected, e.g. an integer argument equal to 1). Records
the launches of tests/kernels/compile_drive.py in the interpreter (GDN; Mamba-2 with Nemotron-H's
dt clamp in one recording), then compiles each distinct specialization once (launches that Triton
would not compile anew share one)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")
ROOT = Path(__file__).resolve().parents[2]


def _run(args, env, cwd):
    r = subprocess.run([sys.executable, "-m", "replayquant.kernels.compile_check", *args],
                       env=env, cwd=cwd, capture_output=True, text=True, timeout=1200)
    return r.returncode, r.stdout + r.stderr


# what each model's drive must reach: the decode step (one launch), the chunked prefill and
# the casts; the NVFP4 anchor's chain both ways (two-pass, and split with its amax exchange
# through atomics)
MUST_REACH = {"_replay_kernel", "_chain_kernel", "_terms_kernel", "_output_kernel"}


@pytest.mark.parametrize("model", ["qwen3_5", "mamba2+nemotron_h"])
def test_model_kernels_compile_for_sm90(model, tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", REPLAYQUANT_BACKEND="triton",
               PYTHONPATH=str(ROOT))
    out = tmp_path / "launches.json"
    rc, log = _run(["record", str(out), "--", str(ROOT / "tests" / "kernels" / "compile_drive.py"), model],
                   env, tmp_path)
    assert rc == 0, log[-3000:]
    launches = json.loads(out.read_text())
    kernels = {ln["kernel"] for ln in launches}
    assert MUST_REACH <= kernels, kernels
    assert {ln["constexprs"].get("SPLIT") for ln in launches
            if ln["kernel"] == "_chain_kernel"} == {False, True}
    # a key word equal to 1 reached a kernel (seed 0, layer 1): the case the interpreter misses
    assert any(ln["signature"].get("key_lo") == "one" for ln in launches)
    if "nemotron_h" in model:       # the decode kernel with and without the dt clamp
        assert {ln["constexprs"]["DT_CLAMP"] for ln in launches
                if ln["kernel"] == "_replay_kernel"} == {False, True}
    env.pop("TRITON_INTERPRET")
    rc, log = _run(["compile", str(out), "--arch", "90"], env, tmp_path)
    assert rc == 0, log[-4000:]
    assert re.search(r"^compile_check: (\d+)/\1 specializations .* compile for sm_90$", log,
                     flags=re.M), log[-2000:]
    if model == "qwen3_5":
        # the SASS count of one small kernel (an NVFP4 dequantize): a count and ptxas's report
        rc, log = _run(["sass", str(out), "--arch", "90", "--kernel", "_nvfp4_dequant_kernel"],
                       env, tmp_path)
        assert rc == 0, log[-2000:]
        assert re.search(r"^    \d+ SASS instructions; .*registers", log, flags=re.M), log[-2000:]


def test_count_sass_counts_instruction_lines():
    from replayquant.kernels.compile_check import count_sass
    listing = ("\t.text.k:\n"
               "        /*0000*/                   LDC R1, c[0x0][0x28] ;\n"
               "        /*0010*/              @!P0 BRA `(.L_x_0) ;\n"
               "        /* 0x000fe40000000f00 */\n"
               "        /*0020*/                   EXIT ;\n")
    assert count_sass(listing) == 3


def test_chunk_register_report_compiles_every_pass(tmp_path):
    """`bench teacher-forcing`'s register report builds the chunk kernel's passes from their
    signatures with hand-written constexprs; a pass it can no longer build (a renamed constexpr)
    would show in the report as "not compiled", which this test refuses."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    code = ("import json; from replayquant.bench import teacher_forcing as tf; "
            "print(json.dumps(tf.resource_report(pairs=('tp4_hi16_sr',), H=2, d=32, L=8)))")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    if any("Triton ships no ptxas" in row["ptxas"] for row in rows):
        pytest.skip("this Triton ships no ptxas")
    assert {row["kernel"] for row in rows} == {"terms", "chain", "cast", "output"}
    assert all("registers" in row["ptxas"] for row in rows), rows
