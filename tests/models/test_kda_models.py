"""Kimi Delta Attention models through replayquant: Kimi Linear (`KimiLinearForCausalLM`) and
GLM-5-Next (`Glm5NextForConditionalGeneration`, whose text model holds the KDA layers), each a
tiny random model built from its real config classes (hidden 32, two KDA layers of 2 heads x
16 x 16 beside one attention layer), saved and loaded with load_model: found from the model as
their families, a shared FP32 pair changes no logit, a shared NVFP4 pair does, unpatch restores
the logits bit for bit, decode through generate equals teacher forcing for the same pair, decode
runs the replay decode kernel (replay_kda_step) and equals the torch step,
`run_kl` and `replayquant kl` run three pairs, and the lm-eval model scores; and the CPU parts
of evals/train_tiny.py's tiny-kimi-linear. Every test here passes under transformers 5.17 and
5.24.

Gates that remember: the HF init forgets within tens of tokens (A_log = log U(1, 16)), which would
hide state errors. `_remember` scales the gate projection f_b_proj to a twentieth, so the decay
follows dt_bias, and sets Kimi Linear's A_log in [-4, -2] (log a = -e^A_log softplus(dt_bias +
f), about -1e-4 .. -4e-3 per channel) and GLM-5-Next's lower-bounded gate (log a = -5
sigmoid(e^A_log (dt_bias + f))) to A_log = 0 and dt_bias in [-9, -6] (about -6e-4 .. -1e-2):
channels that remember hundreds of tokens.
"""

import math
import warnings

import pytest
import torch

from replayquant.models import load_model, patch, recurrent_layers, unpatch
from replayquant.models.families import family_of
from replayquant.models.runtime import decode_path
from test_families import VOCAB, _batch, _generate, _logits, _tokenizer, generate_then_teacher_force

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

FAMS = ["kimi_linear", "glm5_next"]
LINEAR = dict(linear_head_dim=16, linear_num_heads=2, linear_conv_kernel_dim=4)
MLA = dict(num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, v_head_dim=16)


def _config(fam):
    import transformers as tf
    if fam == "kimi_linear":
        return tf.KimiLinearConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, num_experts=2,
            num_experts_per_token=1, pad_token_id=0, bos_token_id=None, eos_token_id=1,
            initializer_range=0.2, **MLA, **LINEAR)
    # "full_attention": the DSA layer, by the name both 5.17 and 5.24 accept (each renames it:
    # deepseek_sparse_attention / indexed_attention). index_topk covers every position the
    # generate tests reach (the DSA indexer's sparse selection of fewer positions makes the
    # unpatched model's own decode differ from its teacher forcing)
    text = tf.Glm5NextTextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "dense"], n_routed_experts=2, num_experts_per_tok=1,
        q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=16, index_topk=32, index_head_dim=16,
        index_n_heads=2, index_kpool=4, hc_mult=2, pad_token_id=0, eos_token_id=1,
        initializer_range=0.2, **MLA, **LINEAR)
    vision = tf.Glm5NextVisionConfig(depth=1, hidden_size=16, num_heads=2, intermediate_size=16,
                                     out_hidden_size=32, projection_intermediate_size=16)
    return tf.Glm5NextConfig(text_config=text.to_dict(), vision_config=vision.to_dict())


def _model(fam, seed):
    torch.manual_seed(seed)
    from replayquant.models.patching import model_from_config
    cfg = _config(fam)
    model = model_from_config(cfg).eval()
    _remember(model)
    return model


@torch.no_grad()
def _remember(model):
    for _, mod, kind in recurrent_layers(model):
        assert kind == "kda"
        gate = mod.forget_gate
        gate.f_b_proj.weight.mul_(0.05)
        if getattr(gate, "safe_gate_lower_bound", None) is not None:     # GLM-5-Next
            gate.A_log.zero_()
            gate.dt_bias.uniform_(-9.0, -6.0)
        else:
            gate.A_log.uniform_(-4.0, -2.0)


