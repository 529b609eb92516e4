"""KL harness: statistics against a direct computation, and document loading (no model)."""

import json
import math

import numpy as np
import pytest
import torch

from replayquant.kl import stats as S
from replayquant.kl.data import load_documents, resolve_source


def _direct_kl(ref, test):
    p = torch.softmax(ref.double(), -1)
    return (p * (torch.log_softmax(ref.double(), -1) - torch.log_softmax(test.double(), -1))).sum(-1)


@pytest.mark.parametrize("n,V", [(7, 5), (33, 1001), (130, 64)])
def test_token_metrics_against_float64(n, V):
    g = torch.Generator().manual_seed(n * V)
    ref = torch.randn(n, V, generator=g) * 3
    test = ref + 0.3 * torch.randn(n, V, generator=g)
    tgt = torch.randint(0, V, (n,), generator=g)
    m = S.token_metrics(ref, test, tgt)
    assert torch.allclose(m["kl"].double(), _direct_kl(ref, test), rtol=1e-4, atol=1e-6)
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
    ar = torch.arange(n)
    assert torch.allclose(m["nll_ref"].double(), -lp[ar, tgt], atol=1e-5)
    assert torch.allclose(m["nll_test"].double(), -lq[ar, tgt], atol=1e-5)
    assert torch.allclose(m["dp"].double(), lq[ar, tgt].exp() - lp[ar, tgt].exp(), atol=1e-6)
    assert torch.equal(m["same_top"], ref.argmax(-1) == test.argmax(-1))
    # bf16 logits are promoted to float32
    m16 = S.token_metrics(ref.bfloat16(), test.bfloat16(), tgt)
    assert m16["kl"].dtype == torch.float32


def test_identical_logits_give_exactly_zero():
    ref = torch.randn(50, 300) * 4
    m = S.token_metrics(ref, ref.clone(), torch.zeros(50, dtype=torch.long))
    assert torch.count_nonzero(m["kl"]) == 0 and m["same_top"].all() and torch.count_nonzero(m["dp"]) == 0


def test_bucket_edges():
    assert S.bucket_edges(131071) == [0, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131071]
    assert S.bucket_edges(100, 16) == [0, 16, 32, 64, 100]
    assert S.bucket_edges(10, 16) == [0, 10]
    assert S.bucket_label(0, 1024) == "<1K" and S.bucket_label(65536, 131071) == "64K-128K"
    assert S.bucket_label(0, 10, 16) == "<16" and S.bucket_label(32, 64, 16) == "32-64"


def _fake_doc(g, T):
    kl = torch.rand(T, generator=g) ** 3 * 0.5
    nr = torch.rand(T, generator=g) * 5
    nt = nr + 0.2 * torch.randn(T, generator=g)
    return {"kl": kl, "nll_ref": nr, "nll_test": nt, "dp": (-nt).exp() - (-nr).exp(),
            "same_top": torch.rand(T, generator=g) > 0.1}


