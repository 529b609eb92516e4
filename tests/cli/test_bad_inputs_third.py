"""Bad inputs, third round: each one clear error (what is wrong, what to do), a non-zero exit,
raised before any expensive work, and nothing already computed lost.

Every case stops before a model loads or runs the embedded tiny Qwen3.5 model on short documents
cut from the shipped held-out text, so the file takes seconds."""

import json
import re
from pathlib import Path

import pytest

from _cli import invoke, one_clear_error

TINY = "tiny-qwen3.5"
CSV = Path(__file__).parents[1] / "data" / "gpqa_tiny.csv"


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


ROOT = Path(__file__).resolve().parents[2]
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

    from replayquant.bench import kl as kb
    from replayquant.bench import teacher_forcing as tf

    def boom(*a, **k):
        raise AssertionError("the benchmark started")
    for mod, name in ((kb, "build_model"), (tf, "build_model"), (tf, "check")):
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
    for bench in ("kl", "teacher-forcing"):
        code, text = invoke(["bench", bench, "--shape", "tiny", *out])  # the CPU smoke test runs
        assert "the benchmark started" in text, text
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ damaged sweep files

SWEEP = ROOT / "results/demo/tiny-qwen3.5_sweep.json"


def _damaged_sweep(tmp_path, damage):
    sw = json.loads(SWEEP.read_text())
    i = [v["name"] for v in sw["variants"]].index("tp8_hi16_sr@L16")     # the recommended one
    damage(sw, sw["variants"][i])
    p = tmp_path / "sw.json"
    p.write_text(json.dumps(sw))
    return p


@pytest.mark.parametrize("damage, where", [
    (lambda sw, v: v["vs_fp32_conventional"].update(state_bytes=0),
     "vs_fp32_conventional.state_bytes should be a finite number > 0"),
    (lambda sw, v: v["vs_fp32_conventional"].update(memory=-1.0),
     "vs_fp32_conventional.memory should be a finite number > 0"),
    (lambda sw, v: v.pop("on_front"), "].on_front is missing"),
    (lambda sw, v: v["kl"].update(same_top="x"), "].kl.same_top should be a number"),
    (lambda sw, v: sw.pop("front"), "front is missing"),
    (lambda sw, v: sw.pop("layers"), "layers is missing"),
    (lambda sw, v: sw["conventional_fp32"].pop("kernel"), "conventional_fp32.kernel is missing"),
    (lambda sw, v: sw["kernels"].pop("batch_requested"), "kernels.batch_requested is missing"),
])
def test_damaged_sweep_is_one_error_in_recommend_and_table(tmp_path, damage, where):
    p = _damaged_sweep(tmp_path, damage)
    for args in (["recommend", p, "--kl-budget", 1e-3], ["table", p]):
        code, text = invoke(args)
        one_clear_error(code, text, "sw.json", where, "replayquant sweep")


@pytest.mark.parametrize("key", ["state_bytes", "memory", "total_bytes"])
def test_sweep_without_an_optional_ratio_still_reads(tmp_path, key):
    p = _damaged_sweep(tmp_path, lambda sw, v: v["vs_fp32_conventional"].pop(key))
    for args in (["recommend", p, "--kl-budget", 1e-3], ["table", p]):
        code, text = invoke(args)
        assert code == 0 and "Traceback" not in text, text
    code, text = invoke(["recommend", p, "--kl-budget", 1e-3])
    assert "recommended tp8_hi16_sr@L16" in text, text


def _deep(path, head):
    path.write_text(head + "[" * 100000 + "]" * 100000 + "}")
    return path


def test_json_nested_too_deeply_is_one_error(tmp_path):
    head = SWEEP.read_text().rstrip().rstrip("}") + ', "x": '
    sw = _deep(tmp_path / "deep.json", head)
    code, text = invoke(["recommend", sw, "--kl-budget", 1e-3])
    one_clear_error(code, text, "deep.json", "not a JSON file", "nest")
    out = _deep(tmp_path / "r.json", '{"x": ')                     # at --out: not overwritten
    before = out.read_text()
    code, text = invoke(["recommend", SWEEP, "--kl-budget", 1e-3, "--out", out])
    one_clear_error(code, text, str(out), "not JSON")
    assert out.read_text() == before


# ------------------------------------------------------------------ damaged progress logs

CTX = 64


