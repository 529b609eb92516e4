"""The KL run: reference and test models in lockstep, segment by segment, with resume.

One model object serves every variant. A variant is the model as it is (the reference) or the model
with a precision pair patched in (`replayquant.patch` / `unpatch`, the model-integration API);
each variant keeps its own cache, so its recurrent state carries over from segment to segment.
Per segment the reference and every pair run over the same tokens; the final hidden states of a
segment are kept, and the LM head is applied to a few positions at a time, so full-vocabulary
logits exist only for `lm_chunk` positions at once (never for a whole segment, let alone the
whole context). The reference's log-probabilities of a chunk serve every pair.

Files of a run with `out = build/kl/NAME.json` (checked before any work, `check_out`: a .json
name in a writable folder, not holding a file of another kind), each written through
`replayquant.outputs` (a temporary file of its own, fsync, rename; a failed write keeps the
earlier file); NAME.lock beside them while the run holds the output (a second run into it is
refused):
* `NAME.json`: the results (statistics per pair, per bucket, per document, provenance); rewritten
  after every finished document (`"complete": false` until the last one);
* `NAME.kl/docNNNNN.npy`: per-token KL of one document, float32 [n_pairs, n_scored] (the scored
  positions, `stats.scored_range`: context - 1 of them under --scoring all, the second half under
  llama); float32 as llama.cpp keeps them, so percentiles and medians are those of the values
  computed (float16 would move them by up to 2^-11 of their size);
* `NAME.kl/docNNNNN.dp.npy`: per-token delta-p of one document, float32 [n_pairs, n_scored];
* `NAME.kl/docNNNNN.nll.npy`: per-token NLL, float32 [1 + n_pairs, n_scored] (row 0 the
  reference's, row 1 + j pair j's), and `docNNNNN.top.npy`, whether the top tokens agree, bool
  [n_pairs, n_scored]: with the KL and delta-p, every per-token value the statistics are made of,
  so a run that scored every position can be re-scored to llama.cpp's window (`rescore`);
* `NAME.kl/progress.rankR.jsonl`: append-only log, a config line then one line per finished
  document with exact float64 sums, the sha256 of its tokens and the code version; resume reads
  these and skips finished documents, recomputes (saying so) a document whose tokens or id
  changed, and refuses another configuration or another code version (`finished_documents`);
* `NAME.png`: KL against position (log x), one line per pair.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import os
import resource
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from replayquant.outputs import (append_line, check_owned, check_writable_folder, diff_records,
                                 other_run_error, output_lock, save_npy, write_json)

from . import stats as S
from .data import Document, DocumentSet, load_documents
from .report import RESULTS_KIND

RESULTS_VERSION = 1


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


def resolve_pair(spec):
    """A precision pair from a name in configs/pairs/, a YAML path, or a pair object; a layer
    policy (replayquant.policy) from a policy YAML path."""
    if not isinstance(spec, (str, os.PathLike)):
        return spec
    try:
        from replayquant.policy import load_pair_or_policy
    except ImportError:
        raise ValueError("precision pairs are not available in this installation "
                         "(replayquant.policy is missing)") from None
    try:
        return load_pair_or_policy(str(spec))
    except ValueError:
        raise
    except (FileNotFoundError, KeyError, OSError) as e:
        raise ValueError(f"unknown precision pair {str(spec)!r} ({e}); give a name from "
                         f"`replayquant pairs` or the path of a pair YAML file") from None


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
    import replayquant
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
    pair = resolve_pair("s32_rs")
    v = patch_variant(model, pair, "exact", seed)
    return Variant(name="reference", record={"name": "reference", "mode": "exact",
                                             "pair": pair_record(pair), "prefill": "exact"},
                   enter=v.enter, exit=v.exit)


# ----------------------------------------------------------------------------------------------
# Segmented forward.

def _cache_kwarg(base) -> str:
    params = inspect.signature(base.forward).parameters
    for name in ("cache", "past_key_values", "cache_params"):
        if name in params:
            return name
    return "past_key_values"


def _out_cache(out):
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
        from replayquant.models.families import lm_head_scale
        self.head_scale = lm_head_scale(model)   # Falcon-H1 / Granite-4 scale the head's output
        self.cache_kw = _cache_kwarg(self.base)
        self.has_cache_position = "cache_position" in inspect.signature(self.base.forward).parameters
        self.device = self.head.weight.device

    def forward(self, ids: torch.Tensor, cache, start: int):
        kw = {self.cache_kw: cache, "use_cache": True}
        if self.has_cache_position:
            kw["cache_position"] = torch.arange(start, start + ids.shape[-1], device=ids.device)
        out = self.base(input_ids=ids, **kw)
        return out.last_hidden_state[0], _out_cache(out)

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


# ----------------------------------------------------------------------------------------------
# Progress files and resume.

def _paths(out: Path) -> tuple[Path, Path]:
    return out.with_suffix(".kl"), out.with_suffix(".png")


def check_out(out: str | os.PathLike) -> Path:
    """The results path of a run, checked before any work: a file name ending in .json (the
    plot goes beside it as NAME.png and the per-document files into NAME.kl/, so no other
    suffix can share a name with them), not a folder, in a folder that can be written (created
    if missing). Returns it as a Path; raises one ValueError saying what to give instead."""
    out = Path(os.path.expanduser(str(out)))
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; give the results file's name, e.g. "
                         f"--out {out / 'results.json'}")
    if out.suffix.lower() != ".json":
        raise ValueError(f"--out {out}: the results file must end in .json (the plot is written "
                         f"beside it as NAME.png, the per-document files into NAME.kl/); give e.g. "
                         f"--out {out.with_suffix('.json')}")
    if out.exists() and not out.is_file():
        raise ValueError(f"--out {out} exists and is not a regular file; give another --out")
    run_dir, png = _paths(out)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--out {out}: {run_dir} (where the per-document files go) exists and is "
                         f"not a folder; move it away or give another --out")
    if png.is_dir():
        raise ValueError(f"--out {out}: {png} (where the plot goes) is a folder; move it away or "
                         f"give another --out")
    check_writable_folder(out.parent, out)
    if run_dir.is_dir():
        check_writable_folder(run_dir, out)
    # a file there is replaced only when it is a KL results file (the configuration is compared
    # with the run's in `finished_documents`); the plot only with it or with its run's folder
    check_owned(out, RESULTS_KIND, "replayquant kl", beside=() if run_dir.is_dir() else (png,),
                rebuilt_from=f"{run_dir}/" if run_dir.is_dir() else None)
    return out


def read_progress(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(config headers, document records) of every progress file; a torn last line is ignored."""
    headers, records = [], []
    for f in sorted(run_dir.glob("progress.rank*.jsonl")):
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue   # interrupted mid-write: that document is redone
                if obj.get("type") == "config":
                    headers.append(obj)
                elif obj.get("type") == "document":
                    records.append(obj)
    return headers, records


