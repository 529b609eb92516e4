"""Timing helpers shared by the teacher-forcing and KL benchmarks: which GDN chunk function the
unpatched Hugging Face layer calls, and the time spent inside chosen callables during a run."""

from __future__ import annotations

import importlib
import time

import torch

from replayquant.kernels.chunk import kernel as chunk

__all__ = ["KernelClock", "REPLAY_TARGETS", "HF_TARGETS", "fla_version", "hf_chunk_function"]


def fla_version() -> str | None:
    """flash-linear-attention's version if importable here (HF then runs its GDN kernels)."""
    try:
        import fla          # fla: optional
    except ImportError:
        return None
    return getattr(fla, "__version__", "installed")


def hf_chunk_function():
    """(function, label): the GDN chunk function HF's Qwen3.5 layer calls (fla's kernel when fla
    is importable: transformers resolves it at import), and which implementation it is."""
    for mod in ("transformers.models.qwen3_5.modeling_qwen3_5",
                "transformers.models.qwen3_next.modeling_qwen3_next"):
        try:
            m = __import__(mod, fromlist=["torch_chunk_gated_delta_rule"])
            fn = getattr(m, "torch_chunk_gated_delta_rule")
        except (ImportError, AttributeError):
            continue
        impl = "transformers torch path"
        for cell in getattr(fn, "__closure__", None) or ():     # the hub wrapper's implementation
            c = cell.cell_contents
            if callable(c) and str(getattr(c, "__module__", "")).startswith("fla"):
                impl = f"fla {fla_version()}: {c.__module__}.{c.__name__}"
        return fn, f"{mod}.torch_chunk_gated_delta_rule ({impl})"
    raise ImportError("transformers has no torch_chunk_gated_delta_rule")


class KernelClock:
    """Time spent inside some module-level callables during a run (a context manager that
    wraps them). On CUDA a pair of events is recorded around each call (no host sync is
    added; the sums are read after the run), elsewhere time.perf_counter. targets: {label:
    (module path, attribute)}; a target whose module does not import is skipped."""

    NOTE = ("GPU time between CUDA events recorded around each call (inside the timed run, no "
            "added sync); nested targets overlap (chunk_scan runs inside the layer's "
            "teacher-forcing call, runtime._teacher_force; "
            "chunk_passes: events around each launch of the chunk kernel's passes, inside "
            "chunk_scan)")

    def __init__(self, device, targets: dict, passes: bool = True):
        self.cuda = str(device).startswith("cuda")
        self.targets = targets
        self.marks = {k: [] for k in targets}
        self._saved = []
        # CUDA: also events around each launch of the chunk kernel's passes (chunk_scan's
        # pass_events argument, added to every call while the clock runs)
        self.pass_events = [] if (passes and self.cuda) else None

    def _wrap(self, label, fn):
        marks = self.marks[label]

        def timed_call(*args, **kwargs):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = fn(*args, **kwargs)
                b.record()
                marks.append((a, b))
            else:
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                marks.append(time.perf_counter() - t0)
            return out
        return timed_call

    def __enter__(self):
        for label, (mod_name, attr) in self.targets.items():
            try:
                mod = importlib.import_module(mod_name)
                fn = getattr(mod, attr)
            except (ImportError, AttributeError):
                continue
            self._saved.append((mod, attr, fn))
            setattr(mod, attr, self._wrap(label, fn))
        if self.pass_events is not None:
            scan, events = chunk.chunk_scan, self.pass_events

            def scan_with_events(*args, **kwargs):
                return scan(*args, pass_events=events, **kwargs)
            self._saved.append((chunk, "chunk_scan", scan))
            chunk.chunk_scan = scan_with_events
        return self

    def __exit__(self, *exc):
        for mod, attr, fn in reversed(self._saved):
            setattr(mod, attr, fn)
        self._saved = []

    def seconds(self) -> dict:
        """{label: {"seconds": total, "calls": n}} (calls 0: the target never ran)."""
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for label, marks in self.marks.items():
            tot = sum(a.elapsed_time(b) / 1e3 for a, b in marks) if self.cuda else sum(marks)
            out[label] = {"seconds": tot, "calls": len(marks)}
        if self.pass_events:
            passes = {}
            for name, a, b in self.pass_events:
                d = passes.setdefault(name, {"seconds": 0.0, "launches": 0})
                d["seconds"] += a.elapsed_time(b) / 1e3
                d["launches"] += 1
            out["chunk_passes"] = passes
        return out


# what the patched model's prefill spends in the replay path (CUDA: the Triton kernel)
REPLAY_TARGETS = {"replay_teacher_force": ("replayquant.models.runtime", "_teacher_force"),
                  "chunk_scan": ("replayquant.kernels.chunk.kernel", "chunk_scan")}
# what the unpatched HF forward spends in its GDN chunk function (fla's kernel when installed)
HF_TARGETS = {"hf_gdn_chunk": ("transformers.models.qwen3_5.modeling_qwen3_5",
                               "torch_chunk_gated_delta_rule")}
