"""KL harness end to end on tiny random models (Qwen3.5 GDN + attention, Mamba-2) saved to disk
with a small trained tokenizer: CLI, outputs and provenance, resume, segmentation, bad input,
the 2-process accelerate path, and (where the model-integration API exists) real pairs."""

import io
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import replayquant
from replayquant.cli import app
from replayquant.kl import run as R
from replayquant.kl import KLSettings, RunParts, run_kl
from replayquant.kl.files import read_progress
from replayquant.kl.lockstep import Variant

ROOT = Path(__file__).resolve().parents[2]
try:
    from replayquant.models import patch as _patch, unpatch as _unpatch  # noqa: F401
    HAVE_PATCH = True
except ImportError:
    HAVE_PATCH = False

# ------------------------------------------------------------------ fixtures


def _texts(rng, lengths):
    words = ["".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(1, 7))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(n)) for n in lengths]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import (Mamba2Config, Mamba2ForCausalLM, NemotronHConfig, NemotronHForCausalLM,
                              PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig,
                              Qwen3NextConfig, Qwen3NextForCausalLM)

    root = tmp_path_factory.mktemp("kl")
    rng = random.Random(1234)
    texts = root / "texts"
    texts.mkdir()
    # doc_1 is too short for the contexts used here: skipped and counted
    for i, t in enumerate(_texts(rng, [300, 20, 260, 280, 320])):
        (texts / f"doc_{i}.txt").write_text(t)
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(_texts(random.Random(7), [3000]),
                           trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")

    torch.manual_seed(0)
    qcfg = Qwen3_5TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        max_position_embeddings=160, initializer_range=0.2)
    mcfg = Mamba2Config(vocab_size=300, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2,
                        head_dim=16, num_heads=8, n_groups=1, chunk_size=16, initializer_range=0.2)
    ncfg = NemotronHConfig(vocab_size=300, hidden_size=64, num_hidden_layers=4, mamba_num_heads=8,
                           mamba_head_dim=16, ssm_state_size=16, n_groups=1, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, intermediate_size=96, chunk_size=16,
                           initializer_range=0.2)
    xcfg = Qwen3NextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=32,
                           layer_types=["linear_attention", "full_attention"], initializer_range=0.2)
    dirs = {}
    for name, cls, cfg in (("qwen", Qwen3_5ForCausalLM, qcfg), ("mamba2", Mamba2ForCausalLM, mcfg),
                           ("nemotron_h", NemotronHForCausalLM, ncfg),
                           ("qwen3_next", Qwen3NextForCausalLM, xcfg)):
        m = cls(cfg)
        d = root / name
        m.save_pretrained(d)
        tok.save_pretrained(d)
        dirs[name] = d
    return {"root": root, "texts": texts, "models": dirs}


def _load(work, family):
    from replayquant.kl.command import load_model_and_tokenizer
    m, tok, _ = load_model_and_tokenizer(str(work["models"][family]), "float32")
    return m, tok


_EPS = {"s32_rs": 0.0, "f4_sr_rs": 0.08, "tp4_hi32": 0.01}


def fake_variant(model, pair, prefill, seed):
    """Stand-in for a patched pair: scales the first recurrent mixer's output by (1 + eps).
    Exercises the harness (lockstep, caches, statistics) without the model-integration code."""
    name = pair if isinstance(pair, str) else pair.name
    eps = _EPS.get(name, 0.03)
    mixer = next(mod for mod in model.modules()
                 if type(mod).__name__.endswith(("GatedDeltaNet", "Mamba2Mixer")))
    handle = {}

    def enter():
        handle["h"] = mixer.register_forward_hook(lambda mod, args, out: out * (1 + eps))

    def exit():
        handle.pop("h").remove()
    # the pair's own record: results files read back are checked against it (policy.check_recorded)
    rec = pair.to_dict() if hasattr(pair, "to_dict") else {"name": name}
    return Variant(name, rec, enter, exit)


@pytest.fixture
def fake_patch(monkeypatch):
    monkeypatch.setattr(R, "patch_variant", fake_variant)


def _invoke(args):
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, (res.stdout or "") + (getattr(res, "stderr", "") or "")


# ------------------------------------------------------------------ CLI end to end, resume


