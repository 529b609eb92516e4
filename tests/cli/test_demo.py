"""`make demo` end to end on a short context: the Makefile's model and pairs, the shipped held-out
text, the real CLI in a subprocess, and the files a newcomer is promised (table, JSON, PNG)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow       # the demo on a tiny model, end to end

ROOT = Path(__file__).resolve().parents[2]


def _makefile_var(name: str) -> str:
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{name}\s*:=\s*(.+)$", text, re.M)
    assert m, f"{name} not found in the Makefile"
    return m.group(1).strip()


def test_demo_command_short_context(tmp_path):
    model = _makefile_var("DEMO_MODEL")
    pairs = _makefile_var("DEMO_PAIRS").split()
    dataset = subprocess.run([sys.executable, "-m", "replayquant.data"], capture_output=True,
                             text=True, check=True).stdout.strip()
    out = tmp_path / "demo.json"
    cmd = [sys.executable, "-m", "replayquant", "kl", "--model", model, *pairs,
           "--dataset", dataset, "--context", "256", "--docs", "1", "--segment", "128",
           "--dtype", "float32", "--device-map", "cpu", "--out", str(out), "--no-progress"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "f4_sr_rs" in run.stdout and "tp4_hi16_sr" in run.stdout
    res = json.loads(out.read_text())
    assert res["provenance"]["git_commit"]
    assert out.with_suffix(".png").exists()
    assert list(res["results"]) == pairs[1::2]          # one result per pair, in order