def save_models(root):
    """Both tiny models saved with the tokenizer under root, and a text file: (dirs, doc, text)."""
    tok, text = _tokenizer()
    (root / "doc.txt").write_text(text)
    dirs = {}
    for i, fam in enumerate(FAMS):
        d = root / fam
        _model(fam, 300 + i).save_pretrained(d)
        tok.save_pretrained(d)
        dirs[fam] = d
    return dirs, root / "doc.txt", text


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    dirs, doc, text = save_models(tmp_path_factory.mktemp("kda"))
    return {"dirs": {f: str(d) for f, d in dirs.items()}, "text_file": str(doc), "text": text}


def test_gates_remember(work):
    """The tiny models' log decays lie where the state remembers hundreds of tokens."""
    for fam in FAMS:
        model = load_model(work["dirs"][fam], dtype="float32")
        for _, mod, _ in recurrent_layers(model):
            g = mod.forget_gate(torch.randn(2, 8, 32))
            assert g.shape == (2, 8, 2, 16) and g.max() < 0 and g.min() > -0.02, (fam, g.min())


@pytest.mark.parametrize("fam", FAMS)
def test_found_fp32_changes_nothing_nvfp4_does_unpatch_restores(work, fam):
    """Both KDA layers are found as the family; shared FP32 (s32_rs, L = 4: flushes inside the
    sequence) changes no logit beyond float32 reassociation; shared NVFP4 + SR (f4_sr_rs) does;
    unpatch restores the unpatched logits bit for bit."""
    ids, mask = _batch()
    valid = mask.bool()
    model = load_model(work["dirs"][fam], dtype="float32")
    layers = recurrent_layers(model)
    assert [kind for _, _, kind in layers] == ["kda", "kda"]
    assert {family_of(m).name for _, m, _ in layers} == {fam}
    ref = _logits(model, ids, mask)
    patch(model, "s32_rs", buffer_len=4)
    scale = ref.abs().max().item()
    torch.testing.assert_close(_logits(model, ids, mask)[valid], ref[valid], rtol=1e-5,
                               atol=1e-5 * scale)
    patch(model, "f4_sr_rs", buffer_len=4)
    effect = (_logits(model, ids, mask) - ref)[valid].abs().max().item()
    assert effect > 1e-3 * scale, f"{fam}: NVFP4 left the logits unchanged ({effect:.1e})"
    unpatch(model)
    assert torch.equal(_logits(model, ids, mask), ref)


@pytest.mark.parametrize("fam", FAMS)
def test_generate_equals_hf_and_decode_equals_teacher_forcing(work, fam):
    """Greedy generate with s32_rs at L = 1 (the conventional FP32 recurrence) gives the
    unpatched model's tokens and scores; with f4_sr_rs (L = 4: the 6 decode steps cross flushes)
    the scores of every decode step equal teacher forcing of the generated sequence through the
    same pair within reassociation (bounded as in tests/models/test_families.py)."""
    model = load_model(work["dirs"][fam], dtype="float32")
    d, tf, effect = generate_then_teacher_force(model, _generate)
    assert effect > 0
    assert (d > 1e-5 * tf.abs().max()).float().mean().item() <= 0.1
    assert d.max().item() <= 1e-5 * tf.abs().max().item() + 0.25 * effect


@pytest.mark.parametrize("fam", FAMS)
def test_fp32_decode_is_its_teacher_forcing(work, fam):
    """s32_rs at L = 8, keys made short (`short_keys`): the unpatched model's greedy tokens, and
    every KDA layer's decode output equal to teacher forcing within float32 noise
    (test_decode_exact.py; a key normalised twice gave 2.5e-4 here)."""
    from test_decode_exact import decode_equals_teacher_forcing, short_keys
    model = load_model(work["dirs"][fam], dtype="float32")
    short_keys(model)
    same, d = decode_equals_teacher_forcing(model, *_batch(seed=2))
    print(f"{fam}: decode vs teacher forcing {d:.1e} of a layer's largest output")
    assert same and d <= 4e-6, (same, d)