def _fresh(out: Path) -> list[str]:
    """The files of a run besides NAME.json, named where a message says how to start fresh."""
    run_dir, png = _paths(out)
    return [str(png), f"{run_dir}/"]


def _scoring(config: dict) -> str:
    """The scoring of a configuration; files written before scorings existed scored every position."""
    return config.get("scoring", "all")


def _check_scoring(out: Path, run_dir: Path, old: dict, config: dict) -> None:
    """One ValueError when results on disk were scored another way than this run scores, or by
    a version that recorded no scoring (and kept per-token KL in float16)."""
    if not isinstance(old, dict) or "context" not in old:
        return
    if "scoring" not in old:
        raise ValueError(f"{out} holds results of an earlier replayquant, which recorded no "
                         f"scoring and kept per-token KL in float16 (this one keeps float32, so "
                         f"the percentiles would mix the two): refusing to resume it. Pass a new "
                         f"--out, or delete {out} and {run_dir}/ to recompute")
    was, now = _scoring(old), _scoring(config)
    if was != now:
        raise ValueError(f"{out} holds results scored with --scoring {was} ({_SCORING_WORDS.get(was, was)}); "
                         f"this run scores with --scoring {now} ({_SCORING_WORDS[now]}): refusing to "
                         f"mix them. Run with --scoring {was} to resume, pass a new --out, or delete "
                         f"{out} and {run_dir}/ to start fresh")


