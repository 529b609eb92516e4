"""Results files are never destroyed or mixed: every write goes through a temporary file of its own
and a rename (a failed one keeps the earlier file and is one error naming the file); a command
replaces only its own results of the same run, never a file of another kind, another run or its
own input; one run at a time holds an output; a resumed KL run says what it found.

The KL runs use the embedded tiny Qwen3.5 model on short documents of the shipped held-out text;
the sweep, sensitivity and recommend cases read committed result files (copied) and stop before
any KL run, so the file takes seconds."""

import contextlib
import errno
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from replayquant.cli import app
from replayquant.kl import command as C

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "results/demo/tiny-qwen3.5_sweep.json"
SENS = ROOT / "results/sensitivity/tiny-qwen3.5_tp4_hi16_sr+tp8_hi16_sr_ctx2k.json"
DEMO_PAIRS = ["s32_rs", "s16_sr", "sbf16", "tp8_hi32", "tp8_hi16_sr", "tp4_hi32", "tp4_hi16_sr",
              "f4_sr_rs"]
TINY = "tiny-qwen3.5"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


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


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """A folder of two .txt documents from the shipped held-out text."""
    from replayquant.data import heldout_documents
    d = tmp_path_factory.mktemp("texts")
    for i, b in enumerate(heldout_documents()[:2]):
        (d / f"doc_{i}.txt").write_text(b["text"][:2000])
    return d


def _kl(texts, out, docs=1):
    return ["kl", "--model", TINY, "--pair", "s32_rs", "--dataset", texts, "--context", 64,
            "--docs", docs, "--segment", 32, "--dtype", "float32", "--reference", "hf",
            "--no-progress", "--out", out]


_KL_COMMAND = C.kl_command


class _NoWork(ValueError):
    pass


def _boom(*a, **k):
    raise _NoWork("reached the KL run")


@pytest.fixture
def no_kl_run(monkeypatch):
    """Stops sweep, sensitivity and recommend where they would start their KL run."""
    monkeypatch.setattr(C, "kl_command", _boom)


# ------------------------------------------------------------------ writes: temporary file + rename


def test_a_failed_write_keeps_the_earlier_file_and_names_it(tmp_path):
    from replayquant.outputs import WriteError, write_file, write_json
    target = tmp_path / "r.json"
    target.write_text("earlier")
    (tmp_path / "r.json.tmp").write_text("someone else's")         # a fixed NAME.tmp is not ours

    def full(fh):
        fh.write(b"part of it")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(WriteError, match=r"cannot write .*r\.json: No space left on device \(the "
                                         r"disk is full\); the earlier r\.json is left as it was"):
        write_file(target, full)
    assert target.read_text() == "earlier"
    write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.json.tmp"]
    assert (tmp_path / "r.json.tmp").read_text() == "someone else's"
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())   # not mkstemp's 0600


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


@contextlib.contextmanager
def _file_size_limit(nbytes):
    """`ulimit -f` for this process, for the `with` block only."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_file_size_limit_keeps_earlier_plot_and_results_and_is_one_error(tmp_path):
    """ulimit -f: the plot is written whole or not at all (it was truncated in place), and a
    command's results file likewise, with one error and no temporary file left behind."""
    from replayquant.kl.plot import plot_kl_vs_position
    res = {"results": {"p": {"kl_mean": 0.1}}, "documents_done": 1,
           "config": {"model": {"id": "m"}, "context": 65, "prefill": "replay"}}
    arrays = {0: np.abs(np.random.default_rng(0).normal(size=(1, 64))).astype(np.float16)}
    png = tmp_path / "plots" / "p.png"
    plot_kl_vs_position(res, arrays, ["p"], png)
    before = png.read_bytes()
    with _file_size_limit(4096), pytest.raises(ValueError, match=r"cannot write .*p\.png: File "
                                                              r"too large \(over the file-size limit"):
        plot_kl_vs_position(res, arrays, ["p"], png)
    assert png.read_bytes() == before and [p.name for p in png.parent.iterdir()] == ["p.png"]
    # a command: drift's results, written before, survive a second run under `ulimit -f`
    out = tmp_path / "drift"
    drift = ["drift", "--kind", "gdn", "--pair", "s32_rs", "--steps", "32", "--seeds", "1",
             "--batch", "1", "--heads", "1", "--d-k", "16", "--d-v", "8", "--no-conventional",
             "--out", str(out)]
    code, text = _invoke(drift)
    assert code == 0, text
    kept = _snapshot(out)
    with _file_size_limit(512):
        code, text = _invoke(drift)
    _one_clear_error(code, text, "gdn_32steps.json: File too large", "left as it was")
    assert _snapshot(out) == kept                                   # no temporary file either
