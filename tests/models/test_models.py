"""Hugging Face integration (replayquant.models) on tiny random models of every family, built
from the real config classes, saved to a temp folder and loaded with load_model."""

import subprocess
import sys

import pytest
import torch

import replayquant
from replayquant.models import SHORT_NAMES, load_model, patch, recurrent_layers, resolve_model_name, unpatch
from replayquant.pairs import list_pairs

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 96


def _configs():
    from transformers import (Mamba2Config, NemotronHConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
                              Qwen3NextConfig)
    gdn = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
               head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32)
    types3 = ["linear_attention", "linear_attention", "full_attention"]
    return {
        "qwen3_5": lambda: Qwen3_5TextConfig(intermediate_size=96, num_hidden_layers=3,
                                             layer_types=types3, **gdn),
        "qwen3_5_moe": lambda: Qwen3_5MoeTextConfig(num_hidden_layers=3, layer_types=types3,
                                                    **gdn, **moe),
        "qwen3_next": lambda: Qwen3NextConfig(intermediate_size=96, num_hidden_layers=3,
                                              layer_types=types3, **gdn, **moe),
        "mamba2": lambda: Mamba2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                       num_heads=8, head_dim=16, state_size=16, n_groups=2,
                                       expand=2, chunk_size=8),
        "nemotron_h": lambda: NemotronHConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
                                              hybrid_override_pattern="M*M", mamba_num_heads=8,
                                              mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                                              num_attention_heads=2, num_key_value_heads=1,
                                              head_dim=32, intermediate_size=96, chunk_size=8),
    }


FAMILIES = list(_configs())


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    dirs = {}
    for i, (fam, make) in enumerate(_configs().items()):
        torch.manual_seed(100 + i)
        m = AutoModelForCausalLM.from_config(make())
        with torch.no_grad():          # random Mamba-2 layers barely use their state (dt near
            for _, mod, kind in recurrent_layers(m):   # 0.005, tiny B, C): make it matter
                if kind == "mamba2":
                    mod.dt_bias.uniform_(-1.0, 0.5)
                    mod.in_proj.weight.mul_(0.1 / mod.in_proj.weight.std())
        d = tmp_path_factory.mktemp(fam)
        m.save_pretrained(d)
        dirs[fam] = str(d)
    return dirs


def _batch(B=2, T=19, pad=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :pad] = 0                      # ragged: row 1 left-padded
    return ids, mask


@torch.no_grad()
def _logits(model, ids, mask, **kw):
    return model(input_ids=ids, attention_mask=mask, **kw).logits


_CACHE_NAMES = ("cache", "past_key_values", "cache_params")   # 5.24, 5.17 / 5.17 Mamba-2


def _cache_kw(model, cache):
    import inspect
    params = inspect.signature(type(model).forward).parameters
    return {next(n for n in _CACHE_NAMES if n in params): cache}


def _cache_of(out):
    return next(c for n in _CACHE_NAMES if (c := getattr(out, n, None)) is not None)


@torch.no_grad()
def _segments(model, ids, mask, cuts):
    """Teacher forcing in segments through the cache; segments of length 1 are decode steps."""
    cache, outs = None, []
    for a, b in zip(cuts[:-1], cuts[1:]):
        kw = {} if cache is None else _cache_kw(model, cache)
        out = model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], use_cache=True, **kw)
        cache = _cache_of(out)
        outs.append(out.logits)
    return torch.cat(outs, 1)


@torch.no_grad()
def _generate(model, ids, mask, n=5, **kw):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, use_cache=True, **kw)
    return out.sequences, torch.stack(out.scores, 1)


