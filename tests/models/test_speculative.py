"""HF's assisted generation on patched models: prompt lookup and an assistant model through
transformers' own candidate generators and acceptance rule, the target's multi-token forwards
running the replay verify against the layer's decode store and `cache.crop` moving its committed
pointer.

With a shared FP32 pair (s32_rs, the torch engine on the CPU) speculative greedy output equals
plain greedy output token for token (HF's contract for assisted decoding), on tiny random Gated
DeltaNet (Qwen3.5), Mamba-2 and Kimi Delta Attention (Kimi Linear) models with gates that
remember, and on the embedded tiny-qwen3.5 with a repetitive prompt. Each run must accept drafts
and reject some (a crop that moves the pointer back), or it would test plain decode only. The
unpatched model keeps HF's refusal; a pair whose L is below the draft length is one error naming
both, before any forward, and so is a static cache. The path that runs is HF's eager loop: HF
compiles no step of a cache whose linear-attention layers record their past.
"""

import copy

import pytest
import torch

from replayquant.models import load_model, patch, unpatch
from replayquant.models import decode_store
from replayquant.models.patching import model_from_config
from replayquant.models.runtime import STATE_ATTR
from test_families import _configs
from test_families import _remember as _remember_gates
from test_kda_models import _model as _kda_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

REFUSAL = "assisted generation is not supported with stateful models"


def _tiny(fam: str, seed: int):
    """A tiny random model of the family with gates that remember (test_families,
    test_kda_models)."""
    if fam == "kimi_linear":
        return _kda_model(fam, seed)
    torch.manual_seed(seed)
    model = model_from_config(_configs()[fam][0]()).eval()
    _remember_gates(model)
    return model


