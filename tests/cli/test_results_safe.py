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

from replayquant.data import tiny_model_path
from replayquant.kl import command as C
from replayquant.provenance import local_fingerprint
from replayquant.sweep import per_layer as PL
from _cli import invoke as _invoke, one_clear_error as _one_clear_error

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "results/demo/tiny-qwen3.5_sweep.json"
SENS = ROOT / "results/sensitivity/tiny-qwen3.5_tp4_hi16_sr+tp8_hi16_sr_ctx2k.json"
DEMO_PAIRS = ["s32_rs", "s16_sr", "sbf16", "tp8_hi32", "tp8_hi16_sr", "tp4_hi32", "tp4_hi16_sr",
              "f4_sr_rs"]
TINY = "tiny-qwen3.5"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


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
    # an append that fails is cut back: the log is as it was
    from replayquant.outputs import append_line
    log = tmp_path / "progress.jsonl"
    append_line(log, '{"a": 1}')
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
        with pytest.raises(WriteError, match="progress.jsonl: full"):
            append_line(log, '{"b": 2}')
    assert log.read_text() == '{"a": 1}\n'
    os.chmod(target, 0o444)                                     # read-only: kept, for root too
    with pytest.raises(WriteError, match="it is read-only"):
        write_json(target, {"b": 2})
    assert json.loads(target.read_text()) == {"a": 1}


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


def test_a_failed_per_document_write_is_one_error_and_keeps_the_results(texts, tmp_path,
                                                                        monkeypatch):
    out = tmp_path / "r.json"
    code, text = _invoke(_kl(texts, out, docs=1))
    assert code == 0, text
    kept = _snapshot(tmp_path)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(np, "save", full)
    code, text = _invoke(_kl(texts, out, docs=2))
    _one_clear_error(code, text, "cannot write", "doc00001.npy", "disk is full", "run the same command")
    assert _snapshot(tmp_path) == kept


def test_every_writer_goes_through_the_outputs_module():
    """No results file is written in place: a raw write in the package is a mistake."""
    raw = re.compile(r"\.write_text\(|\.write_bytes\(|\.savefig\(|json\.dump\(|np\.save\(|"
                     r"open\([^)]*[\"'][wa]b?[\"']|\.tmp[\"']")
    allowed = {("replayquant/kernels/compile_check.py", 'with open(src, "w")'),   # a temp folder
               # the held-out text's cache copy (not a result), through a temporary file of its own
               ("replayquant/data/__init__.py", 'prefix=".kjv_heldout.", suffix=".tmp"'),
               ("replayquant/data/__init__.py", 'with os.fdopen(fd, "wb")')}
    found = []
    for f in sorted((ROOT / "replayquant").rglob("*.py")):
        rel = str(f.relative_to(ROOT))
        if rel == "replayquant/outputs.py":
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if raw.search(line) and not any(rel == a and s in line for a, s in allowed):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert found == []


# ------------------------------------------------------------------ never a file a command did not write


