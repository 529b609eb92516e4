"""Lockstep scoring: reference and test variants of one model, segment by segment.

One model object serves every variant. A variant is the model as it is (the reference) or the model
with a precision pair patched in (`replayquant.patch` / `unpatch`, the model-integration API);
each variant keeps its own cache, so its recurrent state carries over from segment to segment.
Per segment the reference and every pair run over the same tokens; the final hidden states of a
segment are kept, and the LM head is applied to a few positions at a time, so full-vocabulary
logits exist only for `lm_chunk` positions at once (never for a whole segment, let alone the
whole context). The reference's log-probabilities of a chunk serve every pair.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable

import torch

import replayquant
from replayquant.pairs import PrecisionPair

from . import stats as S
from .data import Document


# ----------------------------------------------------------------------------------------------
# Variants: the reference and one per precision pair, over one shared model.

@dataclasses.dataclass
class Variant:
    """The shared model in one configuration. `enter`/`exit` switch the model into it and back."""
    name: str
    record: dict
    enter: Callable[[], None] | None = None
    exit: Callable[[], None] | None = None

    @contextlib.contextmanager
    def active(self):
        if self.enter is not None:
            self.enter()
        try:
            yield
        finally:
            if self.exit is not None:
                self.exit()


def pair_record(pair) -> dict:
    """A JSON-able description of a resolved precision pair (name, read, anchor, buffer_len)."""
    for attr in ("to_dict", "as_dict", "record"):
        f = getattr(pair, attr, None)
        if callable(f):
            return _jsonable(f())
    if dataclasses.is_dataclass(pair):
        return _jsonable(dataclasses.asdict(pair))
    if isinstance(pair, dict):
        return _jsonable(pair)
    return _jsonable({k: v for k, v in vars(pair).items() if not k.startswith("_")})


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if dataclasses.is_dataclass(x):
        return _jsonable(dataclasses.asdict(x))
    if hasattr(x, "__dict__"):
        return _jsonable({k: v for k, v in vars(x).items() if not k.startswith("_")})
    return str(x)


def check_pair_names(pairs) -> list[str]:
    """The names of resolved pairs, refused (one ValueError) when two share a name (results are
    keyed by name) or one is named 'reference' (the comparison's reference)."""
    names = [str(getattr(p, "name", None) or pair_record(p).get("name")) for p in pairs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"pair name(s) {', '.join(dup)} given more than once (results are kept by "
                         f"pair name): drop the repeated --pair, or give the pair YAML another "
                         f"name: line")
    if "reference" in names:
        raise ValueError("a pair is named 'reference', the name the KL results give the reference "
                         "model: rename it (the name: line of its YAML, or the file's name)")
    return names


def patch_variant(model, pair, prefill: str, seed: int) -> Variant:
    """The model with `pair` patched in for the duration of `active()` (model-integration API)."""
    patch, unpatch = getattr(replayquant, "patch", None), getattr(replayquant, "unpatch", None)
    if patch is None or unpatch is None:
        raise ValueError("replayquant.patch / unpatch (model integration) are not available in "
                         "this installation")
    kw = {"prefill": prefill}
    if "seed" in inspect.signature(patch).parameters:
        kw["seed"] = seed
    rec = pair_record(pair)
    return Variant(name=str(getattr(pair, "name", rec.get("name"))), record=rec,
                   enter=lambda: patch(model, pair, **kw), exit=lambda: unpatch(model))


def reference_variant(model=None, mode: str = "exact", seed: int = 0) -> Variant:
    """The reference: the same model with exact FP32 recurrent state (no replay rounding).

    mode "exact" (default): the model patched with the shared FP32 pair `s32_rs` and
    prefill="exact", i.e. every segment computed in FP32 from the FP32 state, cast once to FP32
    (the identity). This is exact FP32 state for every family and dtype, through the same layer
    code as the pairs. mode "hf": the model as loaded (Hugging Face's own recurrence; its state
    is FP32 for Gated DeltaNet, but HF's torch Mamba-2 path keeps the scan in the model dtype).
    """
    if mode == "hf":
        return Variant(name="reference", record={"name": "reference", "mode": "hf",
                                                 "state": "the unpatched Hugging Face model"})
    if mode != "exact":
        raise ValueError(f"--reference must be 'exact' or 'hf', got {mode!r}")
    pair = PrecisionPair.load("s32_rs")
    v = patch_variant(model, pair, "exact", seed)
    return Variant(name="reference", record={"name": "reference", "mode": "exact",
                                             "pair": pair_record(pair), "prefill": "exact"},
                   enter=v.enter, exit=v.exit)


# ----------------------------------------------------------------------------------------------
# Segmented forward.

def cache_kwarg(base) -> str:
    """The forward argument that takes the cache: `cache` (transformers 5.24), `past_key_values`
    (5.17) or `cache_params` (5.17's Mamba-2, whose forward takes no `past_key_values`: a cache
    passed under that name would be dropped and every forward would start from zero state)."""
    params = inspect.signature(base.forward).parameters
    for name in ("cache", "past_key_values", "cache_params"):
        if name in params:
            return name
    return "past_key_values"


def output_cache(out):
    """The cache a forward returned, under whichever name (`cache_kwarg`)."""
    keys = out.keys() if hasattr(out, "keys") else ()
    for name in ("cache", "past_key_values", "cache_params"):
        if name in keys:
            return out[name]
    return None


class SegmentRunner:
    """Runs one variant's forward over consecutive segments of one document, keeping its cache."""

    def __init__(self, model):
        self.model = model
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        if self.head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (LM head)")
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(cfg, attr, None):
                raise ValueError(f"models with {attr} are not supported by the KL harness")
        # imported here: replayquant.models imports transformers, which importing replayquant.kl
        # to read results (`replayquant table`) does not need
        from replayquant.models.families import lm_head_scale
        self.head_scale = lm_head_scale(model)   # Falcon-H1 / Granite-4 scale the head's output
        self.cache_kw = cache_kwarg(self.base)
        self.has_cache_position = "cache_position" in inspect.signature(self.base.forward).parameters
        self.device = self.head.weight.device

    def forward(self, ids: torch.Tensor, cache, start: int):
        kw = {self.cache_kw: cache, "use_cache": True}
        if self.has_cache_position:
            kw["cache_position"] = torch.arange(start, start + ids.shape[-1], device=ids.device)
        out = self.base(input_ids=ids, **kw)
        return out.last_hidden_state[0], output_cache(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.head(hidden.to(self.head.weight.device, self.head.weight.dtype))
        return out if self.head_scale == 1.0 else out * self.head_scale


def default_lm_chunk(vocab: int) -> int:
    """Positions per LM-head chunk: about 2^28 float32 logits (1 GiB) at once."""
    return max(16, (1 << 28) // max(vocab, 1))


def score_document(runner: SegmentRunner, doc: Document, reference: Variant, tests: list[Variant],
                   segment: int, lm_chunk: int | None = None, on_segment: Callable[[int], None] | None = None,
                   first: int = 0) -> dict[str, dict]:
    """Per-token metrics of every test variant against the reference over one document.

    Returns {variant name: {"kl", "nll_ref", "nll_test", "dp", "same_top": cpu tensors [T-1-first]}};
    position t predicts token t+1, so a document of T tokens has T-1 positions to score; the
    positions before `first` run through the models (they build the state) but are not scored.
    """
    toks = doc.tokens
    T = toks.numel()
    variants = [reference] + tests
    caches: dict[str, Any] = {v.name: None for v in variants}
    parts: dict[str, dict[str, list]] = {v.name: {k: [] for k in ("kl", "nll_ref", "nll_test", "dp", "same_top")}
                                         for v in tests}
    dev_ids = toks.to(runner.device)
    for s in range(0, T, segment):
        e = min(T, s + segment)
        ids = dev_ids[s:e].unsqueeze(0)
        hidden = {}
        for v in variants:
            with v.active():
                hidden[v.name], caches[v.name] = runner.forward(ids, caches[v.name], s)
        n_scored = min(e, T - 1) - s   # the document's last position has no next token
        chunk = lm_chunk or default_lm_chunk(runner.head.weight.shape[0])
        for c in range(max(0, first - s), n_scored, chunk):
            c1 = min(n_scored, c + chunk)
            targets = dev_ids[s + c + 1: s + c1 + 1]
            ref_logits = runner.logits(hidden[reference.name][c:c1])
            targets = targets.to(ref_logits.device)
            ref_logp = torch.log_softmax(ref_logits.float(), dim=-1)
            del ref_logits
            for v in tests:
                test_logits = runner.logits(hidden[v.name][c:c1]).to(ref_logp.device)
                m = S.token_metrics(None, test_logits, targets, ref_logp=ref_logp)
                del test_logits
                for k, val in m.items():
                    parts[v.name][k].append(val.cpu())
            del ref_logp
        del hidden
        if on_segment is not None:
            on_segment(e - s)
    del caches
    return {name: {k: torch.cat(vals) for k, vals in p.items()} for name, p in parts.items()}
