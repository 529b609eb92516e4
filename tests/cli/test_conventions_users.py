"""Conventions users bring from other tools: llama.cpp's KL scoring and float32 per-token values,
lm-eval's plain `hf` baseline in tables, pickling and HF's `load_model` arguments, choices in
`--help`, the shipped held-out books as a `--dataset` name and a fast offline error, and the
README's demo tables against the committed results."""

import io
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from replayquant.cli import app
from replayquant.kl import command as C
from replayquant.kl import stats as S
from _cli import invoke as _invoke

ROOT = Path(__file__).resolve().parents[2]
TINY = "tiny-qwen3.5"
CTX = 64


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    from replayquant.data import heldout_documents
    d = tmp_path_factory.mktemp("texts")
    (d / "doc_0.txt").write_text(heldout_documents()[0]["text"][:2000])
    return d


def _kl(texts, out, *extra):
    return ["kl", "--model", TINY, "--pair", "f4_sr_rs", "--dataset", texts, "--context", CTX,
            "--docs", 1, "--segment", 24, "--dtype", "float32", "--reference", "hf",
            "--no-progress", "--out", out, *extra]


@pytest.fixture(scope="module")
def runs(texts, tmp_path_factory):
    """The same document scored both ways (all: the default)."""
    d = tmp_path_factory.mktemp("scoring")
    out = {}
    for scoring in ("all", "llama"):
        f = d / f"{scoring}.json"
        code, text = _invoke(_kl(texts, f, *(() if scoring == "all" else ("--scoring", scoring))))
        assert code == 0, text
        out[scoring] = f
    return out


# ---------------------------------------------------------------- llama.cpp's scoring

def test_scored_range_is_llama_cpps_window():
    # llama.cpp: first = n_ctx/2, n_ctx - 1 - first tokens a chunk, position first + i predicting
    # token first + i + 1
    assert S.scored_range(64, "all") == (0, 63)
    assert S.scored_range(64, "llama") == (32, 63)
    assert S.scored_range(131072, "llama") == (65536, 131071)
    assert S.scored_range(7, "llama") == (3, 6)
    with pytest.raises(ValueError, match="--scoring must be one of all, llama"):
        S.scored_range(64, "half")


def test_document_sums_buckets_are_by_absolute_position():
    n = 40
    m = {"kl": torch.arange(n, dtype=torch.float32), "nll_ref": torch.ones(n), "nll_test": torch.ones(n),
         "dp": torch.zeros(n), "same_top": torch.ones(n, dtype=torch.bool)}
    r = S.document_sums(m, bucket_base=16, first=24)        # positions 24 .. 63
    assert [(b["lo"], b["hi"], b["n"]) for b in r["buckets"]] == [(24, 32, 8), (32, 64, 32)]
    assert r["buckets"][0]["kl"] == sum(range(8))
    assert [S.bucket_label(b["lo"], b["hi"], 16) for b in r["buckets"]] == ["16-32", "32-64"]
    assert S.bucket_label(500, 1024, 1024) == "<1K" and S.bucket_label(3000, 4096) == "2K-4K"