def test_summarize_against_direct_computation():
    g = torch.Generator().manual_seed(5)
    docs = [_fake_doc(g, T) for T in (300, 300, 300)]
    recs = [{"id": f"d{i}", "index": i, **S.document_sums(d, bucket_base=32)} for i, d in enumerate(docs)]
    kl16 = np.concatenate([d["kl"].numpy().astype(np.float16) for d in docs])
    dp32 = np.concatenate([d["dp"].numpy() for d in docs])
    out = S.summarize(recs, kl16, bucket_base=32, dp_values=dp32)

    cat = {k: torch.cat([d[k] for d in docs]).double().numpy() for k in docs[0]}
    n = cat["kl"].size

    def sem(x):
        return np.std(x, ddof=1) / math.sqrt(x.size)

    assert out["n_tokens"] == n == 900 and out["n_documents"] == 3
    assert out["kl_mean"] == pytest.approx(cat["kl"].mean(), rel=1e-12)
    assert out["kl_mean_unc"] == pytest.approx(sem(cat["kl"]), rel=1e-6)
    assert out["kl_max"] == pytest.approx(cat["kl"].max(), rel=1e-6)
    assert out["kl_min"] == pytest.approx(cat["kl"].min(), rel=1e-6)
    ref16 = np.sort(kl16.astype(np.float64))
    assert out["kl_median"] == pytest.approx(np.median(ref16), rel=1e-12)
    assert set(out["kl_percentiles"]) == {"99.9", "99", "95", "90", "10", "5", "1", "0.1"}
    for q in (99.9, 99, 95, 90, 10, 5, 1, 0.1):
        assert out["kl_percentiles"][f"{q:g}"] == pytest.approx(np.percentile(ref16, q), rel=1e-12)
        # float16 storage: within 2^-11 relative of the exact float32 percentile
        assert out["kl_percentiles"][f"{q:g}"] == pytest.approx(np.percentile(cat["kl"], q), rel=2e-3, abs=1e-7)
    p = cat["same_top"].mean()
    assert out["same_top"] == pytest.approx(p) and out["same_top_unc"] == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)))
    assert out["ppl_ref"] == pytest.approx(math.exp(cat["nll_ref"].mean()))
    assert out["ppl_test"] == pytest.approx(math.exp(cat["nll_test"].mean()))
    assert out["ppl_ref_unc"] == pytest.approx(out["ppl_ref"] * sem(cat["nll_ref"]), rel=1e-6)
    d = cat["nll_test"] - cat["nll_ref"]
    assert out["ln_ppl_ratio"] == pytest.approx(d.mean(), rel=1e-9)
    assert out["ln_ppl_ratio_unc"] == pytest.approx(sem(d), rel=1e-6)
    # llama.cpp's form of the same uncertainty: sqrt(u_t^2 + u_r^2 - 2 cov)
    cov = np.cov(cat["nll_test"], cat["nll_ref"])[0, 1] / n
    alt = math.sqrt(sem(cat["nll_test"]) ** 2 + sem(cat["nll_ref"]) ** 2 - 2 * cov)
    assert out["ln_ppl_ratio_unc"] == pytest.approx(alt, rel=1e-6)
    assert out["ln_ppl_cov"] == pytest.approx(cov, rel=1e-6)
    # llama.cpp's Cor(ln(PPL(Q)), ln(PPL(base))) = cov / (u_t u_r): the Pearson correlation
    pearson = np.corrcoef(cat["nll_test"], cat["nll_ref"])[0, 1]
    assert out["ln_ppl_cor"] == pytest.approx(pearson, rel=1e-9)
    assert out["ln_ppl_cor"] == pytest.approx(cov / (sem(cat["nll_test"]) * sem(cat["nll_ref"])), rel=1e-6)
    assert out["ppl_ratio"] == pytest.approx(out["ppl_test"] / out["ppl_ref"], rel=1e-9)
    assert out["ppl_ratio_unc"] == pytest.approx(out["ppl_ratio"] * out["ln_ppl_ratio_unc"], rel=1e-9)
    # PPL(Q) - PPL(base) with llama.cpp's uncertainty sqrt(u_Q^2 + u_b^2 - 2 PPL(Q) PPL(b) cov)
    assert out["ppl_diff"] == pytest.approx(out["ppl_test"] - out["ppl_ref"], rel=1e-12)
    u_t, u_r = out["ppl_test"] * sem(cat["nll_test"]), out["ppl_ref"] * sem(cat["nll_ref"])
    assert out["ppl_diff_unc"] == pytest.approx(
        math.sqrt(u_t ** 2 + u_r ** 2 - 2 * out["ppl_test"] * out["ppl_ref"] * cov), rel=1e-6)
    assert out["dp_mean"] == pytest.approx(cat["dp"].mean(), rel=1e-9, abs=1e-12)
    assert out["dp_mean_unc"] == pytest.approx(sem(cat["dp"]), rel=1e-6)
    rms = math.sqrt((cat["dp"] ** 2).mean())
    assert out["dp_rms"] == pytest.approx(rms, rel=1e-9)
    assert out["dp_rms_unc"] == pytest.approx(0.5 / rms * sem(cat["dp"] ** 2), rel=1e-6)
    assert out["dp_max"] == pytest.approx(cat["dp"].max(), rel=1e-6)
    assert out["dp_min"] == pytest.approx(cat["dp"].min(), rel=1e-6)
    assert out["dp_median"] == pytest.approx(np.median(cat["dp"]), rel=1e-6, abs=1e-9)
    assert set(out["dp_percentiles"]) == {"99.9", "99", "95", "90", "75", "25", "10", "5", "1", "0.1"}
    for q in (99.9, 99, 95, 90, 75, 25, 10, 5, 1, 0.1):
        assert out["dp_percentiles"][f"{q:g}"] == pytest.approx(np.percentile(cat["dp"], q), rel=1e-6, abs=1e-9)
    doc_means = [d["kl"].double().mean().item() for d in docs]
    assert out["kl_mean_unc_docs"] == pytest.approx(np.std(doc_means, ddof=1) / math.sqrt(3), rel=1e-9)
    # position buckets: [0,32) [32,64) [64,128) [128,256) [256,300)
    edges = [0, 32, 64, 128, 256, 300]
    assert [(b["lo"], b["hi"]) for b in out["by_position"]] == list(zip(edges[:-1], edges[1:]))
    for b in out["by_position"]:
        sl = np.concatenate([d["kl"].double().numpy()[b["lo"]:b["hi"]] for d in docs])
        assert b["n_tokens"] == sl.size
        assert b["kl_mean"] == pytest.approx(sl.mean(), rel=1e-12)
        assert b["kl_mean_unc"] == pytest.approx(sem(sl), rel=1e-6)
    assert [r["id"] for r in out["per_document"]] == ["d0", "d1", "d2"]
    assert out["per_document"][1]["kl_mean"] == pytest.approx(doc_means[1], rel=1e-12)
    json.dumps(out)   # JSON-able


