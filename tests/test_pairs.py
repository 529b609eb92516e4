"""Precision pairs: shipped YAML files, loading, validation, sizes, the `pairs` command."""

import re

import pytest
from typer.testing import CliRunner

from replayquant import PrecisionPair
from replayquant.cli import app
from replayquant.pairs import FormatSpec, list_pairs

SHIPPED = {  # name: (read, anchor)
    "s32_rs": (None, ("fp32", "nearest")),
    "s16_sr": (None, ("fp16", "stochastic")),
    "sbf16": (None, ("bf16", "nearest")),
    "tp8_hi32": (("fp8", "nearest"), ("fp32", "nearest")),
    "tp4_hi32": (("nvfp4", "nearest"), ("fp32", "nearest")),
    "tp8_hi16_sr": (("fp8", "nearest"), ("fp16", "stochastic")),
    "tp4_hi16_sr": (("nvfp4", "nearest"), ("fp16", "stochastic")),
    "f4_sr_rs": (None, ("nvfp4", "stochastic")),
}


def test_shipped_pairs():
    assert set(SHIPPED) <= set(list_pairs())
    for name, (read, anchor) in SHIPPED.items():
        p = PrecisionPair.load(name)
        assert p.name == name and p.buffer_len == 16
        assert p.shared == (read is None)
        assert (p.anchor.format, p.anchor.rounding) == anchor
        if read is not None:
            assert (p.read.format, p.read.rounding) == read
        assert p.read_spec == (p.anchor if read is None else p.read)


def test_bytes_per_element():
    p = PrecisionPair.load("tp4_hi16_sr")
    assert p.anchor_bytes() == 2.0
    assert p.read_bytes(128, 128) == pytest.approx(0.5 + 1 / 16 + 4 / (128 * 128))
    assert p.state_bytes() == pytest.approx(p.anchor_bytes() + p.read_bytes())
    s = PrecisionPair.load("s32_rs")
    assert s.read_bytes() == s.anchor_bytes() == s.state_bytes() == 4.0
    assert PrecisionPair.load("tp8_hi32").read_bytes(64, 32) == pytest.approx(1 + 4 / 64)


def test_code_and_path_construction(tmp_path):
    p = PrecisionPair(read=FormatSpec("nvfp4"), anchor=FormatSpec("fp16", "stochastic"), buffer_len=8)
    assert not p.shared and p.buffer_len == 8
    assert PrecisionPair(read="fp8", anchor={"format": "fp32"}, buffer_len=2).read == FormatSpec("fp8")
    f = tmp_path / "mine.yaml"
    f.write_text("read: {format: fp8}\nanchor: {format: bf16, rounding: stochastic}\nbuffer_len: 4\n")
    q = PrecisionPair.load(str(f))
    assert q.name == "mine" and q.read == FormatSpec("fp8") and q.anchor.rounding == "stochastic"
    assert PrecisionPair.from_dict(q.to_dict()) == q


@pytest.mark.parametrize("text,match", [
    ("anchor: {format: fp12}\n", r"unknown format 'fp12'"),
    ("anchor: {format: fp16, rounding: up}\n", r"unknown rounding 'up'"),
    ("read: {format: nvfp4, rounding: sr}\nanchor: {format: fp32}\n", r"unknown rounding 'sr'"),
    ("anchor: {format: fp32}\nbuffer_len: 0\n", r"buffer_len must be an integer >= 1"),
    ("anchor: {format: fp32}\nbuffer_len: 2.5\n", r"buffer_len must be an integer >= 1"),
    ("anchor: {format: fp32}\nbufferlen: 4\n", r"unknown key\(s\) \['bufferlen'\]"),
    ("anchor: {format: fp32, scale: 2}\n", r"anchor: unknown key\(s\) \['scale'\]"),
    ("- a\n- b\n", r"not a precision pair"),
    ("read: {format: fp8}\nbuffer_len: 4\n", r"missing 'anchor'"),
    ("anchor: [1, 2\n", r"not valid YAML"),
])
def test_validation_errors(tmp_path, text, match):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        PrecisionPair.load(str(f))


def test_unknown_name_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"unknown precision pair 'nope'.*s32_rs"):
        PrecisionPair.load("nope")
    with pytest.raises(ValueError, match=r"does not exist"):
        PrecisionPair.load(str(tmp_path / "missing.yaml"))


def test_pairs_command_lists_every_pair():
    r = CliRunner().invoke(app, ["pairs"])
    assert r.exit_code == 0, r.output
    for name in SHIPPED:
        assert name in r.output
    assert "0.5627" in r.output and "anchor B" in r.output
    assert max(map(len, r.output.splitlines())) <= 80, r.output


# -------------------------------------------------------------- names that read as a shipped pair

LOOKALIKES = ["tp4_hi16_sr ", "tp4_hi16_sr!", "TP4_HI16_SR", "tp4-hi16-sr", "tp4_hi16_sr.yaml",
              "tp4_hi16_sr@L16"]


