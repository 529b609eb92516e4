"""Results and sizes a command cannot trust: NaN, negative or incomplete KL figures never fit a
budget, damaged or mismatched files of ours stop at load with one error naming the file, and
sizes that cannot fit are refused before any work with the memory they would need.

Every case runs on the committed demo sweep and sensitivity files (copied and damaged in a
temporary folder) or stops before the model loads, so the file takes seconds."""

import copy
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from replayquant.cli import app
from replayquant.data import tiny_model_path
from replayquant.kl import command as C
from replayquant.provenance import local_fingerprint
from replayquant.sweep import per_layer as PL
from replayquant.sweep import recommend as R

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "results/demo/tiny-qwen3.5_sweep.json"
SENS = ROOT / "results/sensitivity/tiny-qwen3.5_tp4_hi16_sr+tp8_hi16_sr_ctx2k.json"


def _invoke(args, env=None):
    res = CliRunner().invoke(app, [str(a) for a in args], env=env)
    text = (res.stdout or "") + (getattr(res, "stderr", "") or "")
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        text += f"\nTraceback {type(res.exception).__name__}: {res.exception}"
    return res.exit_code, text


def _one_clear_error(code, text, *needles, exit_code=2):
    assert code == exit_code, text
    assert "Traceback" not in text, text
    for n in needles:
        assert n in text, (n, text)


def _sweep():
    return json.loads(SWEEP.read_text())


def _sens():
    sens = json.loads(SENS.read_text())
    # the model's fingerprint as this version records it: every byte of its files
    sens["model"]["local_hash"] = local_fingerprint(tiny_model_path("tiny-qwen3.5"))
    return sens


def _write(tmp_path, obj, name="f.json"):
    p = tmp_path / name
    p.write_text(json.dumps(obj, allow_nan=True))
    return p


# ------------------------------------------------------------------ NaN, negative, incomplete


def _cheapest(sw):
    return min(sw["variants"], key=lambda v: v["bytes_per_step"]["state"])


@pytest.mark.parametrize("mean, upper", [(float("nan"), float("nan")), (0.0, float("nan")),
                                         (float("inf"), float("inf")), (-0.5, -0.4)])
def test_kl_that_is_not_a_number_or_negative_fits_no_budget(tmp_path, mean, upper):
    sw = _sweep()
    v = _cheapest(sw)
    v["kl"].update(kl_mean=mean, kl_upper=upper)
    code, text = _invoke(["recommend", _write(tmp_path, sw), "--kl-budget", 1e-3])
    assert code == 0, text
    assert f"recommended {v['name']}" not in text and "recommended" in text, text
    assert "not considered (KL fits no budget)" in text and v["name"] in text, text
    rec = R.recommend(sw, 1e-3)
    assert rec["recommended"]["name"] != v["name"] and v["name"] in rec["kl_not_valid"]
    assert v["name"] not in rec["fitting"]


def test_noise_level_negative_kl_still_counts():
    sw = _sweep()
    v = next(v for v in sw["variants"] if v["name"] == "s32_rs@L8")
    v["kl"].update(kl_mean=-1e-10, kl_upper=-1e-10 + v["kl"]["kl_unc"])
    assert "s32_rs@L8" in R.recommend(sw, 1e-3)["fitting"]


def test_every_kl_nan_is_no_fit(tmp_path):
    sw = _sweep()
    for v in sw["variants"]:
        v["kl"]["kl_upper"] = float("nan")
    code, text = _invoke(["recommend", _write(tmp_path, sw), "--kl-budget", 1e-3])
    _one_clear_error(code, text, "no variant", "not a finite number", exit_code=1)


def test_incomplete_sweep_is_refused(tmp_path):
    sw = _sweep()
    sw.update(complete=False, documents_done=1, documents_planned=2)
    code, text = _invoke(["recommend", _write(tmp_path, sw), "--kl-budget", 1e-3])
    _one_clear_error(code, text, "f.json", "not complete (1 of 2 documents", "replayquant sweep")


# ------------------------------------------------------------------ damaged sweep files


def _damage(obj, path, value):
    """obj with the value at `path` (keys / indices) replaced, or deleted for value ...."""
    obj = copy.deepcopy(obj)
    at = obj
    for k in path[:-1]:
        at = at[k]
    if value is ...:
        del at[path[-1]]
    else:
        at[path[-1]] = value
    return obj


