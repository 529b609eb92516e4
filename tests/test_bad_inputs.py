"""Bad inputs of the command line and the library: each one clear error (what is wrong, what to
do), a non-zero exit, raised before any expensive work, and nothing already computed lost.

The KL runs use the embedded tiny Qwen3.5 model on two short documents cut from the shipped
held-out text (64 tokens each), so every run takes about a second."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from replayquant.cli import app
from replayquant.kl import command as C
from replayquant.kl import runner as R

TINY = "tiny-qwen3.5"
CTX = 64


def _invoke(args):
    res = CliRunner().invoke(app, [str(a) for a in args])
    text = (res.stdout or "") + (getattr(res, "stderr", "") or "")
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        text += f"\n{type(res.exception).__name__}: {res.exception}"
    return res.exit_code, text


def _one_clear_error(code, text, *needles):
    assert code == 2, text
    assert "Traceback" not in text, text
    for n in needles:
        assert n in text, (n, text)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """A folder of two .txt documents from the shipped held-out text (each >= CTX tokens)."""
    from replayquant.data import heldout_documents
    d = tmp_path_factory.mktemp("texts")
    books = heldout_documents()
    for i, b in enumerate(books[:2]):
        (d / f"doc_{i}.txt").write_text(b["text"][:2000])
    return d


@pytest.fixture
def no_model(monkeypatch):
    """Fails a test that loads the model (tokenizer, config or weights)."""
    def boom(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")
    monkeypatch.setattr(C, "load_tokenizer_and_config", boom)
    monkeypatch.setattr(C, "load_weights", boom)


def _kl(texts, out, *extra, docs=1):
    return ["kl", "--model", TINY, "--pair", "s32_rs", "--dataset", texts, "--context", CTX,
            "--docs", docs, "--segment", 32, "--dtype", "float32", "--reference", "hf",
            "--no-progress", "--out", out, *extra]


# ------------------------------------------------------------------ kl --out


def test_kl_out_checked_before_the_model_loads(texts, tmp_path, no_model):
    folder = tmp_path / "o"
    folder.mkdir()
    a_file = tmp_path / "plain_file"
    a_file.write_text("x")
    cases = [
        (tmp_path / "res.png", "must end in .json"),
        (tmp_path / "res.kl", "must end in .json"),
        (tmp_path / "res", "must end in .json"),
        (folder, "is a folder"),
        (a_file / "res.json", "is a file, not a folder"),
        (Path("/proc/replayquant_no/res.json"), "cannot write in /proc"),
    ]
    for out, msg in cases:
        code, text = _invoke(_kl(texts, out))
        _one_clear_error(code, text, msg)
    (tmp_path / "r.kl").write_text("not a folder")
    code, text = _invoke(_kl(texts, tmp_path / "r.json"))
    _one_clear_error(code, text, "r.kl", "not a folder")
    assert not (tmp_path / "res.png").exists() and a_file.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o", "plain_file", "r.kl"]