def _prompt(seed: int, n: int = 7, repeats: int = 4) -> torch.Tensor:
    """A prompt of one random phrase of n tokens said `repeats` times (token ids 2..127)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 128, (n,), generator=g).repeat(repeats)[None]


@pytest.fixture
def accepts(monkeypatch):
    """Every decode_store.accept of the run: (layer, drafts pending, drafts accepted)."""
    seen = []
    accept = decode_store.accept

    def spy(store, n):
        seen.append((store.layer, int(store.pending_T or 0), int(n)))
        return accept(store, n)

    monkeypatch.setattr(decode_store, "accept", spy)
    return seen


def _greedy(model, ids, n, **kw):
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False, **kw)
    return out[0, ids.shape[1]:].tolist()


def _rounds(seen, drafts: int = 3) -> list[tuple[int, int]]:
    """(tokens verified, tokens kept) of the verify rounds after the prompt's in the first
    recurrent layer: a round verifies the last accepted token and up to `drafts` drafts."""
    first = min(layer for layer, _, _ in seen)
    return [(p, a) for layer, p, a in seen if layer == first and 1 < p <= drafts + 1]


@pytest.mark.parametrize("fam, seed, prompt, n", [("qwen3_5", 11, 5, 24), ("mamba2", 12, 5, 32),
                                                  ("kimi_linear", 11, 7, 32)])
def test_prompt_lookup_equals_greedy(fam, seed, prompt, n, accepts):
    """prompt_lookup_num_tokens=3 on a patched tiny model of each kind gives plain greedy's
    tokens, with drafts accepted in some rounds and rejected in others (seeds where greedy
    repeats a phrase); the unpatched model is refused by HF, patched it is not, unpatched again
    it is refused again."""
    model = _tiny(fam, seed)
    ids = _prompt(prompt)
    with pytest.raises(ValueError, match=REFUSAL):
        _greedy(model, ids, 4, prompt_lookup_num_tokens=3)
    patch(model, "s32_rs", buffer_len=8)
    ref = _greedy(model, ids, n)
    accepts.clear()
    assert _greedy(model, ids, n, prompt_lookup_num_tokens=3) == ref
    rounds = _rounds(accepts)
    assert any(a > 1 for _, a in rounds) and any(a < p for p, a in rounds), rounds
    unpatch(model)
    with pytest.raises(ValueError, match=REFUSAL):
        _greedy(model, ids, 4, prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("fam, seed, prompt, n", [("qwen3_5", 11, 5, 24), ("mamba2", 12, 5, 32),
                                                  ("kimi_linear", 11, 7, 32)])
def test_state_after_speculation_is_plain_decodes(fam, seed, prompt, n):
    """After prompt lookup, every patched layer holds the state plain decode leaves over the
    same tokens: the recurrent state (the anchor with its committed entries) and the
    convolution state within float32 reassociation of the largest element (measured: at most
    1.0e-6 and 4.9e-7 of it; the drafts rounded to bf16 in the torch engine's ring moved the
    first GDN layer's state by 1.6e-3, this test's tiny models' by 1e-3 to 8e-3). Not bit for
    bit: a verify flushes its committed entries where they leave no room for its drafts
    (h + T > L), plain decode where they fill the buffer."""
    model = patch(_tiny(fam, seed), "s32_rs", buffer_len=8)
    ids = _prompt(prompt)
    outs = [model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           do_sample=False, return_dict_in_generate=True, **kw)
            for kw in ({}, {"prompt_lookup_num_tokens": 3})]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    layers = [i for i, lay in enumerate(outs[0].cache.layers) if hasattr(lay, STATE_ATTR)]
    assert layers
    for i in layers:
        plain, spec = (o.cache.layers[i] for o in outs)
        for a, b in ((decode_store.to_replay_state(getattr(x, STATE_ATTR)).current_state()
                      for x in (plain, spec)), (plain.conv_states[0], spec.conv_states[0])):
            assert a.shape == b.shape
            assert (a - b).abs().max() <= 1e-5 * a.abs().max(), (i, (a - b).abs().max())


def test_embedded_model_prompt_lookup(accepts):
    """The embedded tiny-qwen3.5 on a repeated verse: prompt lookup equals plain greedy and
    accepts drafts."""
    from transformers import AutoTokenizer
    from replayquant.data import tiny_model_path
    tok = AutoTokenizer.from_pretrained(tiny_model_path("tiny-qwen3.5"))
    verse = "And God said, Let there be light: and there was light. "
    ids = tok(verse * 3, return_tensors="pt").input_ids
    model = load_model("tiny-qwen3.5", pair="s32_rs")
    ref = _greedy(model, ids, 24)
    accepts.clear()
    assert _greedy(model, ids, 24, prompt_lookup_num_tokens=3) == ref
    assert any(a > 1 for _, a in _rounds(accepts)), accepts


def _noisy_copy(model, noise: float):
    """A copy of model whose LM head carries Gaussian noise of `noise` times its spread: an
    assistant that drafts the target's tokens often, not always."""
    helper = copy.deepcopy(model)
    with torch.no_grad():
        w = helper.get_output_embeddings().weight
        w.add_(noise * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    return helper


@pytest.mark.parametrize("assistant", ["patched", "unpatched"])
def test_assistant_model_equals_greedy(assistant, accepts):
    """A second tiny model of the same vocabulary drafts 3 tokens a round: for a patched tiny
    Kimi Linear, a patched noisy copy of it (whose own cache HF crops as the target's: its decode
    steps stay uncommitted until then), with rounds that keep some drafts and drop others; for a
    patched tiny Qwen3.5, an unpatched plain transformer (Qwen3, attention only)."""
    if assistant == "patched":
        base = _tiny("kimi_linear", 11)
        helper = patch(_noisy_copy(base, 1.0), "s32_rs", buffer_len=8)
        target = patch(base, "s32_rs", buffer_len=8)
    else:
        target = patch(_tiny("qwen3_5", 11), "s32_rs", buffer_len=8)
        torch.manual_seed(12)
        helper = model_from_config(transformers.Qwen3Config(
            vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            head_dim=16, num_attention_heads=2, num_key_value_heads=1)).eval()
    helper.generation_config.num_assistant_tokens = 3
    helper.generation_config.assistant_confidence_threshold = 0.0     # always 3 drafts
    ids = _prompt(5)
    ref = _greedy(target, ids, 16)
    accepts.clear()
    assert _greedy(target, ids, 16, assistant_model=helper) == ref
    if assistant == "patched":
        target_rounds = [(p, a) for p, a in _rounds(accepts) if a > 0]    # the assistant's: 0
        assert any(1 < a < p for p, a in target_rounds), target_rounds


def test_refused_before_any_forward():
    """A pair whose L is below the draft length is one error naming both, before any forward;
    so is an assistant whose draft length may grow past it, and a static cache (which HF does
    not compile while it records the past, and whose tokens differed from plain greedy's)."""
    model = patch(_tiny("qwen3_5", 11), "s32_rs", buffer_len=2)
    ids = _prompt(5)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=r"prompt_lookup_num_tokens=3.*L = 2"):
        _greedy(model, ids, 4, prompt_lookup_num_tokens=3)
    helper = patch(_tiny("qwen3_5", 12), "s32_rs", buffer_len=8)
    helper.generation_config.num_assistant_tokens = 2
    helper.generation_config.num_assistant_tokens_schedule = "heuristic"
    with pytest.raises(ValueError, match="heuristic"):
        _greedy(model, ids, 4, assistant_model=helper)
    with pytest.raises(ValueError, match="cache_implementation='static'"):
        _greedy(patch(model, "s32_rs", buffer_len=8), ids, 16, prompt_lookup_num_tokens=3,
                cache_implementation="static")
    assert not calls
