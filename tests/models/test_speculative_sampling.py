"""HF's assisted generation with sampling on patched models: prompt lookup and an assistant model
with `do_sample=True`, through transformers' own candidate generators and acceptance rule (for
prompt lookup: the target samples every position of a round and keeps the drafts it sampled
itself; for an assistant with logits: HF's speculative sampling).

On tiny random Gated DeltaNet (Qwen3.5), Mamba-2 and Kimi Delta Attention (Kimi Linear) models
with gates that remember, patched with the shared FP32 pair (s32_rs, the torch engine on the CPU),
with prompt lookup and with a draft model (a patched noisy copy of the target; for Mamba-2 a tiny
transformer, since HF asks an assistant's cache for its length through an attention layer):
* sampling with top_k=1 gives plain greedy's tokens (one candidate per position);
* sampling with a fixed seed gives another continuation than greedy, keeps drafts in some
  rounds and drops them in others, and each of its tokens was drawn from the target's own
  distribution: the logits the speculative run scored each position with equal those of plain
  decode over the same tokens (a logits processor forces them), and so does every patched
  layer's state after the run (within float32 reassociation, as in test_speculative).
The embedded tiny-qwen3.5, tiny-mamba2 and tiny-kimi-linear sample with prompt lookup as well, on
a verse said three times (slow: three models load).
"""

import pytest
import torch

from replayquant.models import decode_store, patch
from replayquant.models.patching import model_from_config
from replayquant.models.runtime import STATE_ATTR
from test_speculative import _noisy_copy, _prompt, _rounds, _tiny, accepts  # noqa: F401

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

# (family, model seed, prompt seed, sampling: top_k, temperature, seed): settings whose run keeps
# drafts in some rounds (the tiny random models' distributions are nearly flat; at temperature 1
# over the whole vocabulary the tiny Qwen3.5 drew other tokens than the drafts in every round)
FAMILIES = [("qwen3_5", 11, 5, 2, 1.0, 0), ("mamba2", 12, 5, 0, 1.0, 1),
            ("kimi_linear", 11, 7, 0, 0.5, 1)]


class _Force(transformers.LogitsProcessor):
    """Plain decode over given tokens: at each step every other token gets -inf."""

    def __init__(self, tokens: list[int], start: int):
        self.tokens, self.start = tokens, start

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[input_ids.shape[1] - self.start]] = 0
        return forced


def _generate(model, ids, n, **kw):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, return_dict_in_generate=True, output_logits=True,
                          **kw)


def _same_as_plain_decode(model, ids, out):
    """The run's logits and every patched layer's state equal plain decode's over its tokens."""
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    plain = _generate(model, ids, len(tokens), do_sample=False,
                      logits_processor=[_Force(tokens, ids.shape[1])])
    assert torch.equal(plain.sequences, out.sequences)
    for i, (a, b) in enumerate(zip(plain.logits, out.logits)):
        assert (a - b).abs().max() <= 1e-4 * a.abs().max(), (i, (a - b).abs().max())
    layers = [i for i, lay in enumerate(out.cache.layers) if hasattr(lay, STATE_ATTR)]
    assert layers
    for i in layers:
        p, s = plain.cache.layers[i], out.cache.layers[i]
        for a, b in ((decode_store.to_replay_state(getattr(x, STATE_ATTR)).current_state() for x in (p, s)),
                     (p.conv_states[0], s.conv_states[0])):
            assert (a - b).abs().max() <= 1e-5 * a.abs().max(), (i, (a - b).abs().max())


def _lookup_sampled(model, ids, temperature, top_k, draw, accepts):
    """Prompt lookup with sampling: at top_k=1 it gives greedy's tokens; at `temperature` and
    `top_k` (0: all), seeded with `draw`, other tokens, its rounds recorded in `accepts`."""
    greedy = _generate(model, ids, 24, do_sample=False).sequences
    torch.manual_seed(0)
    top1 = _generate(model, ids, 24, do_sample=True, top_k=1, prompt_lookup_num_tokens=3)
    assert torch.equal(top1.sequences, greedy)
    accepts.clear()
    torch.manual_seed(draw)
    out = _generate(model, ids, 24, do_sample=True, temperature=temperature, top_k=top_k,
                    prompt_lookup_num_tokens=3)
    assert not torch.equal(out.sequences, greedy)
    return out