def test_llama_scoring_scores_only_the_second_half(runs):
    a, b = (json.loads(runs[k].read_text()) for k in ("all", "llama"))
    assert a["config"]["scoring"] == "all" and b["config"]["scoring"] == "llama"
    assert b["provenance"]["scoring"] == "llama"
    ka = np.load(runs["all"].with_suffix(".kl") / "doc00000.npy")
    kb = np.load(runs["llama"].with_suffix(".kl") / "doc00000.npy")
    assert ka.shape == (1, CTX - 1) and kb.shape == (1, CTX - 1 - CTX // 2)
    # the same positions give the same values; the statistics are over those positions only
    np.testing.assert_allclose(kb[0], ka[0, CTX // 2:], rtol=1e-5, atol=1e-9)
    st = b["results"]["f4_sr_rs"]
    assert st["n_tokens"] == CTX - 1 - CTX // 2
    assert st["kl_mean"] == pytest.approx(float(ka[0, CTX // 2:].astype(np.float64).mean()), rel=1e-5)
    assert st["kl_mean"] != pytest.approx(a["results"]["f4_sr_rs"]["kl_mean"], rel=1e-3)
    assert [r["lo"] for r in st["by_position"]] == [CTX // 2]
    assert runs["llama"].with_suffix(".png").stat().st_size > 0


def test_per_token_values_are_float32_and_percentiles_are_theirs(runs):
    res = json.loads(runs["all"].read_text())["results"]["f4_sr_rs"]
    kl = np.load(runs["all"].with_suffix(".kl") / "doc00000.npy")
    assert kl.dtype == np.float32
    v = np.sort(kl[0])

    def llama_percentile(values, fraction):   # llama.cpp's formula, on float32 values
        p = fraction * (len(values) - 1)
        i = int(p)
        p -= i
        return (1 - p) * values[i] + p * values[min(i + 1, len(values) - 1)]
    for q in S.PERCENTILES:
        assert res["kl_percentiles"][f"{q:g}"] == pytest.approx(llama_percentile(v, q / 100), rel=1e-6)
    assert res["kl_percentiles_from"] == "float32 per-token values"


def test_resume_with_another_scoring_is_refused_and_keeps_the_results(runs, texts, tmp_path):
    before = runs["all"].read_bytes()
    code, text = _invoke(_kl(texts, runs["all"], "--scoring", "llama"))
    assert code == 2 and "Traceback" not in text, text
    assert "scored with --scoring all" in text and "refusing to mix" in text
    assert runs["all"].read_bytes() == before
    # results of a version that recorded no scoring (and kept float16 values) are not resumed
    old = json.loads(before)
    del old["config"]["scoring"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    code, text = _invoke(_kl(texts, tmp_path / "old.json"))
    assert code == 2 and "results of an earlier replayquant, which recorded no scoring" in text, text


def test_a_resumed_run_says_what_it_found_and_kept(runs, texts):
    code, text = _invoke(_kl(texts, runs["llama"], "--scoring", "llama"))
    assert code == 0, text
    assert f"resuming {runs['llama']}: 1 of 1 document(s) already done and kept" in text
    assert "nothing left to compute" in text


def test_table_refuses_to_mix_scorings_and_llama_format_says_which(runs):
    code, text = _invoke(["table", runs["all"], runs["llama"]])
    assert code == 2 and "scored over different positions" in text and "Traceback" not in text
    code, text = _invoke(["table", runs["llama"], "--format", "llama"])
    assert code == 0, text
    assert "scoring=llama (positions n/2 ... n-2 of each window, as llama.cpp)" in text
    assert "chunk             PPL" in text and "fewer than 100 positions scored" in text  # 31
    code, text = _invoke(["table", runs["all"], "--format", "llama"])
    assert code == 0 and "scoring=all (every position" in text and "--scoring llama` for its numbers" in text
    code, text = _invoke(["table", runs["llama"], "--format", "csv"])
    assert code == 0 and text.splitlines()[0].split(",")[3] == "scoring"
    assert text.splitlines()[1].split(",")[3] == "llama"


def test_table_rescores_a_run_of_every_position_to_llamas_window(runs, tmp_path):
    import shutil

    from replayquant.kl.results import rescore
    a, b = (json.loads(runs[k].read_text()) for k in ("all", "llama"))
    got, want = rescore(a, runs["all"], "llama")["results"]["f4_sr_rs"], b["results"]["f4_sr_rs"]
    for k in ("n_tokens", "kl_mean", "kl_max", "kl_min", "kl_median", "same_top", "ppl_ref", "ppl_test",
              "ln_ppl_ratio", "ln_ppl_ratio_unc", "ln_ppl_cor", "dp_mean", "dp_rms", "dp_median"):
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-9), k
    for k in ("kl_percentiles", "dp_percentiles"):
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-9), k
    assert [(r["lo"], r["n_tokens"]) for r in got["by_position"]] == \
        [(r["lo"], r["n_tokens"]) for r in want["by_position"]]
    code, text = _invoke(["table", runs["all"], "--format", "llama", "--scoring", "llama"])
    assert code == 0, text
    code2, direct = _invoke(["table", runs["llama"], "--format", "llama"])
    assert text.splitlines()[1:] == direct.splitlines()[1:]          # the same block
    assert "re-scored from the per-token values of a run that scored every position" in text
    # mixing is judged after re-scoring; fewer positions cannot be re-scored to more
    code, text = _invoke(["table", runs["all"], runs["llama"], "--scoring", "llama"])
    assert code == 0, text
    code, text = _invoke(["table", runs["llama"], "--scoring", "all"])
    assert code == 2 and "cannot be re-scored with --scoring all" in text
    # a run without the per-token NLL (an earlier version) says so
    old = tmp_path / "old.json"
    shutil.copy(runs["all"], old)
    shutil.copytree(runs["all"].with_suffix(".kl"), tmp_path / "all.kl")    # kl_tokens_dir
    (tmp_path / "all.kl" / "doc00000.nll.npy").unlink()
    code, text = _invoke(["table", old, "--scoring", "llama"])
    assert code == 2 and "doc00000.nll.npy (the per-token NLL of document 0) is missing" in text


def test_default_out_names_the_scoring():
    assert C.default_out("m", ["p"], 64, "replay", "llama").name == "m_p_ctx64_replay_llama.json"
    assert C.default_out("m", ["p"], 64, "replay").name == "m_p_ctx64_replay.json"


# ---------------------------------------------------------------- lm-eval's hf baseline

def _lm_eval(model_block: dict, acc: float) -> dict:
    return {"results": {"gpqa_diamond_zeroshot": {"alias": "gpqa", "acc,none": acc,
                                                   "acc_stderr,none": 0.03}},
            "config": {"model_args": "pretrained=Qwen/Qwen3.5-4B,dtype=bfloat16", "limit": None,
                       **model_block},
            "n-samples": {"gpqa_diamond_zeroshot": {"original": 198, "effective": 198}}}


def test_table_takes_lm_eval_results_of_the_plain_hf_model(tmp_path):
    hf = tmp_path / "hf.json"
    hf.write_text(json.dumps(_lm_eval({"model": "hf"}, 0.40)))
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps(_lm_eval({"model": "replayquant", "replayquant": {
        "pair": {"name": "tp4_hi16_sr"}, "prefill": "replay"}}, 0.38)))
    code, text = _invoke(["table", hf, ours])
    assert code == 0, text
    rows = [r for r in text.splitlines() if "gpqa_diamond_zeroshot" in r]
    assert rows[0].startswith("| Qwen3.5-4B | unpatched (hf) | - |") and "0.4000" in rows[0]
    assert "| tp4_hi16_sr | replay |" in rows[1] and "0.3800" in rows[1]
    code, text = _invoke(["table", hf, "--format", "csv"])
    assert code == 0 and "unpatched (hf)" in text
    code, text = _invoke(["table", hf, "--scoring", "llama"])
    assert code == 2 and "--scoring applies to KL results files" in text
    # other lm-eval models still are not ours to read
    other = tmp_path / "vllm.json"
    other.write_text(json.dumps(_lm_eval({"model": "vllm"}, 0.4)))
    code, text = _invoke(["table", other])
    assert code == 2 and "of model 'vllm'" in text and "lm-eval's hf model" in text


# ---------------------------------------------------------------- pickling, load_model

@pytest.fixture(scope="module")
def patched():
    import replayquant
    return replayquant.load_model(TINY, "tp4_hi16_sr", dtype="float32")


def test_a_patched_model_pickles_and_loads_patched(patched):
    from replayquant.models import is_patched, patch_info, unpatch
    ids = torch.arange(1, 20).unsqueeze(0)
    with torch.no_grad():
        want = patched(ids).logits
    buf = io.BytesIO()
    torch.save(patched, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert is_patched(again) and patch_info(again)["pair"].name == "tp4_hi16_sr"
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want)
    unpatch(again)
    with torch.no_grad():
        assert not torch.equal(again(ids).logits, want)     # the model's own recurrence again


def test_load_model_returns_hf_loading_info_and_takes_hf_dtype_names():
    import replayquant
    from replayquant.models import is_patched
    from replayquant.models.patching import resolve_dtype
    model, info = replayquant.load_model(TINY, "s32_rs", dtype="half", output_loading_info=True)
    assert is_patched(model) and not model.training
    assert isinstance(info, dict) and "missing_keys" in info
    assert next(model.parameters()).dtype == torch.float16
    assert resolve_dtype("float") == torch.float32 and resolve_dtype(torch.bfloat16) == torch.bfloat16
    model = replayquant.load_model(TINY, torch_dtype="float")          # HF's older argument name
    assert next(model.parameters()).dtype == torch.float32 and not isinstance(model, tuple)
    with pytest.raises(ValueError, match="disagree"):
        replayquant.load_model(TINY, dtype="bf16", torch_dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype 'quarter' unknown; use auto, one of bfloat16, float16"):
        replayquant.load_model(TINY, dtype="quarter")


# ---------------------------------------------------------------- --help

def _commands(group, prefix=()):
    import typer.main
    cmd = typer.main.get_command(group) if not hasattr(group, "commands") else group
    for name, sub in cmd.commands.items():
        if hasattr(sub, "commands"):
            yield from _commands(sub, prefix + (name,))
        else:
            yield prefix + (name,), sub


def test_help_lists_choices_and_never_cuts_an_option_name():
    from replayquant.models.patching import DTYPES
    import typing
    from replayquant.cli.common import Dtype
    assert typing.get_args(Dtype) == ("auto", *DTYPES)
    seen = 0
    for path, cmd in _commands(app):
        code, text = _invoke([*path, "--help"])
        assert code == 0, (path, text)
        assert "…" not in text, (path, text)
        for p in cmd.params:
            for opt in p.opts + p.secondary_opts:
                if opt.startswith("--") and not p.hidden:     # hidden: an earlier spelling
                    assert re.search(re.escape(opt) + r"(?![\w-])", text), (path, opt, text)
                    seen += 1
    assert seen > 100
    code, text = _invoke(["kl", "--help"])
    for choice in ("<replay|exact>", "<exact|hf>", "<all|llama>", "half"):
        assert choice in text, choice
    code, text = _invoke(["table", "--help"])
    assert "<md|csv|llama>" in text and "<pair|model>" in text


def test_a_bad_choice_is_refused_by_the_option_before_any_work(monkeypatch, tmp_path):
    def boom(*a, **k):
        raise AssertionError("work started before the bad choice was refused")
    monkeypatch.setattr(C, "kl_command", boom)
    for opt, bad in (("--prefill", "exat"), ("--dtype", "fp8"), ("--reference", "HF"),
                     ("--scoring", "half")):
        code, text = _invoke(["kl", "--model", TINY, "--pair", "s32_rs", opt, bad])
        assert code == 2 and f"Invalid value for '{opt}'" in text and "Traceback" not in text, text
    code, text = _invoke(["table", tmp_path / "x.json", "--format", "tsv"])
    assert code == 2 and "Invalid value for '--format'" in text


# ---------------------------------------------------------------- datasets

def test_heldout_is_a_dataset_short_name():
    from transformers import AutoTokenizer

    from replayquant.data import heldout_path, tiny_model_path
    from replayquant.kl.data import load_documents, resolve_source
    assert resolve_source("heldout") == ("jsonl", str(heldout_path()))
    tok = AutoTokenizer.from_pretrained(tiny_model_path(TINY))
    docs = load_documents("heldout", tok, 128, 2)
    assert [d.id for d in docs.documents] == ["kjv-job", "kjv-isaiah"]
    assert docs.kind == "jsonl"


@pytest.mark.parametrize("how", ["offline-env", "no-connection"])
def test_a_hub_dataset_without_the_hub_fails_at_once(monkeypatch, how):
    import socket

    from replayquant.kl.data import load_documents
    for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    if how == "offline-env":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        def refused(*a, **k):
            raise OSError(-2, "Name or service not known")
        monkeypatch.setattr(socket, "create_connection", refused)
    t0 = time.time()
    with pytest.raises(ValueError) as e:
        load_documents("pg19", None, 64, 1)
    assert time.time() - t0 < 5
    msg = str(e.value)
    assert "'emozilla/pg19' is a Hugging Face hub dataset, and the hub cannot be reached" in msg
    assert "--dataset heldout" in msg
    assert ("HF_HUB_OFFLINE=1 is set" in msg) == (how == "offline-env")


# ---------------------------------------------------------------- README against results/

def test_readme_front_table_is_the_committed_front_and_the_per_layer_budget_is_stated():
    readme = (ROOT / "README.md").read_text()
    sweep = json.loads((ROOT / "results/demo/tiny-qwen3.5_sweep.json").read_text())
    start = readme.index("The front it prints")
    table = readme[start:readme.index("\n\n", readme.index("| variant |", start))]
    names = re.findall(r"^\| \**([a-z0-9_]+@L\d+)", table, flags=re.M)
    assert names == sweep["front"]
    conv = sweep["conventional_fp32"]["bytes_per_step"]["state"]
    by = {v["name"]: v for v in sweep["variants"]}
    for line in table.splitlines():
        m = re.match(r"^\| \**([a-z0-9_]+@L\d+).*?\| (\d+) KiB \| ([\d.]+)x \|", line)
        if m:
            b = by[m.group(1)]["bytes_per_step"]["state"]
            assert int(m.group(2)) == round(b / 1024) and float(m.group(3)) == round(conv / b, 1)
    policy = json.loads((ROOT / "results/policy/tiny-qwen3.5_tp4_hi16_sr+tp8_hi16_sr_kl1e-3.json").read_text())
    assert policy["kl_budget"] == 1e-3
    para = readme[readme.index("`recommend --per-layer"):]
    assert "--kl-budget 1e-3" in para[:200] and "budget of 1e-3" in para[:400]