def test_cli_end_to_end_outputs_resume_and_table(work, fake_patch, monkeypatch, tmp_path):
    out = tmp_path / "r.json"
    base = ["kl", "--model", work["models"]["qwen"], "--pair", "s32_rs", "--pair", "f4_sr_rs",
            "--dataset", work["texts"], "--context", 96, "--segment", 40, "--dtype", "float32",
            "--out", out, "--no-progress", "--reference", "hf"]
    code, text = _invoke(base + ["--docs", 2])
    assert code == 0, text
    assert "f4_sr_rs" in text and "s32_rs" in text and "median" in text
    res = json.loads(out.read_text())
    assert res["kind"] == "replayquant.kl" and res["complete"] and res["documents_done"] == 2
    assert Path(out.with_suffix(".png")).stat().st_size > 1000
    arr = np.load(out.with_suffix(".kl") / "doc00000.npy")
    assert arr.dtype == np.float32 and arr.shape == (2, 95)
    assert np.all(arr[0] == 0)                       # s32_rs stand-in: no change at all
    st = res["results"]["f4_sr_rs"]
    assert st["kl_mean"] > 0 and st["n_tokens"] == 2 * 95 and st["n_documents"] == 2
    assert {"kl_percentiles", "kl_median", "same_top", "ppl_ref", "ppl_test", "ln_ppl_ratio",
            "dp_mean", "dp_rms", "by_position", "per_document"} <= set(st)
    assert res["results"]["s32_rs"]["kl_mean"] == 0 and res["results"]["s32_rs"]["same_top"] == 1
    prov = res["provenance"]
    for k in ("git_commit", "date", "device", "versions", "prefill", "context", "seed", "wall_time_s",
              "peak_rss_bytes", "document_ids", "dataset", "buffer_len", "pairs", "model"):
        assert k in prov, k
    assert {"torch", "triton", "transformers"} <= set(prov["versions"])
    assert prov["model"]["local_hash"].startswith("sha256:")
    assert prov["buffer_len"] == {"s32_rs": 16, "f4_sr_rs": 16}
    assert prov["pairs"][1]["anchor"] == {"format": "nvfp4", "rounding": "stochastic"}
    assert prov["document_ids"] == ["doc_0.txt", "doc_2.txt"]
    assert prov["dataset"]["skipped_short"] == 1
    first = st["kl_mean"]

    # re-running the same command computes nothing; a larger --docs computes only the new one
    calls = []
    orig = R.score_document
    monkeypatch.setattr(R, "score_document", lambda *a, **k: calls.append(a[1].index) or orig(*a, **k))
    code, text = _invoke(base + ["--docs", 2])
    assert code == 0, text
    assert calls == []
    code, text = _invoke(base + ["--docs", 3])
    assert code == 0, text
    assert calls == [2]
    res3 = json.loads(out.read_text())
    assert res3["documents_done"] == 3 and res3["results"]["f4_sr_rs"]["per_document"][0]["kl_mean"] == \
        res["results"]["f4_sr_rs"]["per_document"][0]["kl_mean"]
    assert res3["results"]["f4_sr_rs"]["kl_mean"] != first
    # back to --docs 2: nothing computed, the results cover exactly the 2 planned documents
    calls.clear()
    code, text = _invoke(base + ["--docs", 2])
    assert code == 0 and calls == []
    res2 = json.loads(out.read_text())
    assert res2["complete"] and res2["documents_done"] == 2
    assert res2["results"]["f4_sr_rs"]["kl_mean"] == first

    # a different configuration into the same file is refused, saying how to start fresh
    code, text = _invoke([a if a != 96 else 64 for a in base] + ["--docs", 2])
    assert code == 2 and "different configuration" in text and "context" in text and "delete" in text

    # results table from the file
    code, md = _invoke(["table", out])
    assert code == 0 and md.startswith("| pair") and "f4_sr_rs" in md and "s32_rs" in md
    code, csv_text = _invoke(["table", out, "--format", "csv", "--by", "model"])
    assert code == 0 and csv_text.splitlines()[0].startswith("model,pair")
    code, text = _invoke(["table", work["texts"] / "doc_0.txt"])
    assert code == 2 and "not a JSON results file" in text


