"""The embedded tiny models: load offline, trained (held-out perplexity far below a
uniform guess), held-out text present and large enough, short names resolve to the shipped folders."""

import json
import math
import shutil

import pytest
import torch

from replayquant.data import (HELDOUT_BOOKS, TINY_MODELS, heldout_documents, heldout_path,
                              tiny_model_path)

VOCAB = 4096
SNIPPET = 768          # tokens of held-out text scored per model


@pytest.fixture(scope="module")
def heldout():
    return heldout_documents()


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_model_folder_contents(name):
    path = tiny_model_path(name)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / f).is_file(), f"{path / f} missing"
    assert (path / "model.safetensors").stat().st_size <= 20 * 2**20
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["vocab_size"] == VOCAB and cfg["dtype"] == "float32"


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_model_loads_and_is_trained(name, heldout):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = tiny_model_path(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert next(model.parameters()).dtype == torch.float32
    assert len(tok) == model.config.vocab_size == VOCAB
    # a held-out book from its middle, after a document separator as in training
    text = heldout[3]["text"]                        # John
    ids = tok(text[len(text) // 2:])["input_ids"][:SNIPPET]
    x = torch.tensor([[tok.eos_token_id] + ids])
    with torch.no_grad():
        logits = model(input_ids=x, use_cache=False).logits.float()
    assert torch.isfinite(logits).all()
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:])
    ppl = math.exp(nll.item())
    # this snippet: ppl 32 / 36 / 28 (tiny-qwen3.5, tiny-mamba2, tiny-kimi-linear);
    # results/train_tiny/train_log*.json have the whole held-out set (35 / 40 / 33 at 4K
    # context); uniform would be 4096
    assert ppl < 100, f"{name}: held-out perplexity {ppl:.1f} is not that of a trained model"


def test_short_names_resolve_to_shipped_folders():
    from replayquant.models import resolve_model_name
    for name, folder in TINY_MODELS.items():
        assert resolve_model_name(name) == str(folder)
        assert resolve_model_name(name.upper()) == str(folder)


def test_load_model_by_short_name():
    from replayquant.models import load_model
    model = load_model("tiny-mamba2")
    assert type(model).__name__ == "Mamba2ForCausalLM"
    assert next(model.parameters()).dtype == torch.float32


def test_tiny_kimi_linear_generates_and_runs_kl(heldout, tmp_path):
    """tiny-kimi-linear by its short name: six Kimi Delta Attention layers found; greedy generate
    with s32_rs at L = 1 (the conventional FP32 recurrence) gives the unpatched model's tokens;
    `run_kl` with three pairs on held-out text: s32_rs agrees to float32 rounding and the shared
    NVFP4 state (f4_sr_rs) is further off than an NVFP4 read copy over an FP32 anchor (tp4_hi32)."""
    from transformers import AutoTokenizer

    from replayquant.kl import KLSettings, RunParts, run_kl
    from replayquant.models import load_model, patch, recurrent_layers
    model = load_model("tiny-kimi-linear")
    assert type(model).__name__ == "KimiLinearForCausalLM"
    assert [kind for _, _, kind in recurrent_layers(model)] == ["kda"] * 6
    tok = AutoTokenizer.from_pretrained(tiny_model_path("tiny-kimi-linear"))
    text = heldout[3]["text"]                        # John
    x = torch.tensor([[tok.eos_token_id] + tok(text[len(text) // 2:])["input_ids"][:48]])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        ref = model.generate(x, **kw)
        patch(model, "s32_rs", buffer_len=1)
        assert torch.equal(model.generate(x, **kw), ref)
    settings = KLSettings(dataset=heldout_path(tmp_path), context=160, docs=1, segment=64,
                          progress=False)
    res = run_kl(model, tok, ["s32_rs", "tp4_hi32", "f4_sr_rs"], settings, out=tmp_path / "kl.json",
                 parts=RunParts(plot=False))
    r = {p: v["kl_mean"] for p, v in res["results"].items()}
    assert abs(r["s32_rs"]) < 1e-6, r
    assert r["f4_sr_rs"] > r["tp4_hi32"] > 0, r


def test_heldout_text(heldout, tmp_path):
    from transformers import AutoTokenizer
    assert [d["book"] for d in heldout] == HELDOUT_BOOKS
    assert len({d["id"] for d in heldout}) == len(heldout)
    tok = AutoTokenizer.from_pretrained(tiny_model_path("tiny-qwen3.5"))
    n = sum(len(tok(d["text"])["input_ids"]) for d in heldout)
    assert n >= 150_000, n
    p = heldout_path(tmp_path)
    assert p.suffix == ".jsonl"
    assert [json.loads(line) for line in p.read_text().splitlines()] == heldout
    assert heldout_path(tmp_path) == p                 # second call: cached copy


def test_tiny_model_path_bad_name():
    with pytest.raises(ValueError, match="tiny-qwen3.5"):
        tiny_model_path("tiny-llama")


# ---------------------------------------------------------------- the training script's scans
def _train_tiny():
    import importlib.util
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    if "train_tiny" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_tiny", root / "evals" / "train_tiny.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["train_tiny"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["train_tiny"]


def _mamba_inputs(T=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, P, N = 2, 4, 16, 32
    return dict(hidden_states=torch.randn(B, T, H, P, generator=g),
                dt=torch.randn(B, T, H, generator=g) * 0.5,
                A=-torch.arange(1, H + 1, dtype=torch.float32),
                B=torch.randn(B, T, 1, N, generator=g) * 0.3,
                C=torch.randn(B, T, 1, N, generator=g) * 0.3,
                D=torch.ones(H), dt_bias=torch.linspace(-4, 0, H),
                initial_states=torch.randn(B, H, P, N, generator=g))


def test_mamba2_scan_as_simple_gla_matches_transformers():
    """The training-only Mamba-2 scan (SSD as scalar-decay gated linear attention, q=C, k=B,
    v=dt*x, g=dt*A) equals transformers' torch scan, final state included, and so do gradients
    (the fla kernel stands where the naive GLA is here)."""
    tt = _train_tiny()
    scan, ref = tt.make_mamba2_scan(tt.naive_simple_gla), tt.hf_mamba_scan()
    x = _mamba_inputs()
    kw = dict(chunk_size=32, dt_softplus=True, return_final_states=True)
    o1, s1 = scan(**x, **kw)
    o2, s2 = ref(**x, **kw)
    assert (o1 - o2).abs().max() < 1e-4 * o2.abs().max()
    assert (s1 - s2).abs().max() < 1e-4 * s2.abs().max()
    chk = tt.check_scan("mamba", scan, torch.device("cpu"), bf16=False, T=128)
    assert max(chk["rel_max_err"].values()) < 1e-4, chk


def test_segment_reset_restarts_the_state():
    """Recurrent state reset every `seg` tokens == running each segment on its own (for the scan
    of each architecture), with a length that is not a multiple of seg."""
    tt = _train_tiny()
    x = _mamba_inputs(T=100)
    x.pop("initial_states")
    ref = tt.hf_mamba_scan()
    out = tt.segment_reset(ref, 32)(**x, chunk_size=32, dt_softplus=True)
    parts = [ref(**{k: (v[:, s:s + 32] if v.dim() >= 2 else v) for k, v in x.items()},
                 chunk_size=32, dt_softplus=True) for s in range(0, 100, 32)]
    assert torch.allclose(out, torch.cat(parts, 1), atol=1e-5)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 100, 2, 16, generator=g) for _ in range(3))
    gg, beta = -torch.rand(1, 100, 2, generator=g), torch.rand(1, 100, 2, generator=g)
    gdn = tt.hf_gdn_reference()
    out = tt.segment_reset(gdn, 32)(q, k, v, g=gg, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    parts = [gdn(q[:, s:s + 32], k[:, s:s + 32], v[:, s:s + 32], g=gg[:, s:s + 32],
                 beta=beta[:, s:s + 32], use_qk_l2norm_in_kernel=True)[0] for s in range(0, 100, 32)]
    assert torch.allclose(out, torch.cat(parts, 1), atol=1e-5)


def test_install_keeps_the_log_of_other_models(tmp_path):
    """`install` of a run of one model beside a train_log.json of two others: the existing log is
    left byte for byte, the run's log goes to train_log_<model>.json, its stdout is copied, and
    loss_curve.png is redrawn with all three models; a rerun of the same model replaces its log."""
    tt = _train_tiny()
    logs = tt.ROOT / "results" / "train_tiny"
    results, src = tmp_path / "results", tmp_path / "run"
    results.mkdir()
    src.mkdir()
    shutil.copy(logs / "train_log.json", results / "train_log.json")
    shutil.copy(logs / "train_log_tiny-kimi-linear.json", src / "train_log.json")
    (src / "train_stdout_tiny-kimi-linear.txt").write_text("step 1\n")
    tt.install_logs(src, results)
    assert (results / "train_log.json").read_bytes() == (logs / "train_log.json").read_bytes()
    assert (results / "train_log_tiny-kimi-linear.json").read_bytes() == \
        (src / "train_log.json").read_bytes()
    assert (results / "train_stdout_tiny-kimi-linear.txt").read_text() == "step 1\n"
    assert (results / "loss_curve.png").stat().st_size > 10_000
    models = tt.log_models(sorted(results.glob("train_log*.json")))
    assert [m["name"] for m in models] == ["tiny-qwen3.5", "tiny-mamba2", "tiny-kimi-linear"]
    rerun = json.loads((src / "train_log.json").read_text())
    rerun["provenance"]["date"] = "2100-01-01T00:00:00+00:00"
    first = rerun["models"][0]["val_curve"][0][0]             # a step the validation curve has
    rerun["models"][0]["best_val"] = {**rerun["models"][0]["best_val"], "step": first}
    (src / "train_log.json").write_text(json.dumps(rerun))
    tt.install_logs(src, results)
    assert sorted(p.name for p in results.glob("train_log*.json")) == \
        ["train_log.json", "train_log_tiny-kimi-linear.json"]
    models = tt.log_models(sorted(results.glob("train_log*.json")))
    assert models[2]["best_val"]["step"] == first


def test_load_model_builds_transformers_class_whatever_the_auto_registry_holds(monkeypatch):
    # flash-linear-attention, once imported, registers its own Mamba-2 config and model for
    # model_type 'mamba2' with AutoConfig / AutoModelForCausalLM (exist_ok=True); its layers are
    # not the Mamba2Mixer replayquant patches
    from transformers import AutoConfig, AutoModelForCausalLM, Mamba2Config, Mamba2ForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from replayquant import load_model

    class OtherMamba2Config(Mamba2Config):
        model_type = "mamba2"

    class OtherMamba2(Mamba2ForCausalLM):
        config_class = OtherMamba2Config

    monkeypatch.setattr(CONFIG_MAPPING, "_extra_content", dict(CONFIG_MAPPING._extra_content))
    monkeypatch.setattr(AutoModelForCausalLM._model_mapping, "_extra_content",
                        dict(AutoModelForCausalLM._model_mapping._extra_content))
    AutoConfig.register("mamba2", OtherMamba2Config, exist_ok=True)
    AutoModelForCausalLM.register(OtherMamba2Config, OtherMamba2, exist_ok=True)
    model = load_model("tiny-mamba2", pair="s32_rs")
    assert type(model) is Mamba2ForCausalLM and type(model.config) is Mamba2Config