@pytest.mark.parametrize("path, value, where", [
    (("variants",), ..., "variants is missing"),
    (("variants",), {"a": 1}, "variants should be a list"),
    (("variants", 0), [1, 2], "variants[0] should be a mapping"),
    (("variants", 0, "kl"), "x", "variants[0].kl should be a mapping"),
    (("variants", 0, "kl", "kl_upper"), ..., "variants[0].kl.kl_upper is missing"),
    (("variants", 0, "kl", "kl_upper"), "0.1", "variants[0].kl.kl_upper should be a number"),
    (("variants", 2, "bytes_per_step"), ..., "variants[2].bytes_per_step is missing"),
    (("variants", 2, "memory", "total"), None, "variants[2].memory.total should be a finite"),
    (("variants", 1, "name"), 3, "variants[1].name should be a string"),
    (("variants", 1, "kernel"), [], "variants[1].kernel should be a mapping"),
    (("conventional_fp32",), [], "conventional_fp32 should be a mapping"),
    (("conventional_fp32", "memory"), ..., "conventional_fp32.memory is missing"),
    (("complete",), ..., "complete is missing"),
    (("front",), "a", "front should be a list"),
])
def test_damaged_sweep_is_one_error(tmp_path, path, value, where):
    code, text = _invoke(["recommend", _write(tmp_path, _damage(_sweep(), path, value)),
                          "--kl-budget", 1e-3])
    _one_clear_error(code, text, "f.json", where, "replayquant sweep")


def test_sweep_of_repeated_variants_is_refused(tmp_path):
    sw = _sweep()
    sw["variants"].append(sw["variants"][0])
    code, text = _invoke(["recommend", _write(tmp_path, sw), "--kl-budget", 1e-3])
    _one_clear_error(code, text, "f.json", "s32_rs@L8 come more than once")


# ------------------------------------------------------------------ damaged sensitivity files


def _per_layer(tmp_path, sens, *extra):
    return _invoke(["recommend", "--per-layer", _write(tmp_path, sens, "s.json"), "--kl-budget",
                    1e-3, "--out", tmp_path / "r.json", "--no-progress", *extra])


@pytest.mark.parametrize("path, value, where", [
    (("per_layer",), ..., "per_layer is missing"),
    (("per_layer",), {}, "per_layer holds no pair"),
    (("per_layer", "tp4_hi16_sr"), [], "per_layer.tp4_hi16_sr should be a non-empty list"),
    (("per_layer", "tp4_hi16_sr", 0), ..., "per_layer.tp8_hi16_sr measured other layers"),
    (("per_layer", "tp4_hi16_sr", 0, "kl"), ..., "per_layer.tp4_hi16_sr[0].kl is missing"),
    (("per_layer", "tp4_hi16_sr", 0, "index"), 99, "names layers the file's layers do not hold"),
    (("pairs",), [], "pairs should be a non-empty list"),
    (("pairs", 0, "name"), "other", "per_layer.tp4_hi16_sr is not among its pairs"),
    (("layers", 0), ..., "names layers the file's layers do not hold"),
    (("layers", 0, "kind"), "lstm", "layer kind must be one of"),
    (("all_layers", "tp8_hi16_sr"), ..., "all_layers.tp8_hi16_sr should be a mapping"),
    (("kl_args",), ..., "kl_args is missing"),
    (("kl_args", "model"), 1, "kl_args.model should be a string"),
    (("kl_args", "context"), "2048", "kl_args.context should be an integer"),
    (("kl_args", "pack"), 0, "kl_args.pack should be true or false"),
    (("kl_args", "colour"), "red", "kl_args holds ['colour'], which no KL run takes"),
])
def test_damaged_sensitivity_is_one_error(tmp_path, no_model, path, value, where):
    code, text = _per_layer(tmp_path, _damage(_sens(), path, value))
    _one_clear_error(code, text, where)
    assert "s.json" in text or "sensitivity file" in text, text
    assert not (tmp_path / "r.json").exists() and not list(tmp_path.glob("r_*"))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_per_layer_kl_not_a_number_is_refused(tmp_path, no_model, value):
    sens = _sens()
    sens["per_layer"]["tp8_hi16_sr"][2]["kl"].update(kl_mean=value, kl_upper=value)
    code, text = _per_layer(tmp_path, sens)
    _one_clear_error(code, text, "s.json", "single-layer KL of tp8_hi16_sr on layer")
    assert "budget met" not in text