def test_sweep_sensitivity_recommend_refuse_files_of_another_kind(tmp_path, no_kl_run, monkeypatch):
    import replayquant.sweep.command as SC
    monkeypatch.setattr(SC, "shapes_of_model", lambda *a, **k: pytest.fail("work before the check"))
    kl = tmp_path / "kl.json"
    kl.write_text(json.dumps({"kind": "replayquant.kl", "config": {}}))
    kl.with_suffix(".png").write_bytes(b"\x89PNG the KL plot")
    (tmp_path / "notes.json").write_text("my notes")
    (tmp_path / "plain.json").write_text(json.dumps({"a": 1}))
    sweep = shutil.copy(SWEEP, tmp_path / "sweep.json")
    sens = shutil.copy(SENS, tmp_path / "sens.json")
    (tmp_path / "mine.png").write_bytes(b"my picture")
    before = _snapshot(tmp_path)
    sw = ["sweep", "--model", TINY, "--pair", "s32_rs", "--no-progress", "--out"]
    cases = [
        ([*sw, kl], "holds a replayquant.kl file, not the replayquant.sweep results"),
        ([*sw, tmp_path / "notes.json"], "not JSON"),
        ([*sw, tmp_path / "plain.json"], "JSON that is not a replayquant results file"),
        ([*sw, sens], "holds a replayquant.sensitivity file"),
        ([*sw, tmp_path / "mine.json"], "mine.png is there but mine.json is not"),
        (["sensitivity", "--model", TINY, "--pair", "tp4_hi32", "--no-progress", "--out", kl],
         "holds a replayquant.kl file, not the replayquant.sensitivity results"),
        (["sensitivity", "--model", TINY, "--pair", "tp4_hi32", "--no-progress", "--out", sweep],
         "holds a replayquant.sweep file"),
        (["recommend", sweep, "--kl-budget", 1e-3, "--out", sweep], "is the file this command reads"),
        (["recommend", sweep, "--kl-budget", 1e-3, "--out", kl], "holds a replayquant.kl file"),
        (["recommend", sweep, "--kl-budget", 1e-3, "--out", tmp_path / "notes.json"], "not JSON"),
        (["recommend", "--per-layer", sens, "--kl-budget", 1e-3, "--out", sens],
         "is the file this command reads"),
        (["recommend", "--per-layer", sens, "--kl-budget", 1e-3, "--out", sweep],
         "holds a replayquant.sweep file"),
    ]
    for args, msg in cases:
        code, text = _invoke(args)
        _one_clear_error(code, text, msg, "--out")
    assert _snapshot(tmp_path) == before
    # kl's own checks are the same: a plot there without its results file
    monkeypatch.setattr(C, "kl_command", _KL_COMMAND)
    monkeypatch.setattr(C, "load_tokenizer_and_config", _boom)
    code, text = _invoke(_kl(tmp_path, tmp_path / "mine.json"))
    _one_clear_error(code, text, "mine.png is there but mine.json is not")
    code, text = _invoke(_kl(tmp_path, sweep))
    _one_clear_error(code, text, "holds a replayquant.sweep file, not the replayquant.kl results")
    code, text = _invoke(_kl(tmp_path, tmp_path / "notes.json"))    # no run of it to rebuild from
    _one_clear_error(code, text, "not JSON", "refusing to overwrite it")
    assert _snapshot(tmp_path) == before
    # a results file of its own kind made read-only is not replaced either
    os.chmod(sweep, 0o444)
    for args in (["sweep", "--model", TINY, "--pair", "s32_rs", "--out", sweep],
                 ["kl", "--model", TINY, "--pair", "s32_rs", "--out", sweep]):
        code, text = _invoke(args)
        _one_clear_error(code, text, "is read-only")
    os.chmod(sweep, 0o644)
    assert _snapshot(tmp_path) == before


def test_another_run_is_refused_the_same_run_goes_on(tmp_path, no_kl_run):
    sweep = shutil.copy(SWEEP, tmp_path / "sweep.json")
    before = _snapshot(tmp_path)
    code, text = _invoke(["sweep", "--model", TINY, "--pair", "s32_rs", "--buffer-len", 4,
                          "--no-progress", "--out", sweep])
    _one_clear_error(code, text, "different configuration", "s32_rs@L4", "delete")
    assert _snapshot(tmp_path) == before
    # the variants the file holds: past the check, on to the KL run (which resumes)
    code, text = _invoke(["sweep", "--model", TINY, *[a for p in DEMO_PAIRS for a in ("--pair", p)],
                          "--buffer-len", "8,16", "--no-progress", "--out", sweep])
    assert code == 2 and "reached the KL run" in text, text
    # a recommendation: the same budgets replace it, others are refused
    rec = tmp_path / "rec.json"
    code, text = _invoke(["recommend", sweep, "--kl-budget", 1e-3, "--out", rec])
    assert code == 0 and rec.exists(), text
    code, text = _invoke(["recommend", sweep, "--kl-budget", 1e-3, "--out", rec])
    assert code == 0, text
    first = rec.read_bytes()
    code, text = _invoke(["recommend", sweep, "--kl-budget", 2e-3, "--out", rec])
    _one_clear_error(code, text, "different configuration", "kl_budget")
    assert rec.read_bytes() == first


