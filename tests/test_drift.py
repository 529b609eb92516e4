"""Drift report: protocol runs end to end, results file has provenance, metrics are sane."""

import json

import pytest
from typer.testing import CliRunner

from replayquant.cli import app
from replayquant.drift import make_inputs, run_drift, write_drift


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_inputs_follow_protocol(kind):
    q, k, v, la, beta = make_inputs(kind, 50, 1, 2, 3, 32, 16)
    a = la.exp()
    assert float(a.min()) >= 0.9 - 1e-6 and float(a.max()) < 1.0
    assert k.shape == (2, 50, 3, 32) and v.shape == (2, 50, 3, 16)
    assert float((k.norm(dim=-1) - 1).abs().max()) < 1e-3
    assert (beta is not None) == (kind == "gdn")


def test_kda_inputs_follow_protocol():
    """KDA: one decay per key channel, rates spread from forgetting within a step to holding
    about a thousand steps; q / k / v / beta as GDN's."""
    q, k, v, la, beta = make_inputs("kda", 50, 1, 2, 3, 32, 16)
    assert la.shape == (2, 50, 3, 32) and beta.shape == (2, 50, 3)
    a = la.exp()
    assert float(a.max()) < 1.0 and float(a.min()) >= 0.22
    rate = -la.mean(dim=1)                         # per (sequence, head, channel)
    assert float(rate.min()) < 3e-3 and float(rate.max()) > 0.3
    assert float((k.norm(dim=-1) - 1).abs().max()) < 1e-3


def test_run_drift_kda():
    """Vector gates through ReplayState / ConventionalState: FP32 pairs follow the FP32
    recurrence; an FP32 anchor stays exact under an NVFP4 read copy; a shared NVFP4 anchor drifts."""
    res = run_drift("kda", ["s32_rs", "tp4_hi32", "f4_sr_rs"], steps=24, seeds=[5],
                    batch=1, heads=2, d_k=16, d_v=8)
    rows = {(r["pair"], r["mode"]): r for r in res["rows"]}
    assert res["params"]["kind"] == "kda" and len(rows) == 5
    for key in (("s32_rs", "replay"), ("s32_rs", "conventional")):
        assert rows[key]["output_rel_rmse"]["mean"] < 1e-5
        assert rows[key]["anchor_rel_rmse"]["mean"] < 1e-5
    assert rows[("tp4_hi32", "replay")]["anchor_rel_rmse"]["mean"] < 1e-5
    assert rows[("tp4_hi32", "replay")]["output_rel_rmse"]["mean"] > 1e-3
    assert rows[("f4_sr_rs", "replay")]["anchor_rel_rmse"]["mean"] > 1e-3


def test_run_drift_and_write(tmp_path):
    res = run_drift("gdn", ["s32_rs", "tp4_hi32", "f4_sr_rs"], steps=40, seeds=[1, 2],
                    batch=1, heads=2, d_k=16, d_v=8)
    rows = {(r["pair"], r["mode"]): r for r in res["rows"]}
    assert set(rows) == {("s32_rs", "replay"), ("s32_rs", "conventional"), ("tp4_hi32", "replay"),
                         ("f4_sr_rs", "replay"), ("f4_sr_rs", "conventional")}
    assert rows[("s32_rs", "replay")]["anchor_rel_rmse"]["mean"] < 1e-5
    assert rows[("s32_rs", "replay")]["output_rel_rmse"]["mean"] < 1e-5
    # FP32 anchor: read-copy rounding never enters it
    assert rows[("tp4_hi32", "replay")]["anchor_rel_rmse"]["mean"] < 1e-5
    assert rows[("tp4_hi32", "replay")]["output_rel_rmse"]["mean"] > 1e-3
    assert rows[("f4_sr_rs", "replay")]["anchor_rel_rmse"]["mean"] > 1e-3
    assert rows[("f4_sr_rs", "replay")]["anchor_rmse"]["n"] == 2
    path = write_drift(res, tmp_path)
    data = json.loads(path.read_text())
    for key in ("git_commit", "date", "device", "versions"):
        assert key in data["provenance"]
    assert data["params"]["steps"] == 40 and data["params"]["seeds"] == [1, 2]
    assert "| tp4_hi32 | replay | 16 |" in path.with_suffix(".md").read_text()


def test_drift_command(tmp_path):
    r = CliRunner().invoke(app, ["drift", "--kind", "mamba2", "--pair", "s32_rs", "--steps", "20",
                                 "--seeds", "3,4", "--heads", "1", "--d-k", "16", "--d-v", "8",
                                 "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "mamba2_20steps.json").exists()
    r = CliRunner().invoke(app, ["drift", "--kind", "kda", "--pair", "s32_rs", "--steps", "20",
                                 "--seeds", "3", "--heads", "1", "--d-k", "16", "--d-v", "8",
                                 "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "kda_20steps.json").read_text())["params"]["kind"] == "kda"
    r = CliRunner().invoke(app, ["drift", "--kind", "rwkv", "--steps", "20"])
    assert r.exit_code == 2 and "Invalid value for '--kind'" in r.output and "'kda'" in r.output