@pytest.mark.parametrize("fam", FAMILIES)
def test_shared_fp32_L1_equals_hf(model_dirs, fam):
    """s32_rs with L = 1 is the conventional FP32 recurrence: the patched model equals HF's
    (teacher forcing, generate with a ragged batch, and a cache prefilled by the unpatched
    model and continued patched); prefill='exact' with s32_rs equals HF at any L."""
    ids, mask = _batch()
    valid = mask.bool()
    base = load_model(model_dirs[fam], dtype="float32")
    ref = _logits(base, ids, mask)
    seq_ref, sc_ref = _generate(base, ids, mask)

    model = load_model(model_dirs[fam], pair="s32_rs", buffer_len=1, dtype="float32")
    assert len(recurrent_layers(model)) >= 2
    torch.testing.assert_close(_logits(model, ids, mask)[valid], ref[valid], rtol=1e-5, atol=2e-5)
    seq, sc = _generate(model, ids, mask)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(sc, sc_ref, rtol=1e-5, atol=2e-5)

    # a cache filled by the unpatched model is adopted as the initial state
    full = torch.cat([ids, seq_ref[:, ids.shape[1]:ids.shape[1] + 3]], 1)
    fmask = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
    cut = [0, ids.shape[1], ids.shape[1] + 1, ids.shape[1] + 2, ids.shape[1] + 3]
    ref_seg = _segments(base, full, fmask, cut)
    unpatch(model)
    cache = _cache_of(model(input_ids=ids, attention_mask=mask, use_cache=True))
    patch(model, "s32_rs", buffer_len=1)
    with torch.no_grad():
        for i in range(3):
            p = ids.shape[1] + i
            out = model(input_ids=full[:, p:p + 1], attention_mask=fmask[:, :p + 1], use_cache=True,
                        **_cache_kw(model, cache))
            torch.testing.assert_close(out.logits[:, 0], ref_seg[:, ids.shape[1] + i], rtol=1e-5,
                                       atol=2e-5)

    exact = load_model(model_dirs[fam], pair="s32_rs", prefill="exact", dtype="float32")
    torch.testing.assert_close(_logits(exact, ids, mask)[valid], ref[valid], rtol=1e-5, atol=2e-5)


def _assert_same_semantics(got, ref, effect, what):
    """Equal within reassociation; a low-precision cast may flip one step where reassociation
    crosses a rounding boundary, so bound the rare outliers by a fraction of the pair's effect."""
    d = (got - ref).abs()
    scale = ref.abs().max().item()
    assert (d > 1e-5 * scale).float().mean().item() <= 0.1, what
    assert d.max().item() <= 1e-5 * scale + 0.25 * effect, f"{what}: {d.max().item():.2e} vs effect {effect:.2e}"


@pytest.mark.parametrize("fam,pair", [(f, "tp4_hi16_sr") for f in FAMILIES]
                         + [("qwen3_5", p) for p in list_pairs() if p != "tp4_hi16_sr"]
                         + [("mamba2", p) for p in list_pairs() if p != "tp4_hi16_sr"])
def test_teacher_forcing_equals_decode(model_dirs, fam, pair):
    """prefill='replay': one forward over the sequence, the same in segments of odd lengths,
    and token-by-token decode (ReplayState.step) agree within reassociation, with L = 4 and a
    length that is not a multiple of it; the pair really changes the logits."""
    ids, mask = _batch(T=19, seed=1)
    valid = mask.bool()
    base = load_model(model_dirs[fam], dtype="float32")
    ref = _logits(base, ids, mask)
    model = patch(base, pair, buffer_len=4, seed=7)
    full = _logits(model, ids, mask)
    effect = (full - ref)[valid].abs().max().item()
    seg = _segments(model, ids, mask, [0, 6, 7, 12, 13, 19])
    steps = _segments(model, ids, mask, [0, 5] + list(range(6, 20)))
    _assert_same_semantics(seg[valid], full[valid], effect, f"{fam} {pair} segmented")
    _assert_same_semantics(steps[valid], full[valid], effect, f"{fam} {pair} step decode")
    if pair in ("tp4_hi16_sr", "f4_sr_rs", "tp4_hi32"):
        assert effect > 5e-6, f"{fam}: NVFP4 pair left the logits unchanged ({effect:.1e})"