def _fake_kl(calls):
    def kl_command(model, pairs, settings=None, out=None, **kw):
        calls.append(out)
        return {"results": {pairs[0].name: {"kl_mean": 1e-4, "kl_mean_unc": 1e-5}},
                "provenance": {"git_commit": "test"}}
    return kl_command


def _current_sens(path: Path) -> Path:
    """The committed sensitivity file at `path` with the identity of its model and documents as
    this version records them: the fingerprint of every byte of the model, and the documents'
    record from the file's own KL run."""
    sens = json.loads(SENS.read_text())
    sens["model"]["local_hash"] = local_fingerprint(tiny_model_path(TINY))
    kl = json.loads((SENS.parent / sens["kl_results"][0]).read_text())
    sens["data"] = kl["provenance"]["dataset"]
    path.write_text(json.dumps(sens))
    return path


def test_per_layer_refuses_another_budget_before_writing_anything(tmp_path, monkeypatch):
    """The policy YAML was written before the KL run refused: the JSON and the YAML then
    described two policies. Now the check comes first, and both always describe one."""
    calls = []
    monkeypatch.setattr(C, "kl_command", _fake_kl(calls))
    monkeypatch.setattr(PL, "plot_results_file", lambda *a, **k: None)   # the fake writes no file
    sens = _current_sens(tmp_path / "sens.json")
    rec, yaml_file = tmp_path / "rec.json", tmp_path / "rec_policy.yaml"
    args = ["recommend", "--per-layer", sens, "--no-progress", "--out", rec, "--kl-budget"]
    code, text = _invoke([*args, 1e-3])
    assert code == 0 and len(calls) == 1, text
    res = json.loads(rec.read_text())
    from replayquant.policy import LayerPolicy
    assert LayerPolicy.load(str(yaml_file)).to_dict() == res["policy"]
    before = _snapshot(tmp_path)
    code, text = _invoke([*args, 2e-3])
    _one_clear_error(code, text, "different configuration", "kl_budget", "rec_policy.yaml")
    assert len(calls) == 1 and _snapshot(tmp_path) == before
    code, text = _invoke([*args, 1e-3])                          # the same run: replaced
    assert code == 0 and len(calls) == 2, text
    rec.unlink()                                                  # a YAML without its JSON
    code, text = _invoke([*args, 1e-3])
    _one_clear_error(code, text, "rec_policy.yaml is there but rec.json is not")
    assert len(calls) == 2


def test_recommend_out_in_a_read_only_place_is_one_error_before_any_work(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(C, "kl_command", _fake_kl(calls))
    ro = "/proc/replayquant_no/rec.json"
    for args in (["recommend", tmp_path / "not_read_yet.json", "--kl-budget", 1e-3, "--out", ro],
                 ["recommend", SWEEP, "--kl-budget", 1e-3, "--out", ro],
                 ["recommend", "--per-layer", SENS, "--kl-budget", 1e-3, "--out", ro]):
        code, text = _invoke(args)
        _one_clear_error(code, text, "cannot write in /proc")
    assert calls == []


# ------------------------------------------------------------------ one run per output


_HOLD = ("import sys\n"
         "from replayquant.outputs import output_lock\n"
         "with output_lock(sys.argv[1]):\n"
         "    print('locked', flush=True)\n"
         "    sys.stdin.read()\n")


def test_a_second_run_into_an_output_is_refused_and_a_dead_holder_blocks_nothing(texts, tmp_path):
    from replayquant.outputs import lock_path, output_lock
    out = tmp_path / "r.json"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for args in (_kl(texts, out), ["sweep", "--model", TINY, "--pair", "s32_rs", "--out", out],
                     ["sensitivity", "--model", TINY, "--pair", "tp4_hi32", "--out", out]):
            code, text = _invoke(args)
            _one_clear_error(code, text, f"{out} is in use by another run", f"process {holder.pid}",
                             str(lock_path(out)), "another --out")
        with pytest.raises(ValueError, match=f"process {holder.pid}"):
            with output_lock(out):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)                        # killed: its lock file stays
        holder.wait()
    assert lock_path(out).exists()
    with output_lock(out):                                        # but blocks nothing
        with output_lock(out):                                    # one process nests its locks
            pass
    assert not lock_path(out).exists()
    code, text = _invoke(_kl(texts, out))
    assert code == 0, text
    mine = tmp_path / "mine.lock"                               # a file that is not a lock of ours
    mine.write_text("my notes")
    code, text = _invoke(_kl(texts, tmp_path / "mine.json"))
    _one_clear_error(code, text, "mine.lock is there and is not a replayquant lock file")
    assert mine.read_text() == "my notes"