def test_incomplete_sensitivity_is_refused(tmp_path, no_model):
    sens = _sens()
    sens.update(complete=False, documents_done=1)
    code, text = _per_layer(tmp_path, sens)
    _one_clear_error(code, text, "s.json", "not complete", "replayquant sensitivity")


def test_nan_upper_bounds_build_no_policy():
    sens = _sens()
    for r in sens["per_layer"]["tp8_hi16_sr"]:
        r["kl"]["kl_upper"] = float("nan")
    with pytest.raises(ValueError, match="kl_upper nan is not a finite number"):
        PL.build_policy(sens, 1e-3)


# ------------------------------------------------------------------ the model a file measured


def test_per_layer_refuses_another_model_than_the_file_measured(tmp_path, monkeypatch):
    import functools

    @functools.wraps(C.kl_command)
    def boom(*a, **k):
        raise AssertionError("the KL run started on another model")
    monkeypatch.setattr(C, "kl_command", boom)
    sens = _sens()
    sens["model"]["local_hash"] = "sha256:" + "0" * 32
    code, text = _per_layer(tmp_path, sens)
    _one_clear_error(code, text, "s.json", "sha256:" + "0" * 32,
                     local_fingerprint(tiny_model_path("tiny-qwen3.5")), "now holds another")
    assert not (tmp_path / "r.json").exists() and not list(tmp_path.glob("r_*"))


def test_per_layer_measures_the_recorded_hub_revision():
    sens = _sens()
    sens["model"] = {"id": "Qwen/Qwen3.5-4B", "revision": "abc123"}
    sens["kl_args"]["model"] = "Qwen/Qwen3.5-4B"
    assert PL.check_same_model(sens)["revision"] == "abc123"
    assert PL.check_same_model(_sens())["revision"] is None


# ------------------------------------------------------------------ sizes, before any work

TINY = "tiny-qwen3.5"


@pytest.fixture
def no_weights(monkeypatch):
    """Fails a test that loads weights or documents (config and tokenizer may load)."""
    from replayquant.kl import data as D

    def boom(*a, **k):
        raise AssertionError("weights or documents were loaded before the bad size was refused")
    monkeypatch.setattr(C, "load_weights", boom)
    monkeypatch.setattr(D, "load_documents", boom)


def _pair_yaml(tmp_path, L, name="long"):
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"name: {name}\nanchor: {{format: fp16, rounding: stochastic}}\nbuffer_len: {L}\n")
    return p


def test_sweep_buffer_not_below_the_context_is_refused(tmp_path, no_weights):
    code, text = _invoke(["sweep", "--model", TINY, "--pair", "s32_rs", "--buffer-len", "8,512",
                          "--context", 256, "--docs", 1, "--out", tmp_path / "s.json"])
    _one_clear_error(code, text, "buffer length 512 is not below --context 256", "no flush")
    assert list(tmp_path.iterdir()) == []


def test_kl_pair_yaml_buffer_not_below_the_context_is_refused(tmp_path, no_weights):
    code, text = _invoke(["kl", "--model", TINY, "--pair", _pair_yaml(tmp_path, 256), "--context",
                          256, "--out", tmp_path / "k.json"])
    _one_clear_error(code, text, "buffer length 256 is not below --context 256")


@pytest.mark.parametrize("args", [["--pair", "YAML"], ["--pair", "s32_rs", "--buffer-len", 10 ** 6]])
def test_huge_buffer_lengths_are_refused_with_the_memory_they_need(tmp_path, no_weights, args,
                                                                    monkeypatch):
    from replayquant import memory
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: (16 * 2.0 ** 30, "the host"))
    args = [_pair_yaml(tmp_path, 10 ** 8) if a == "YAML" else a for a in args]
    code, text = _invoke(["sweep" if "--buffer-len" in args else "kl", "--model", TINY, *args,
                          "--out", tmp_path / "k.json"])
    L = 10 ** 8 if "--buffer-len" not in args else 10 ** 6
    need = 6 * 4 * 4 * (L * 258 + 2 * 64 * 128)
    _one_clear_error(code, text, f"would need {need / 2 ** 30:.3g} GiB of memory",
                     f"buffer lengths up to {L}")