def test_summary_is_independent_of_document_split():
    g = torch.Generator().manual_seed(9)
    docs = [_fake_doc(g, 100) for _ in range(4)]
    recs = [{"id": str(i), "index": i, **S.document_sums(d)} for i, d in enumerate(docs)]
    a = S.summarize(recs, None)
    b = S.summarize(recs[2:] + recs[:2], None)
    for k in ("kl_mean", "kl_mean_unc", "same_top", "ln_ppl_ratio", "dp_rms"):
        assert a[k] == pytest.approx(b[k], rel=1e-12)


# ---------------------------------------------------------------- documents

class _CharTok:
    """One token per character; enough to test document selection."""
    eos_token_id = 0

    def __call__(self, text, **kw):
        return {"input_ids": [1 + (ord(c) % 50) for c in text]}


def test_folder_txt_jsonl(tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "b.txt").write_text("x" * 30)
    (d / "a.txt").write_text("y" * 12)       # too short for context 20
    (d / "c.txt").write_text("z" * 25)
    (d / "ignored.md").write_text("w" * 100)
    ds = load_documents(str(d), _CharTok(), context=20, n_docs=5)
    assert [x.id for x in ds.documents] == ["b.txt", "c.txt"]
    assert ds.skipped_short == 1 and ds.scanned == 3 and ds.kind == "folder"
    assert all(x.tokens.numel() == 20 for x in ds.documents) and ds.notes
    ds1 = load_documents(str(d), _CharTok(), context=20, n_docs=1)
    assert [x.id for x in ds1.documents] == ["b.txt"] and not ds1.notes

    f = tmp_path / "one.txt"
    f.write_text("q" * 40)
    ds = load_documents(str(f), _CharTok(), context=40, n_docs=3)
    assert [x.id for x in ds.documents] == ["one.txt"]

    j = tmp_path / "docs.jsonl"
    j.write_text("\n".join(json.dumps(o) for o in [{"text": "a" * 50, "id": "first"}, {"text": "b" * 5},
                                                    {"text": "c" * 60}]) + "\n")
    ds = load_documents(str(j), _CharTok(), context=30, n_docs=10)
    assert [x.id for x in ds.documents] == ["first", "line3"] and ds.skipped_short == 1


def test_pack(tmp_path):
    j = tmp_path / "docs.jsonl"
    j.write_text("\n".join(json.dumps({"text": t}) for t in ["a" * 10, "b" * 10, "c" * 10, "d" * 3]))
    ds = load_documents(str(j), _CharTok(), context=8, n_docs=10, pack=True)
    # stream: 10 a, eos, 10 b, eos, 10 c, eos, 3 d = 36 tokens -> 4 pieces of 8
    assert len(ds.documents) == 4 and ds.skipped_short == 0
    stream = torch.cat([d.tokens for d in ds.documents])
    assert stream[10].item() == 0 and stream[21].item() == 0
    assert [d.id for d in ds.documents] == ["line1", "line1+line2", "line2+line3", "line3"]


def test_bad_datasets(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="does not exist"):
        load_documents(str(tmp_path / "nope"), _CharTok(), 10, 1)
    with pytest.raises(ValueError, match="does not exist"):
        load_documents("missing_file.jsonl", _CharTok(), 10, 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .txt files"):
        load_documents(str(tmp_path / "empty"), _CharTok(), 10, 1)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no documents"):
        load_documents(str(tmp_path / "e.jsonl"), _CharTok(), 10, 1)
    (tmp_path / "short.txt").write_text("abc")
    with pytest.raises(ValueError, match="shorter than --context.*--pack"):
        load_documents(str(tmp_path / "short.txt"), _CharTok(), 10, 1)
    (tmp_path / "f.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="--text-column"):
        load_documents(str(tmp_path / "f.jsonl"), _CharTok(), 10, 1)
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"no 'text' column \(columns: \['a', 'b'\]\)"):
        load_documents(str(tmp_path / "x.csv"), _CharTok(), 10, 1)
    (tmp_path / "x.xlsx").write_text("a,b")
    with pytest.raises(ValueError, match="suffix \\(.xlsx\\) no reader takes"):
        load_documents(str(tmp_path / "x.xlsx"), _CharTok(), 10, 1)
    assert resolve_source("pg19") == ("hub", "emozilla/pg19")
    # a dataset that cannot be reached (offline here): one clear error naming it and what to do
    import datasets
    import huggingface_hub
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="'no-such-org/no-such-dataset' is a Hugging Face hub dataset, "
                       "and the hub cannot be reached .*HF_HUB_OFFLINE.*--dataset heldout"):
        load_documents("no-such-org/no-such-dataset", _CharTok(), 10, 1)
