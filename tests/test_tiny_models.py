"""The embedded tiny models (issue 8): load offline, trained (held-out perplexity far below a
uniform guess), held-out text present and large enough, short names resolve to the shipped folders."""

import json
import math

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
    # training log: held-out ppl 52 (qwen) / 83 (mamba) at 4K context; uniform would be 4096
    assert ppl < 250, f"{name}: held-out perplexity {ppl:.1f} is not that of a trained model"


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