def test_decode_kernel_equals_torch_step_and_teacher_forcing(work, monkeypatch):
    """Where the replay decode kernel runs (REPLAYQUANT_BACKEND=triton; the interpreter here), a
    KDA layer's prompt runs the chunk kernel (vector gates) and its decode steps replay_kda_step,
    without a warning, on the bf16 model it serves (its ring holds bf16 activations exactly);
    tokens are the torch path's, and the scores of every decode step (L = 4: they cross a
    flush) equal the torch path's and teacher forcing of the generated sequence within a bf16
    model's logit bound, 8 x 2^-9 of the largest logit (tests/models/test_models_decode_kernel.py).
    The kernel against ReplayState on the same bf16 inputs:
    tests/kernels/replay/test_kernel_kda_replay.py."""
    from replayquant.kernels.chunk import kernel as chunk
    from replayquant.kernels.replay import decode as rd
    calls, scans = [], []
    step = rd.replay_kda_step
    monkeypatch.setattr(rd, "replay_kda_step", lambda *a, **k: calls.append(a) or step(*a, **k))
    scan = chunk.chunk_scan
    monkeypatch.setattr(chunk, "chunk_scan", lambda *a, **k: scans.append(a) or scan(*a, **k))
    model = load_model(work["dirs"]["kimi_linear"], dtype="bfloat16")   # the kernel's models
    patch(model, "s32_rs", buffer_len=4)
    ids, mask = _batch(T=6, seed=2)
    n = 4
    bound = 8 * 2.0 ** -9
    seq_t, sc_t = _generate(model, ids, mask, n=n)
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")
    assert decode_path(vector_gate=True) == "triton"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        seq_k, sc_k = _generate(model, ids, mask, n=n)
    assert not [x for x in w if "replayquant decode" in str(x.message)]
    assert len(calls) == 2 * (n - 1) and len(scans) == 2
    assert torch.equal(seq_k, seq_t)
    torch.testing.assert_close(sc_k, sc_t, rtol=0, atol=bound * sc_t.abs().max().item())
    P = ids.shape[1]
    fmask = torch.cat([mask, torch.ones(2, n, dtype=mask.dtype)], 1)
    tf = _logits(model, seq_k, fmask)[:, P - 1:P - 1 + n].to(sc_k.dtype)
    torch.testing.assert_close(sc_k, tf, rtol=0, atol=bound * tf.abs().max().item())


@pytest.mark.parametrize("fam", FAMS)
def test_run_kl_three_pairs(work, fam, tmp_path):
    """`run_kl` with three pairs against the exact FP32 reference: s32_rs agrees to float32
    rounding, tp4_hi32 and f4_sr_rs are finite and the shared NVFP4 pair is off the reference."""
    from transformers import AutoTokenizer

    from replayquant.kl import KLSettings, RunParts, run_kl
    model = load_model(work["dirs"][fam], dtype="float32")
    tok = AutoTokenizer.from_pretrained(work["dirs"][fam])
    settings = KLSettings(dataset=work["text_file"], context=48, docs=1, segment=20, progress=False)
    res = run_kl(model, tok, ["s32_rs", "tp4_hi32", "f4_sr_rs"], settings, out=tmp_path / "kl.json",
                 parts=RunParts(plot=False))
    r = res["results"]
    assert set(r) == {"s32_rs", "tp4_hi32", "f4_sr_rs"}
    assert abs(r["s32_rs"]["kl_mean"]) < 1e-6 and r["s32_rs"]["same_top"] == 1
    assert all(math.isfinite(r[p]["kl_mean"]) for p in r)
    assert r["f4_sr_rs"]["kl_mean"] > 1e-6, r["f4_sr_rs"]["kl_mean"]