@pytest.mark.parametrize("fam", FAMILIES)
def test_unpatch_restores_and_seed(model_dirs, fam):
    ids, mask = _batch(T=17, seed=2)
    model = load_model(model_dirs[fam], dtype="float32")
    before = _logits(model, ids, mask)
    patch(model, "f4_sr_rs", buffer_len=4, seed=0)
    a = _logits(model, ids, mask)
    assert torch.equal(a, _logits(model, ids, mask)), "same seed, same bits"
    patch(model, "f4_sr_rs", buffer_len=4, seed=1)
    b = _logits(model, ids, mask)
    assert not torch.equal(a, b), "another seed draws other SR bits"
    assert not torch.equal(a, before)
    unpatch(model)
    assert torch.equal(_logits(model, ids, mask), before)
    assert not any(hasattr(m, "_replayquant") for _, m, _ in recurrent_layers(model))


def test_ragged_batch_rows_are_independent(model_dirs):
    """A left-padded row generates exactly as the same prompt alone (padding takes no buffer
    slot, so the flush schedule is the prompt's own); a non-SR pair so row ids do not matter."""
    ids, mask = _batch(T=11, pad=3, seed=3)
    model = load_model(model_dirs["qwen3_5"], pair="tp4_hi32", buffer_len=4, dtype="float32")
    seq, sc = _generate(model, ids, mask, n=6)
    alone, sc1 = _generate(model, ids[1:, 3:], mask[1:, 3:], n=6)
    assert torch.equal(seq[1, 3:], alone[0])
    torch.testing.assert_close(sc[1], sc1[0], rtol=1e-4, atol=1e-4)


def test_beam_search_follows_reorder(model_dirs, monkeypatch):
    from replayquant.models import runtime
    calls = []
    orig = runtime.take_rows
    monkeypatch.setattr(runtime, "take_rows", lambda st, ids: calls.append(1) or orig(st, ids))
    ids, mask = _batch(T=9, pad=2, seed=4)
    base = load_model(model_dirs["qwen3_5"], dtype="float32")
    ref = base.generate(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=6,
                        do_sample=False)
    patch(base, "s32_rs", buffer_len=1)
    got = base.generate(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=6,
                        do_sample=False)
    assert torch.equal(got, ref)
    assert calls, "beam reordering never reached the replay state"


def test_errors(model_dirs):
    from transformers import LlamaConfig, LlamaForCausalLM
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="no recurrent layer"):
        patch(llama, "s32_rs")
    with pytest.raises(ValueError, match="torch.nn.Module"):
        patch("model", "s32_rs")
    model = load_model(model_dirs["mamba2"], dtype="float32")
    with pytest.raises(ValueError, match="prefill"):
        patch(model, "s32_rs", prefill="fast")
    with pytest.raises(ValueError, match="unknown precision pair"):
        patch(model, "no_such_pair")
    with pytest.raises(ValueError, match="buffer_len"):
        patch(model, "s32_rs", buffer_len=0)
    with pytest.raises(ValueError, match="seed"):
        patch(model, "s32_rs", seed=-1)
    with pytest.raises(ValueError, match="not patched"):
        unpatch(model)
    with pytest.raises(ValueError, match="unknown model"):
        load_model("NoSuchModel-1B")
    with pytest.raises(ValueError, match="dtype"):
        load_model(model_dirs["mamba2"], dtype="float64x")
    with pytest.raises(ValueError, match="unknown precision pair"):
        load_model(model_dirs["mamba2"], pair="nope")


def test_names_and_lazy_import():
    assert resolve_model_name("qwen3.5-4b") == "Qwen/Qwen3.5-4B" == SHORT_NAMES["Qwen3.5-4B"]
    assert resolve_model_name("someone/some-model") == "someone/some-model"
    assert replayquant.load_model is load_model and replayquant.unpatch is unpatch
    code = "import replayquant, sys; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "import replayquant must not import transformers"
