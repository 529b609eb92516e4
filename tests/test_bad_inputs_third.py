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


# ------------------------------------------------------------------ sizes that would hang


@pytest.fixture
def deadline():
    """Fails a test whose command runs past `seconds` (a hang) instead of waiting on it."""
    import signal

    def start(seconds):
        def fail(*_):
            raise AssertionError(f"still running after {seconds} s")
        signal.signal(signal.SIGALRM, fail)
        signal.alarm(seconds)
    yield start
    signal.alarm(0)


ROOT = Path(__file__).resolve().parents[1]
SENS = ROOT / "results/sensitivity/tiny-qwen3.5_tp4_hi16_sr+tp8_hi16_sr_ctx2k.json"


def _sens():
    from replayquant.data import tiny_model_path
    from replayquant.provenance import local_fingerprint
    sens = json.loads(SENS.read_text())
    sens["model"]["local_hash"] = local_fingerprint(tiny_model_path(TINY))
    return sens


def test_byte_model_of_a_huge_buffer_length_is_counted_at_once(deadline):
    from replayquant.pairs import PrecisionPair
    from replayquant.statebytes import (LayerShape, layer_step_bytes, replay_flush_step_bytes,
                                        replay_read_step_bytes, replay_window_bytes)
    deadline(5)
    for kind in ("gdn", "kda", "mamba2"):
        sh = LayerShape(kind, 4, 4 if kind == "kda" else 2, 32, 64)
        for name in ("s32_rs", "tp4_hi16_sr"):
            p = PrecisionPair.load(name)
            rf = None if p.read is None else p.read.format
            for L in (1, 2, 3, 16, 10 ** 9):
                w = replay_window_bytes(kind, p.anchor.format, rf, L, 1, sh.H, sh.HK, sh.dv, sh.dk)
                assert layer_step_bytes(sh, p, L).total == pytest.approx(w, rel=1e-12)
                if L < 100:                                     # the window, step by step
                    ub = 4 if rf is None and p.anchor.format == "fp32" else 2
                    steps = sum(replay_read_step_bytes(kind, rf or p.anchor.format, h, 1, sh.H,
                                                       sh.HK, sh.dv, sh.dk, ub, L)
                                for h in range(L - 1))
                    steps += replay_flush_step_bytes(kind, p.anchor.format, rf, L, 1, sh.H, sh.HK,
                                                     sh.dv, sh.dk)
                    assert w == pytest.approx(steps / L, rel=1e-12)


def test_sensitivity_file_with_a_huge_buffer_length_is_refused_at_once(tmp_path, no_model,
                                                                      deadline):
    sens = _sens()
    sens["pairs"][0]["buffer_len"] = 10 ** 9
    src = tmp_path / "s.json"
    src.write_text(json.dumps(sens))
    deadline(60)
    code, text = invoke(["recommend", "--per-layer", src, "--kl-budget", 1e-3, "--out",
                         tmp_path / "r.json", "--no-progress"])
    one_clear_error(code, text, "buffer length", "1000000000")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]


def test_model_benches_of_the_4b_shape_refuse_a_machine_without_cuda(tmp_path, monkeypatch):
    import torch

    from replayquant.bench import teacher_forcing as tf
    from replayquant.kl import bench as kb

    def boom(*a, **k):
        raise AssertionError("the benchmark started")
    for mod, name in ((kb, "_bench_kl"), (tf, "whole_model"), (tf, "check")):
        monkeypatch.setattr(mod, name, boom)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = ["--out", tmp_path / "b.json"]
    for args in (["bench", "kl"], ["bench", "teacher-forcing"]):
        code, text = invoke([*args, *out])
        one_clear_error(code, text, "qwen3.5-4b", "no CUDA GPU", "--shape tiny")
    for part in ("layer", "all"):
        code, text = invoke(["bench", "teacher-forcing", "--part", part, *out])
        one_clear_error(code, text, "need a CUDA GPU", "run it on a machine with one")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    code, text = invoke(["bench", "teacher-forcing", "--device", "cpu", *out])
    one_clear_error(code, text, "--device cpu", "--shape tiny")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for args in (["bench", "kl", "--shape", "tiny"], ["bench", "teacher-forcing", "--shape", "tiny"]):
        code, text = invoke([*args, *out])                      # the CPU smoke test runs
        assert "the benchmark started" in text, text
    assert list(tmp_path.iterdir()) == []
