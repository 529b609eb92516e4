"""The conventions users bring from datasets, lm-eval, llama.cpp and accelerate, and bad inputs
of the same kinds: each one clear error naming the file (and line or row), no silent fallback."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

from replayquant.kl import data as kl_data
from replayquant.kl.data import load_documents, resolve_source


class _CharTok:
    """One token per character; enough to test document selection."""
    eos_token_id = 0

    def __call__(self, text, **kw):
        return {"input_ids": [1 + (ord(c) % 50) for c in text]}


TEXTS = ["a" * 50, "b" * 12, "c" * 60, "d" * 45]


def _table(texts=TEXTS, **extra):
    import datasets
    return datasets.Dataset.from_dict({"text": list(texts), "id": [f"r{i}" for i in range(len(texts))],
                                       **extra})


def _ids(ds):
    return [d.id for d in ds.documents]


def _sha(pairs):
    h = hashlib.sha256()
    for doc_id, text in pairs:
        for part in (doc_id.encode(), text.encode()):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()


# ---------------------------------------------------------------- bad text files (defect 5)

def test_binary_or_undecodable_txt_is_refused_with_its_name(tmp_path):
    b = tmp_path / "weights.txt"
    b.write_bytes(b"PK\x03\x04\x00\x00" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"weights\.txt is binary, not text \(NUL byte at offset 4\)"):
        load_documents(str(b), _CharTok(), 10, 1)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9 ".encode("latin-1") * 20)
    with pytest.raises(ValueError, match=r"latin\.txt is not UTF-8 text \(byte 0xe9 at offset 3\).*iconv"):
        load_documents(str(latin), _CharTok(), 10, 1)
    # in a folder of .txt files: the same check, naming the file
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text("x" * 40)
    (d / "b.txt").write_bytes(b"\x00\x01\x02" * 20)
    with pytest.raises(ValueError, match=r"texts/b\.txt is binary"):
        load_documents(str(d), _CharTok(), 20, 5)


def test_binary_jsonl_names_file_and_line(tmp_path):
    j = tmp_path / "docs.jsonl"
    j.write_bytes(json.dumps({"text": "a" * 30}).encode() + b"\n" + b"\xff\xfe\x00\x01garbage\n")
    with pytest.raises(ValueError, match=r"docs\.jsonl:2 \(a \.jsonl line\) is binary"):
        load_documents(str(j), _CharTok(), 10, 5)
    j.write_bytes(json.dumps({"text": "a" * 30}).encode() + b"\n" + b'{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"docs\.jsonl:2 \(a \.jsonl line\) is not UTF-8"):
        load_documents(str(j), _CharTok(), 10, 5)


@pytest.mark.parametrize("value,shown", [(None, "null"), (12345, r"an int \(12345\)"),
                                         (["x"], r"a list \(\['x'\]\)"), ({"t": 1}, "a dict")])
def test_jsonl_text_not_a_string_names_file_and_line(tmp_path, value, shown):
    j = tmp_path / "docs.jsonl"
    j.write_text(json.dumps({"text": "a" * 30}) + "\n\n" + json.dumps({"text": value}) + "\n")
    with pytest.raises(ValueError, match=rf"docs\.jsonl:3: 'text' is {shown}.*not a string"):
        load_documents(str(j), _CharTok(), 10, 5)
    j.write_text(json.dumps([1, 2]) + "\n")
    with pytest.raises(ValueError, match=r"docs\.jsonl:1 is a list .*not a JSON object"):
        load_documents(str(j), _CharTok(), 10, 5)


# ---------------------------------------------------------------- what datasets users have

def test_local_data_files_through_datasets(tmp_path):
    t = _table()
    for suffix, write in ((".parquet", t.to_parquet), (".csv", t.to_csv), (".json", t.to_json)):
        f = tmp_path / f"docs{suffix}"
        write(str(f))
        ds = load_documents(str(f), _CharTok(), context=40, n_docs=10)
        assert ds.kind == "file" and ds.source == str(f.resolve()), suffix
        assert _ids(ds) == ["0:r0", "2:r2", "3:r3"] and ds.skipped_short == 1, suffix
        assert ds.documents[1].tokens.tolist() == [1 + ord("c") % 50] * 40
        assert ds.record()["text_sha256"] == _sha([(f"{i}:r{i}", x) for i, x in enumerate(TEXTS)])
    # an .arrow file (one shard of a save_to_disk folder)
    t.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    ds = load_documents(str(arrow), _CharTok(), context=40, n_docs=2)
    assert ds.kind == "file" and _ids(ds) == ["0:r0", "2:r2"]


def test_save_to_disk_and_hub_layout_folders(tmp_path):
    import datasets
    t = _table()
    t.save_to_disk(str(tmp_path / "saved"))
    ds = load_documents(str(tmp_path / "saved"), _CharTok(), context=40, n_docs=10)
    assert ds.kind == "saved" and _ids(ds) == ["0:r0", "2:r2", "3:r3"] and ds.split is None
    dd = datasets.DatasetDict({"test": t, "train": _table(["z" * 80])})
    dd.save_to_disk(str(tmp_path / "saveddict"))
    assert _ids(load_documents(str(tmp_path / "saveddict"), _CharTok(), 40, 10)) == ["0:r0", "2:r2", "3:r3"]
    ds = load_documents(str(tmp_path / "saveddict"), _CharTok(), 40, 10, split="train")
    assert _ids(ds) == ["0:r0"] and ds.split == "train"
    with pytest.raises(ValueError, match=r"no split 'validation' \(splits: \['test', 'train'\]\).*--split"):
        load_documents(str(tmp_path / "saveddict"), _CharTok(), 40, 10, split="validation")

    # what `hf download --local-dir` writes: README.md, data/<split>-*.parquet, .cache/
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    (hub / ".cache" / "huggingface").mkdir(parents=True)
    t.to_parquet(str(hub / "data" / "test-00000-of-00001.parquet"))
    _table(["y" * 70]).to_parquet(str(hub / "data" / "train-00000-of-00001.parquet"))
    (hub / "README.md").write_text("# a dataset\n")
    assert resolve_source(str(hub))[0] == "hub-folder"
    ds = load_documents(str(hub), _CharTok(), 40, 10)
    assert ds.kind == "hub-folder" and ds.split == "test" and _ids(ds) == ["0:r0", "2:r2", "3:r3"]
    assert _ids(load_documents(str(hub), _CharTok(), 40, 10, split="train")) == ["0:r0"]
    with pytest.raises(ValueError, match=r"the dataset folder .*hub.*validation"):
        load_documents(str(hub), _CharTok(), 40, 10, split="validation")

    # configurations from the README (--dataset-config) and --data-files within the folder
    cfg = tmp_path / "cfg"
    (cfg / "long").mkdir(parents=True)
    (cfg / "short").mkdir()
    t.to_parquet(str(cfg / "long" / "part.parquet"))
    _table(["s" * 41]).to_parquet(str(cfg / "short" / "part.parquet"))
    (cfg / "README.md").write_text(
        "---\nconfigs:\n- config_name: long\n  data_files:\n  - split: test\n    path: long/*.parquet\n"
        "- config_name: short\n  data_files:\n  - split: test\n    path: short/*.parquet\n---\n")
    ds = load_documents(str(cfg), _CharTok(), 40, 10, dataset_config="short")
    assert _ids(ds) == ["0:r0"] and ds.record()["config"] == "short"
    ds = load_documents(str(cfg), _CharTok(), 40, 10, data_files=["long/*.parquet"])
    assert _ids(ds) == ["0:r0", "2:r2", "3:r3"]
    assert ds.record()["data_files"] == {"test": ["long/*.parquet"]}


def test_builder_names_need_data_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _table().to_parquet("a.parquet")
    _table(["q" * 99]).to_parquet("b.parquet")
    with pytest.raises(ValueError, match=r"--dataset parquet is a `datasets` builder.*--data-files"):
        load_documents("parquet", _CharTok(), 40, 10)
    ds = load_documents("parquet", _CharTok(), 40, 10, data_files=["*.parquet"])
    assert ds.kind == "builder" and ds.split == "test" and len(ds.documents) == 4
    ds = load_documents("parquet", _CharTok(), 40, 10, data_files=["train=b.parquet"], split="train")
    assert _ids(ds) == ["0:r0"] and ds.record()["data_files"] == {"train": ["b.parquet"]}
    with pytest.raises(ValueError, match=r"could not load builder 'parquet'.*Unable to find"):
        load_documents("parquet", _CharTok(), 40, 10, data_files=["missing.parquet"])
    # --data-files / --dataset-config given with a source they do not apply to
    with pytest.raises(ValueError, match="--data-files applies to"):
        load_documents("a.parquet", _CharTok(), 40, 10, data_files=["b.parquet"])
    with pytest.raises(ValueError, match="--dataset-config applies to"):
        load_documents("a.parquet", _CharTok(), 40, 10, dataset_config="x")


def test_hub_name_passes_config_split_and_data_files_to_datasets(tmp_path, monkeypatch):
    import datasets
    seen = {}
    real = datasets.load_dataset
    t = _table()
    t.to_parquet(str(tmp_path / "x.parquet"))

    def fake(path, **kw):
        seen.update(path=path, **kw)
        return real("parquet", data_files={kw["split"]: [str(tmp_path / "x.parquet")]},
                    split=kw["split"], streaming=True)
    monkeypatch.setattr(datasets, "load_dataset", fake)
    monkeypatch.setattr(kl_data, "check_hub_reachable", lambda what: None)   # no hub here
    monkeypatch.setattr(kl_data, "hub_offline", lambda: None)     # as online, whatever HF_HUB_OFFLINE
    ds = load_documents("org/books", _CharTok(), 40, 2, split="validation", dataset_config="en",
                        data_files=["en/validation-*.parquet"])
    assert seen == {"path": "org/books", "name": "en", "split": "validation", "streaming": True,
                    "data_files": {"validation": ["en/validation-*.parquet"]}}
    rec = ds.record()
    assert (rec["kind"], rec["source"], rec["split"], rec["config"]) == ("hub", "org/books", "validation", "en")
    assert _ids(ds) == ["0:r0", "2:r2"]


def test_text_column_missing_or_not_a_string(tmp_path):
    import datasets
    f = tmp_path / "body.parquet"
    datasets.Dataset.from_dict({"body": ["a" * 50], "id": ["x"]}).to_parquet(str(f))
    with pytest.raises(ValueError, match=r"no 'text' column \(columns: \['body', 'id'\]\); pass --text-column"):
        load_documents(str(f), _CharTok(), 40, 2)
    ds = load_documents(str(f), _CharTok(), 40, 2, text_field="body")
    assert _ids(ds) == ["0:x"] and ds.record()["text_column"] == "body"
    g = tmp_path / "nulls.parquet"
    _table(["a" * 50, None, "c" * 50]).to_parquet(str(g))
    with pytest.raises(ValueError, match=r"nulls\.parquet \(builder parquet\), row 1: 'text' is null"):
        load_documents(str(g), _CharTok(), 40, 5)
    c = tmp_path / "nums.csv"
    c.write_text("text,id\n12345,a\n")
    with pytest.raises(ValueError, match=r"nums\.csv \(builder csv\), row 0: 'text' is an int \(12345\)"):
        load_documents(str(c), _CharTok(), 40, 5)
    (tmp_path / "j.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"j\.jsonl:1 has no 'text' field \(fields: \['body'\]\).*--text-column"):
        load_documents(str(tmp_path / "j.jsonl"), _CharTok(), 40, 5)
    bad = tmp_path / "damaged.parquet"
    bad.write_bytes(b"not a parquet file" * 10)
    with pytest.raises(ValueError, match=r"could not load .*damaged\.parquet"):
        load_documents(str(bad), _CharTok(), 40, 5)


def test_fingerprints_follow_the_content(tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text("x" * 40)
    (d / "b.txt").write_text("y" * 40)
    r1 = load_documents(str(d), _CharTok(), 30, 5).record()
    assert r1["text_sha256"] == _sha([("a.txt", "x" * 40), ("b.txt", "y" * 40)])
    (d / "b.txt").write_text("y" * 39 + "z")      # same ids, same tokens used, other text
    r2 = load_documents(str(d), _CharTok(), 30, 5).record()
    assert r2["text_sha256"] != r1["text_sha256"] and r2["tokens_sha256"] == r1["tokens_sha256"]
    (d / "b.txt").write_text("z" * 40)
    r3 = load_documents(str(d), _CharTok(), 30, 5).record()
    assert r3["tokens_sha256"] != r1["tokens_sha256"]
    assert r1["document_ids"] == ["a.txt", "b.txt"] and r1["kind"] == "folder"


# ---------------------------------------------------------------- a tiny model and real KL runs

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Qwen3.5 text model (one GDN layer, one attention layer) with a word-level BPE
    tokenizer, saved as a local folder."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    root = tmp_path_factory.mktemp("conv")
    rng = random.Random(3)
    words = ["".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(1, 6))) for _ in range(200)]
    texts = [" ".join(rng.choice(words) for _ in range(n)) for n in (200, 220, 240)]
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<eos>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(
        vocab_size=200, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=256,
        initializer_range=0.2)
    d = root / "tiny-qwen"
    Qwen3_5ForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    import datasets
    data = root / "books.parquet"
    datasets.Dataset.from_dict({"body": texts, "title": ["one", "two", "three"]}).to_parquet(str(data))
    return {"root": root, "model": d, "data": data, "texts": texts}


def _eps_variant(model, pair, prefill, seed):
    """Stand-in for a patched pair (no model integration): the first GDN layer's output scaled by
    1 + eps; s32_rs leaves the model as it is (KL exactly 0)."""
    from replayquant.kl.lockstep import Variant
    name = pair if isinstance(pair, str) else pair.name
    eps = {"s32_rs": 0.0, "f4_sr_rs": 0.3, "tp4_hi32": 0.05}.get(name, 0.1)
    mixer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    handle = {}

    def enter():
        if eps:
            handle["h"] = mixer.register_forward_hook(lambda mod, args, out: out * (1 + eps))

    def exit():
        if "h" in handle:
            handle.pop("h").remove()
    return Variant(name, {"name": name, "stand_in_eps": eps}, enter, exit)


def _invoke(args, **kw):
    from typer.testing import CliRunner

    from replayquant.cli import app
    res = CliRunner().invoke(app, [str(a) for a in args], **kw)
    return res.exit_code, (res.stdout or "") + (getattr(res, "stderr", "") or "")


@pytest.fixture(scope="module")
def kl_run(tiny):
    """One real `replayquant kl` run through the CLI: a parquet file through the parquet builder
    (--data-files), the text in column `body`, --dtype auto, three pairs (stand-ins)."""
    from replayquant.kl import run as R
    out = tiny["root"] / "kl" / "run.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(R, "patch_variant", _eps_variant)
        mp.chdir(tiny["root"])
        code, text = _invoke(["kl", "--model", tiny["model"], "--pair", "s32_rs", "--pair", "f4_sr_rs",
                              "--pair", "tp4_hi32", "--dataset", "parquet", "--data-files", "books.parquet",
                              "--text-column", "body", "--context", 120, "--segment", 200, "--docs", 2,
                              "--dtype", "auto", "--reference", "hf", "--no-progress", "--out", out])
    assert code == 0, text
    return {"out": out, "text": text, "res": json.loads(out.read_text())}


def test_kl_cli_reads_a_builder_with_data_files_and_records_the_data(kl_run, tiny):
    res = kl_run["res"]
    ds = res["provenance"]["dataset"]
    assert (ds["kind"], ds["source"], ds["split"], ds["text_column"]) == ("builder", "parquet", "test", "body")
    assert ds["data_files"] == {"test": ["books.parquet"]}
    assert ds["text_sha256"] == _sha([("0:one", tiny["texts"][0]), ("1:two", tiny["texts"][1])])
    assert len(ds["tokens_sha256"]) == 64 and ds["document_ids"] == ["0:one", "1:two"]
    # --dtype auto: the model's own dtype (saved float32), recorded as loaded
    assert res["config"]["model"]["dtype"] == "float32"
    assert res["results"]["s32_rs"]["kl_mean"] == 0 and res["results"]["f4_sr_rs"]["kl_mean"] > 0


# ---------------------------------------------------------------- replayquant table

def test_table_on_a_file_with_only_kind_and_version_is_one_clear_error(tmp_path):
    f = tmp_path / "stub.json"
    f.write_text(json.dumps({"kind": "replayquant.kl", "version": 1}))
    code, text = _invoke(["table", f])
    assert code == 2 and "Traceback" not in text and "KeyError" not in text
    assert f"{f} says it is a KL results file" in text
    assert "has no config, results, documents_done, documents_planned" in text
    f.write_text(json.dumps({"kind": "replayquant.kl", "version": 1, "config": {"model": {}},
                             "results": {}, "documents_done": 0, "documents_planned": 1}))
    code, text = _invoke(["table", f, "--format", "llama"])
    assert code == 2 and "has no config.pairs, config.prefill, config.context" in text
    f.write_text(json.dumps({"results": {}, "config": {"model": "vllm"}}))
    code, text = _invoke(["table", f])
    assert code == 2 and "lm-eval results file without replayquant's record" in text


def test_table_csv_has_mean_and_uncertainty_in_separate_numeric_columns(kl_run):
    import csv
    code, text = _invoke(["table", kl_run["out"], "--format", "csv"])
    assert code == 0, text
    rows = {r["pair"]: r for r in csv.DictReader(text.splitlines())}
    st = kl_run["res"]["results"]["f4_sr_rs"]
    r = rows["f4_sr_rs"]
    assert float(r["kl_mean"]) == st["kl_mean"] and float(r["kl_mean_unc"]) == st["kl_mean_unc"]
    assert float(r["same_top_pct"]) == pytest.approx(100 * st["same_top"])
    assert float(r["same_top_pct_unc"]) == pytest.approx(100 * st["same_top_unc"])
    assert float(r["ppl_ratio_unc"]) == st["ppl_ratio_unc"] and float(r["dp_rms_pct"]) > 0
    for row in rows.values():
        for k, v in row.items():
            assert "±" not in v, (k, v)
    assert r["complete"] == "True" and r["documents_done"] == "2"


def test_table_llama_prints_llama_cpp_block(kl_run):
    import re
    code, text = _invoke(["table", kl_run["out"], "--format", "llama"])
    assert code == 0, text
    blocks = text.split("# ")[1:]
    assert [b.split(":", 1)[1].split(",")[0].strip() for b in blocks] == \
        ["Q = pair s32_rs", "Q = pair f4_sr_rs", "Q = pair tp4_hi32"]
    b = blocks[1].splitlines()[1:]
    assert b[0].startswith("chunk             PPL")             # llama.cpp's per-chunk table first
    b = b[b.index("====== Perplexity statistics ======"):]
    labels = [line.split(":")[0] for line in b if line]
    assert labels == [
        "====== Perplexity statistics ======", "Mean PPL(Q)                   ",
        "Mean PPL(base)                ", "Cor(ln(PPL(Q)), ln(PPL(base)))", "Mean ln(PPL(Q)/PPL(base))     ",
        "Mean PPL(Q)/PPL(base)         ", "Mean PPL(Q)-PPL(base)         ",
        "====== KL divergence statistics ======", "Mean    KLD", "Maximum KLD", "99.9%   KLD",
        "99.0%   KLD", "95.0%   KLD", "90.0%   KLD", "Median  KLD", "10.0%   KLD", " 5.0%   KLD",
        " 1.0%   KLD", " 0.1%   KLD", "Minimum KLD", "====== Token probability statistics ======",
        "Mean    Δp", "Maximum Δp", "99.9%   Δp", "99.0%   Δp", "95.0%   Δp", "90.0%   Δp", "75.0%   Δp",
        "Median  Δp", "25.0%   Δp", "10.0%   Δp", " 5.0%   Δp", " 1.0%   Δp", " 0.1%   Δp", "Minimum Δp",
        "RMS Δp    ", "Same top p"]
    st = kl_run["res"]["results"]["f4_sr_rs"]
    line = {ln.split(":")[0].strip(): ln.split(":", 1)[1] for ln in b if ":" in ln}
    assert line["Mean    KLD"] == f" {st['kl_mean']:10.6f} ± {st['kl_mean_unc']:10.6f}"
    assert line["Mean PPL(Q)-PPL(base)"] == f" {st['ppl_diff']:10.6f} ± {st['ppl_diff_unc']:10.6f}"
    assert line["Cor(ln(PPL(Q)), ln(PPL(base)))"] == f" {100 * st['ln_ppl_cor']:6.2f}%"
    assert line["0.1%   KLD"] == f" {st['kl_percentiles']['0.1']:10.6f}"
    assert line["Maximum Δp"] == f" {100 * st['dp_max']:6.3f}%"
    assert line["25.0%   Δp"] == f" {100 * st['dp_percentiles']['25']:6.3f}%"
    assert line["Same top p"] == f" {100 * st['same_top']:6.3f} ± {100 * st['same_top_unc']:5.3f} %"
    assert "nan" not in blocks[1] and re.search(r"RMS Δp    :  *\d+\.\d{3} ± \d+\.\d{3} %", blocks[1])
    # the per-token delta-p behind the percentiles is kept beside the KL, float32
    import numpy as np
    dp = np.load(kl_run["out"].with_suffix(".kl") / "doc00000.dp.npy")
    assert dp.dtype == np.float32 and dp.shape == (3, 119) and np.all(dp[0] == 0)


def test_kl_console_table_fits_80_columns_without_splitting_a_number(kl_run):
    import copy
    import io

    from rich.console import Console

    from replayquant.kl.report import print_summary
    res = copy.deepcopy(kl_run["res"])
    for st in res["results"].values():   # the small values long-context pairs give
        st.update(kl_mean=1.9134e-10, kl_mean_unc=7.321e-10, kl_median=1.2345e-11, kl_max=3.456e-07,
                  ln_ppl_ratio=-1.234e-07, ln_ppl_ratio_unc=5.678e-08)
        st["kl_percentiles"]["99"] = 2.345e-09
        for b in st["by_position"]:
            b["kl_mean"] = 1.9134e-10
    res["config"]["pairs"] += [dict(p, name=p["name"] + "_copy") for p in res["config"]["pairs"]]
    res["results"].update({k + "_copy": v for k, v in list(res["results"].items())})
    for width in (80, 60, 120):
        buf = io.StringIO()
        print_summary(res, Console(file=buf, width=width, force_terminal=False))
        out = buf.getvalue()
        assert max(len(line) for line in out.splitlines()) <= width, (width, out)
        assert out.count("~0±7.3e-10") == 6, out      # every mean KL whole (float noise), one line
        assert "e-" not in "".join(line.rstrip()[-2:] for line in out.splitlines())
    assert "left out at 120 columns" not in out


def test_progress_bar_shows_tokens_per_second_from_the_first_segment(tiny, tmp_path):
    import io
    import re

    from rich.console import Console

    from replayquant.kl import KLSettings, RunParts, run_kl
    from replayquant.kl.command import load_model_and_tokenizer
    from replayquant.kl.lockstep import Variant
    model, tok, _ = load_model_and_tokenizer(str(tiny["model"]), "float32")
    texts = tmp_path / "t"
    texts.mkdir()
    (texts / "a.txt").write_text(tiny["texts"][0])
    buf = io.StringIO()
    from replayquant.pairs import PrecisionPair
    run_kl(model, tok, [PrecisionPair.load("s32_rs")],
           KLSettings(dataset=str(texts), context=64, docs=1, segment=100, reference="hf"),
           out=tmp_path / "z.json",
           parts=RunParts(make_variant=lambda m, p, pre, s: Variant(p.name, {"name": p.name}),
                          plot=False, console=Console(file=buf, force_terminal=True, width=140)))
    out = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", buf.getvalue())
    assert re.search(r"\d[\d,]* tok/s", out), out         # one segment: no second rich sample
    assert "-- tok/s" not in out.splitlines()[-1]


LM_EVAL_FILES = sorted((Path(__file__).parent / "data" / "lm_eval").glob("*_results.json"))


def test_table_reads_the_lm_eval_results_replayquant_writes(tmp_path):
    import csv
    assert len(LM_EVAL_FILES) == 2
    code, md = _invoke(["table", *LM_EVAL_FILES])
    assert code == 0, md
    lines = md.splitlines()
    assert lines[0] == "| model | pair | prefill | task | metric | n | value | stderr |"
    rows = [ln for ln in lines[2:] if ln.startswith("| tiny-qwen35")]
    assert [r.split(" | ")[1] for r in rows] == ["f4_sr_rs", "f4_sr_rs", "s32_rs", "s32_rs"]
    res = json.loads(LM_EVAL_FILES[1].read_text())
    acc = res["results"]["gpqa_diamond_zeroshot"]["acc,none"]
    se = res["results"]["gpqa_diamond_zeroshot"]["acc_stderr,none"]
    assert f"| s32_rs | replay | gpqa_diamond_zeroshot | acc | 6 | {acc:.4f} | {se:.4f} |" in md
    code, text = _invoke(["table", *LM_EVAL_FILES, "--format", "csv"])
    assert code == 0, text
    got = list(csv.DictReader(text.splitlines()))
    assert float(got[2]["value"]) == acc and float(got[2]["stderr"]) == se and got[2]["pair"] == "s32_rs"
    # kinds are not mixed in one table; KL-only formats are refused for them
    kl = tmp_path / "kl.json"
    kl.write_text(json.dumps({"kind": "replayquant.kl"}))
    code, text = _invoke(["table", LM_EVAL_FILES[0], kl])
    assert code == 2 and "one table takes one kind of file" in text and "lm-eval results" in text
    code, text = _invoke(["table", *LM_EVAL_FILES, "--format", "llama"])
    assert code == 2 and "lm-eval results render as md or csv" in text


# ---------------------------------------------------------------- lm-eval, accelerate, flags

def test_lm_eval_internals_we_rely_on_are_where_we_expect(monkeypatch):
    import lm_eval.models.huggingface as hf

    from replayquant.gpqa import lm_eval_model as M
    assert M.lm_eval_internals_problems() == []
    monkeypatch.delattr(hf.HFLM, "_model_call")
    monkeypatch.setattr(hf.HFLM, "_loglikelihood_tokens", lambda self, requests, disable_tqdm=False: [])
    problems = M.lm_eval_internals_problems()
    assert "lm_eval.models.huggingface:HFLM._model_call is missing" in problems
    assert ("lm_eval.models.huggingface:HFLM._loglikelihood_tokens has no argument(s) override_bs"
            in problems)
    assert "lm_eval.models.huggingface:HFLM._loglikelihood_tokens no longer calls self._model_call" in problems
    with pytest.raises(ValueError, match=r"tested: lm-eval 0\.4\.13.*_model_call is missing.*pip install"):
        M.check_lm_eval_internals()


def test_no_stray_git_fatal_line_outside_a_checkout(tmp_path, monkeypatch, capfd):
    import replayquant.gpqa.lm_eval_model  # noqa: F401  (quiets lm-eval's git call)
    from lm_eval import evaluator
    from replayquant.provenance import provenance
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    capfd.readouterr()
    assert evaluator.get_git_commit_hash() is None
    provenance()
    err = capfd.readouterr().err
    assert "fatal" not in err and "not a git repository" not in err, err


def test_single_process_warning_for_accelerates_cpu_launcher(monkeypatch):
    from replayquant.launch import single_process_warning
    cpu = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    w = single_process_warning("kl", env=cpu)
    assert "runs as one process" in w and "accelerate launch --multi_gpu --num_processes N -m replayquant kl" in w
    w = single_process_warning("kl", env={"ACCELERATE_NUM_PROCESSES": "4"})
    assert w.startswith("warning: 4 processes were asked for") and "--num_processes 4" in w
    assert single_process_warning(env={**cpu, "WORLD_SIZE": "2"}) is None        # --multi_gpu
    assert single_process_warning(env={"ACCELERATE_USE_CPU": "True"}) is None      # --num_processes 1
    assert single_process_warning(env={}) is None
    # through the command line, before anything is loaded
    for k, v in cpu.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("ACCELERATE_NUM_PROCESSES", raising=False)
    code, text = _invoke(["kl", "--model", "/nonexistent/model", "--pair", "s32_rs", "--docs", "0"])
    assert code == 2 and "runs as one process" in text


def test_version_and_lm_eval_spellings(monkeypatch):
    import replayquant
    code, text = _invoke(["--version"])
    assert code == 0 and text.strip() == f"replayquant {replayquant.__version__}"
    seen = {}

    def fake_run(model, pairs, settings, **kw):
        seen.update(dataclasses.asdict(settings), **kw, model=model, pairs=pairs)
    import replayquant.gpqa as G
    monkeypatch.setattr(G, "run_gpqa", fake_run)
    code, text = _invoke(["gpqa", "--model", "m", "--pair", "s32_rs", "--tasks",
                          "gpqa_diamond_zeroshot,gpqa_diamond_n_shot", "--batch_size", "4",
                          "--output_path", "o", "--num_fewshot", "2", "--log_samples",
                          "--apply_chat_template", "--model_args", "max_length=64"])
    assert code == 0, text
    assert seen["tasks"] == ["gpqa_diamond_zeroshot", "gpqa_diamond_n_shot"] and seen["batch_size"] == 4
    assert seen["out"] == "o" and seen["num_fewshot"] == 2 and seen["log_samples"] and seen["apply_chat_template"]
    assert seen["model_args"] == {"max_length": 64}


def test_pyproject_ranges_and_markers():
    import tomllib
    proj = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    import replayquant
    assert proj["version"] == replayquant.__version__
    deps = {d.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip(): d
            for d in proj["dependencies"] + [d for ds in proj["optional-dependencies"].values() for d in ds]}
    assert "<" in deps["lm-eval"] and ">=" in deps["lm-eval"]
    assert "<" in deps["transformers"] and ">=" in deps["transformers"]
    assert 'sys_platform == "linux"' in deps["triton"]
    assert deps["torch"].startswith("torch>=") and "==" not in deps["torch"]
    from packaging.requirements import Requirement
    from packaging.version import Version
    import lm_eval
    import transformers
    for name, have in (("lm-eval", lm_eval.__version__), ("transformers", transformers.__version__)):
        assert Version(have) in Requirement(deps[name]).specifier, (name, have)   # the venv is in range


# ---------------------------------------------------------------- plots

def test_plot_names_the_model_keeps_curves_apart_and_shows_zero(kl_run):
    import matplotlib.pyplot as plt
    import numpy as np

    from replayquant.kl.plot import kl_figure
    res = kl_run["res"]
    run_dir = kl_run["out"].with_suffix(".kl")
    arrays = {i: np.load(run_dir / f"doc{i:05d}.npy") for i in range(2)}
    names = [p["name"] for p in res["config"]["pairs"]]
    fig = kl_figure(res, arrays, names)
    ax = fig.axes[0]
    title = ax.get_title()
    assert title.startswith("tiny-qwen (") and "/" not in title.split(":")[0]
    assert str(Path(res["config"]["model"]["id"]).parent) not in title
    # every pair its own colour, marker and line style
    curves = [ln for ln in ax.get_lines() if ln.get_label() and not ln.get_label().startswith("_")]
    assert len(curves) == 3
    styles = [(ln.get_color(), ln.get_marker(), ln.get_linestyle()) for ln in curves]
    for k in range(3):
        assert len({s[k] for s in styles}) == 3, styles
    # the legend lies outside the axes: it covers no curve
    fig.canvas.draw()
    leg = ax.get_legend().get_window_extent()
    box = ax.get_window_extent()
    assert leg.x0 >= box.x1
    # s32_rs (KL exactly 0 everywhere) is a gap on the log axis, every bin counted as ~0
    assert ax.get_yscale() == "log"
    n = len(curves[0].get_xdata())
    assert np.isnan(curves[0].get_ydata()).all() and f"{n}/{n} bins ~0" in curves[0].get_label()
    assert any("~0" in t.get_text() for t in fig.texts)
    plt.close(fig)
    assert kl_run["out"].with_suffix(".png").stat().st_size > 10_000