@pytest.mark.parametrize("fam, seed, prompt, top_k, temperature, draw", FAMILIES)
def test_prompt_lookup_sampling(fam, seed, prompt, top_k, temperature, draw, accepts):
    model = patch(_tiny(fam, seed), "s32_rs", buffer_len=8)
    ids = _prompt(prompt)
    out = _lookup_sampled(model, ids, temperature, top_k, draw, accepts)
    rounds = _rounds(accepts)
    assert any(a > 1 for _, a in rounds) and any(a < p for p, a in rounds), rounds
    _same_as_plain_decode(model, ids, out)


def _assistant(fam: str, base):
    """A draft model for `base`: for Kimi Linear and Qwen3.5 a patched noisy copy of it (whose
    own cache HF crops as the target's); for Mamba-2, whose copy would have no attention layer
    for HF to ask its cache's length, a tiny unpatched transformer (Qwen3) of its vocabulary."""
    if fam != "mamba2":
        return patch(_noisy_copy(base, 1.0), "s32_rs", buffer_len=8)
    torch.manual_seed(12)
    return model_from_config(transformers.Qwen3Config(
        vocab_size=base.get_output_embeddings().weight.shape[0], hidden_size=32,
        intermediate_size=48, num_hidden_layers=2, head_dim=16, num_attention_heads=2,
        num_key_value_heads=1)).eval()


@pytest.mark.parametrize("fam, seed", [("qwen3_5", 11), ("mamba2", 12), ("kimi_linear", 11)])
def test_assistant_sampling(fam, seed, accepts):
    """A draft model proposes 3 tokens a round with sampling (HF's speculative sampling: the
    drafts' and the target's probabilities decide which drafts stay)."""
    base = _tiny(fam, seed)
    helper = _assistant(fam, base)
    target = patch(base, "s32_rs", buffer_len=8)
    helper.generation_config.num_assistant_tokens = 3
    helper.generation_config.assistant_confidence_threshold = 0.0
    ids = _prompt(5)
    greedy = _generate(target, ids, 16, do_sample=False).sequences
    torch.manual_seed(0)
    top1 = _generate(target, ids, 16, do_sample=True, top_k=1, assistant_model=helper)
    assert torch.equal(top1.sequences, greedy)
    accepts.clear()
    torch.manual_seed(1)
    out = _generate(target, ids, 16, do_sample=True, temperature=1.0, top_k=0,
                    assistant_model=helper)
    assert not torch.equal(out.sequences, greedy)
    rounds = [(p, a) for p, a in _rounds(accepts) if a > 0]     # the assistant's own: 0
    assert any(a > 1 for _, a in rounds) and any(a < p for p, a in rounds), rounds
    _same_as_plain_decode(target, ids, out)


@pytest.mark.slow
@pytest.mark.parametrize("name, temperature, draw", [("tiny-qwen3.5", 0.5, 1),
                                                     ("tiny-mamba2", 0.5, 1),
                                                     ("tiny-kimi-linear", 0.7, 0)])
def test_embedded_models_sample_with_prompt_lookup(name, temperature, draw, accepts):
    """The embedded models on a verse said three times: sampling with top_k=1 gives greedy's
    tokens; sampling at the temperature keeps drafts in some round and scores each token with
    plain decode's logits."""
    from transformers import AutoTokenizer

    from replayquant.data import tiny_model_path
    from replayquant.models import load_model
    tok = AutoTokenizer.from_pretrained(tiny_model_path(name))
    ids = tok("And God said, Let there be light: and there was light. " * 3,
              return_tensors="pt").input_ids
    model = load_model(name, pair="s32_rs", dtype="float32", buffer_len=8)
    out = _lookup_sampled(model, ids, temperature, 0, draw, accepts)
    assert any(a > 1 for _, a in _rounds(accepts)), accepts
    _same_as_plain_decode(model, ids, out)
