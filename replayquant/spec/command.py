"""`replayquant spec`: check the options, load the documents and the model once, measure every
pair beside the FP32 reference document by document, and write the results, table and plot.

Per document (its first `context` tokens are the prompt) and per variant (the reference first:
s32_rs with exact prefill, as `replayquant kl` names it, then each --pair), the variant decodes
`new_tokens` three ways on one model object: plain decode, prompt lookup
(`prompt_lookup_num_tokens=N`) and, with --assistant, a draft model proposing N tokens a round
(`assistant_model=`); `measure.counted_generate` counts each. Decoding is greedy, or with
--temperature above 0 sampled (HF's temperature, top_p, top_k), each call seeded from --seed and
the document's index: every variant draws the same random numbers for a document and method, so
that its tokens compare with the reference's of the same method (sampled plain decode and
speculation draw them differently, and are not compared). The results file is rewritten after
every document (`"complete": false` until the last): the same command run again skips the
documents it holds; a file of another configuration is refused (`outputs.check_owned`), and so is
a second run into the same --out while one runs (`outputs.output_lock`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from replayquant.kl import command as kl_loaders
from replayquant.kl.data import load_documents
from replayquant.kl.lockstep import pair_record, patch_variant, reference_variant
from replayquant.models.device import check_device
from replayquant.models.patching import patch, recurrent_layers
from replayquant.outputs import (check_out_given, check_owned, check_writable_folder, parse_json,
                                 output_lock, write_json)
from replayquant.policy import resolve_pair
from replayquant.provenance import model_identity, provenance
from replayquant.spec.settings import REFERENCE_PAIR, SpecSettings

from .measure import counted_generate
from .report import plot_acceptance, render_table, summarize

SPEC_KIND = "replayquant-spec"
WRITER = "replayquant spec"


def default_out(model: str, names: list[str], context: int, new_tokens: int) -> Path:
    def clean(s):
        return re.sub(r"[^A-Za-z0-9._@-]+", "-", str(s)).strip("-")
    stem = f"{clean(Path(model).name)}_{'+'.join(map(clean, names))}"
    return Path("build/spec") / f"{stem}_ctx{context}_new{new_tokens}.json"


def check_spec_out(out) -> Path:
    """The results path, checked before any work: a .json name (the plot goes beside it as
    NAME.png), not a folder, in a folder that can be written."""
    check_out_given(out)
    out = Path(os.path.expanduser(str(out)))
    if out.is_dir() or out.suffix.lower() != ".json":
        raise ValueError(f"--out {out}: give the results file's name ending in .json (the plot is "
                         f"written beside it as NAME.png), e.g. --out {out.with_suffix('.json')}")
    if out.with_suffix(".png").is_dir():
        raise ValueError(f"--out {out}: {out.with_suffix('.png')} (where the plot goes) is a "
                         f"folder; move it away or give another --out")
    check_writable_folder(out.parent, out)
    return out


def spec_command(model: str, pairs: list, settings: SpecSettings | None = None, *,
                 out: str | None = None) -> dict:
    """Everything `replayquant spec` does (module docstring); returns the results dict."""
    st = settings or SpecSettings()
    resolved = st.check(pairs)
    names = [p.label() for p in resolved]
    out_path = check_spec_out(out if out is not None else
                              default_out(model, names, st.context, st.new_tokens))
    device = check_device(st.device) if st.device is not None else (
        "cuda" if torch.cuda.is_available() else "cpu")
    tok, cfg, name = kl_loaders.load_tokenizer_and_config(model, st.revision)
    limit = getattr(cfg.get_text_config(), "max_position_embeddings", None)
    if limit and st.context + st.new_tokens > limit:
        raise ValueError(f"--context {st.context} + --new-tokens {st.new_tokens} is longer than "
                         f"the model supports (max_position_embeddings = {limit})")
    if st.assistant is not None:
        atok = kl_loaders.load_tokenizer_and_config(st.assistant)[0]
        if atok.get_vocab() != tok.get_vocab():
            raise ValueError(f"--assistant {st.assistant} has another tokenizer than --model "
                             f"{model}: `replayquant spec` measures assistants of the same "
                             f"vocabulary")
    documents = load_documents(st.dataset, tok, st.context, st.docs, split=st.split,
                               text_field=st.text_field, pack=st.pack,
                               dataset_config=st.dataset_config, data_files=st.data_files)
    for note in documents.notes:             # e.g. fewer documents of --context tokens than --docs
        Console(stderr=True).print(f"note: {note}", markup=False, highlight=False)
    config = {"model": model_identity(name, st.revision), "dtype": st.dtype,
              "prefill": st.prefill,
              "reference": {"name": "reference", "pair": pair_record(resolve_pair(REFERENCE_PAIR)),
                            "prefill": "exact"},
              "pairs": [{"name": n, **pair_record(p)} for n, p in zip(names, resolved)],
              "methods": st.methods, "draft_tokens": st.draft_tokens,
              "assistant": None if st.assistant is None else model_identity(st.assistant),
              "context": st.context, "new_tokens": st.new_tokens, "seed": st.seed,
              "data": documents.record()}
    if st.sampling:               # greedy runs keep the configuration they always recorded
        config["sampling"] = st.sampling
    with output_lock(out_path):
        check_owned(out_path, SPEC_KIND, WRITER, identity=config, recorded=lambda o: o["config"],
                    beside=(out_path.with_suffix(".png"),), fresh=(out_path.with_suffix(".png"),))
        helper = None if st.assistant is None else load_assistant(st.assistant, st.dtype, device,
                                                                  st.draft_tokens)
        m = kl_loaders.load_weights(name, st.dtype, device, st.revision)
        run = _Run(model=m, names=names, config=config, out=out_path, device=device,
                   variants=[reference_variant(m, "exact", st.seed)] +
                   [patch_variant(m, p, st.prefill, st.seed) for p in resolved],
                   speculation=_speculation(st.methods, st.draft_tokens, helper))
        return run.measure(documents, st.progress)


def load_assistant(assistant: str, dtype: str, device: str, draft_tokens: int):
    """The draft model: patched with the reference pair where it has recurrent layers (HF crops
    its cache too), proposing `draft_tokens` tokens every round (a constant schedule and no
    confidence stop, so that every position is measured)."""
    _, cfg, name = kl_loaders.load_tokenizer_and_config(assistant)
    helper = kl_loaders.load_weights(name, dtype, device)
    n_layers = getattr(cfg.get_text_config(), "num_hidden_layers", None)
    if n_layers and len(recurrent_layers(helper)) >= n_layers:
        raise ValueError(f"--assistant {assistant}: every layer is recurrent, and transformers' "
                         f"assisted generation asks the assistant's cache for its length "
                         f"(get_seq_length), which only an attention layer answers; give an "
                         f"assistant with attention layers (a hybrid or a transformer)")
    if recurrent_layers(helper):
        pair = resolve_pair(REFERENCE_PAIR)
        patch(helper, pair, buffer_len=max(pair.buffer_len, draft_tokens))
    gc = helper.generation_config
    gc.num_assistant_tokens = draft_tokens
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0
    return helper


def _speculation(methods, draft_tokens: int, helper) -> dict:
    kw = {"lookup": {"prompt_lookup_num_tokens": draft_tokens},
          "assistant": {"assistant_model": helper}}
    return {m: kw[m] for m in methods}


class _Run:
    """One run's model, variants and output; `measure` does the work."""

    def __init__(self, *, model, names, config, out: Path, device: str, variants, speculation):
        self.model, self.names, self.config, self.out = model, names, config, out
        self.device, self.variants, self.speculation = device, variants, speculation
        self.provenance, self.notes = None, []

    def measure(self, documents, progress: bool) -> dict:
        """Every document not yet in the results file, then the table and the plot."""
        earlier = self._earlier()
        done = list(earlier["per_document"]) if earlier else []
        self.notes = list(documents.notes)
        todo = [d for d in documents.documents if d.index not in {r["index"] for r in done}]
        console = Console(stderr=True)
        if done:
            console.print(f"resuming {self.out}: {len(done)} of {len(documents.documents)} "
                          f"documents done", markup=False, highlight=False)
        per_doc = len(self.variants) * (1 + len(self.speculation)) * self.config["new_tokens"]
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[rate]}"), TimeElapsedColumn())
        if todo:           # the provenance, taken before any work (and that of a resumed run)
            self._write(done, complete=False, resumed=earlier and earlier.get("provenance"))
        with Progress(*columns, console=console, disable=not progress or not todo) as bar:
            task = bar.add_task("spec tokens", total=len(todo) * per_doc, rate="")
            if todo:
                self._warm_up(todo[0])

            def advance(what: str, g):
                rate = (len(g.tokens) - g.first_tokens) / max(g.decode_s, 1e-9)
                bar.update(task, advance=len(g.tokens), rate=f"{what} {rate:,.0f} tok/s")

            for doc in todo:
                done.append(self._document(doc, advance))
                done.sort(key=lambda r: r["index"])
                self._write(done, complete=len(done) == len(documents.documents))
        res = self._write(done, complete=True) if todo else earlier   # finished: as it was
        if self.config.get("sampling"):
            sm = self.config["sampling"]
            Console().print(f"sampled (temperature {sm['temperature']:g}, top-p {sm['top_p']:g}, "
                            f"top-k {sm['top_k']}): ref1st and refall compare with\nthe "
                            f"reference's tokens of the same method and random draws",
                            markup=False, highlight=False, soft_wrap=True)
        Console().print(render_table(res["results"]), markup=False, highlight=False, end="")
        title = Path(self.config["model"]["id"]).name
        if self.config.get("sampling"):
            title += f", temperature {self.config['sampling']['temperature']:g}"
        png = plot_acceptance(res["results"], title, self.out.with_suffix(".png"))
        console.print(f"wrote {self.out} and {png}", markup=False, highlight=False)
        return res

    def _earlier(self) -> dict | None:
        """The results file of an earlier run of this configuration at --out (`check_owned`
        refused any other), or None."""
        if not self.out.is_file():
            return None
        try:
            res = parse_json(self.out.read_text(encoding="utf-8"))
            list(res["per_document"])
            return res
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.out} is a damaged spec results file ({e}); delete it to "
                             f"start fresh") from None

    def _warm_up(self, doc) -> None:
        """A short plain and speculative decode before any timing (first-call costs: allocator,
        lazy imports, kernel selection)."""
        ids = doc.tokens[None].to(self.device)
        with self.variants[0].active():
            for kw in [{}, *self.speculation.values()]:
                counted_generate(self.model, ids, min(4, self.config["new_tokens"]),
                                 self.config.get("sampling"), **kw)

    def _document(self, doc, advance) -> dict:
        """One document's records: per variant, plain decode then each speculation method."""
        ids, n = doc.tokens[None].to(self.device), self.config["new_tokens"]
        sampling = self.config.get("sampling")
        seed = (self.config["seed"] + doc.index) % 2 ** 63       # one document's draws
        pairs, reference = {}, None
        for v in self.variants:
            with v.active():
                plain = counted_generate(self.model, ids, n, sampling, seed)
                advance(f"{v.name} plain", plain)
                reference = reference or {"plain": plain.tokens}
                rec = {"plain": plain.record(reference["plain"])}
                for m, kw in self.speculation.items():
                    g = counted_generate(self.model, ids, n, sampling, seed, **kw)
                    advance(f"{v.name} {m}", g)
                    if sampling:        # the reference's tokens of this method and draws
                        reference.setdefault(m, g.tokens)
                        rec[m] = g.record(reference[m])
                    else:
                        rec[m] = g.record(reference["plain"], plain.tokens)
            pairs[v.name] = rec
        return {"index": doc.index, "id": doc.id, "pairs": pairs}

    def _write(self, done: list[dict], complete: bool, resumed: dict | None = None) -> dict:
        names = ["reference", *self.names]
        if self.provenance is None:          # the code and machine as the run started
            self.provenance = provenance(
                resumed_from=resumed,
                device=self.device, model=self.config["model"], pairs=names,
                buffer_len={p["name"]: p.get("buffer_len") for p in self.config["pairs"]},
                data_fingerprint=self.config["data"]["tokens_sha256"], seed=self.config["seed"],
                torch_threads=torch.get_num_threads(),
                omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
        res = {"kind": SPEC_KIND, "complete": complete, "config": self.config,
               "provenance": self.provenance, "notes": self.notes,
               "results": summarize(done, names, list(self.speculation),
                                    self.config["draft_tokens"]),
               "per_document": done}
        write_json(self.out, res)
        return res