def test_kl_command_on_a_local_folder_and_text_file(work, tmp_path):
    """`replayquant kl` itself on the saved GLM-5-Next folder (loaded through its
    conditional-generation class) and a local .txt file, three pairs."""
    import json

    from typer.testing import CliRunner

    from replayquant.cli import app
    out = tmp_path / "glm.json"
    res = CliRunner().invoke(app, [
        "kl", "--model", work["dirs"]["glm5_next"], "--pair", "s32_rs", "--pair", "tp4_hi32",
        "--pair", "f4_sr_rs", "--dataset", work["text_file"], "--context", "40", "--docs", "1",
        "--segment", "16", "--dtype", "float32", "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())["results"]
    assert abs(r["s32_rs"]["kl_mean"]) < 1e-6 and r["f4_sr_rs"]["kl_mean"] > 1e-6


@pytest.mark.parametrize("fam", FAMS)
def test_lm_eval_model(work, fam):
    """The lm-eval model (what `replayquant gpqa` scores with) loads both (GLM-5-Next through
    its conditional-generation class): with s32_rs its loglikelihoods are the unpatched
    model's; with f4_sr_rs they change; generate_until runs the pair."""
    from lm_eval.api.instance import Instance

    from replayquant.gpqa.lm_eval_model import ReplayQuantLM
    lm = ReplayQuantLM(pretrained=work["dirs"][fam], pair="s32_rs", device="cpu", dtype="float32",
                       batch_size=2)
    words = work["text"].split()
    req = [Instance("loglikelihood", {}, (" ".join(words[i:i + 12]),
                                          " " + " ".join(words[i + 12:i + 16])), i) for i in (0, 40)]
    ll32 = [x[0] for x in lm.loglikelihood(req, disable_tqdm=True)]
    lm.set_pair("f4_sr_rs")
    ll4 = [x[0] for x in lm.loglikelihood(req, disable_tqdm=True)]
    gen = lm.generate_until([Instance("generate_until", {}, (" ".join(words[:12]), {
        "until": ["<eos>"], "max_gen_toks": 4, "do_sample": False}), 0)], disable_tqdm=True)
    assert len(gen) == 1 and isinstance(gen[0], str)
    unpatch(lm.model)
    for (ctx, cont), got in zip([r.args for r in req], ll32):
        ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
        with torch.no_grad():
            logits = lm.model(torch.tensor([ctx_ids + cont_ids[:-1]])).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        ref = sum(float(logp[len(ctx_ids) - 1 + t, tok]) for t, tok in enumerate(cont_ids))
        assert got == pytest.approx(ref, abs=1e-4)
    assert all(a != b for a, b in zip(ll32, ll4)), (ll32, ll4)


def test_layout_change_is_one_clear_error(work):
    """A KDA class whose attributes differ from the layout read here (another transformers
    version's) is one error naming what is missing."""
    model = load_model(work["dirs"]["kimi_linear"], dtype="float32")
    del recurrent_layers(model)[0][1].forget_gate
    with pytest.raises(ValueError, match="KimiLinearDeltaAttention.*forget_gate"):
        patch(model, "s32_rs")


def test_short_names():
    from replayquant.models import resolve_model_name
    assert resolve_model_name("kimi-linear-48b-a3b-instruct") == "moonshotai/Kimi-Linear-48B-A3B-Instruct"
    assert resolve_model_name("GLM-5.3-Flash") == "zai-org/GLM-5.3-Flash"


def test_train_tiny_kimi_parts():
    """evals/train_tiny.py's third model on the CPU: the Kimi Linear config builds (5.5M
    parameters at this test's vocabulary of 512; the shipped model's 4096 give 7.38M; untied head:
    KimiLinearForCausalLM ties nothing), the long-memory initialisation
    spreads the per-channel decay rates over [1e-4, 1] in every layer and head, and the
    recurrent-state reset of the evaluation equals running each segment alone with transformers'
    torch chunk_kimi_delta_attention."""
    from test_tiny_models import _train_tiny
    tt = _train_tiny()
    model = tt.build_model("kimi", 512, 0)
    assert type(model).__name__ == "KimiLinearForCausalLM" and not model.config.tie_word_embeddings
    rates = tt.init_long_memory(model, seed=0)
    assert len(rates) == 6 and all(len(layer) == 2 for layer in rates)
    for layer in rates:
        for lo, *_, hi in layer:                         # every head holds short and long memory
            assert 1e-4 <= lo < 1e-3 and 0.1 < hi <= 1.0, layer
    assert tt.decay_rates(model) == rates
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 70, 2, 16, generator=g) for _ in range(3))
    gg, beta = -torch.rand(1, 70, 2, 16, generator=g) * 0.1, torch.rand(1, 70, 2, generator=g)
    kda = tt.hf_kda_reference()
    out = tt.segment_reset(kda, 32)(q, k, v, g=gg, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    parts = [kda(q[:, s:s + 32], k[:, s:s + 32], v[:, s:s + 32], g=gg[:, s:s + 32],
                 beta=beta[:, s:s + 32], use_qk_l2norm_in_kernel=True)[0] for s in range(0, 70, 32)]
    assert torch.allclose(out, torch.cat(parts, 1), atol=1e-5)