@pytest.mark.parametrize("name", LOOKALIKES)
def test_name_that_reads_as_a_shipped_pair_must_store_its_formats(tmp_path, name):
    """Names compare as the sweep tidies them for display (`pairs.name_key`): a lookalike holding
    other formats is refused wherever a pair is made; holding the shipped formats, it is fine."""
    p = tmp_path / "mine.yaml"
    p.write_text(f"name: {name!r}\nread: {{format: fp8}}\nanchor: {{format: fp32}}\n")
    with pytest.raises(ValueError, match="reads as the shipped pair tp4_hi16_sr.*another name"):
        PrecisionPair.load(p)
    with pytest.raises(ValueError, match="reads as the shipped pair tp4_hi16_sr"):
        PrecisionPair(FormatSpec("fp8"), FormatSpec("fp32"), 16, name)
    same = PrecisionPair(FormatSpec("nvfp4"), FormatSpec("fp16", "stochastic"), 8, name)
    assert same.buffer_len == 8


def test_policy_named_as_a_shipped_pair_must_hold_only_that_pair(tmp_path):
    from replayquant.policy import EXACT, LayerPolicy, Override
    pol = tmp_path / "tp4_hi16_sr!.yaml"
    pol.write_text("default: tp8_hi32\n")
    with pytest.raises(ValueError, match="reads as the shipped pair tp4_hi16_sr"):
        LayerPolicy.load(pol)
    inline = tmp_path / "mixed.yaml"
    inline.write_text("default: tp8_hi32\noverrides:\n  - layers: [0]\n    pair: {name: 'S32_RS', "
                      "anchor: {format: fp16}}\n")
    with pytest.raises(ValueError, match="reads as the shipped pair s32_rs"):
        LayerPolicy.load(inline)
    # a sensitivity run's single-layer variant: the pair it names on one layer, exact elsewhere
    tp4 = PrecisionPair.load("tp4_hi16_sr")
    assert LayerPolicy(EXACT, (Override(tp4, (3,), None),), "tp4_hi16_sr@layer3").name


def test_sweep_tidies_no_lookalike_onto_the_front(tmp_path):
    from replayquant.sweep.command import sweep_variants
    p = tmp_path / "mine.yaml"
    p.write_text("name: 'tp4_hi16_sr '\nread: {format: fp8}\nanchor: {format: fp32}\n")
    with pytest.raises(ValueError, match="reads as the shipped pair tp4_hi16_sr"):
        sweep_variants([str(p)], [16])
    ok = tmp_path / "ok.yaml"
    ok.write_text("name: 'my pair!'\nread: {format: fp8}\nanchor: {format: fp32}\n")
    assert [v["variant"].name for v in sweep_variants([str(ok)], [16])] == ["my-pair@L16"]


def _results(tmp_path, src, edit):
    import json
    from pathlib import Path
    obj = json.loads((Path(__file__).resolve().parents[1] / src).read_text())
    edit(obj)
    out = tmp_path / Path(src).name
    out.write_text(json.dumps(obj))
    return out


def _fp32(rec):
    rec.pop("read", None)
    rec["anchor"] = {"format": "fp32", "rounding": "nearest"}


def test_pairs_read_back_from_results_files_are_checked_against_their_formats(tmp_path):
    """A results file whose pair record under a shipped name holds other formats (edited, or
    written by a lookalike) is refused at load, naming the file and the record."""
    from replayquant.kl.report import load_results
    from replayquant.sweep.common import load_json_kind

    def sweep(o):
        v = next(v for v in o["variants"] if v["name"] == "tp4_hi16_sr@L16")
        _fp32(v["pair"])
        v["pair"]["name"] = "mine@L16"          # the variant's name still says tp4_hi16_sr

    def sens(o):
        _fp32(o["pairs"][0])

    def kl(o):
        o["config"]["pairs"][0]["anchor"] = {"format": "fp16", "rounding": "nearest"}
    cases = [("results/demo/tiny-qwen3.5_sweep.json", sweep, "replayquant.sweep"),
             ("results/sensitivity/tiny-qwen3.5_tp4_hi16_sr+tp8_hi16_sr_ctx2k.json", sens,
              "replayquant.sensitivity")]
    for src, edit, kind in cases:
        f = _results(tmp_path, src, edit)
        with pytest.raises(ValueError, match=re.escape(f"{f}: ") + "(variants|pairs).*(reads as "
                           "the shipped pair tp4_hi16_sr|named tp4_hi16_sr, as a shipped pair)"):
            load_json_kind(f, kind, "x")
        assert load_json_kind(_results(tmp_path, src, lambda o: None), kind, "x")["pairs" if
                                                                                 "sens" in kind
                                                                                 else "variants"]
    f = _results(tmp_path, "results/demo/tiny-qwen3.5_sweep_kl.json", kl)
    with pytest.raises(ValueError, match=re.escape(f"{f}: config.pairs[0]") + ".*reads as the "
                       "shipped pair s32_rs"):
        load_results([f])