def test_interrupted_run_loses_at_most_the_document_in_flight(work, tmp_path):
    model, tok = _load(work, "mamba2")
    settings = KLSettings(dataset=str(work["texts"]), context=80, docs=3, segment=32,
                          progress=False, reference="hf")
    parts = RunParts(make_variant=fake_variant, plot=False)
    state = {"n": 0}

    def flaky(model, pair, prefill, seed):
        v = fake_variant(model, pair, prefill, seed)
        inner = v.enter

        def enter():
            state["n"] += 1
            if state["n"] == 5:          # 3 segments per document: the 5th forward is in document 1
                raise KeyboardInterrupt
            inner()
        return Variant(v.name, v.record, enter, v.exit)

    out = tmp_path / "i.json"
    with pytest.raises(KeyboardInterrupt, match="1 of 3 documents are finished"):
        run_kl(model, tok, ["f4_sr_rs"], settings, out=out,
               parts=RunParts(make_variant=flaky, plot=False))
    assert json.loads(out.read_text())["documents_done"] == 1     # summary written after each document
    # a process killed mid-write leaves a torn log line (and maybe the in-flight npy): both ignored
    with open(tmp_path / "i.kl" / "progress.rank0.jsonl", "a") as fh:
        fh.write('{"type": "document", "index": 1, "id": "doc_2.t')
    np.save(tmp_path / "i.kl" / "doc00001.npy", np.ones((1, 79), np.float32))
    done = []
    orig = R.score_document

    def counting(*a, **k):
        done.append(a[1].index)
        return orig(*a, **k)
    R.score_document, saved = counting, R.score_document
    try:
        resumed = run_kl(model, tok, ["f4_sr_rs"], settings, out=out, parts=parts)
    finally:
        R.score_document = saved
    assert done == [1, 2]
    fresh = run_kl(model, tok, ["f4_sr_rs"], settings, out=tmp_path / "f.json", parts=parts)
    a, b = resumed["results"]["f4_sr_rs"], fresh["results"]["f4_sr_rs"]
    assert a["kl_mean"] == b["kl_mean"] and a["kl_percentiles"] == b["kl_percentiles"]
    assert [d["id"] for d in a["per_document"]] == [d["id"] for d in b["per_document"]]


FAMILIES = ["qwen", "mamba2", "nemotron_h", "qwen3_next"]


@pytest.mark.parametrize("family", FAMILIES)
def test_segmented_equals_unsegmented(work, family, tmp_path):
    model, tok = _load(work, family)
    kw = dict(dataset=str(work["texts"]), context=120, docs=2, progress=False, reference="hf")
    whole = run_kl(model, tok, ["f4_sr_rs"], KLSettings(segment=120, **kw), out=tmp_path / "a.json",
                   parts=RunParts(make_variant=fake_variant, plot=False, bucket_base=16))
    seg = run_kl(model, tok, ["f4_sr_rs"], KLSettings(segment=17, **kw), out=tmp_path / "b.json",
                 parts=RunParts(make_variant=fake_variant, plot=False, bucket_base=16, lm_chunk=23))
    a, b = whole["results"]["f4_sr_rs"], seg["results"]["f4_sr_rs"]
    assert a["kl_mean"] > 1e-4
    assert b["kl_mean"] == pytest.approx(a["kl_mean"], rel=1e-3)
    assert b["same_top"] == a["same_top"]
    assert b["ln_ppl_ratio"] == pytest.approx(a["ln_ppl_ratio"], rel=1e-3, abs=1e-6)
    for x, y in zip(a["by_position"], b["by_position"]):
        assert x["bucket"] == y["bucket"] and y["kl_mean"] == pytest.approx(x["kl_mean"], rel=1e-3, abs=1e-7)
    na = np.load(tmp_path / "a.kl" / "doc00001.npy").astype(np.float64)
    nb = np.load(tmp_path / "b.kl" / "doc00001.npy").astype(np.float64)
    assert np.allclose(na, nb, rtol=5e-3, atol=1e-6)


