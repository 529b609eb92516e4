"""Kimi Delta Attention in the byte model and in sweep / recommend / sensitivity.

The byte model counts a KDA layer as GDN except its gate, which is d_k wide (the step's gate
input and every buffered G); its ring holds what `ReplayState(vector_gate=True)` buffers. The
commands run on tiny random Kimi Linear and GLM-5-Next models (tests/models/test_kda_models.py's
builder: gates that remember hundreds of tokens), read the layer shapes from the models and
report bytes and memory by layer kind.
"""

import json

import pytest
import torch

from replayquant.pairs import PrecisionPair
from replayquant.statebytes import (LayerShape, conventional_bytes, io_bytes, layer_memory_bytes,
                                    ring_u_bytes,
                                    layer_step_bytes, model_memory_bytes, model_step_bytes,
                                    replay_window_bytes)

transformers = pytest.importorskip("transformers")

from test_kda_models import FAMS, save_models  # noqa: E402
from test_sweep import ROOT, _cli  # noqa: E402

PAIRS = ("s32_rs", "tp4_hi32", "tp8_hi16_sr", "f4_sr_rs")
SHORT = ["--context", "48", "--docs", "1", "--segment", "24", "--dtype", "float32",
         "--device-map", "cpu", "--no-progress"]


def _fmts(p):
    return p.anchor.format, None if p.read is None else p.read.format


@pytest.mark.parametrize("H, dv, dk", [(2, 16, 16), (32, 128, 128)])
def test_kda_bytes_are_gdns_but_the_gate(H, dv, dk):
    """KDA minus GDN (q / k / v heads equal) = the gate's extra 4 (d_k - 1) bytes per head
    wherever a gate moves: each step's input, each entry written, read by the flush and read by
    the read steps (h of them at committed length h); less, where GDN solves for u, its key
    factors (4 L bytes an entry, moved with the entries, not as an input); the state matrices
    and the rest alike."""
    B, extra = 3, 4 * (dk - 1)
    for name in PAIRS:
        p = PrecisionPair.load(name)
        for L in (1, 4, 16):
            kf = 0 if ring_u_bytes(*_fmts(p)) == 4 else 4 * L
            kda = replay_window_bytes("kda", *_fmts(p), L, B, H, H, dv, dk)
            gdn = replay_window_bytes("gdn", *_fmts(p), L, B, H, H, dv, dk)
            moved = L + 2 * (L - 1) + (L - 1) * (L - 2) / 2
            assert kda - gdn == pytest.approx(B * H * (extra * moved - kf * (moved - L)) / L)
            sh = LayerShape("kda", H, H, dv, dk)
            assert layer_step_bytes(sh, p, L).total * B == pytest.approx(kda)
            mk, mg = (layer_memory_bytes(LayerShape(k, H, H, dv, dk), p, L) for k in ("kda", "gdn"))
            assert (mk.anchor, mk.read_copy) == (mg.anchor, mg.read_copy)
            assert mk.ring - mg.ring == H * L * (extra - kf)
    assert conventional_bytes("kda", "fp32", B, H, H, dv, dk) - \
        conventional_bytes("gdn", "fp32", B, H, H, dv, dk) == B * H * extra
    with pytest.raises(ValueError, match="layer kind must be one of"):
        io_bytes("rwkv", H, H, dv, dk)


def test_kda_ring_is_the_replay_buffer():
    """A KDA layer's ring is what a vector-gated ReplayState buffers (k, v, u, G per key channel,
    beta for L entries), at the kernel ring's widths (bf16 k, v; u bf16, fp32 for a shared pair;
    fp32 G, beta)."""
    from replayquant.replay import ReplayState
    H, dv, dk = 2, 8, 16
    for name in ("s32_rs", "tp4_hi32"):
        width = {"k": 2, "v": 2, "u": 4 if name == "s32_rs" else 2, "G": 4, "beta": 4}
        P = PrecisionPair.load(name).with_buffer_len(8)
        st = ReplayState(torch.zeros(1, H, dv, dk), P, delta=True, vector_gate=True)
        buf = st.buffer
        assert set(buf) == set(width) and buf["G"].shape == (1, H, 8, dk)
        ring = sum(t.numel() * width[n] for n, t in buf.items())
        assert layer_memory_bytes(LayerShape("kda", H, H, dv, dk), P).ring == ring


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    dirs, doc, _ = save_models(tmp_path_factory.mktemp("kda_sweep"))
    return dirs, doc