# ------------------------------------------------------------------ resume says what it found


def test_a_resumed_kl_run_says_how_many_documents_it_kept(texts, tmp_path):
    out = tmp_path / "r.json"
    code, text = _invoke(_kl(texts, out, docs=1))
    assert code == 0 and "already done" not in text, text
    code, text = _invoke(_kl(texts, out, docs=2))
    assert code == 0, text
    assert "1 of 2 document(s) already done and kept" in text and "computing the other 1" in text
    code, text = _invoke(_kl(texts, out, docs=2))
    assert code == 0, text
    assert "2 of 2 document(s) already done and kept" in text and "nothing left to compute" in text
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.rglob("*.tmp"))


# ------------------------------------------------------------------ gpqa, drift and the benchmarks

GPQA_CSV = ROOT / "tests/data/gpqa_tiny.csv"
KL_FILE = ROOT / "results/demo/tiny-qwen3.5_ctx16k_cpu.json"


def _writers(d: Path) -> list[tuple[list, Path]]:
    """(command line, the results file it writes) of every command writing into `d`."""
    return [
        (["gpqa", "--model", TINY, "--pair", "s32_rs", "--gpqa-csv", GPQA_CSV, "--device", "cpu",
          "--out", d], d / "s32_rs.json"),
        (["gpqa", "--model", TINY, "--pair", "s32_rs", "--gpqa-csv", GPQA_CSV, "--device", "cpu",
          "--out", d], d / "SUMMARY.json"),
        (["drift", "--kind", "gdn", "--pair", "s32_rs", "--steps", 4096, "--seeds", 1, "--out", d],
         d / "gdn_4096steps.json"),
        (["bench", "formats", "--out", d], d / "formats.json"),
        (["bench", "kernels", "--out", d], d / "kernels.json"),
        (["bench", "merge", ROOT / "results/bench/kernels.json", ROOT / "results/bench/kernels.json",
          "--out", d], d / "kernels.json"),
        (["bench", "teacher-forcing", "--part", "layer", "--out", d / "tf.json"], d / "tf.json"),
        (["bench", "teacher-forcing", "--part", "model", "--out", d / "tf.json"], d / "tf.json"),
        (["bench", "kl", "--out", d / "kl_bench.json"], d / "kl_bench.json"),
        (["bench", "generate", "--out", d / "gen.json"], d / "gen.json"),
    ]


@pytest.fixture
def no_work(monkeypatch):
    """Every command of `_writers` stops where its work would begin (after its checks)."""
    import replayquant.bench.formats as bf
    import replayquant.bench.generate as bg
    import replayquant.bench.kernels.merge as bkm
    import replayquant.bench.kernels.run as bkr
    import replayquant.bench.kl as kb
    import replayquant.bench.teacher_forcing as tf
    import replayquant.drift as dr
    import replayquant.gpqa.run as gr
    for mod, name in ((gr, "ReplayQuantLM"), (dr, "run_drift"), (bf, "_run_formats_bench"),
                      (bkr, "_run_kernels_bench"), (bkm, "_merge_kernels"), (tf, "_run_layer"),
                      (tf, "whole_model"), (kb, "_bench_kl"), (bg, "_run_generate_bench")):
        monkeypatch.setattr(mod, name, _boom, raising=False)   # (the names of the checked code)


