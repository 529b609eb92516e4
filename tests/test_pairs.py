"""Precision pairs: shipped YAML files, loading, validation, sizes, the `pairs` command."""

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
    assert "0.5627" in r.output and "anchor B/elem" in r.output