def test_caches_that_do_not_fit_are_refused_with_the_memory_they_need(tmp_path, no_weights,
                                                                       monkeypatch):
    from replayquant import memory
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: (2.0 ** 30, "the host"))
    # tiny-qwen3.5: 6 GDN layers of 4 heads, d_k 128, d_v 64: 258 FP32 values per head and entry
    need = 6 * 4 * 4 * (100000 * 258 + 2 * 64 * 128)
    code, text = _invoke(["sweep", "--model", TINY, "--pair", "s32_rs", "--buffer-len", 100000,
                          "--context", 131072, "--out", tmp_path / "s.json"])
    _one_clear_error(code, text, f"would need {need / 2 ** 30:.3g} GiB of memory",
                     "more than the 1 GiB free on the host")
    from replayquant.pairs import PrecisionPair
    from replayquant.policy import quantized_layers
    from replayquant.sweep.common import shapes_of_model
    pair = PrecisionPair.load("s32_rs").with_buffer_len(100000)
    layers = quantized_layers(pair, shapes_of_model(TINY)[0])
    assert memory.kl_cache_bytes([layers]) == need


# ------------------------------------------------------------------ names and seeds that would mislead


def test_user_pair_named_like_a_shipped_pair_must_store_its_formats(tmp_path, no_model):
    other = tmp_path / "tp4_hi32.yaml"                 # the shipped name from the file's name
    other.write_text("read: {format: fp8}\nanchor: {format: fp32}\n")
    named = tmp_path / "mine.yaml"                     # ... or from its name: line
    named.write_text("name: s16_sr\nanchor: {format: fp16, rounding: nearest}\n")
    for p, name in ((other, "tp4_hi32"), (named, "s16_sr")):
        code, text = _invoke(["kl", "--model", TINY, "--pair", p, "--out", tmp_path / "k.json"])
        _one_clear_error(code, text, str(p), f"named {name}, as a shipped pair", "another name")
    same = tmp_path / "s32_rs.yaml"                    # the same formats (another L) are that pair
    same.write_text("anchor: {format: fp32}\nbuffer_len: 4\n")
    from replayquant.pairs import PrecisionPair
    assert PrecisionPair.load(same).buffer_len == 4


def test_drift_repeated_seed_is_refused(tmp_path):
    code, text = _invoke(["drift", "--kind", "gdn", "--pair", "s32_rs", "--steps", 32, "--seeds",
                          "1,1", "--out", tmp_path])
    _one_clear_error(code, text, "seed(s) 1 given more than once")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, needles", [
    (["drift", "--kind", "gdn", "--pair", "s32_rs", "--steps", 100000000, "--seeds", "1"],
     ["a drift of 100000000 steps", "would need 1.44e+03 GiB of memory", "fewer --steps"]),
    (["drift", "--kind", "kda", "--pair", "s32_rs", "--steps", 100000000, "--seeds", "1"],
     ["would need 1.82e+03 GiB of memory"]),
    (["formats", "--d", 1000000], ["the test tensor [8, 1000000, 1000000]",
                                   "would need 4.77e+05 GiB of memory", "smaller --d"]),
])
def test_huge_drift_and_formats_sizes_are_refused_before_any_work(tmp_path, monkeypatch, args,
                                                                  needles):
    import replayquant.drift as drift
    import replayquant.formats.report as report

    def boom(*a, **k):
        raise AssertionError("the work started before the size was refused")
    monkeypatch.setattr(drift, "make_inputs", boom)
    monkeypatch.setattr(report, "state_like_tensor", boom)
    code, text = _invoke([*args, *(["--out", tmp_path] if args[0] == "drift" else [])])
    _one_clear_error(code, text, "more than the", "free on the host", *needles)


# ------------------------------------------------------------------ the Triton backend without a GPU


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA GPU runs the kernels")
def test_triton_backend_without_gpu_or_interpreter_is_one_error_at_once(monkeypatch):
    import torch

    from replayquant import formats
    from replayquant.formats import report

    def boom(*a, **k):
        raise AssertionError("the command started before the backend was refused")
    monkeypatch.setattr(report, "print_formats_table", boom)
    env = {"REPLAYQUANT_BACKEND": "triton", "TRITON_INTERPRET": "0"}
    code, text = _invoke(["formats"], env=env)
    _one_clear_error(code, text, "REPLAYQUANT_BACKEND=triton", "no CUDA GPU", "TRITON_INTERPRET=1")
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="the tensor is not on a CUDA GPU"):
        formats.get_format("fp16").quantize(torch.ones(4, 16))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert formats.use_triton(torch.ones(1))


# ------------------------------------------------------------------ YAML that would fill memory or hang


