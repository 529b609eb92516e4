"""evals/spec_gpu.py --smoke-cpu: the GPU script's steps on a tiny Qwen3.5 shape on the CPU (a
64-token prompt of a held-out excerpt said four times, 16 new tokens): every pair and way is
measured, the oracle (the pair's own plain tokens as drafts) has every draft accepted and gives
plain decode's tokens on the exact FP32 pair, prompt lookup drafts from the repeated prompt, the
verify forwards are timed apart per length, no compile happens in a timed run, the break-even
is computed, the static cache with prompt lookup is refused before any forward, the JSON
carries provenance, and the table (printed last) fits 80 columns."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_spec_gpu_smoke_cpu(tmp_path):
    out = tmp_path / "spec_gpu.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "evals" / "spec_gpu.py"), str(out),
                        "--smoke-cpu", "--repeats", "1"], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["kind"] == "replayquant-spec-gpu"
    assert {"git_commit", "versions", "device"} <= set(res["provenance"])
    assert res["config"]["prompt_tokens"] == 64 and res["config"]["new_tokens"] == 16
    assert not res["lookup_static"]["runs"] and "static" in res["lookup_static"]["refusal"]
    assert list(res["results"]) == ["s32_rs", "tp4_hi16_sr"]
    assert res["compiles_in_timed_runs"] == 0
    ways = {"plain_eager", "plain_compiled", "oracle_eager", "lookup_eager"}
    for name, row in res["results"].items():
        assert set(row) == ways | {"break_even"}
        for way in ways:
            w = row[way]
            assert w["tokens"] == 16 and w["decode_tok_s"] > 0
            assert len(w["runs"]) == 1 and w["compiles_in_timed_runs"] == 0
        plain, look, oracle = row["plain_eager"], row["lookup_eager"], row["oracle_eager"]
        assert plain["forwards"] == 16 and plain["step_ms"] > 0 and plain["verify_ms"] is None
        assert look["accepted"] > 0 and look["forwards"] < 16
        assert look["verify_ms"] > 0 and 0 < look["verify_share"] <= 1
        assert look["speedup_vs_plain_eager"] > 0 and oracle["speedup_vs_plain_eager"] > 0
        # 4 drafts a round, capped before the last token: 5 + 5 + 5 + 1 tokens
        assert oracle["rounds"] == 4 and oracle["drafted"] == oracle["accepted"] == 12
        assert oracle["verify_ms_by_t"].keys() == {"5"} and oracle["step_ms"] > 0
        if name == "s32_rs":                           # exact: speculation is plain greedy
            assert oracle["acceptance"] == 1 and oracle["agree_plain"] == [16, 16]
            assert look["agree_plain"] == [16, 16]
        be = row["break_even"]
        assert be["at_full_drafts"] == be["by_t"]["5"] and be["wall_at_oracle_rounds"] > -1
    lines = r.stdout.rstrip().splitlines()
    assert lines[-1].startswith("lookup on the static cache: refused")
    assert lines[-2] == "compiles in timed runs: 0"
    assert sum(line.startswith("s32_rs ") for line in lines) == 4
    assert all(len(line) <= 80 for line in lines[lines.index("-" * 80) - 1:])
