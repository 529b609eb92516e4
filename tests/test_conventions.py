"""The conventions users bring from datasets, lm-eval, llama.cpp and accelerate, and bad inputs
of the same kinds: each one clear error naming the file (and line or row), no silent fallback."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

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
    from replayquant.kl.runner import Variant
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
    from replayquant.kl import runner as R
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