def test_gpqa_drift_and_benchmarks_refuse_a_file_of_another_kind_before_any_work(tmp_path, no_work):
    for args, target in _writers(tmp_path):
        shutil.copy(KL_FILE, target)
        before = _snapshot(tmp_path)
        code, text = _invoke(args)
        _one_clear_error(code, text, f"--out {target} holds a replayquant.kl file", "another --out")
        assert "reached" not in text
        assert _snapshot(tmp_path) == before
        target.unlink()
    # a file written beside a results file is refused without it: the drift table, the plot
    (tmp_path / "gdn_4096steps.md").write_text("my notes")
    (tmp_path / "kernels_speedup.png").write_bytes(b"my picture")
    for args, target in _writers(tmp_path)[2:6:3]:
        code, text = _invoke(args)
        _one_clear_error(code, text, f"is there but {target.name} is not")


def test_gpqa_drift_and_benchmarks_replace_their_own_files(tmp_path, no_work):
    """Files of each command's own kind, the committed ones written before they carried a kind
    among them, pass the checks: the command reaches its work."""
    own = {"s32_rs.json": {"results": {}, "config": {}, "replayquant": {"pair": {}}},
           "SUMMARY.json": {"kind": "replayquant/gpqa-summary"},
           "gdn_4096steps.json": ROOT / "results/drift/gdn_4096steps.json",
           "formats.json": ROOT / "results/bench/formats.json",
           "kernels.json": ROOT / "results/bench/kernels.json",
           "tf.json": ROOT / "results/bench/teacher_forcing.json",
           "kl_bench.json": ROOT / "results/bench/kl_128k.json",
           "gen.json": ROOT / "results/bench/generate.json"}
    for name, src in own.items():
        if isinstance(src, dict):
            (tmp_path / name).write_text(json.dumps(src))
        else:
            shutil.copy(src, tmp_path / name)
    for args, target in _writers(tmp_path):
        code, text = _invoke(args)
        _one_clear_error(code, text, "reached the KL run")    # the work it stops at (no_work)
    # merge never writes over one of its parts
    code, text = _invoke(["bench", "merge", tmp_path / "kernels.json", ROOT / "results/bench/kernels.json",
                          "--out", tmp_path])
    _one_clear_error(code, text, "is the file this command reads")


def test_drift_checks_again_when_it_writes_and_holds_the_lock(tmp_path):
    """A file of another kind put there during the run is refused at the write, and the write
    holds the output's lock."""
    from replayquant.drift import run_drift, write_drift
    from replayquant.outputs import lock_path
    res = run_drift("gdn", ["s32_rs"], steps=32, seeds=[1], batch=1, heads=1, d_k=8, d_v=4,
                    conventional=False)
    path = write_drift(res, tmp_path)                 # into an empty folder
    assert json.loads(path.read_text())["kind"] == "replayquant.drift"
    write_drift(res, tmp_path)                        # and again over its own results
    shutil.copy(KL_FILE, path)
    with pytest.raises(ValueError, match="holds a replayquant.kl file"):
        write_drift(res, tmp_path)
    assert path.read_bytes() == KL_FILE.read_bytes()
    path.unlink()
    path.with_suffix(".md").unlink()
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=f"in use by another run .process {holder.pid}"):
            write_drift(res, tmp_path)
        assert str(lock_path(path)).endswith("gdn_32steps.lock")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert not path.exists()


_HOLD_ALL = ("import contextlib, sys\n"
             "from replayquant.outputs import output_lock\n"
             "with contextlib.ExitStack() as locks:\n"
             "    for out in sys.argv[1:]:\n"
             "        locks.enter_context(output_lock(out))\n"
             "    print('locked', flush=True)\n"
             "    sys.stdin.read()\n")


def test_gpqa_and_benchmarks_are_refused_while_another_run_holds_their_output(tmp_path, no_work):
    cases = [(args, target) for args, target in _writers(tmp_path)
             if target.name not in ("s32_rs.json", "gdn_4096steps.json")]   # gpqa: SUMMARY.lock
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_ALL, *sorted({str(t) for _, t in cases})],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for args, target in cases:
            code, text = _invoke(args)
            _one_clear_error(code, text, f"{target} is in use by another run",
                             f"process {holder.pid}")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
