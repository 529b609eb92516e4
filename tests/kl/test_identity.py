"""Every result is tied to the exact model and data that produced it: a model's fingerprint covers
every byte of its weights (a tensor changed in the middle of a weight file changes it), and every
command that uses a file written by another run (kl resume, `recommend --per-layer`,
`recommend --gpqa`, `table --scoring llama`) refuses another model, other documents or another
run's per-token values with one error naming both sides.

The runs use copies of the embedded tiny Qwen3.5 model on 64-token documents of the shipped
held-out text, so the file takes seconds."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from replayquant.data import heldout_documents, tiny_model_path
from replayquant.kl import command as C
from replayquant.kl.run import local_fingerprint
from _cli import invoke as _invoke, one_clear_error as _one_clear_error

TINY = "tiny-qwen3.5"


@pytest.fixture(autouse=True, scope="module")
def _own_hash_cache(tmp_path_factory):
    """The file's runs hash into a cache of their own (not the user's)."""
    was = os.environ.get("REPLAYQUANT_CACHE")
    os.environ["REPLAYQUANT_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if was is None:
        del os.environ["REPLAYQUANT_CACHE"]
    else:
        os.environ["REPLAYQUANT_CACHE"] = was


def _copy_model(dest: Path, name: str = TINY) -> Path:
    shutil.copytree(tiny_model_path(name), dest)
    return dest


def _change_middle_tensor(folder: Path) -> None:
    """Doubles one value of the tensor whose bytes lie in the middle of model.safetensors, so the
    first and last MiB of the file stay as they were."""
    path = folder / "model.safetensors"
    before = path.read_bytes()
    header = json.loads(before[8:8 + int.from_bytes(before[:8], "little")])
    start = 8 + int.from_bytes(before[:8], "little")
    middle = len(before) // 2
    name = next(k for k, v in header.items() if k != "__metadata__" and
                start + v["data_offsets"][0] <= middle < start + v["data_offsets"][1])
    tensors = load_file(path)
    tensors[name].view(-1)[tensors[name].numel() // 2] *= 2
    save_file(tensors, path, metadata=header.get("__metadata__"))
    after = path.read_bytes()
    assert len(after) == len(before) and after != before
    assert after[:1 << 20] == before[:1 << 20] and after[-(1 << 20):] == before[-(1 << 20):]


# ------------------------------------------------------------------ the model's fingerprint


def test_a_tensor_changed_in_the_middle_of_the_weights_changes_the_fingerprint(tmp_path):
    model = _copy_model(tmp_path / "model")
    before = local_fingerprint(model)
    assert local_fingerprint(tiny_model_path(TINY)) == before       # a copy is the same model
    _change_middle_tensor(model)
    assert local_fingerprint(model) != before


def test_whole_file_hashes_are_cached_by_path_size_and_times(tmp_path, monkeypatch):
    from replayquant import provenance as P
    monkeypatch.setenv("REPLAYQUANT_CACHE", str(tmp_path / "cache"))
    model = _copy_model(tmp_path / "model")
    hashed = []
    real = P._sha256_file
    monkeypatch.setattr(P, "_sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    first = local_fingerprint(model)
    assert "model.safetensors" in hashed and (tmp_path / "cache" / "file_sha256.json").is_file()
    hashed.clear()
    assert local_fingerprint(model) == first and hashed == []       # nothing read again
    _change_middle_tensor(model)
    assert local_fingerprint(model) != first and hashed == ["model.safetensors"]


# ------------------------------------------------------------------ kl resume


def _kl(model, texts, out, docs=1, pair="s32_rs"):
    return ["kl", "--model", model, "--pair", pair, "--dataset", texts, "--context", 64,
            "--docs", docs, "--segment", 32, "--dtype", "float32", "--reference", "hf",
            "--no-progress", "--out", out]


def test_kl_resume_on_changed_weights_is_refused_not_mixed(tmp_path, texts):
    model = _copy_model(tmp_path / "model")
    out = tmp_path / "r.json"
    code, text = _invoke(_kl(model, texts, out))
    assert code == 0, text
    was = json.loads(out.read_text())["config"]["model"]["local_hash"]
    _change_middle_tensor(model)
    before = out.read_bytes()
    code, text = _invoke(_kl(model, texts, out, docs=2))
    _one_clear_error(code, text, "another model", was, local_fingerprint(model))
    assert out.read_bytes() == before


# ------------------------------------------------------------------ recommend --per-layer


def _book(folder: Path, index: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "doc.txt").write_text(heldout_documents()[index]["text"][:2000])
    return folder


@pytest.fixture(scope="module")
def sens_run(tmp_path_factory):
    """A sensitivity file of two pairs on layer 0 of a copy of the tiny model, measured on the
    book in a/texts named relatively from a/; b/texts holds another book."""
    root = tmp_path_factory.mktemp("sens")
    model = _copy_model(root / "model")
    _book(root / "a" / "texts", 0)
    _book(root / "b" / "texts", 1)
    cwd = os.getcwd()
    os.chdir(root / "a")
    try:
        code, text = _invoke(["sensitivity", "--model", model, "--pair", "tp8_hi32", "--pair",
                              "tp4_hi32", "--layers", "0", "--dataset", "texts", "--context", 64,
                              "--docs", 1, "--segment", 32, "--dtype", "float32", "--no-progress",
                              "--out", root / "sens.json"])
    finally:
        os.chdir(cwd)
    assert code == 0, text
    return root


def _tokens_of(kl_results: Path) -> str:
    """The sha256 of the tokens a KL run measured."""
    return json.loads(kl_results.read_text())["provenance"]["dataset"]["tokens_sha256"]


def _per_layer(sens: Path, out: Path):
    return _invoke(["recommend", "--per-layer", sens, "--kl-budget", 1.0, "--no-progress",
                    "--out", out])


def _no_kl_run(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the weights were loaded")
    monkeypatch.setattr(C, "load_weights", boom)


def test_per_layer_refuses_a_model_changed_in_the_middle(sens_run, tmp_path, monkeypatch):
    model = _copy_model(tmp_path / "model")
    sens = json.loads((sens_run / "sens.json").read_text())
    sens["kl_args"]["model"] = sens["model"]["id"] = sens["model"]["path"] = str(model)
    sens["kl_args"]["dataset"] = str(sens_run / "a" / "texts")
    (tmp_path / "s.json").write_text(json.dumps(sens))
    was = sens["model"]["local_hash"]
    _change_middle_tensor(model)
    _no_kl_run(monkeypatch)
    code, text = _per_layer(tmp_path / "s.json", tmp_path / "r.json")
    _one_clear_error(code, text, "s.json", was, local_fingerprint(model))
    assert not (tmp_path / "r.json").exists()


def test_per_layer_measures_the_book_the_file_measured_from_any_folder(sens_run, tmp_path,
                                                                      monkeypatch):
    monkeypatch.chdir(sens_run / "b")               # its texts/ holds another book
    code, text = _per_layer(sens_run / "sens.json", tmp_path / "r.json")
    assert code == 0, text
    measured = json.loads((tmp_path / "r_kl.json").read_text())["provenance"]["dataset"]
    assert measured["source"] == str(sens_run / "a" / "texts")
    assert measured["tokens_sha256"] == _tokens_of(sens_run / "sens_kl.json")
    sens = json.loads((sens_run / "sens.json").read_text())
    assert sens["kl_args"]["dataset"] == str(sens_run / "a" / "texts")


def test_per_layer_refuses_a_book_that_changed(sens_run, tmp_path, monkeypatch):
    book = shutil.copytree(sens_run / "a" / "texts", tmp_path / "texts")
    sens = json.loads((sens_run / "sens.json").read_text())
    sens["kl_args"]["dataset"] = str(book)
    (tmp_path / "s.json").write_text(json.dumps(sens))
    (book / "doc.txt").write_text(heldout_documents()[2]["text"][:2000])
    _no_kl_run(monkeypatch)
    code, text = _per_layer(tmp_path / "s.json", tmp_path / "r.json")
    _one_clear_error(code, text, "s.json", str(book), _tokens_of(sens_run / "sens_kl.json"))
    assert not (tmp_path / "r.json").exists()


# ------------------------------------------------------------------ recommend --gpqa

SWEEP = Path(__file__).resolve().parents[2] / "results/demo/tiny-qwen3.5_sweep.json"


def _gpqa_summary(model: str, variants: list[dict], digests=None) -> dict:
    """A GPQA summary of `model` (`build_summary` of lm-eval-shaped results) with one pair per
    sweep variant in `variants` (the first is the reference), its questions `digests`."""
    from replayquant.gpqa.summary import build_summary
    per_pair = []
    for i, v in enumerate(variants):
        per_doc = {"0": 1.0, "1": 0.0, "2": float(i == 0)}
        per_pair.append({"label": v["name"], "file": f"{i}.json", "results": {
            "results": {"t": {"acc,none": sum(per_doc.values()) / 3, "acc_stderr,none": 0.3}},
            "n-samples": {"t": {"effective": 3}},
            "replayquant": {"pair": v["pair"], "per_doc": {"t": {"acc,none": per_doc}},
                            "questions_digest": {"t": (digests or {}).get(i, "d")}}}})
    return build_summary(per_pair, model=model, tasks=["t"], limit=3, seed=0, prefill="replay",
                         data={"source": "csv"}, provenance={})


def _gpqa_recommend(tmp_path, summary):
    sweep = json.loads(SWEEP.read_text())
    # the sweep as this version writes it: the fingerprint of every byte of the model
    sweep["model"]["local_hash"] = local_fingerprint(tiny_model_path(TINY))
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    (tmp_path / "gpqa.json").write_text(json.dumps(summary))
    return _invoke(["recommend", tmp_path / "sweep.json", "--kl-budget", 1.0, "--gpqa",
                    tmp_path / "gpqa.json", "--gpqa-budget", 50])


def _two_variants():
    by = {v["name"]: v for v in json.loads(SWEEP.read_text())["variants"]}
    return [by["s32_rs@L16"], by["tp8_hi32@L16"]]


def test_recommend_gpqa_refuses_a_summary_of_another_model(tmp_path):
    code, text = _gpqa_recommend(tmp_path, _gpqa_summary("tiny-mamba2", _two_variants()))
    _one_clear_error(code, text, "GPQA", str(tiny_model_path("tiny-mamba2")),
                     local_fingerprint(tiny_model_path("tiny-mamba2")),
                     local_fingerprint(tiny_model_path(TINY)))
    code, text = _gpqa_recommend(tmp_path, _gpqa_summary(TINY, _two_variants()))
    assert code == 0 and "recommended" in text, text


def test_recommend_gpqa_refuses_pairs_asked_other_questions(tmp_path):
    summary = _gpqa_summary(TINY, _two_variants(), digests={1: "other"})
    code, text = _gpqa_recommend(tmp_path, summary)
    _one_clear_error(code, text, "GPQA", "tp8_hi32@L16", "other questions")


# ------------------------------------------------------------------ table --scoring llama


def test_rescoring_refuses_another_runs_per_token_folder(tmp_path, texts):
    """A results file copied beside another run's folder of the same name is not re-scored from
    that run's per-token values."""
    for folder, pair in (("a", "tp8_hi32"), ("b", "tp4_hi32")):
        (tmp_path / folder).mkdir()
        code, text = _invoke(_kl(TINY, texts, tmp_path / folder / "r.json", pair=pair))
        assert code == 0, text
    code, text = _invoke(["table", tmp_path / "a" / "r.json", "--scoring", "llama"])
    assert code == 0 and "tp8_hi32" in text, text
    copied = shutil.copy(tmp_path / "a" / "r.json", tmp_path / "b" / "copy.json")
    code, text = _invoke(["table", copied, "--scoring", "llama"])
    _one_clear_error(code, text, str(copied), str(tmp_path / "b" / "r.kl"), "tp4_hi32")
    # the run's own folder with one document's per-token KL replaced
    npy = tmp_path / "a" / "r.kl" / "doc00000.npy"
    np.save(npy, np.load(npy) * 2)
    code, text = _invoke(["table", tmp_path / "a" / "r.json", "--scoring", "llama"])
    _one_clear_error(code, text, str(npy), "is not the per-token KL")