def _kl(texts, out, *extra, pair="s32_rs", docs=2):
    return ["kl", "--model", TINY, "--pair", pair, "--dataset", texts, "--context", CTX,
            "--docs", docs, "--segment", 32, "--dtype", "float32", "--reference", "hf",
            "--no-progress", "--out", out, *extra]


@pytest.fixture(scope="module")
def finished_run(texts, tmp_path_factory):
    """A finished two-document KL run: {file name: bytes} of its run folder and results file."""
    d = tmp_path_factory.mktemp("run")
    code, text = invoke(_kl(texts, d / "r.json"))
    assert code == 0, text
    return {p.relative_to(d): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def _lay_out(files, d):
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)


def _changed(line, **changes):
    return json.dumps({**json.loads(line), **changes})


@pytest.mark.parametrize("damage, needles", [
    (lambda lines: lines.insert(2, "[1, 2]"), ["line 3", "not a record"]),
    (lambda lines: lines.__setitem__(1, _changed(lines[1], pairs={"s32_rs": {}})),
     ["line 2", "sums"]),
    (lambda lines: lines.__setitem__(1, _changed(lines[1], pairs={"other": {}})),
     ["line 2", "['other']", "['s32_rs']"]),
    (lambda lines: lines.__setitem__(0, '{"type": "config"}'), ["line 1", "no configuration"]),
    (lambda lines: lines.__setitem__(1, json.dumps({k: v for k, v in json.loads(lines[1]).items()
                                                    if k != "index"})), ["line 2", "index"]),
    (lambda lines: lines.__setitem__(1, lines[1].replace('"npy": "doc00000.npy"',
                                                         '"npy": "../x.npy"')), ["line 2", "npy"]),
])
def test_damaged_progress_log_is_one_error_before_the_model_loads(texts, finished_run, tmp_path,
                                                                 no_model, damage, needles):
    _lay_out(finished_run, tmp_path)
    log = tmp_path / "r.kl" / "progress.rank0.jsonl"
    lines = log.read_text().splitlines()
    damage(lines)
    log.write_text("\n".join(lines) + "\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code, text = invoke(_kl(texts, tmp_path / "r.json"))
    one_clear_error(code, text, str(log), *needles, "delete")
    assert before == {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}


def test_progress_log_replaced_by_a_folder_is_one_error(texts, finished_run, tmp_path, no_model):
    _lay_out(finished_run, tmp_path)
    log = tmp_path / "r.kl" / "progress.rank0.jsonl"
    log.unlink()
    log.mkdir()
    code, text = invoke(_kl(texts, tmp_path / "r.json"))
    one_clear_error(code, text, str(log), "not a file", "move it away")


def test_torn_last_line_of_a_progress_log_is_still_recomputed(texts, finished_run, tmp_path,
                                                             monkeypatch):
    _lay_out(finished_run, tmp_path)
    log = tmp_path / "r.kl" / "progress.rank0.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines[:2]) + "\n" + lines[2][:40])     # a crash mid-write
    code, text = invoke(_kl(texts, tmp_path / "r.json"))
    assert code == 0 and "1 of 2 document(s) already done and kept" in text, text


# ------------------------------------------------------------------ table of damaged KL results

KL_FILE = ROOT / "results/demo/tiny-qwen3.5_ctx16k_cpu.json"


@pytest.mark.parametrize("damage, where", [
    (lambda st, res: st.pop("kl_mean"), "results.s32_rs.kl_mean"),
    (lambda st, res: st.update(kl_max="big"), "results.s32_rs.kl_max"),
    (lambda st, res: res["results"].update(s32_rs=[1]), "results.s32_rs"),
    (lambda st, res: res["config"]["pairs"][0].pop("name"), "config.pairs"),
    (lambda st, res: st["by_position"].append({"bucket": "x"}), "results.s32_rs.by_position"),
    (lambda st, res: st["per_document"][0].pop("index"), "results.s32_rs.per_document"),
])
def test_table_of_damaged_kl_results_is_one_error(tmp_path, damage, where):
    res = json.loads(KL_FILE.read_text())
    damage(res["results"]["s32_rs"], res)
    p = tmp_path / "k.json"
    p.write_text(json.dumps(res))
    for fmt in ("md", "csv", "llama"):
        code, text = invoke(["table", p, "--format", fmt])
        one_clear_error(code, text, str(p), where, "replayquant kl")


def test_table_of_json_nested_too_deeply_is_one_error(tmp_path):
    for name, head in (("sw.json", SWEEP.read_text().rstrip().rstrip("}") + ', "x": '),
                       ("k.json", '{"kind": "replayquant.kl", "x": ')):
        code, text = invoke(["table", _deep(tmp_path / name, head)])
        one_clear_error(code, text, name, "nest")


# ------------------------------------------------------------------ pair names that are no names


@pytest.mark.parametrize("name", ["123", "[a, b]", "true", "''", "{a: 1}"])
def test_pair_named_by_no_string_is_refused_before_the_model_loads(texts, tmp_path, no_model,
                                                                  name):
    for text in (f"name: {name}\nanchor: {{format: fp32}}\n",
                 f"name: {name}\ndefault: s32_rs\n"):
        p = tmp_path / "p.yaml"
        p.write_text(text)
        code, text = invoke(_kl(texts, tmp_path / "r.json", pair=p))
        one_clear_error(code, text, str(p), "name must be a non-empty string")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["p.yaml"]


def test_pair_and_policy_objects_named_by_no_string_are_refused():
    from replayquant.pairs import PrecisionPair
    from replayquant.policy import LayerPolicy
    for name in (123, ["a", "b"], "", "  "):
        with pytest.raises(ValueError, match="name must be a non-empty string"):
            PrecisionPair(None, "fp32", 16, name)
        with pytest.raises(ValueError, match="name must be a non-empty string"):
            LayerPolicy("s32_rs", (), name)


# ------------------------------------------------------------------ a file-size limit (ulimit -f)


@pytest.fixture
def file_size_limit():
    """set(n): files of this process may grow to n bytes (RLIMIT_FSIZE, as `ulimit -f`; Python
    ignores SIGXFSZ, so a write past it fails with EFBIG); set(None) and the test's end lift it."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    yield lambda n: resource.setrlimit(resource.RLIMIT_FSIZE, (soft if n is None else n, hard))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_writes_past_a_file_size_limit_leave_no_torn_or_cut_file(tmp_path, file_size_limit):
    import numpy as np

    from replayquant.outputs import WriteError, append_line, save_npy
    log = tmp_path / "log.jsonl"
    log.write_text("a" * 450 + "\n")
    file_size_limit(500)
    with pytest.raises(WriteError, match="log.jsonl: .*file-size limit"):
        append_line(log, "b" * 100)
    with pytest.raises(WriteError, match="x.npy: .*file-size limit"):
        save_npy(tmp_path / "x.npy", np.zeros(200, np.float32))
    assert log.read_text() == "a" * 450 + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]


def test_fresh_kl_under_a_file_size_limit_is_one_error_and_resumes(texts, finished_run, tmp_path,
                                                                  file_size_limit):
    import numpy as np
    config_line = finished_run[Path("r.kl/progress.rank0.jsonl")].split(b"\n")[0]
    file_size_limit(len(config_line) + 100)                 # room for the config line only
    code, text = invoke(_kl(texts, tmp_path / "r.json"))
    file_size_limit(None)
    log = tmp_path / "r.kl" / "progress.rank0.jsonl"
    one_clear_error(code, text, str(log), "file-size limit", "run the same command again")
    assert log.read_bytes() == config_line + b"\n"
    for npy in (tmp_path / "r.kl").glob("*.npy"):
        np.load(npy)                                        # whole, or not there
    code, text = invoke(_kl(texts, tmp_path / "r.json"))
    assert code == 0 and json.loads((tmp_path / "r.json").read_text())["complete"], text


# ------------------------------------------------------------------ gpqa --model-args


@pytest.mark.parametrize("model_args, needles", [
    ("foo", ["--model-args 'foo'", "key=value"]),
    ("a=1,,b", ["--model-args 'a=1,,b'", "'b'", "key=value"]),
    ("pretrained=other", ["pretrained", "--model"]),
    ("pair=s32_rs", ["pair", "--pair"]),
    ("dtype=float16", ["dtype", "--dtype"]),
    ("batch_size=4", ["batch_size", "--batch-size"]),
    ("buffer_len=4", ["buffer_len", "buffer_len:"]),
])
def test_gpqa_model_args_that_cannot_work_are_refused_before_the_model(tmp_path, gpqa_no_model,
                                                                       model_args, needles):
    code, text = invoke(_gpqa(tmp_path / "G", "--model-args", model_args))
    one_clear_error(code, text, *needles)
    assert "gpqa: tiny-qwen3.5 on" not in text and not (tmp_path / "G").exists()


def test_gpqa_model_args_device_against_device_and_an_unknown_argument(tmp_path, gpqa_no_model):
    code, text = invoke(_gpqa(tmp_path / "G", "--device", "cpu", "--model-args", "device=cuda:1"))
    one_clear_error(code, text, "device", "--device cpu", "give one")
    code, text = invoke(_gpqa(tmp_path / "G", "--model-args", "trust_remote_code=False"))
    assert "Stop" in text, text                                  # lm-eval's own argument: taken


def test_gpqa_model_args_the_model_does_not_take_is_one_error(tmp_path):
    code, text = invoke(_gpqa(tmp_path / "G", "--device", "cpu", "--model-args", "bar=1"))
    one_clear_error(code, text, "--model-args", "bar", "remove it")


# ------------------------------------------------------------------ formats and states


@pytest.mark.parametrize("shape", [(0,), (0, 16), (2, 0, 16), (4, 0), (2, 3, 0)])
def test_quantize_of_a_tensor_without_elements_is_one_error(shape):
    import torch

    from replayquant.formats import FORMATS
    for fmt in FORMATS.values():
        for rounding in ("nearest", "stochastic"):
            with pytest.raises(ValueError, match=rf"{fmt.name}: input has no elements \(shape "
                                                 rf"\[{', '.join(map(str, shape))}\]\)"):
                fmt.quantize(torch.zeros(shape), rounding)


def test_quantize_with_random_bits_of_another_shape_or_kind_is_one_error():
    import torch

    from replayquant.formats import FORMATS
    x = torch.randn(4, 16)
    for fmt in FORMATS.values():
        for rbits, what in ((torch.zeros(3, dtype=torch.int64), "shape [3]"),
                            (torch.zeros(2, 4, 16, dtype=torch.int64), "shape [2, 4, 16]"),
                            (torch.zeros(4, 16), "torch.float32"),
                            (torch.zeros(4, 16, dtype=torch.bool), "torch.bool"),
                            ("bits", "str")):
            with pytest.raises(ValueError, match=rf"{fmt.name}: rbits .*{re.escape(what)}.*"
                                                 rf"integer tensor of the input's shape \[4, 16\]"):
                fmt.quantize(x, "stochastic", rbits=rbits)
        fmt.quantize(x, "stochastic", rbits=torch.zeros(4, 16, dtype=torch.int64))


@pytest.mark.parametrize("shape", [(0, 2, 16, 16), (1, 0, 16, 16), (1, 2, 0, 16), (1, 2, 16, 0)])
def test_a_state_without_rows_heads_or_columns_is_one_error(shape):
    import torch

    from replayquant.replay import ConventionalState, ReplayState
    for cls, pair in ((ReplayState, "tp4_hi16_sr"), (ReplayState, "s32_rs"),
                      (ConventionalState, "s16_sr")):
        dims = ", ".join(map(str, shape))
        with pytest.raises(ValueError, match=rf"initial_state has shape \[{dims}\]: B, H, d_v and "
                                             rf"d_k must each be at least 1"):
            cls(torch.zeros(shape), pair, delta=True)


# ------------------------------------------------------------------ gpqa counts, before the model


@pytest.mark.parametrize("args, needles", [
    (["--batch-size", "abc"], ["--batch-size 'abc'", "auto"]),
    (["--batch-size", "0"], ["--batch-size 0", "at least 1"]),
    (["--batch-size", "auto:x"], ["--batch-size 'auto:x'"]),
    (["--batch-size", "-2"], ["--batch-size '-2'"]),
    (["--num-fewshot", "-1"], ["--num-fewshot -1", ">= 0"]),
    (["--max-gen-toks", "0"], ["--max-gen-toks 0", ">= 1"]),
])
def test_gpqa_counts_are_checked_before_the_model(tmp_path, gpqa_no_model, args, needles):
    code, text = invoke(_gpqa(tmp_path / "G", *args))
    one_clear_error(code, text, *needles)
    assert "gpqa: tiny-qwen3.5 on" not in text and not (tmp_path / "G").exists()


def test_gpqa_counts_lm_eval_takes_pass(tmp_path, gpqa_no_model):
    for ok in (["--batch-size", "auto"], ["--batch-size", "auto:4"], ["--num-fewshot", "0"]):
        code, text = invoke(_gpqa(tmp_path / "G", *ok))
        assert "Stop" in text, (ok, text)


# ------------------------------------------------------------------ --segment, seeds, RANK


def test_a_segment_that_splits_replay_windows_is_said_before_the_run(texts, tmp_path, no_model):
    long = ("--context", 256)
    code, text = invoke(_kl(texts, tmp_path / "r.json", *long, "--segment", 100,
                            pair="tp4_hi16_sr"))
    assert "--segment 100 is not a multiple of the buffer length 16" in text, text
    assert "give a multiple of 16" in text, text
    code, text = invoke(_kl(texts, tmp_path / "r.json", *long, "--segment", 96))
    assert "is not a multiple" not in text, text


@pytest.mark.parametrize("seed", [2 ** 64, 2 ** 63, -1])
def test_seeds_outside_the_philox_keys_are_refused_before_any_work(texts, tmp_path, no_model,
                                                                  gpqa_no_model, seed):
    code, text = invoke(_kl(texts, tmp_path / "r.json", "--seed", seed))
    one_clear_error(code, text, f"--seed {seed}", "[0, 2^63)")
    code, text = invoke(_gpqa(tmp_path / "G", "--seed", seed))
    one_clear_error(code, text, f"--seed {seed}", "[0, 2^63)")
    code, text = invoke(["drift", "--kind", "gdn", "--pair", "s32_rs", "--steps", 32, "--seeds",
                         f"1,{seed}", "--out", tmp_path / "d"])
    one_clear_error(code, text, "--seeds", str(seed), "[0, 2^63)")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_seeds_and_streams_that_are_not_integers_are_refused_in_the_library():
    import torch

    from replayquant.formats import get_format
    from replayquant.replay import ReplayState
    for seed in (1.5, 2 ** 64, -3, "7", True):
        with pytest.raises(ValueError, match=r"seed .*: give an integer in \[0, 2\^63\)"):
            ReplayState(torch.zeros(1, 1, 16, 16), "tp4_hi16_sr", delta=True, seed=seed)
        with pytest.raises(ValueError, match=r"seed .*: give an integer in \[0, 2\^63\)"):
            get_format("fp16").quantize(torch.ones(4, 16), "stochastic", seed=seed)
    for stream in (1.5, torch.zeros(1), "0"):
        with pytest.raises(ValueError, match=r"stream .*: give an integer or an integer tensor"):
            get_format("fp16").quantize(torch.ones(4, 16), "stochastic", stream=stream)


def test_a_rank_or_world_size_that_is_not_a_count_is_one_clear_error(texts, tmp_path, no_model,
                                                                     gpqa_no_model, monkeypatch):
    for var, value, said in (("RANK", "abc", "RANK='abc'"), ("WORLD_SIZE", "0", "WORLD_SIZE='0'"),
                             ("WORLD_SIZE", "abc", "WORLD_SIZE='abc'"), ("RANK", "3", "RANK=3")):
        monkeypatch.setenv(var, value)
        for args in (_kl(texts, tmp_path / "r.json"), _gpqa(tmp_path / "G")):
            code, text = invoke(args)
            one_clear_error(code, text, said, "torchrun", "unset")
        monkeypatch.delenv(var)
    assert not (tmp_path / "r.json").exists()


# ------------------------------------------------------------------ --out values that mislead


def test_an_empty_out_is_refused(texts, tmp_path, no_model, gpqa_no_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for args in (_kl(texts, ""), _gpqa(""),
                 ["sweep", "--model", TINY, "--pair", "s32_rs", "--out", ""],
                 ["sensitivity", "--model", TINY, "--pair", "s32_rs", "--out", " "],
                 ["recommend", SWEEP, "--kl-budget", 1e-3, "--out", ""],
                 ["drift", "--kind", "gdn", "--pair", "s32_rs", "--steps", 32, "--seeds", 1,
                  "--out", ""]):
        code, text = invoke(args)
        one_clear_error(code, text, "--out is empty", "give a path")
    assert list(tmp_path.iterdir()) == []


def test_an_out_that_is_a_symlink_is_refused(texts, finished_run, tmp_path, no_model):
    _lay_out(finished_run, tmp_path)
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "r.json")
    before = (tmp_path / "r.json").read_bytes()
    for args in (_kl(texts, link), ["recommend", SWEEP, "--kl-budget", 1e-3, "--out", link]):
        code, text = invoke(args)
        one_clear_error(code, text, str(link), "symbolic link", "r.json", "give")
    assert link.is_symlink() and (tmp_path / "r.json").read_bytes() == before


def test_a_folder_where_a_file_is_read_is_said_to_be_one(tmp_path):
    folder = tmp_path / "sweep.json"
    folder.mkdir()
    for args in (["recommend", folder, "--kl-budget", 1e-3], ["table", folder],
                 ["recommend", "--per-layer", folder, "--kl-budget", 1e-3]):
        code, text = invoke(args)
        one_clear_error(code, text, str(folder), "is a folder")


def test_a_policy_without_default_says_so(texts, tmp_path, no_model):
    p = tmp_path / "pol.yaml"
    for text in ("name: mixed\noverrides:\n  - {layers: [0], pair: tp8_hi32}\n",
                 "buffer_len: 8\noverrides: []\n"):
        p.write_text(text)
        code, out = invoke(_kl(texts, tmp_path / "r.json", pair=p))
        one_clear_error(code, out, str(p), "missing 'default'", "default: tp4_hi32")


# ------------------------------------------------------------------ tables of look-alike runs


def test_table_refuses_a_file_given_twice_and_tells_look_alike_runs_apart(texts, finished_run,
                                                                          tmp_path):
    _lay_out(finished_run, tmp_path)
    a = tmp_path / "r.json"
    code, text = invoke(["table", a, a])
    one_clear_error(code, text, str(a), "more than once")
    code, text = invoke(["table", a, f"{tmp_path}/./r.json"])
    one_clear_error(code, text, "more than once")
    for flag, value, cell in (("--dtype", "bfloat16", "dtype"), ("--seed", 3, "seed 3")):
        b = tmp_path / f"b{value}.json"
        code, text = invoke(_kl(texts, b, flag, value))
        assert code == 0, text
        code, text = invoke(["table", a, b])
        assert code == 0, text
        rows = [ln for ln in text.splitlines() if ln.startswith("| s32_rs")]
        assert len(rows) == 2 and rows[0] != rows[1] and all(cell.split()[0] in r for r in rows)
        assert any(cell in r for r in rows), text


# ------------------------------------------------------------------ recommend: what to do


def test_recommend_budgets_no_variant_can_meet_say_what_to_give(tmp_path):
    code, text = invoke(["recommend", SWEEP, "--kl-budget", 1e-3, "--max-bytes", 1])
    assert code == 1 and "--max-bytes 1 is below every variant" in text, text
    assert "give --max-bytes" in text and "higher-precision" not in text, text
    code, text = invoke(["recommend", SWEEP, "--kl-budget", 1e-3, "--max-memory", 1])
    assert code == 1 and "--max-memory 1 is below every variant" in text, text
    code, text = invoke(["recommend", SWEEP, "--kl-budget", 1e-12])
    assert code == 1 and "--kl-budget 1e-12 is below every variant" in text, text


def test_per_layer_low_and_high_swapped_is_one_error(tmp_path, no_model):
    sens = _sens()
    sens["data"] = {"tokens_sha256": "0" * 64, "source": "heldout", "document_ids": []}
    p = tmp_path / "s.json"
    p.write_text(json.dumps(sens))
    for budget in (1e-3, 1e-4):
        code, text = invoke(["recommend", "--per-layer", p, "--kl-budget", budget, "--low",
                             "tp8_hi16_sr", "--high", "tp4_hi16_sr", "--out", tmp_path / "r.json",
                             "--no-progress"])
        one_clear_error(code, text, "--high tp4_hi16_sr", "does not lower the KL",
                        "--low tp4_hi16_sr --high tp8_hi16_sr")


def test_per_layer_default_names_keep_the_budget(tmp_path):
    from replayquant.sweep.per_layer import build_policy
    names = {build_policy(_sens(), b)[0].name for b in (1.2e-3, 1.4e-3, 1e-3, 1.25e-3)}
    assert len(names) == 4, names


def test_patch_with_a_buffer_length_that_cannot_fit_is_refused_before_the_model_changes():
    import torch

    from replayquant import load_model, patch
    from replayquant.models.patching import is_patched
    m = load_model(TINY, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"buffer length 1000000000 would need .* GiB of memory, "
                                         r"more than .*; give a smaller buffer_len"):
        patch(m, "s32_rs", buffer_len=10 ** 9)
    assert not is_patched(m)


def test_the_teacher_forcing_bench_module_without_a_gpu_is_one_line(tmp_path):
    import subprocess
    import sys

    import torch
    if torch.cuda.is_available():
        pytest.skip("the refusal is for a machine without CUDA")
    r = subprocess.run([sys.executable, "-m", "replayquant.bench.teacher_forcing",
                        str(tmp_path / "tf.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: ") and "need a CUDA GPU" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