_SCORING_WORDS = {"all": "every position", "llama": "the second half of each window, as llama.cpp"}


def _kl_shape(config: dict) -> tuple[int, int]:
    first, stop = S.scored_range(config["context"], _scoring(config))
    return len(config["pairs"]), stop - first


def document_fingerprint(tokens: torch.Tensor) -> str:
    """sha256 of a document's token ids (int64, little-endian): what its KL was computed on."""
    a = np.ascontiguousarray(tokens.detach().cpu().numpy().astype("<i8"))
    return "sha256:" + hashlib.sha256(a.tobytes()).hexdigest()[:32]


def code_version() -> dict:
    """The code that computes per-document results: replayquant's version and the git commit
    of the checkout it runs from (`provenance.git_commit`: '+dirty' with uncommitted edits,
    'unknown' outside a checkout)."""
    import replayquant
    from replayquant.provenance import git_commit
    return {"replayquant": replayquant.__version__, "git_commit": git_commit()}


def same_code(a, b) -> bool:
    """Whether two `code_version` records name the same code: the same replayquant version and,
    where both runs came from clean checkouts, the same commit (a commit names the code exactly
    only without uncommitted edits; with them, or outside a checkout, the version is all that
    can be compared)."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    if a.get("replayquant") != b.get("replayquant"):
        return False
    ca, cb = str(a.get("git_commit")), str(b.get("git_commit"))
    exact = all(c != "unknown" and not c.endswith("+dirty") for c in (ca, cb))
    return ca == cb if exact else True


def _code_str(code) -> str:
    if not isinstance(code, dict):
        return "a replayquant that did not record its version"
    return f"replayquant {code.get('replayquant')} at commit {code.get('git_commit')}"


def _say(console, msg: str) -> None:
    if console is not None:
        console.print(msg, markup=False, highlight=False, soft_wrap=True)   # paths stay whole
    else:
        import sys
        print(msg, file=sys.stderr)


def finished_documents(out: Path, config: dict, docs: DocumentSet, code: dict | None = None,
                       fingerprints: dict[int, str] | None = None,
                       report: Callable[[str], None] | None = None) -> dict[int, dict]:
    """Records of documents already finished by earlier runs of this configuration and code.

    Refused (ValueError, saying what to do): results of another configuration, or per-document
    results of other code (`same_code`; code None: this code's `code_version()`). Recomputed, with one
    line through `report` naming the document and why: a finished document whose id or tokens
    (`document_fingerprint`) differ from the document the dataset now gives at its index."""
    run_dir, _ = _paths(out)
    code = code_version() if code is None else code
    if fingerprints is None:
        fingerprints = {d.index: document_fingerprint(d.tokens) for d in docs.documents}
    headers, records = read_progress(run_dir) if run_dir.is_dir() else ([], [])
    for r in records:
        if not same_code(r.get("code"), code):
            raise ValueError(
                f"{run_dir}/ holds per-document results computed by {_code_str(r.get('code'))}; "
                f"this is {_code_str(code)}: refusing to mix results of two code versions. Resume "
                f"with that code, pass a new --out, or delete {out} and {run_dir}/ to recompute")
    if out.exists():
        try:
            old = json.loads(out.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            old = None
        if isinstance(old, dict) and old.get("kind") == RESULTS_KIND:
            _check_scoring(out, run_dir, old.get("config", {}), config)
    check_owned(out, RESULTS_KIND, "replayquant kl", identity=config,
                recorded=lambda old: old.get("config", {}),
                rebuilt_from=f"{run_dir}/" if run_dir.is_dir() else None,
                fresh=_fresh(out))
    for h in headers:
        _check_scoring(out, run_dir, h["config"], config)
        diffs = diff_records(h["config"], config)
        if diffs:
            raise other_run_error(out, diffs, _fresh(out))
    planned = {d.index: d for d in docs.documents}
    done, stale = {}, {}
    for r in records:
        i = r["index"]
        if i not in planned:
            continue                  # beyond this run's --docs: kept for a larger one
        d = planned[i]
        if r["id"] != d.id or r.get("tokens") != fingerprints[i]:
            stale[i] = r
            continue
        if (run_dir / r["npy"]).exists():
            load_document_kl(run_dir / r["npy"], _kl_shape(config), i)
            done[i] = r
    for i in sorted(set(stale) - set(done)):
        r, d = stale[i], planned[i]
        why = (f"the dataset now gives {d.id!r} at this index, {r['id']!r} was computed"
               if r["id"] != d.id else
               f"its tokens differ from those its KL was computed on ({r.get('tokens')} then, "
               f"{fingerprints[i]} now: the text or the tokenizer changed)")
        if report is not None:
            report(f"document {i} ({d.id!r}): {why}; recomputing it")
    return done


def _append(path: Path, obj: dict):
    append_line(path, json.dumps(obj))


def load_document_kl(path: Path, shape: tuple, index: int) -> np.ndarray:
    """A document's per-token KL file, float32 [n_pairs, n_scored]; a damaged or foreign one
    is one ValueError naming it and saying how to recompute that document."""
    what = (f"delete it and re-run the same command to recompute document {index} (the other "
            f"finished documents are kept)")
    try:
        a = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"{path}, the per-token KL of document {index}, is damaged "
                         f"({type(e).__name__}: {e}); {what}") from None
    if a.dtype != np.float32 or tuple(a.shape) != tuple(shape):
        raise ValueError(f"{path}, the per-token KL of document {index}, holds {a.dtype} "
                         f"{list(a.shape)} where float32 {list(shape)} was written; {what}")
    return a


def _dp_name(npy: str) -> str:
    return npy[:-len(".npy")] + ".dp.npy"


def _side_name(npy: str, what: str) -> str:
    return npy[:-len(".npy")] + f".{what}.npy"


def _load_side(path: Path, dtype, shape: tuple, what: str, index: int) -> np.ndarray:
    """A per-token side file (NLL, top-token agreement) of document `index`, checked."""
    if not path.is_file():
        raise ValueError(f"{path} (the per-token {what} of document {index}) is missing: the run "
                         f"was written by an earlier replayquant, which kept no per-token {what}; "
                         f"run `replayquant kl --scoring llama` for llama.cpp's window")
    try:
        a = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        a = e
    if not isinstance(a, np.ndarray) or a.dtype != dtype or tuple(a.shape) != tuple(shape):
        raise ValueError(f"{path}, the per-token {what} of document {index}, is damaged; delete it "
                         f"and {path.name.split('.')[0]}.npy and re-run the kl command to recompute "
                         f"that document")
    return a


def load_scored(paths, scoring: str | None = None) -> list[tuple[str, dict]]:
    """(source, results) of each KL results file (`report.load_results`), re-scored to
    `scoring` where one is given (`rescore`; None: as each file was scored)."""
    from .report import load_results
    loaded = load_results(paths)
    if scoring is None:
        return loaded
    return [(src, rescore(res, src, scoring)) for src, res in loaded]


def rescore(res: dict, path: str | os.PathLike, scoring: str) -> dict:
    """The results `res` of the results file `path` as `scoring` gives them, rebuilt from the
    per-token values in its NAME.kl/ folder (KL, delta-p, NLL, top-token agreement): a run that
    scored every position re-scored to llama.cpp's window, as `kl --scoring llama` over the same
    documents gives it. The same scoring returns `res`; a run that scored fewer positions than
    asked for is one ValueError."""
    cfg = res["config"]
    was = _scoring(cfg)
    if scoring == was:
        return res
    if was != "all":
        raise ValueError(f"{path} scored only positions {S.scored_range(cfg['context'], was)[0]} "
                         f"... of each document (--scoring {was}); it cannot be re-scored with "
                         f"--scoring {scoring}: run `replayquant kl --scoring {scoring}`")
    path = Path(path)
    run_dir = path.parent / res.get("kl_tokens_dir", path.with_suffix(".kl").name)
    first, _ = S.scored_range(cfg["context"], scoring)
    shape = _kl_shape(cfg)
    names = [p["name"] for p in cfg["pairs"]]
    docs = next((st["per_document"] for st in res["results"].values() if st), [])
    per_pair: dict[str, list] = {n: [] for n in names}
    kl_all: dict[str, list] = {n: [] for n in names}
    dp_all: dict[str, list] = {n: [] for n in names}
    for d in docs:
        i = d["index"]
        npy = f"doc{i:05d}.npy"
        kl = load_document_kl(run_dir / npy, shape, i)
        dp = load_document_dp(run_dir, [{"index": i, "npy": npy}], shape)
        if dp is None:
            raise ValueError(f"{run_dir / _dp_name(npy)} (the per-token delta-p of document {i}) "
                             f"is missing; run `replayquant kl --scoring {scoring}`")
        dp = dp[i]
        nll = _load_side(run_dir / _side_name(npy, "nll"), np.float32, (1 + shape[0], shape[1]), "NLL", i)
        top = _load_side(run_dir / _side_name(npy, "top"), np.bool_, shape, "top-token agreement", i)
        for j, n in enumerate(names):
            m = {"kl": torch.from_numpy(kl[j, first:]), "dp": torch.from_numpy(dp[j, first:]),
                 "nll_ref": torch.from_numpy(nll[0, first:]), "nll_test": torch.from_numpy(nll[1 + j, first:]),
                 "same_top": torch.from_numpy(top[j, first:])}
            per_pair[n].append({"id": d["id"], "index": i, **S.document_sums(m, cfg["bucket_base"], first)})
            kl_all[n].append(kl[j, first:])
            dp_all[n].append(dp[j, first:])
    results = {n: (S.summarize(per_pair[n], np.concatenate(kl_all[n]), cfg["bucket_base"],
                               dp_values=np.concatenate(dp_all[n])) if per_pair[n] else None)
               for n in names}
    return {**res, "config": {**cfg, "scoring": scoring}, "results": results, "rescored_from": was}


def load_document_dp(run_dir: Path, recs: list[dict], shape: tuple) -> dict[int, np.ndarray] | None:
    """Per document, the per-token delta-p file (float32 [n_pairs, n_scored], for the delta-p
    percentiles); None when a document has none (computed by a version that did not write them).
    A damaged one is one ValueError naming it."""
    out = {}
    for r in recs:
        path = run_dir / _dp_name(r["npy"])
        if not path.exists():
            return None
        try:
            a = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            a = e
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or tuple(a.shape) != tuple(shape):
            raise ValueError(f"{path}, the per-token delta-p of document {r['index']}, is damaged; "
                             f"delete it and {r['npy']} and re-run the same command to recompute "
                             f"that document")
        out[r["index"]] = a
    return out


def _peak_memory() -> dict:
    out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_available():
        out["peak_gpu_bytes"] = max(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count()))
    return out


# ----------------------------------------------------------------------------------------------
# Model identity.

def model_record(model, name: str | None = None, dtype: str | None = None) -> dict:
    """Model id, hub revision or a local fingerprint, class and dtype, for the config and provenance."""
    cfg = model.config
    path = getattr(cfg, "_name_or_path", "") or ""
    # a local folder by its real path: named relative or absolute, it is the same model
    path = os.path.realpath(path) if path and os.path.isdir(path) else path
    name = os.path.realpath(name) if name and os.path.isdir(name) else name
    rec = {"id": name or path or type(model).__name__, "path": path, "class": type(model).__name__,
           "dtype": dtype or str(next(model.parameters()).dtype).replace("torch.", "")}
    rev = getattr(cfg, "_commit_hash", None)
    if rev:
        rec["revision"] = rev
    if path and Path(path).is_dir():
        rec["local_hash"] = local_fingerprint(Path(path))
    return rec


def local_fingerprint(folder: Path) -> str:
    """sha256 over config.json and, per weight file, its name, size and first and last MiB."""
    h = hashlib.sha256()
    files = sorted(p for p in folder.iterdir() if p.is_file() and
                   (p.name == "config.json" or p.suffix in (".safetensors", ".bin", ".pt")))
    for p in files:
        h.update(p.name.encode())
        size = p.stat().st_size
        h.update(str(size).encode())
        with open(p, "rb") as fh:
            if p.name == "config.json" or size <= 2 << 20:
                h.update(fh.read())
            else:
                h.update(fh.read(1 << 20))
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return "sha256:" + h.hexdigest()[:32]


def max_context(model) -> int | None:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    m = getattr(cfg, "max_position_embeddings", None)
    return int(m) if m else None


# ----------------------------------------------------------------------------------------------
# The run.

def _one_run_per_output(run):
    """`run` with its `out` checked (`check_out`) and locked (`replayquant.outputs.output_lock`)
    by the main process for the whole run: a second run into the same output is refused."""
    params = inspect.signature(run)

    @functools.wraps(run)
    def locked(*args, **kwargs):
        bound = params.bind(*args, **kwargs)
        bound.apply_defaults()
        out = bound.arguments["out"] = check_out(bound.arguments["out"])
        state = bound.arguments["state"]
        main = state is None or state.is_main_process
        with output_lock(out) if main else contextlib.nullcontext():
            return run(*bound.args, **bound.kwargs)
    return locked


@_one_run_per_output
def run_kl(model, tokenizer, pairs: list, *, dataset: str, out: str | os.PathLike,
           context: int = 131072, n_docs: int = 10, segment: int = 8192, prefill: str = "replay",
           seed: int = 0, split: str | None = "test", text_field: str = "text", pack: bool = False,
           model_info: dict | None = None, make_variant: Callable | None = None,
           reference: str | Variant = "exact", bucket_base: int = 1024, lm_chunk: int | None = None,
           progress: bool = True, console=None, state=None, plot: bool = True,
           extra_params: dict | None = None, documents: DocumentSet | None = None,
           scoring: str = "all") -> dict | None:
    """Run (or resume) a KL measurement; returns the results dict (on the main process).

    pairs: pair names / YAML paths / pair objects. make_variant(model, pair, prefill, seed) -> Variant
    builds the test variants (default: `replayquant.patch`). reference: "exact" (s32_rs patched
    with prefill="exact"), "hf" (the unpatched model) or a Variant (see `reference_variant`).
    state: an accelerate PartialState for data-parallel runs (documents are split round-robin
    between processes; process 0 merges the results).
    `documents`: a DocumentSet already loaded (by `load_documents` with the same settings).
    scoring: "all" (every position) or "llama" (the second half of each document, as llama.cpp's
    `--kl-divergence`; `stats.scored_range`); recorded in the results, and a resume with another
    scoring is refused.
    """
    t_start = time.time()
    if prefill not in ("replay", "exact"):
        raise ValueError(f"--prefill must be 'replay' or 'exact', got {prefill!r}")
    if segment < 1:
        raise ValueError(f"--segment must be >= 1, got {segment}")
    first, _ = S.scored_range(context, scoring)
    if not pairs:
        raise ValueError("give at least one --pair")
    limit = max_context(model)
    if limit is not None and context > limit:
        raise ValueError(f"--context {context} is longer than the model supports "
                         f"(max_position_embeddings = {limit}); lower --context")
    out = check_out(out)
    resolved = [resolve_pair(p) for p in pairs]
    check_pair_names(resolved)
    make_variant = make_variant or patch_variant
    tests = [make_variant(model, p, prefill, seed) for p in resolved]
    names = [v.name for v in tests]
    if len(set(names)) != len(names) or "reference" in names:
        raise ValueError(f"pair names must be distinct and not 'reference': {names}")
    if not isinstance(reference, Variant):
        reference = reference_variant(model, reference, seed)
    runner = SegmentRunner(model)

    docs = documents or load_documents(dataset, tokenizer, context, n_docs, split=split,
                                       text_field=text_field, pack=pack)
    if any(d.tokens.numel() != context for d in docs.documents):
        raise ValueError(f"the documents given are not all {context} tokens long")
    config = {
        "model": model_info or model_record(model),
        "reference": reference.record,
        "pairs": [{"name": v.name, **v.record} for v in tests],
        "prefill": prefill,
        # canonical values only, so that one dataset named two ways (a relative or an absolute
        # path, pg19 or emozilla/pg19) is one configuration
        "dataset": {"name": docs.source, "source": docs.source, "kind": docs.kind,
                    "split": docs.split, "pack": pack,
                    "text_field": None if docs.kind in ("folder", "txt") else text_field},
        "context": context, "segment": segment, "seed": seed, "bucket_base": bucket_base,
        "scoring": scoring,
    }
    run_dir, png = _paths(out)
    rank = state.process_index if state is not None else 0
    world = state.num_processes if state is not None else 1
    is_main = rank == 0

    code = code_version()
    fingerprints = {d.index: document_fingerprint(d.tokens) for d in docs.documents}
    done = finished_documents(out, config, docs, code, fingerprints,
                              report=(lambda msg: _say(console, msg)) if is_main else None)
    pending = [d for d in docs.documents if d.index not in done]
    if is_main and done:
        _say(console, f"resuming {out}: {len(done)} of {len(docs.documents)} document(s) already "
                      f"done and kept (in {run_dir}/); " +
                      (f"computing the other {len(pending)}" if pending else "nothing left to compute"))
    mine = pending[rank::world]
    if state is not None:
        state.wait_for_everyone()   # every process has read the same finished set before any writes
    run_dir.mkdir(parents=True, exist_ok=True)
    prog_file = run_dir / f"progress.rank{rank}.jsonl"
    if not prog_file.exists() or prog_file.stat().st_size == 0:
        _append(prog_file, {"type": "config", "config": config})

    bar = _Progress(progress and is_main, total=len(mine) * context,
                    label=f"KL {len(mine)} docs x {context} tok, {len(tests)} pair(s)", console=console)
    summary = None
    try:
        with bar, torch.inference_mode():
            for doc in mine:
                t0 = time.time()
                if torch.cuda.is_available():
                    for d in range(torch.cuda.device_count()):
                        torch.cuda.reset_peak_memory_stats(d)
                metrics = score_document(runner, doc, reference, tests, segment, lm_chunk,
                                         on_segment=bar.advance, first=first)
                npy = f"doc{doc.index:05d}.npy"
                save_npy(run_dir / npy, np.stack([metrics[v.name]["kl"].numpy().astype(np.float32)
                                                   for v in tests]))
                save_npy(run_dir / _dp_name(npy), np.stack([metrics[v.name]["dp"].numpy().astype(np.float32)
                                                             for v in tests]))
                save_npy(run_dir / _side_name(npy, "nll"), np.stack(
                    [metrics[tests[0].name]["nll_ref"].numpy()] +
                    [metrics[v.name]["nll_test"].numpy() for v in tests]).astype(np.float32))
                save_npy(run_dir / _side_name(npy, "top"), np.stack([metrics[v.name]["same_top"].numpy()
                                                                      for v in tests]))
                rec = {"type": "document", "index": doc.index, "id": doc.id, "n_tokens": context,
                       "tokens": fingerprints[doc.index], "code": code, "npy": npy, "wall_s": time.time() - t0, "rank": rank, **_peak_memory(),
                       "pairs": {v.name: S.document_sums(metrics[v.name], bucket_base, first)
                                 for v in tests}}
                _append(prog_file, rec)
                if is_main and world == 1:
                    summary = write_results(out, config, docs, t_start, extra_params, plot=False,
                                            fingerprints=fingerprints)
    except KeyboardInterrupt:
        _, recs = read_progress(run_dir)
        raise KeyboardInterrupt(f"interrupted: {len({r['index'] for r in recs})} of {len(docs.documents)} "
                                f"documents are finished and kept in {run_dir}/; re-run the same "
                                f"command to resume") from None
    if state is not None:
        state.wait_for_everyone()
    if is_main:
        summary = write_results(out, config, docs, t_start, extra_params, plot=plot,
                                fingerprints=fingerprints)
    return summary


def write_results(out: Path, config: dict, docs: DocumentSet, t_start: float,
                  extra_params: dict | None = None, plot: bool = True,
                  fingerprints: dict[int, str] | None = None) -> dict:
    """Merge every progress file into NAME.json (and NAME.png)."""
    from replayquant.provenance import provenance
    run_dir, png = _paths(out)
    _, records = read_progress(run_dir)
    by_index = {}
    if fingerprints is None:
        fingerprints = {d.index: document_fingerprint(d.tokens) for d in docs.documents}
    planned = {d.index: (d.id, fingerprints[d.index]) for d in docs.documents}
    for r in records:   # documents of this run's plan only (an earlier run may have had a larger
        #                 --docs), computed on the tokens the dataset gives now
        if planned.get(r["index"]) == (r["id"], r.get("tokens")) and (run_dir / r["npy"]).exists():
            by_index[r["index"]] = r
    recs = [by_index[i] for i in sorted(by_index)]
    arrays = {r["index"]: load_document_kl(run_dir / r["npy"], _kl_shape(config), r["index"])
              for r in recs}
    dps = load_document_dp(run_dir, recs, _kl_shape(config))
    results = {}
    for j, p in enumerate(config["pairs"]):
        name = p["name"]
        doc_recs = [{"id": r["id"], "index": r["index"], **r["pairs"][name]} for r in recs]
        kl = np.concatenate([arrays[r["index"]][j] for r in recs]) if recs else None
        dp = np.concatenate([dps[r["index"]][j] for r in recs]) if recs and dps else None
        results[name] = S.summarize(doc_recs, kl, config["bucket_base"], dp_values=dp) if recs else None
    peak = {}
    for key in ("peak_gpu_bytes", "peak_rss_bytes"):
        vals = [r[key] for r in recs if key in r]
        if vals:
            peak[key] = max(vals)
    params = {
        "model": config["model"], "pairs": config["pairs"],
        "buffer_len": {p["name"]: p.get("buffer_len") for p in config["pairs"]},
        "prefill": config["prefill"], "scoring": _scoring(config), "dataset": docs.record(),
        "context": config["context"],
        "segment": config["segment"], "seed": config["seed"],
        "document_ids": [r["id"] for r in recs],
        "wall_time_s": time.time() - t_start,
        "compute_time_s": sum(r["wall_s"] for r in recs),
        **peak, **(extra_params or {}),
    }
    res = {
        "kind": RESULTS_KIND, "version": RESULTS_VERSION,
        "complete": len(recs) == len(docs.documents),
        "documents_done": len(recs), "documents_planned": len(docs.documents),
        "notes": docs.notes,
        "config": config,
        "provenance": provenance(**params),
        "kl_tokens_dir": run_dir.name,
        "results": results,
    }
    write_json(out, res)
    if plot and recs:
        from .plot import plot_kl_vs_position
        plot_kl_vs_position(res, arrays, [p["name"] for p in config["pairs"]], png,
                            first=S.scored_range(config["context"], _scoring(config))[0])
    return res


class _Progress:
    """A rich progress bar with tokens/s and ETA (or nothing when disabled)."""

    def __init__(self, enabled: bool, total: int, label: str, console=None):
        self.enabled = enabled and total > 0
        if self.enabled:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn,
                                       TextColumn, TimeElapsedColumn)
            from rich.text import Text

            def rate(task):
                # rich's speed needs two samples within its window; one segment per document
                # (or segments longer than the window) give one: then the mean since the start
                if task.speed:
                    return task.speed
                return task.completed / task.elapsed if task.completed and task.elapsed else None

            class _Speed(ProgressColumn):
                def render(self, task):
                    r = rate(task)
                    return Text(f"{r:,.0f} tok/s" if r else "-- tok/s")

            class _Eta(ProgressColumn):
                def render(self, task):
                    r = rate(task)
                    if not r or task.total is None:
                        return Text("-:--:--")
                    s = int(max(task.total - task.completed, 0) / r)
                    return Text(f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}")

            self.p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                              _Speed(), TimeElapsedColumn(), TextColumn("ETA"), _Eta(),
                              console=console, transient=False)
            self.task = self.p.add_task(label, total=total)

    def __enter__(self):
        if self.enabled:
            self.p.__enter__()
        return self

    def __exit__(self, *a):
        if self.enabled:
            self.p.__exit__(*a)

    def advance(self, n: int):
        if self.enabled:
            self.p.advance(self.task, n)