def test_layer_shapes_of_kda_models(folders):
    """Read from the models on the meta device (GLM-5-Next through its conditional-generation
    class): two KDA layers of 2 heads x 16 x 16 at layers 0 and 2."""
    from replayquant.sweep.common import shapes_of_model
    dirs, _ = folders
    for fam in FAMS:
        shapes, *_ = shapes_of_model(str(dirs[fam]))
        assert [(s.kind, s.H, s.HK, s.dv, s.dk, s.index) for s in shapes] == \
            [("kda", 2, 2, 16, 16, 0), ("kda", 2, 2, 16, 16, 2)], fam


def test_sweep_and_recommend_on_kimi_linear(folders, tmp_path):
    """Bytes per step and memory per variant are the byte model's over the KDA layers; the
    kernels grid, which times KDA's conventional step but no KDA replay rows, gives the FP32
    baseline a time and the replay variants none, saying why; recommend picks the cheapest
    variant within the budget."""
    dirs, doc = folders
    out = tmp_path / "kimi.json"
    run = _cli("sweep", "--model", dirs["kimi_linear"], "--pair", "s32_rs", "--pair", "tp4_hi32",
               "--pair", "f4_sr_rs", "--buffer-len", "4", "--dataset", doc, *SHORT,
               "--kernels", ROOT / "results/bench/kernels.json", "--out", out)
    sw = json.loads(out.read_text())
    shapes = [LayerShape.from_dict(s) for s in sw["layers"]]
    assert {s.kind for s in shapes} == {"kda"} and len(shapes) == 2
    by = {v["name"]: v for v in sw["variants"]}
    assert list(by) == ["s32_rs@L4", "tp4_hi32@L4", "f4_sr_rs@L4"]
    for v in sw["variants"]:
        p = PrecisionPair.load(v["base"])
        assert v["bytes_per_step"] == model_step_bytes(shapes, p, 4).to_dict()
        assert v["memory"] == model_memory_bytes(shapes, p, 4).to_dict()
        assert v["kernel"]["us_per_step"] is None
        # the grid times KDA's replay windows at L = 16 and s32_rs / tp8_hi32 / tp4_hi32 only:
        # no time of another L or pair is put in their place
        assert len(v["kernel"]["missing"]) == 1
        assert v["kernel"]["missing"][0].endswith(
            "(no pair with its formats in the grid)" if v["base"] == "f4_sr_rs"
            else "L=4 (not in the grid)"), v["kernel"]["missing"]
    assert abs(by["s32_rs@L4"]["kl"]["kl_mean"]) < 1e-6
    assert by["f4_sr_rs@L4"]["kl"]["kl_mean"] > 1e-4
    assert sw["conventional_fp32"]["kernel"]["us_per_step"] > 0
    assert "speedup over the FP32 conventional step" in " ".join(run.stdout.split())
    budget = 2 * by["tp4_hi32@L4"]["kl"]["kl_upper"]
    _cli("recommend", out, "--kl-budget", budget, "--out", tmp_path / "rec.json")
    rec = json.loads((tmp_path / "rec.json").read_text())
    fits = [v for v in sw["variants"] if v["kl"]["kl_upper"] <= budget]
    assert rec["recommended"]["bytes_per_step"] == min(v["bytes_per_step"]["state"] for v in fits)


def test_sensitivity_and_per_layer_policy_on_glm5_next(folders, tmp_path):
    """Each KDA layer of GLM-5-Next alone with tp4_hi32 and tp8_hi16_sr, and a layer policy from
    it whose bytes are the byte model's for KDA layers."""
    dirs, doc = folders
    out = tmp_path / "sens.json"
    _cli("sensitivity", "--model", dirs["glm5_next"], "--pair", "tp4_hi32", "--pair", "tp8_hi16_sr",
         "--dataset", doc, *SHORT, "--out", out)
    sens = json.loads(out.read_text())
    assert [s["kind"] for s in sens["layers"]] == ["kda", "kda"]
    for name in ("tp4_hi32", "tp8_hi16_sr"):
        assert sorted(r["rank"] for r in sens["per_layer"][name]) == [1, 2]
    lo, hi = (sum(r["kl"]["kl_upper"] for r in sens["per_layer"][p])
              for p in ("tp4_hi32", "tp8_hi16_sr"))
    rec_out = tmp_path / "rec.json"
    run = _cli("recommend", "--per-layer", out, "--kl-budget", (lo + hi) / 2, "--out", rec_out,
               "--no-progress", check=False)
    assert run.returncode in (0, 1), run.stderr[-3000:]
    res = json.loads(rec_out.read_text())
    shapes = [LayerShape.from_dict(s) for s in sens["layers"]]
    for name in ("tp4_hi32", "tp8_hi16_sr"):
        p = PrecisionPair.load(name)
        assert res["costs"][name]["bytes_per_step"]["state"] == pytest.approx(
            model_step_bytes(shapes, p).state)
    assert 1 <= len(res["plan"]["upgraded"]) <= 2