def _bomb(levels=9):
    lines = ['a0: &a0 "lol"']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return lines


def test_alias_bomb_in_a_policy_is_refused_before_any_kl_work(tmp_path, no_weights):
    pol = tmp_path / "bomb.yaml"
    pol.write_text("x_: &x\n" + "\n".join("  " + ln for ln in _bomb()) +
                   "\ndefault: tp4_hi32\ndescription: *x\n")
    code, text = _invoke(["kl", "--model", TINY, "--pair", pol, "--out", tmp_path / "k.json"])
    _one_clear_error(code, text, "bomb.yaml", "more than 100000 values", "aliases")
    pair = tmp_path / "p.yaml"                          # a pair file the same
    pair.write_text("\n".join(_bomb()) + "\nanchor: {format: fp32}\n")
    code, text = _invoke(["kl", "--model", TINY, "--pair", pair, "--out", tmp_path / "k.json"])
    _one_clear_error(code, text, "p.yaml", "more than 100000 values")
    rec = tmp_path / "r.yaml"                           # a value holding itself
    rec.write_text("default: tp4_hi32\ndescription: &d [*d]\n")
    code, text = _invoke(["kl", "--model", TINY, "--pair", rec, "--out", tmp_path / "k.json"])
    _one_clear_error(code, text, "r.yaml", "refers to the value that holds it")


def test_anchors_of_a_reasonable_policy_still_load(tmp_path):
    from replayquant.policy import LayerPolicy
    pol = tmp_path / "ok.yaml"
    pol.write_text("default: tp4_hi32\noverrides:\n  - {layers: [0], pair: &hi {anchor: "
                   "{format: fp32}, read: {format: fp8}}}\n  - {layers: [3], pair: *hi}\n")
    p = LayerPolicy.load(pol)
    assert p.overrides[0].pair == p.overrides[1].pair


def test_many_overrides_load_fast_and_too_many_are_refused(tmp_path):
    import time

    from replayquant.policy import LayerPolicy

    def policy(n):
        p = tmp_path / f"p{n}.yaml"
        p.write_text("default: tp4_hi32\noverrides:\n" + "".join(
            f"  - {{layers: [{i}], pair: tp8_hi32}}\n" for i in range(n)))
        return p
    t = time.perf_counter()
    assert len(LayerPolicy.load(policy(5000)).overrides) == 5000      # each pair file read once
    with pytest.raises(ValueError, match="MiB long"):
        LayerPolicy.load(policy(200000))
    assert time.perf_counter() - t < 10


def test_deeply_nested_yaml_is_one_error(tmp_path):
    from replayquant.pairs import PrecisionPair
    deep = tmp_path / "deep.yaml"
    deep.write_text("anchor: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ValueError, match="deep.yaml: (not valid YAML|its values nest too deeply)"):
        PrecisionPair.load(deep)


@pytest.mark.parametrize("summary, where", [
    ({"pairs": "x", "rows": []}, "pairs should be a list"),
    ({"pairs": [{"label": "a"}], "rows": []}, "pairs[0].pair is missing"),
    ({"pairs": [], "rows": [{"pair": "a", "delta": "0.1", "task": "t"}]}, "rows[0].delta should be"),
])
def test_damaged_gpqa_summary_is_one_error(summary, where):
    with pytest.raises(ValueError, match=r"the GPQA summary: " + __import__("re").escape(where)):
        R.recommend(_sweep(), 1e-3, gpqa={"kind": "replayquant.gpqa_summary", **summary},
                    gpqa_budget=1.0)


def test_kl_that_fits_no_budget_is_on_no_front():
    from replayquant.sweep.common import pareto_front
    pts = [("nan", 1, float("nan"), 0.0), ("neg", 2, -0.5, 0.01), ("inf", 3, float("inf"), 0.0),
           ("noise", 4, -1e-10, 1e-9), ("ok", 5, 1e-3, 1e-5)]
    assert pareto_front(pts) == ["noise"]
    assert pareto_front([("ok", 5, 1e-3, 1e-5), ("neg", 2, -0.5, 0.01)]) == ["ok"]


def test_per_layer_model_gone_names_the_file(tmp_path, no_model):
    sens = _sens()
    sens["kl_args"]["model"] = str(tmp_path / "gone")
    code, text = _per_layer(tmp_path, sens)
    _one_clear_error(code, text, "s.json measured the model", "gone")
