"""Run-time options from the environment, read when they are used, never frozen at import.

| variable | option | values | what it chooses |
| --- | --- | --- | --- |
| REPLAYQUANT_BACKEND | backend | auto, triton, torch | where format casts run: auto = the Triton kernels on CUDA tensors, the torch reference on CPU ones; triton forces the kernels (CPU tensors only under TRITON_INTERPRET=1; `check_backend` refuses it otherwise) |
| REPLAYQUANT_CHUNK_DOT | chunk_dot | tf32x3, ieee | the chunk kernel's tl.dot input precision (see replayquant/kernels/chunk/kernel.py) |
| REPLAYQUANT_NVFP4_CHAIN_SPLIT | nvfp4_chain_split | unset, 0, N >= 1 | the chunk kernel's NVFP4 chain: unset chooses by shape, 0 forces two-pass, N splits a matrix over N programs |
| REPLAYQUANT_CPU_THREADS | cpu_threads | N >= 1 (default 1) | intra-op threads of the CPU teacher-forcing scan |
| REPLAYQUANT_DECODE_GRAPHS | decode_graphs | on, off | whether a patched layer's eager decode steps on CUDA replay a recorded CUDA graph (replayquant/models/decode_graph.py) or launch their kernels one by one |

Code that wants another value for a while (a benchmark comparing both dot precisions, a test)
uses `override(...)`, which holds for the enclosed block of the current thread only:

    from replayquant import options
    with options.override(chunk_dot="ieee"):
        ...
    options.get().chunk_dot
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os

import torch

from replayquant.extras import require

__all__ = ["Options", "get", "override", "ENV", "triton_interpreter", "check_backend"]

ENV = {
    "backend": "REPLAYQUANT_BACKEND",
    "chunk_dot": "REPLAYQUANT_CHUNK_DOT",
    "nvfp4_chain_split": "REPLAYQUANT_NVFP4_CHAIN_SPLIT",
    "cpu_threads": "REPLAYQUANT_CPU_THREADS",
    "decode_graphs": "REPLAYQUANT_DECODE_GRAPHS",
}
BACKENDS = ("auto", "triton", "torch")
DOT_PRECISIONS = ("ieee", "tf32x3")
ON_OFF = ("on", "off")


@dataclasses.dataclass(frozen=True)
class Options:
    backend: str = "auto"
    chunk_dot: str = "tf32x3"
    nvfp4_chain_split: int | None = None
    cpu_threads: int = 1
    decode_graphs: str = "on"

    def __post_init__(self):
        def bad(field, value, want):
            raise ValueError(f"{ENV[field]}={value!r} ({field}): {want}")
        if self.backend not in BACKENDS:
            bad("backend", self.backend, f"use one of {', '.join(BACKENDS)}")
        if self.chunk_dot not in DOT_PRECISIONS:
            bad("chunk_dot", self.chunk_dot, f"use one of {', '.join(DOT_PRECISIONS)}")
        s = self.nvfp4_chain_split
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            bad("nvfp4_chain_split", s, "give 0 (two-pass) or a number of programs >= 1; unset it "
                "to choose by shape")
        c = self.cpu_threads
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            bad("cpu_threads", c, "give a positive integer (threads of the CPU teacher-forcing scan)")
        if self.decode_graphs not in ON_OFF:
            bad("decode_graphs", self.decode_graphs, "use on or off")


def _int(field, raw):
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{ENV[field]}={raw!r} ({field}): give an integer") from None


def _from_env() -> Options:
    kw = {}
    for field, var in ENV.items():
        raw = os.environ.get(var)
        if raw is None or raw == "":
            continue
        kw[field] = _int(field, raw) if field in ("nvfp4_chain_split", "cpu_threads") else raw
    return Options(**kw)


_overrides: contextvars.ContextVar[dict] = contextvars.ContextVar("replayquant_options", default={})


def triton_interpreter() -> bool:
    """True where Triton runs its kernels in the CPU interpreter (TRITON_INTERPRET=1, as Triton
    reads it: 1, true, on or yes; it must be set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def check_backend(on_cuda: bool | None = None) -> None:
    """One ValueError where backend = triton cannot run: without TRITON_INTERPRET=1 the Triton
    kernels need CUDA tensors (`on_cuda`: the tensor at hand; None: whether this machine has a
    CUDA GPU at all, the check a command makes before any work); without Triton installed, one
    `extras.MissingExtra` naming the extra that installs it."""
    if get().backend != "triton":
        return
    require("triton")
    if triton_interpreter():
        return
    if on_cuda is None:
        on_cuda = torch.cuda.is_available()
        where = "this machine has no CUDA GPU"
    else:
        where = "the tensor is not on a CUDA GPU"
    if not on_cuda:
        raise ValueError(f"{ENV['backend']}=triton runs the Triton kernels, which need a CUDA GPU "
                         f"or Triton's CPU interpreter, and {where}: set TRITON_INTERPRET=1 (the "
                         f"interpreter), or unset {ENV['backend']} (auto: the torch reference on "
                         f"the CPU)")


def get() -> Options:
    """The options in force now: the environment, then any enclosing `override`."""
    base = _from_env()
    over = _overrides.get()
    return dataclasses.replace(base, **over) if over else base


@contextlib.contextmanager
def override(**values):
    """Set options for the enclosed block (this thread / task only); checked like the environment."""
    unknown = set(values) - set(ENV)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; options are {sorted(ENV)}")
    merged = {**_overrides.get(), **values}
    dataclasses.replace(_from_env(), **merged)        # validate now, where the caller set them
    token = _overrides.set(merged)
    try:
        yield
    finally:
        _overrides.reset(token)
