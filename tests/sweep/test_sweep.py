"""sweep / recommend / sensitivity / layer policies on the embedded tiny models at short contexts,
and the byte model against the kernels bench's counts and the decode store's allocations."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replayquant.pairs import PrecisionPair
from replayquant.statebytes import (LayerShape, conventional_bytes, layer_conventional_bytes,
                                    layer_memory_bytes, layer_step_bytes, replay_window_bytes)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


class _Run:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _cli(*args, check=True, timeout=600, own_process=False):
    """The command line: in this process (typer's CliRunner; the imports are paid once), or as a
    user runs it (`python -m replayquant`) with own_process."""
    if own_process:
        run = subprocess.run([sys.executable, "-m", "replayquant", *map(str, args)],
                             capture_output=True, text=True, timeout=timeout, env=ENV)
    else:
        from typer.testing import CliRunner

        from replayquant.cli import app
        res = CliRunner().invoke(app, [str(a) for a in args])
        if res.exception is not None and not isinstance(res.exception, SystemExit):
            raise res.exception
        run = _Run(res.exit_code, res.stdout, res.stderr)
    if check:
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def _dataset() -> str:
    return subprocess.run([sys.executable, "-m", "replayquant.data"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _makefile_var(name: str) -> str:
    m = re.search(rf"^{name}\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"{name} not found in the Makefile"
    return m.group(1).strip()


SHORT = ["--context", "256", "--docs", "1", "--segment", "128", "--dtype", "float32",
         "--device-map", "cpu", "--no-progress"]


# ----------------------------------------------------------------------------- the byte model

def test_byte_model_equals_kernels_bench_counts():
    """Per sequence x batch = the `bytes` of every window and conventional row of the committed
    kernels grid (the bench's own count), and the parts add up to the bench's window total. The
    grid is the `targets` preset's: each kind (GDN, Mamba-2, KDA) at its main L, three pairs,
    every batch."""
    grid = json.loads((ROOT / "results/bench/kernels.json").read_text())
    prov = grid["provenance"]
    shapes = prov["shapes"]
    windows = {(r["kind"], r["variant"], r["L"], r["B"]) for r in grid["rows"] if r["kernel"] == "replay-window"}
    assert windows == {(k, p, prov["main_L"][k], B) for k in ("gdn", "mamba2", "kda")
                       for p in ("s32_rs", "tp8_hi32", "tp4_hi32") for B in (1, 8, 32, 128, 256, 512)}
    convs = {(r["kind"], r["variant"], r["B"]) for r in grid["rows"] if r["kernel"] == "conventional"}
    assert convs == {(k, v, B) for k in ("gdn", "mamba2", "kda") for v in ("fp32", "bf16")
                     for B in (1, 8, 32, 128, 256, 512)}
    n = 0
    for r in grid["rows"]:
        if r["kernel"] not in ("replay-window", "conventional") or not r.get("bytes"):
            continue
        S = shapes[r["kind"]]
        sh = LayerShape(r["kind"], S["H"], S["HK"], S["dv"], S["dk"])
        if r["kernel"] == "conventional":
            got = layer_conventional_bytes(sh, r["variant"]).total * r["B"]
        else:
            got = layer_step_bytes(sh, PrecisionPair.load(r["variant"]), r["L"]).total * r["B"]
        assert got == pytest.approx(r["bytes"], rel=1e-12), r
        n += 1
    assert n == len(windows) + len(convs)
    # the tiny models' shapes, every shipped pair and L
    for kind, H, HK, dv, dk in (("gdn", 4, 2, 64, 128), ("mamba2", 8, 1, 64, 128)):
        sh = LayerShape(kind, H, HK, dv, dk)
        for name in ("s32_rs", "sbf16", "tp8_hi16_sr", "tp4_hi32", "f4_sr_rs"):
            p = PrecisionPair.load(name)
            rf = None if p.read is None else p.read.format
            for L in (1, 4, 8, 16, 32):
                b = layer_step_bytes(sh, p, L)
                assert b.total * 3 == pytest.approx(replay_window_bytes(kind, p.anchor.format, rf, L,
                                                                        3, H, HK, dv, dk))
        assert layer_conventional_bytes(sh).total * 5 == conventional_bytes(kind, "fp32", 5, H, HK, dv, dk)
        # L = 1 with the shared FP32 pair is the conventional step
        assert layer_step_bytes(sh, PrecisionPair.load("s32_rs"), 1).state == \
            layer_conventional_bytes(sh).state


def test_memory_equals_replay_store_allocation():
    """State memory per sequence = what a one-slot ReplayStore allocates (anchor, read copy, ring
    with GDN's key factors where it solves for u)."""
    from replayquant.replay.stores import ReplayStore

    def nb(t):
        return 0 if t is None else t.numel() * t.element_size()
    for kind, H, HK, dv, dk in (("gdn", 4, 2, 64, 128), ("mamba2", 8, 1, 64, 128)):
        for name in ("s32_rs", "tp4_hi32", "tp8_hi16_sr", "f4_sr_rs"):
            P = PrecisionPair.load(name).with_buffer_len(8)
            st = ReplayStore.from_state(torch.zeros(1, H, dv, dk), P, kind, key_heads=HK)
            roles = [st.anchor] + ([st.read] if st.read is not None else [])
            got = sum(nb(r.payload) + nb(r.scale) + nb(r.gscale) for r in roles)
            got += sum(nb(x) for x in (st.kbuf, st.vbuf, st.ubuf, st.Gbuf, st.bbuf, st.Tbuf))
            assert layer_memory_bytes(LayerShape(kind, H, HK, dv, dk), P).total == got, (kind, name)


# ----------------------------------------------------------------------------- layer policies

def _policy(tmp_path, text, name="p.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return f


@pytest.mark.parametrize("text, message", [
    ("overrides: []\n", "missing 'default'"),
    ("default: nope\n", "unknown precision pair 'nope'"),
    ("default: s32_rs\nanchor: {format: fp32}\n", "mixes a pair and a policy"),
    ("default: s32_rs\nbuffer_len: 0\n", "buffer_len must be an integer >= 1"),
    ("default: s32_rs\noverrides: {layers: [0]}\n", "overrides must be a list"),
    ("default: s32_rs\noverrides: [{layers: [0]}]\n", "missing 'pair'"),
    ("default: s32_rs\noverrides: [{layers: [0], match: 'x', pair: sbf16}]\n", "exactly one of"),
    ("default: s32_rs\noverrides: [{layers: [-1], pair: sbf16}]\n", "integers >= 0"),
    ("default: s32_rs\noverrides: [{layers: [0], pair: sbf16}, {layers: [0], pair: f4_sr_rs}]\n",
     "layer 0 is already named by override 1"),
    ("default: s32_rs\noverrides: [{layers: [0], pair: sbf16, when: x}]\n", r"unknown key\(s\) \['when'\]"),
    ("default: s32_rs\noverrides: [{match: '', pair: sbf16}]\n", "non-empty name pattern"),
])
def test_policy_yaml_errors(tmp_path, text, message):
    from replayquant.policy import LayerPolicy
    with pytest.raises(ValueError, match=message):
        LayerPolicy.load(_policy(tmp_path, text))


def _tiny_meta(name="tiny-qwen3.5"):
    from replayquant.sweep.common import shapes_of_model
    shapes, meta, *_ = shapes_of_model(name)
    return shapes, meta


@pytest.mark.parametrize("text, message", [
    ("default: s32_rs\noverrides: [{layers: [3], pair: sbf16}]\n",
     r"names layer\(s\) \[3\], which are not recurrent layers.*0 \(model.layers.0.linear_attn\)"),
    ("default: s32_rs\noverrides: [{match: 'backbone.*', pair: sbf16}]\n", "matches no recurrent layer"),
    ("default: s32_rs\noverrides: [{layers: [1], pair: sbf16}, {match: '*.1.*', pair: sbf16}]\n",
     r"layer 1 \(model.layers.1.linear_attn\) is named by override 1 .* and override 2"),
])
def test_policy_errors_against_the_model(tmp_path, text, message):
    """Checked when the policy meets the model: patch (before anything changes) and sweep."""
    from replayquant import patch
    from replayquant.models import is_patched
    _, meta = _tiny_meta()
    with pytest.raises(ValueError, match=message):
        patch(meta, str(_policy(tmp_path, text)))
    assert not is_patched(meta)


def test_policy_patches_each_layer(tmp_path):
    """Overrides by index and pattern, `exact`, a pair file relative to the policy, L for all;
    load_model and the one pair resolution (policy.resolve_pair) take the file."""
    import replayquant
    from replayquant.policy import resolve_pair
    from replayquant.models import patch_info
    from replayquant.policy import LayerPolicy
    (tmp_path / "mine.yaml").write_text("read: {format: fp8}\nanchor: {format: fp16, rounding: stochastic}\n")
    f = _policy(tmp_path, "name: mixed\ndefault: tp4_hi32\nbuffer_len: 8\noverrides:\n"
                          "  - {layers: [0, 4], pair: mine.yaml}\n"
                          "  - {match: 'model.layers.6.*', pair: exact}\n")
    m = replayquant.load_model("tiny-qwen3.5", pair=str(f), dtype="float32")
    lp = patch_info(m)["layer_pairs"]
    assert lp["model.layers.0.linear_attn"] == ("mine", "replay")
    assert lp["model.layers.1.linear_attn"] == ("tp4_hi32", "replay")
    assert lp["model.layers.6.linear_attn"] == ("s32_rs", "exact")
    rts = {n: mod._replayquant for n, mod, _ in replayquant.models.recurrent_layers(m)}
    assert rts["model.layers.4.linear_attn"].pair.buffer_len == 8
    assert rts["model.layers.4.linear_attn"].pair.read.format == "fp8"
    with torch.no_grad():
        assert torch.isfinite(m(torch.randint(0, 4096, (1, 40))).logits).all()
    p = resolve_pair(str(f))
    assert isinstance(p, LayerPolicy) and p.label() == "mixed" and p.buffer_len == 8
    assert LayerPolicy.from_dict(p.to_dict()).to_dict() == p.to_dict()     # the record round-trips


# ----------------------------------------------------------------------------- sweep + recommend

@pytest.fixture(scope="module")
def demo_sweep(tmp_path_factory):
    """The demo's sweep (the Makefile's model, pairs and buffer lengths) at 256 tokens."""
    out = tmp_path_factory.mktemp("sweep") / "demo.json"
    args = ["sweep", "--model", _makefile_var("DEMO_MODEL"), *_makefile_var("DEMO_PAIRS").split(),
            "--buffer-len", _makefile_var("DEMO_BUFFER_LEN"), "--dataset", _dataset(), *SHORT,
            "--kernels", ROOT / "results/bench/kernels.json", "--out", out]
    run = _cli(*args, own_process=True)
    return out, run, args


@pytest.mark.slow
def test_sweep_file_plot_and_resume(demo_sweep):
    from replayquant.statebytes import LayerShape, model_step_bytes
    from replayquant.sweep.plot import axis_floor, plot_sweep
    out, run, args = demo_sweep
    sw = json.loads(out.read_text())
    pairs = _makefile_var("DEMO_PAIRS").split()[1::2]
    Ls = [int(x) for x in _makefile_var("DEMO_BUFFER_LEN").split(",")]
    assert [v["name"] for v in sw["variants"]] == [f"{p}@L{L}" for p in pairs for L in Ls]
    assert sw["kind"] == "replayquant.sweep" and sw["complete"] and sw["provenance"]["git_commit"]
    kl = json.loads(out.with_name("demo_kl.json").read_text())      # one KL run, one reference
    assert list(kl["results"]) == [v["name"] for v in sw["variants"]]
    shapes = [LayerShape.from_dict(s) for s in sw["layers"]]
    assert len(shapes) == 6 and {s.kind for s in shapes} == {"gdn"}
    for v in sw["variants"]:
        p = PrecisionPair.load(v["base"])
        assert v["bytes_per_step"]["state"] == model_step_bytes(shapes, p, v["buffer_len"]).state
        assert v["kl"]["kl_upper"] >= v["kl"]["kl_mean"]
    assert sw["front"] and all(v["on_front"] == (v["name"] in sw["front"]) for v in sw["variants"])
    front = [v for v in sw["variants"] if v["on_front"]]
    from replayquant.sweep.command import front_kl
    kls = [front_kl(v["kl"]["kl_mean"], v["kl"]["kl_unc"])
           for v in sorted(front, key=lambda v: v["bytes_per_step"]["state"])]
    assert kls == sorted(kls, reverse=True) and len(set(kls)) == len(kls)
    # measured times: the grid timed tp4_hi32 at the GDN main L = 16 at B = 256, not at L = 8
    # (whose time is absent, never another L's)
    k = next(v for v in sw["variants"] if v["name"] == "tp4_hi32@L16")["kernel"]
    assert k["us_per_step"] > 0 and k["batch"] == 256 and k["parts"][0]["kernel"] == "replay-window"
    k8 = next(v for v in sw["variants"] if v["name"] == "tp4_hi32@L8")["kernel"]
    assert k8["us_per_step"] is None and len(k8["missing"]) == 1 \
        and k8["missing"][0].startswith("gdn ") and k8["missing"][0].endswith("L=8 (not in the grid)")
    assert next(v for v in sw["variants"] if v["name"] == "f4_sr_rs@L16")["kernel"]["us_per_step"] is None
    assert out.with_suffix(".png").stat().st_size > 10_000
    # a KL of 0 or below the floor is drawn at the axis floor, never dropped
    zero = json.loads(json.dumps(sw))
    zero["variants"][0]["kl"].update(kl_mean=0.0, kl_unc=0.0)
    drawn = plot_sweep(zero, out.with_name("zero.png"))
    floor = axis_floor([front_kl(v["kl"]["kl_mean"], v["kl"]["kl_unc"]) for v in zero["variants"]])
    assert (zero["variants"][0]["name"], zero["variants"][0]["bytes_per_step"]["state"], floor) in drawn
    assert len(drawn) == len(zero["variants"])
    assert "Pareto front" in run.stdout
    # resume: the same command finds the document done and writes the same figures
    _cli(*args)
    progress = (out.with_name("demo_kl.kl") / "progress.rank0.jsonl").read_text().splitlines()
    assert sum(json.loads(line)["type"] == "document" for line in progress) == 1
    sw2 = json.loads(out.read_text())
    assert [v["kl"]["kl_mean"] for v in sw2["variants"]] == [v["kl"]["kl_mean"] for v in sw["variants"]]


def test_pareto_front_counts_noise_as_zero():
    """A mean KL not above its uncertainty is 0 on the front: the costlier of two exact variants
    is not on it because of float noise."""
    from replayquant.sweep.command import pareto_front
    pts = [("cheap", 1, 0.1, 0.01), ("mid", 2, 0.1, 0.01), ("good", 3, 1e-3, 1e-5),
           ("exact", 4, 3e-10, 3e-9), ("exact_more", 5, -1e-9, 2e-9), ("worse", 6, 0.5, 0.0)]
    assert pareto_front(pts) == ["cheap", "good", "exact"]


@pytest.mark.slow
def test_recommend_fit_and_no_fit(demo_sweep, tmp_path):
    out, _, _ = demo_sweep
    sw = json.loads(out.read_text())
    budget = float(_makefile_var("DEMO_KL_BUDGET"))
    run = _cli("recommend", out, "--kl-budget", budget, "--out", tmp_path / "rec.json")
    rec = json.loads((tmp_path / "rec.json").read_text())
    best = rec["recommended"]
    assert best["kl_upper"] <= budget and f"recommended {best['name']}" in run.stdout
    fits = [v for v in sw["variants"] if v["kl"]["kl_upper"] <= budget]
    assert best["bytes_per_step"] == min(v["bytes_per_step"]["state"] for v in fits)
    assert rec["runner_up"]["bytes_per_step"] >= best["bytes_per_step"]
    assert best["bytes_saving"] > 1 and "less traffic than the FP32 conventional step" in run.stdout
    # nothing fits: one message naming the closest, exit 1
    least = min(v["bytes_per_step"]["state"] for v in sw["variants"])
    assert least < best["bytes_per_step"] - 1          # each limit alone can be met
    bad = _cli("recommend", out, "--kl-budget", budget, "--max-bytes", best["bytes_per_step"] - 1,
               check=False)
    assert bad.returncode == 1
    assert re.search(r"no variant fits the budgets; the closest is \S+@L\d+: .*To fit: raise",
                     bad.stderr)
    # a limit below every variant on its own: what to give
    bad = _cli("recommend", out, "--kl-budget", budget, "--max-bytes", 1000, check=False)
    assert bad.returncode == 1 and "--max-bytes 1000 is below every variant" in bad.stderr
    assert f"give --max-bytes {math.ceil(least)} or more" in bad.stderr
    # the shared FP32 pair's KL is float noise around 0 (its upper bound can be below any budget):
    # left out here
    inexact = {**sw, "variants": [v for v in sw["variants"] if v["base"] != "s32_rs"]}
    (tmp_path / "inexact.json").write_text(json.dumps(inexact))
    tight = _cli("recommend", tmp_path / "inexact.json", "--kl-budget", 1e-30, "--max-bytes", 1e12,
                 check=False)
    assert tight.returncode == 1 and "--kl-budget 1e-30 is below every variant" in tight.stderr
    # bad input: exit 2
    assert _cli("recommend", out, "--kl-budget", -1, check=False).returncode == 2
    assert _cli("recommend", out, "--kl-budget", 1e-3, "--gpqa-budget", 1, check=False).returncode == 2
    wrong = _cli("recommend", out.with_name("demo_kl.json"), "--kl-budget", 1e-3, check=False)
    assert wrong.returncode == 2 and "not a replayquant.sweep file" in wrong.stderr


@pytest.mark.slow
def test_recommend_with_gpqa_budget(demo_sweep):
    """A GPQA summary's drop (upper end of its paired uncertainty) is one more budget."""
    from replayquant.gpqa.summary import SUMMARY_KIND
    from replayquant.sweep.recommend import NoFit, recommend
    out, _, _ = demo_sweep
    sw = json.loads(out.read_text())
    by = {v["name"]: v for v in sw["variants"]}
    budget = 1.0
    cheap = min(by.values(), key=lambda v: v["bytes_per_step"]["state"])["name"]
    ref, ok = by["s32_rs@L16"], by["tp8_hi32@L16"]

    def pair_rec(v, label):
        return {"label": label, "pair": {**v["pair"], "name": label}, "file": f"{label}.json"}
    summary = {"kind": SUMMARY_KIND, "reference_pair": "s32_rs", "model_identity": sw["model"],
               "pairs": [pair_rec(ref, "s32_rs"), pair_rec(ok, "tp8_hi32"), pair_rec(by[cheap], "cheap")],
               "rows": [{"pair": "s32_rs", "task": "t", "primary": True, "delta": 0.0, "delta_stderr": 0.0},
                        {"pair": "tp8_hi32", "task": "t", "primary": True, "delta": -0.004,
                         "delta_stderr": 0.003},
                        {"pair": "cheap", "task": "t", "primary": True, "delta": -0.10,
                         "delta_stderr": 0.02}]}
    rec = recommend(sw, 1.0, gpqa=summary, gpqa_budget=budget)
    assert rec["recommended"]["name"] == "tp8_hi32@L16"          # the cheap one drops 10 points
    assert rec["recommended"]["gpqa"]["drop_upper_pts"] == pytest.approx(0.7)
    assert "cheap" not in rec["fitting"] and cheap in rec["not_fitting"]
    assert len(rec["without_gpqa_result"]) == len(sw["variants"]) - 3
    # only the cheapest is within --max-bytes, and it misses the GPQA budget by 0.5 points
    with pytest.raises(NoFit, match=f"closest is {re.escape(cheap)}: its GPQA drop reaches 12.00 points"):
        recommend(sw, 1.0, gpqa=summary, gpqa_budget=11.5, max_bytes=by[cheap]["bytes_per_step"]["state"])


# ----------------------------------------------------------------------------- sensitivity + per-layer

@pytest.mark.slow
def test_sensitivity_and_per_layer_policy(tmp_path):
    """tiny-mamba2: each layer alone with tp4_hi32 and with tp8_hi32 in one pass, ranked; a
    policy from it for a budget between the two pairs, measured beside its prediction; the
    policy file it writes runs through `replayquant kl`."""
    out = tmp_path / "sens.json"
    _cli("sensitivity", "--model", "tiny-mamba2", "--pair", "tp4_hi32", "--pair", "tp8_hi32",
         "--dataset", _dataset(), *SHORT, "--out", out)
    sens = json.loads(out.read_text())
    assert sens["kind"] == "replayquant.sensitivity" and len(sens["layers"]) == 8
    kl = json.loads(out.with_name("sens_kl.json").read_text())
    assert len(kl["results"]) == 2 * (8 + 1)                    # one pass: every layer, both pairs
    for name in ("tp4_hi32", "tp8_hi32"):
        rows = sens["per_layer"][name]
        assert sorted(r["rank"] for r in rows) == list(range(1, 9))
        ranked = sorted(rows, key=lambda r: r["rank"])
        assert [r["kl"]["kl_mean"] for r in ranked] == sorted((r["kl"]["kl_mean"] for r in rows), reverse=True)
        c = sens["sum_vs_all"][name]
        assert c["sum"] == pytest.approx(sum(r["kl"]["kl_mean"] for r in rows))
        assert c["all"] == kl["results"][f"{name}@all"]["kl_mean"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000
    lo, hi = (sum(r["kl"]["kl_upper"] for r in sens["per_layer"][p]) for p in ("tp4_hi32", "tp8_hi32"))
    budget = (lo + hi) / 2
    rec_out = tmp_path / "rec.json"
    run = _cli("recommend", "--per-layer", out, "--kl-budget", budget, "--out", rec_out, "--no-progress",
               check=False)
    assert run.returncode in (0, 1), run.stderr[-3000:]        # 1: measured over the budget, reported
    res = json.loads(rec_out.read_text())
    assert 0 < len(res["plan"]["upgraded"]) < 8
    assert res["predicted"]["kl_upper"] <= budget
    assert res["measured"]["kl_mean"] > 0 and "measured" in run.stdout and "predicted" in run.stdout
    assert res["measured_fits"] == (run.returncode == 0)
    assert res["costs"]["policy"]["bytes_per_step"]["state"] < res["costs"]["tp8_hi32"]["bytes_per_step"]["state"]
    policy_file = rec_out.with_name("rec_policy.yaml")
    _cli("kl", "--model", "tiny-mamba2", "--pair", policy_file, "--dataset", _dataset(), "--context", "128",
         "--docs", "1", "--segment", "128", "--dtype", "float32", "--device-map", "cpu", "--no-progress",
         "--out", tmp_path / "policy_kl.json")
    pk = json.loads((tmp_path / "policy_kl.json").read_text())
    assert list(pk["results"]) == [res["policy"]["name"]]
    # one pair measured: no policy can be built
    one = json.loads(json.dumps(sens))
    one["per_layer"].pop("tp8_hi32")
    (tmp_path / "one.json").write_text(json.dumps(one))
    bad = _cli("recommend", "--per-layer", tmp_path / "one.json", "--kl-budget", budget, check=False)
    assert bad.returncode == 2 and "needs two" in bad.stderr


def test_bad_sweep_and_sensitivity_input():
    """Errors before any weights load, exit 2."""
    r = _cli("sweep", "--model", "tiny-qwen3.5", "--pair", "s32_rs", "--buffer-len", "8,x", check=False)
    assert r.returncode == 2 and "--buffer-len" in r.stderr
    r = _cli("sweep", "--model", "tiny-qwen3.5", "--pair", "s32_rs", "--pair", "s32_rs", check=False)
    assert r.returncode == 2 and "comes twice" in r.stderr
    r = _cli("sweep", "--model", "tiny-qwen3.5", "--pair", "s32_rs", "--kernels", "nope.json", check=False)
    assert r.returncode == 2 and "--kernels nope.json" in r.stderr
    r = _cli("sensitivity", "--model", "tiny-qwen3.5", "--pair", "s32_rs", "--layers", "3", check=False)
    assert r.returncode == 2 and "not recurrent layers" in r.stderr


@pytest.mark.slow
def test_sensitivity_per_pass_splits_the_runs(tmp_path):
    """--per-pass 2 with 2 layers and one pair: 3 variants in two KL runs, one result."""
    out = tmp_path / "s.json"
    _cli("sensitivity", "--model", "tiny-mamba2", "--pair", "tp4_hi32", "--layers", "3,0", "--per-pass", 2,
         "--dataset", _dataset(), "--context", "128", "--docs", "1", "--segment", "128", "--dtype",
         "float32", "--device-map", "cpu", "--no-progress", "--out", out)
    sens = json.loads(out.read_text())
    assert sens["kl_results"] == ["s_kl1.json", "s_kl2.json"]
    assert [r["index"] for r in sens["per_layer"]["tp4_hi32"]] == [3, 0]
    assert sens["sum_vs_all"]["tp4_hi32"]["layers_measured"] == 2
    one = json.loads((tmp_path / "s_kl2.json").read_text())
    assert list(one["results"]) == ["tp4_hi32@all"]
