"""lm-eval model ``replayquant``: lm-eval's own Hugging Face model (HFLM) with a precision pair
patched into every recurrent layer, so that what lm-eval scores is what a ReplaySSM server with that
pair would compute.

    replayquant lm-eval --model replayquant \\
        --model_args pretrained=Qwen/Qwen3.5-4B,pair=tp4_hi16_sr,dtype=bfloat16 \\
        --tasks gpqa_diamond_cot_zeroshot --output_path build/gpqa/ --log_samples

Model arguments, besides every argument of lm-eval's ``hf`` model (dtype, device, batch_size,
parallelize, max_length, ...):

* ``pair``: a shipped pair name (``replayquant pairs``), the path of a pair YAML file or of a layer
  policy YAML (a pair per recurrent layer, ``replayquant.policy``) (default s32_rs);
* ``prefill``: how the prompt is processed. ``replay`` (default): every token goes through the step
  semantics, as if the server had decoded the prompt; loglikelihoods come from one teacher-forced
  forward over context + continuation. ``exact``: as a server's prefill, the context in FP32 and
  cast once; loglikelihoods then decode the continuation token by token (row by row: slower), so
  the pair is still on the scored path;
* ``seed``: the stochastic-rounding seed (default 0);
* ``buffer_len``: overrides the pair's buffer length L;
* ``assistant``: a draft model of the same tokenizer (hub id, short name or folder) for every
  ``generate_until`` request (HF's ``assistant_model``), loaded in the model's dtype and device
  and patched with s32_rs where it has recurrent layers (as ``replayquant spec --assistant``);
  ``assistant_tokens``: the drafts it proposes each round (default 4, a constant schedule);
* ``compile_generate``: ``generate_until`` through Hugging Face's static cache compiled with
  torch.compile (``cache_implementation="static"``, the default ``CompileConfig``: CUDA graphs).
  ``auto`` (default): on when the model runs on CUDA, off elsewhere; ``false``: the eager decode
  steps; ``true``: on, and an error where the model is not on CUDA. A task compiles once per batch
  size, not once per batch: lm-eval runs the longest prompts first and transformers keeps the
  first batch's static cache length for the later, shorter batches (counted on CPU in the tests).

Speculative decoding: a generate-until task's ``gen_kwargs`` (lm-eval's ``--gen_kwargs``, or the
task's own) pass HF's speculative options to ``generate``, e.g. ``--gen_kwargs
prompt_lookup_num_tokens=4`` (with ``do_sample``/``temperature`` too): HF's assisted generation
runs on the patched model, its candidate generator and acceptance rule. It decodes one sequence at
a time, so a generate-until request with such an option at ``batch_size`` other than 1 (``auto``
included) is one error before any of them runs; its requests run eager decode steps
(``compile_generate=auto`` leaves HF's static cache off for them, ``true`` is one error); drafts
per round beyond a pair's L are one error; ``assistant_model``, which must be a model object,
cannot come through ``gen_kwargs`` (one error; the ``assistant`` model argument loads one, and
every generate-until request then drafts with it). Stop sequences end a generation where the last
round's tokens hold them (lm-eval's criterion looks that far back), and lm-eval cuts the text at
the first one, so the answers are those of plain decode with the same pair.

Both of lm-eval's scoring paths see the pair: ``loglikelihood`` (multiple-choice tasks) runs plain
forwards over whole sequences, which the patched model computes by teacher forcing with
``prefill="replay"`` (with ``prefill="exact"``, a whole-sequence forward would be exact FP32 and
blind to the pair, so the continuation is decoded instead, see above); ``generate_until`` (CoT and
generative tasks) runs ``model.generate(use_cache=True)``: the prompt is processed per ``prefill``,
and every decode step goes through the replay state machine, flushing every L tokens, batched.

Registration: importing this module registers the name ``replayquant`` with lm-eval.
lm-eval 0.4.13 discovers no models from other packages, so the plain ``lm_eval`` command cannot find
it; ``replayquant lm-eval ARGS`` runs lm-eval's own command line with it registered (and
``accelerate launch -m replayquant.cli lm-eval ARGS`` for data-parallel GPUs). pyproject.toml also
declares the ``lm_eval.models`` entry point, which lm-eval versions that read that group use.
From Python: ``import replayquant.gpqa.lm_eval_model`` and then ``lm_eval.simple_evaluate(model="replayquant", ...)``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
import sys
import tempfile

from replayquant.extras import require

require("lm_eval")      # lm-eval is an extra: without it, one error naming `replayquant[lm-eval]`
import lm_eval  # noqa: E402
import lm_eval.evaluator as ev  # noqa: E402
import torch
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from transformers import AutoModelForCausalLM, CompileConfig, GenerationConfig

from replayquant.choices import PREFILLS
from replayquant.gpqa.tasks import write_task_dir
from replayquant.kl.lockstep import cache_kwarg, output_cache
from replayquant.models.device import default_device
from replayquant.models.names import resolve_model_name
from replayquant.models.patching import check_draft_length, model_class, patch, unpatch
from replayquant.policy import resolve_pair

__all__ = ["ReplayQuantLM", "lm_eval_main", "LM_EVAL_INTERNALS",
           "lm_eval_internals_problems"]

log = logging.getLogger(__name__)

# compile_generate's values: on, off, or (None) on where the model runs on CUDA
COMPILE_GENERATE = {"auto": None, "true": True, "1": True, "false": False, "0": False}
# generate's options that turn on HF's assisted generation
SPECULATIVE = ("prompt_lookup_num_tokens", "assistant_model", "assistant_early_exit")


def speculative_options(gen_kwargs) -> dict:
    """The options of `gen_kwargs` (one generate-until request's) that turn on HF's assisted
    generation, where set."""
    if not isinstance(gen_kwargs, dict):
        return {}
    return {k: gen_kwargs[k] for k in SPECULATIVE if gen_kwargs.get(k) is not None}

# What this module relies on inside lm-eval (pyproject's tested range; lm-eval 0.4.13): the HFLM
# methods ReplayQuantLM overrides, with the arguments it passes on by name, the HFLM methods that
# must still call them (else the override, and with it the pair, would be bypassed without a
# word), and the functions it calls; and what the GPQA task class (replayquant/gpqa/lm_task.py)
# needs: lm-eval builds a task file's `class:` with the task's config and reads every pass over
# the documents through `config.process_docs`, which that class runs once per task.
LM_EVAL_INTERNALS = {
    "lm_eval.models.huggingface:HFLM._loglikelihood_tokens": ("disable_tqdm", "override_bs"),
    "lm_eval.models.huggingface:HFLM._model_call": ("attn_mask", "labels"),
    "lm_eval.models.huggingface:HFLM._model_generate": (),
    "lm_eval.models.huggingface:HFLM.generate_until": ("requests", "disable_tqdm"),
    "lm_eval.models.huggingface:HFLM.get_model_info": (),
    "lm_eval.models.huggingface:HFLM._get_backend": ("config", "backend", "trust_remote_code"),
    "lm_eval.__main__:cli_evaluate": (),
    "lm_eval.evaluator:get_git_commit_hash": (),
    "lm_eval.api.task:ConfigurableTask.__init__": ("config",),
}
LM_EVAL_CALLS = {   # "caller": "what its source must call"
    "lm_eval.models.huggingface:HFLM._loglikelihood_tokens": "self._model_call(",
    "lm_eval.models.huggingface:HFLM.generate_until": "self._model_generate(",
    "lm_eval.models.huggingface:HFLM.__init__": "self._get_backend(",
    "lm_eval.tasks._factory:TaskFactory._build_task": "cls(config=cfg)",
    "lm_eval.api.task:ConfigurableTask.validation_docs": "self.config.process_docs(",
    "lm_eval.api.task:ConfigurableTask.training_docs": "self.config.process_docs(",
}


def _resolve(spec: str):
    mod, _, attr = spec.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def lm_eval_internals_problems() -> list[str]:
    """What no longer matches in the installed lm-eval (empty: everything this module uses is
    where it expects it)."""
    problems = []
    for spec, params in LM_EVAL_INTERNALS.items():
        try:
            obj = _resolve(spec)
        except (ImportError, AttributeError):
            problems.append(f"{spec} is missing")
            continue
        try:
            have = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            have = {}
        lost = [p for p in params if p not in have]
        if lost:
            problems.append(f"{spec} has no argument(s) {', '.join(lost)}")
    for spec, call in LM_EVAL_CALLS.items():
        try:
            src = inspect.getsource(_resolve(spec))
        except (ImportError, AttributeError, OSError, TypeError):
            problems.append(f"{spec} is missing")
            continue
        if call not in src:
            problems.append(f"{spec} no longer calls {call.rstrip('(')}")
    return problems


def check_lm_eval_internals() -> None:
    """One ValueError naming every lm-eval internal that moved, and the tested lm-eval version."""
    problems = lm_eval_internals_problems()
    if problems:
        raise ValueError(
            f"the installed lm-eval ({getattr(lm_eval, '__version__', '?')}) is not the one "
            f"replayquant's lm-eval model is built on (tested: lm-eval 0.4.13, pyproject's range): "
            f"{'; '.join(problems)}. Install the tested version (pip install 'lm-eval==0.4.13')")


check_lm_eval_internals()


@contextlib.contextmanager
def _child_stderr_to_devnull():
    """Point file descriptor 2 at /dev/null for the enclosed block (what child processes write
    there is dropped); Python's own sys.stderr is flushed first and restored after."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _quiet_git_hash():
    """lm-eval records the git commit of the working folder by running `git describe` with the
    terminal's stderr: outside a git checkout (an ordinary user's folder) git prints `fatal: not a
    git repository`. lm-eval's own function runs unchanged; only git's stderr is dropped."""
    orig = ev.get_git_commit_hash
    if getattr(orig, "_replayquant_quiet", False):
        return

    @functools.wraps(orig)
    def get_git_commit_hash():
        with _child_stderr_to_devnull():
            return orig()
    get_git_commit_hash._replayquant_quiet = True
    ev.get_git_commit_hash = get_git_commit_hash


_quiet_git_hash()


@register_model("replayquant")
class ReplayQuantLM(HFLM):
    """HFLM with a precision pair on every scored path. See the module docstring."""

    def __init__(self, pretrained="", pair="s32_rs", prefill: str = "replay", seed: int = 0,
                 buffer_len=None, compile_generate="auto", assistant=None, assistant_tokens=4,
                 **kwargs) -> None:
        # Validate our own arguments before any weights are loaded.
        self._rq_pair = resolve_pair(pair, buffer_len)
        try:
            self._rq_assistant_tokens = int(assistant_tokens)
        except (TypeError, ValueError):
            self._rq_assistant_tokens = 0
        if self._rq_assistant_tokens < 1 or str(assistant_tokens).strip() != \
                str(self._rq_assistant_tokens):
            raise ValueError(f"assistant_tokens={assistant_tokens!r}: give an integer >= 1 "
                             f"(drafts per round)")
        self._rq_assistant_name = None if assistant in (None, "") else str(assistant)
        self._rq_assistant = None
        compile_generate = str(compile_generate).lower()
        if compile_generate not in COMPILE_GENERATE:
            raise ValueError(f"compile_generate={compile_generate!r}: use auto, true or false")
        self._rq_compile_asked = COMPILE_GENERATE[compile_generate]
        if self._rq_compile_asked and self._rq_assistant_name is not None:
            raise ValueError(f"assistant={self._rq_assistant_name} with compile_generate=true: "
                             f"HF's assisted generation runs eager decode steps; use "
                             f"compile_generate=auto or false")
        if prefill not in PREFILLS:
            raise ValueError(f"prefill={prefill!r}: use one of {', '.join(PREFILLS)}")
        try:
            self._rq_seed = int(seed)
        except (TypeError, ValueError):
            raise ValueError(f"seed={seed!r}: must be an integer") from None
        self._rq_prefill = prefill
        self._rq_patched = False
        self._rq_split = self._rq_lengths = None
        if isinstance(pretrained, str):
            if not pretrained:
                raise ValueError("model_args needs pretrained=<hub id, short name or local path>")
            pretrained = resolve_model_name(pretrained)
        if kwargs.get("device") is None:        # hf's default is cuda, on a machine without one too
            kwargs["device"] = default_device()
        super().__init__(pretrained=pretrained, **kwargs)
        self._rq_compile = COMPILE_GENERATE[compile_generate]
        on_cuda = self.device.type == "cuda"
        if self._rq_compile is None:
            self._rq_compile = on_cuda
        elif self._rq_compile and not on_cuda:
            raise ValueError("compile_generate=true compiles the decode step for CUDA graphs; "
                             f"the model runs on {self.device}: use compile_generate=auto or false")
        if self._rq_compile:
            log.info("replayquant: generate_until runs HF's static cache compiled with torch.compile")
        else:
            (log.info if on_cuda else log.warning)(
                "replayquant: generate_until runs eager decode steps (compile_generate=%s%s)",
                compile_generate, "" if on_cuda else f"; the model is on {self.device}, not CUDA")
        self.set_pair(self._rq_pair)
        if self._rq_assistant_name is not None:
            self._rq_assistant = self._load_assistant(self._rq_assistant_name)

    def _load_assistant(self, name: str):
        """The draft model (module docstring), after checking that its vocabulary is the
        model's (HF's assistant shares the target's token ids)."""
        from replayquant.kl import command as loaders
        from replayquant.spec.command import load_assistant
        if loaders.load_tokenizer_and_config(name)[0].get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"assistant={name} has another tokenizer than pretrained: HF's "
                             f"assistant model drafts token ids of the model's own vocabulary")
        dtype = str(self.model.dtype).removeprefix("torch.")
        return load_assistant(name, dtype, str(self.device), self._rq_assistant_tokens)

    def _get_backend(self, config, backend="default", trust_remote_code=False):
        """HFLM's backend choice, with the class `replayquant.load_model` uses: transformers' own
        (`model_class`; GLM-5-Next's causal LM is its conditional-generation class, which
        AutoModelForCausalLM does not know)."""
        auto = model_class(config)
        if auto is not AutoModelForCausalLM:
            self.AUTO_MODEL_CLASS = auto
            backend = "causal" if backend == "default" else backend
        return super()._get_backend(config, backend=backend, trust_remote_code=trust_remote_code)

    # -- the pair
    @property
    def pair(self):
        return self._rq_pair

    @property
    def prefill(self) -> str:
        return self._rq_prefill

    def set_pair(self, pair, prefill: str | None = None, seed: int | None = None, buffer_len=None):
        """Patch `pair` into the model (replacing the pair patched before), so one loaded model
        serves several pairs in turn."""
        pair = resolve_pair(pair, buffer_len)
        if prefill is not None and prefill not in PREFILLS:
            raise ValueError(f"prefill={prefill!r}: use one of {', '.join(PREFILLS)}")
        model = self.model
        if self._rq_patched:
            unpatch(model)
            self._rq_patched = False
        self._rq_pair = pair
        self._rq_prefill = prefill or self._rq_prefill
        self._rq_seed = self._rq_seed if seed is None else int(seed)
        patched = patch(model, pair, prefill=self._rq_prefill, seed=self._rq_seed)
        if patched is not None and patched is not model:   # patch works in place; keep what it returns
            self._model = patched
        self._rq_patched = True
        log.info("replayquant: pair %s (prefill=%s, seed=%d) patched", pair.label(), self._rq_prefill,
                 self._rq_seed)
        return self

    def replayquant_info(self) -> dict:
        info = {"pair": self._rq_pair.to_dict(), "pair_label": self._rq_pair.label(),
                "prefill": self._rq_prefill, "seed": self._rq_seed}
        if self._rq_assistant_name is not None:
            info["assistant"] = {"model": self._rq_assistant_name,
                                 "tokens": self._rq_assistant_tokens}
        return info

    # -- lm-eval hooks: both scoring paths run the patched model
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        if self._rq_prefill != "exact" or self.backend != "causal":
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        # prefill="exact" scores as a server would: the context is prefilled (FP32, one cast), the
        # continuation decoded token by token through the replay state machine. HFLM hands
        # _model_call only the right-padded inputs, so remember where each input's context ends,
        # with HFLM's own left truncation.
        split = {}
        for _, context_enc, continuation_enc in requests:
            inp = (context_enc + continuation_enc)[-(self.max_length + 1):][:-1]
            split[tuple(inp)] = len(inp) - len(continuation_enc) + 1
        self._rq_split, self._rq_lengths = split, None
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        finally:
            self._rq_split = self._rq_lengths = None

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        if not self._rq_patched:
            raise RuntimeError("replayquant: the model is not patched; scoring it would not use the pair")
        if getattr(self, "_rq_split", None) is None or attn_mask is not None:
            # prefill="replay": one forward over each whole sequence, every token through the step
            # semantics (teacher forcing, as if the server had decoded the prompt)
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        return self._prefill_then_decode(inps)

    def _find_split(self, row: list[int]) -> tuple[int, int]:
        """(real length, context tokens) of one input row, right-padded with zeros by HFLM: its real
        length lies between the length without trailing zeros and the full length."""
        lengths = {len(k) for k in self._rq_split} if self._rq_lengths is None else self._rq_lengths
        self._rq_lengths = lengths
        stripped = len(row)
        while stripped > 0 and row[stripped - 1] == 0:
            stripped -= 1
        for n in range(len(row), stripped - 1, -1):
            if n in lengths and (p := self._rq_split.get(tuple(row[:n]))) is not None:
                return n, p
        raise RuntimeError("replayquant: an input row matches no loglikelihood request")

    def _prefill_then_decode(self, inps: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] for right-padded `inps`, row by row: one forward with the cache over
        the context (the patched model's exact prefill), then one decode step per continuation
        token. Positions past a row's end stay zero (HFLM never reads them)."""
        out = None
        kw = cache_kwarg(self.model)
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            for i, row in enumerate(inps.tolist()):
                n, p = self._find_split(row)
                o = self.model(inps[i:i + 1, :p], use_cache=True)
                pieces, cache = [o.logits[0]], output_cache(o)
                for t in range(p, n):
                    o = self.model(inps[i:i + 1, t:t + 1], use_cache=True, **{kw: cache})
                    pieces.append(o.logits[0])
                    cache = output_cache(o)
                logits = torch.cat(pieces)
                if out is None:
                    out = logits.new_zeros(inps.shape[0], inps.shape[1], logits.shape[-1])
                out[i, :n] = logits
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        """HFLM's generate_until, after the checks of requests with speculative options (module
        docstring), all before the first request runs."""
        spec = [speculative_options(r.args[1]) for r in requests]
        if self._rq_assistant is not None:           # every request drafts with the assistant
            spec = [{**o, "assistant": self._rq_assistant_name} for o in spec]
        spec = [o for o in spec if o]
        if spec:
            self._check_speculation(spec)
            if self._rq_compile:
                log.info("replayquant: requests with speculative options run eager decode steps "
                         "(HF's assisted generation)")
        return super().generate_until(requests, disable_tqdm=disable_tqdm)

    def _check_speculation(self, options: list[dict]) -> None:
        """One ValueError for what HF's assisted generation cannot run here: a batch of more than
        one sequence, a compiled static cache asked for, an assistant model given as text, more
        drafts per round than a patched layer's L."""
        named = " and ".join(f"model_args assistant={v}" if k == "assistant" else
                             f"gen_kwargs {k}={v!r}" for k, v in options[0].items())
        if str(self.batch_size) != "1":
            raise ValueError(
                f"{named}: HF's assisted generation decodes one sequence at a time, "
                f"and batch_size is {self.batch_size}; run with --batch_size 1 (or drop the "
                f"speculative option to decode in batches)")
        if self._rq_compile_asked:
            raise ValueError(
                f"{named} with compile_generate=true: HF's assisted generation runs "
                f"eager decode steps (it compiles no step of a cache that records its past); use "
                f"compile_generate=auto (eager for these requests) or false")
        for o in options:
            if "assistant_model" in o:
                raise ValueError(
                    f"gen_kwargs assistant_model={o['assistant_model']!r}: HF takes the assistant "
                    f"as a loaded model object, which lm-eval's gen_kwargs (text and numbers) "
                    f"cannot carry; give the model argument assistant=MODEL (it loads the model), "
                    f"or use prompt_lookup_num_tokens=N")
            check_draft_length(self.model, GenerationConfig(**{
                k: v for k, v in o.items() if k in SPECULATIVE}), self._rq_assistant)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        if not self._rq_patched:
            raise RuntimeError("replayquant: the model is not patched; generating would not use the pair")
        if self._rq_assistant is not None:
            generation_kwargs.setdefault("assistant_model", self._rq_assistant)
        compile_config = None if speculative_options(generation_kwargs) else self._compile_config()
        if compile_config is not None:
            generation_kwargs.setdefault("cache_implementation", "static")
            generation_kwargs.setdefault("compile_config", compile_config)
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def _compile_config(self) -> CompileConfig | None:
        """HF's compile config for generate_until (None: eager decode steps)."""
        return CompileConfig() if self._rq_compile else None

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["replayquant"] = self.replayquant_info()
        return info


def lm_eval_logs_to_stderr() -> None:
    """Point lm-eval's console handler at today's sys.stderr. lm-eval adds it once per process
    (lm_eval.utils.setup_logging), bound to the sys.stderr of that moment: a caller that swapped
    sys.stderr for a while (a notebook cell, a test runner, an earlier `replayquant lm-eval` run
    from Python) may have closed that stream since, and every lm-eval log line of a later run
    would then print a logging traceback."""
    for h in logging.getLogger("lm_eval").handlers:
        if type(h) is logging.StreamHandler:
            h.stream = sys.stderr        # not setStream, which flushes the stream it replaces


def lm_eval_main(argv: list[str]) -> None:
    """lm-eval's own command line (`lm_eval ARGS`) with the `replayquant` model registered.
    `--gpqa-csv PATH` (ours, removed before lm-eval sees the arguments) makes lm-eval's GPQA-Diamond
    tasks read a local CSV instead of the gated hub dataset."""
    args = list(argv)
    csv_path = None
    for i, a in enumerate(args):
        if a == "--gpqa-csv" or a.startswith("--gpqa-csv="):
            if "=" in a:
                csv_path = a.split("=", 1)[1]
                del args[i]
            else:
                if i + 1 >= len(args):
                    raise ValueError("--gpqa-csv needs a path")
                csv_path = args[i + 1]
                del args[i:i + 2]
            break
    with tempfile.TemporaryDirectory(prefix="replayquant_gpqa_tasks_") as tmp:
        if csv_path is not None:
            if any(a == "--include_path" or a.startswith("--include_path=") for a in args):
                raise ValueError("--gpqa-csv writes lm-eval's include_path itself; pass either --gpqa-csv "
                                 "or --include_path, not both")
            args += ["--include_path", str(write_task_dir(csv_path, tmp))]
        old = sys.argv
        sys.argv = ["lm-eval", *args]
        try:
            lm_eval_logs_to_stderr()
            cli_evaluate()
        finally:
            sys.argv = old
