"""Bad inputs, third round: each one clear error (what is wrong, what to do), a non-zero exit,
raised before any expensive work, and nothing already computed lost.

Every case stops before a model loads or runs the embedded tiny Qwen3.5 model on short documents
cut from the shipped held-out text, so the file takes seconds."""

import json
from pathlib import Path

import pytest

from _cli import invoke, one_clear_error

TINY = "tiny-qwen3.5"
CSV = Path(__file__).parent / "data" / "gpqa_tiny.csv"


class Stop(Exception):
    """Raised where the model would load: the run got past every check."""


@pytest.fixture
def gpqa_no_model(monkeypatch):
    """`replayquant gpqa` stops with Stop where it would load the model."""
    import replayquant.gpqa.run as gpqa_run

    def fake_lm(**kw):
        raise Stop
    monkeypatch.setattr(gpqa_run, "ReplayQuantLM", fake_lm)


def _gpqa(out, *extra):
    return ["gpqa", "--model", TINY, "--pair", "s32_rs", "--gpqa-csv", CSV, "--limit", 1,
            "--out", out, *extra]


# ------------------------------------------------------------------ gpqa's task folder


def test_gpqa_keeps_a_users_files_in_its_task_folder(tmp_path, gpqa_no_model):
    out = tmp_path / "G"
    tasks = out / "_tasks"
    tasks.mkdir(parents=True)
    mine = tasks / "gpqa_diamond_cot_zeroshot.yaml"              # a file of the same name
    mine.write_text("# my own task\ntask: mine\n")
    code, text = invoke(_gpqa(out))
    one_clear_error(code, text, str(mine), "not a task file `replayquant gpqa` wrote",
                    "move it away or give another --out")
    assert mine.read_text() == "# my own task\ntask: mine\n"
    mine.unlink()
    other = tasks / "notes.yaml"                                 # lm-eval reads every YAML there
    other.write_text("task: other\n")
    code, text = invoke(_gpqa(out))
    one_clear_error(code, text, str(other), "move it away")
    other.unlink()
    (tasks / "sub").mkdir()
    code, text = invoke(_gpqa(out))
    one_clear_error(code, text, str(tasks / "sub"))
    (tasks / "sub").rmdir()
    tasks.rmdir()
    tasks.write_text("a file of mine")                           # _tasks a regular file
    code, text = invoke(_gpqa(out))
    one_clear_error(code, text, str(tasks), "not a folder", "move it away")
    assert tasks.read_text() == "a file of mine"
    tasks.unlink()
    code, text = invoke(_gpqa(out))                              # gpqa's own files: replaced
    assert "Stop" in text and mine.read_text().startswith("# Written by replayquant"), text
    code, text = invoke(_gpqa(out))
    assert "Stop" in text, text