def test_identical_variant_gives_exactly_zero_and_progress_bar(work, tmp_path):
    from rich.console import Console
    model, tok = _load(work, "qwen")
    buf = io.StringIO()

    def same(model, pair, prefill, seed):
        return Variant(pair.name, {"name": pair.name})
    from replayquant.pairs import PrecisionPair
    settings = KLSettings(dataset=str(work["texts"]), context=64, docs=1, segment=30,
                          reference="hf")
    res = run_kl(model, tok, [PrecisionPair.load("s32_rs")], settings, out=tmp_path / "z.json",
                 parts=RunParts(make_variant=same, plot=False,
                                console=Console(file=buf, force_terminal=True, width=140)))
    st = res["results"]["s32_rs"]
    assert st["kl_mean"] == 0 and st["kl_max"] == 0 and st["same_top"] == 1 and st["ln_ppl_ratio"] == 0
    assert "tok/s" in buf.getvalue() and "ETA" in buf.getvalue()


# ------------------------------------------------------------------ bad input


def test_bad_inputs_each_one_clear_error(work, fake_patch, tmp_path):
    model_dir, texts = work["models"]["qwen"], work["texts"]
    def ok(dataset=texts, context=64):
        return ["--dataset", dataset, "--context", context, "--docs", 1, "--dtype", "float32", "--no-progress"]

    def run(*args):
        return _invoke(["kl", *args, "--out", tmp_path / "x.json"])

    bad_pair = tmp_path / "bad.yaml"
    bad_pair.write_text("name: bad\nanchor: {format: fp5}\n")
    not_pair = tmp_path / "np.yaml"
    not_pair.write_text("- just\n- a list\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    m, f4 = ["--model", model_dir], ["--pair", "f4_sr_rs"]
    cases = [
        ([*m, *f4, *ok(context=512)], "longer than the model supports"),
        ([*m, "--pair", "no_such_pair", *ok()], "unknown precision pair"),
        ([*m, "--pair", bad_pair, *ok()], "unknown format"),
        ([*m, "--pair", not_pair, *ok()], "not a precision pair"),
        (["--model", tmp_path / "no_model_here", *f4, *ok()], "unknown or unreachable model"),
        ([*m, *f4, *ok(dataset=tmp_path / "missing_dir")], "does not exist"),
        ([*m, *f4, *ok(dataset=empty)], "empty dataset"),
        ([*m, *f4, *ok(), "--prefill", "fast"], "--prefill"),
        ([*m, *f4, *ok(), "--dtype", "int3"], "--dtype"),
        ([*m, *f4, *ok(), "--reference", "fp64"], "--reference"),
    ]
    for args, msg in cases:
        code, text = run(*args)
        assert code == 2, (args, text)
        assert msg in text, (msg, text)
        assert "Traceback" not in text


# ------------------------------------------------------------------ data-parallel through accelerate


@pytest.mark.slow
def test_two_process_accelerate_path_merges_into_one_file(work, tmp_path):
    script = tmp_path / "dp.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import test_kl_run as T
        from replayquant.kl import run as R
        from replayquant.kl import KLSettings
        from replayquant.kl.command import kl_command
        R.patch_variant = T.fake_variant
        settings = KLSettings(dataset={str(work['texts'])!r}, context=72, docs=3, segment=32,
                              dtype="float32", progress=False, reference="hf")
        kl_command({str(work['models']['mamba2'])!r}, ["f4_sr_rs", "s32_rs"], settings,
                   out=sys.argv[1])
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    # accelerate's torch.distributed launcher (--multi_gpu); on a machine without CUDA the processes
    # form a gloo group on CPU
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(script), str(tmp_path / "dp.json")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    dp = json.loads((tmp_path / "dp.json").read_text())
    assert dp["complete"] and dp["documents_done"] == 3
    assert dp["provenance"]["num_processes"] == 2
    _, recs = read_progress(tmp_path / "dp.kl")
    assert sorted(r["rank"] for r in recs) == [0, 0, 1]      # documents 0, 2 on rank 0; 1 on rank 1
    model, tok = _load(work, "mamba2")
    settings = KLSettings(dataset=str(work["texts"]), context=72, docs=3, segment=32,
                          progress=False, reference="hf")
    single = run_kl(model, tok, ["f4_sr_rs", "s32_rs"], settings, out=tmp_path / "one.json",
                    parts=RunParts(make_variant=fake_variant, plot=False))
    for name in ("f4_sr_rs", "s32_rs"):
        a, b = dp["results"][name], single["results"][name]
        assert [d["id"] for d in a["per_document"]] == [d["id"] for d in b["per_document"]]
        assert a["kl_mean"] == pytest.approx(b["kl_mean"], rel=1e-5, abs=1e-12)


# ------------------------------------------------------------------ real pairs (model integration)


@pytest.mark.skipif(not HAVE_PATCH, reason="replayquant.patch (model integration) not available")
@pytest.mark.parametrize("family", FAMILIES)
def test_real_pairs_s32_l1_zero_and_f4_positive(work, family, tmp_path):
    """Against the unpatched model (reference hf) and the exact FP32 reference: s32_rs with L = 1
    agrees to float32 rounding (the chunked and sequential FP32 recurrences differ only in
    summation order), shared NVFP4 + SR really changes the logits."""
    from replayquant import PrecisionPair
    model, tok = _load(work, family)
    s32_l1 = PrecisionPair.load("s32_rs").with_buffer_len(1)
    object.__setattr__(s32_l1, "name", "s32_rs_L1")
    for ref in ("hf", "exact"):
        settings = KLSettings(dataset=str(work["texts"]), context=64, docs=1, segment=24,
                              progress=False, reference=ref)
        res = run_kl(model, tok, [s32_l1, "f4_sr_rs"], settings, out=tmp_path / f"real_{ref}.json",
                     parts=RunParts(plot=False))
        s32, f4 = res["results"]["s32_rs_L1"], res["results"]["f4_sr_rs"]
        assert abs(s32["kl_mean"]) < 1e-7 and s32["kl_max"] < 2e-6 and s32["same_top"] == 1, ref
        assert f4["kl_mean"] > 1e-5, ref


@pytest.mark.skipif(not HAVE_PATCH, reason="replayquant.patch (model integration) not available")
def test_real_cli_s32_exact_gives_exactly_zero(work, tmp_path):
    """The CLI with the real patch and the default (exact FP32) reference: s32_rs with
    --prefill exact is the reference computation itself, KL exactly 0; tp4_hi32 only changes the
    read copy, which teacher forcing with exact prefill never reads: also exactly 0."""
    out = tmp_path / "c.json"
    code, text = _invoke(["kl", "--model", work["models"]["qwen"], "--pair", "s32_rs", "--pair", "tp4_hi32",
                          "--pair", "f4_sr_rs", "--dataset", work["texts"], "--context", 64, "--docs", 2,
                          "--segment", 24, "--prefill", "exact", "--dtype", "float32", "--out", out,
                          "--no-progress"])
    assert code == 0, text
    res = json.loads(out.read_text())
    assert res["config"]["reference"]["mode"] == "exact"
    for name in ("s32_rs", "tp4_hi32"):
        st = res["results"][name]
        assert st["kl_mean"] == 0 and st["kl_max"] == 0 and st["ln_ppl_ratio"] == 0, name
    assert res["results"]["f4_sr_rs"]["kl_mean"] > 1e-5
    arr = np.load(out.with_suffix(".kl") / "doc00001.npy")
    assert not arr[:2].any() and arr[2].any()


def test_long_text_prefix_tokenisation_matches_full(work):
    """Books are tokenised from a prefix when that suffices: same first tokens as the whole text."""
    from transformers import AutoTokenizer

    from replayquant.kl.data import tokenize
    tok = AutoTokenizer.from_pretrained(work["models"]["qwen"])
    text = " ".join(_texts(random.Random(3), [6000]))
    full = tokenize(tok, text)
    part = tokenize(tok, text, need=100)
    assert part.numel() < full.numel() and torch.equal(part[:100], full[:100])


def test_bench_kl_runs_on_cpu_with_a_tiny_shape(tmp_path):
    """The GPU benchmark's code path (random-weight model, synthetic document, baseline forward)."""
    from replayquant.bench.kl import bench_kl
    if not HAVE_PATCH:
        pytest.skip("replayquant.patch (model integration) not available")
    r = bench_kl(shape="tiny", context=96, segment=32, dtype="float32", out=tmp_path / "b.json",
                 warmup_tokens=32)
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["kl_wall_time_s"] > 0 and saved["hf_forward_s"] > 0 and saved["pairs"] == ["f4_sr_rs", "tp4_hi32"]
    assert "git_commit" in saved["provenance"] and r["slowdown_vs_plain_forwards"] > 0
