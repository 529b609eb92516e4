"""CUDA graphs of a patched recurrent layer's eager decode step.

An eager decode step of a patched layer (projections, short convolution, the replay step on the
layer's decode store, gated norm, output projection) is a few dozen small kernels whose launches
the host issues one by one; on an H200 host a decode step of the Qwen3.5-4B-shape model (B = 1)
spent about 2.5 ms of host time in each of its 24 Gated DeltaNet layers when every step launched
its kernels one by one (cProfile: `REPLAYQUANT_DECODE_GRAPHS=off python
evals/decode_host_profile.py OUT`), while the GPU was busy 6.5 ms of the whole 94-ms step
(torch.profiler, `bench generate` under the same setting), so the GPU waited. Every tensor such a
step touches keeps its address from one step to the next (the weights, HF's conv state, which
its update writes in place, and the decode store, allocated once for the batch), and the step
reads nothing on the host (0 host syncs), so it can be recorded once as a CUDA graph and replayed:
the host then issues one graph launch per layer and step.

When a layer's forward is graphed (`graphed_decode`): a Gated DeltaNet, Kimi Delta Attention or
Mamba-2 layer (`GRAPHED_KINDS`), a CUDA tensor input of one token per row, no
padding mask and no other tensor argument, gradients off, not inside torch.compile or another
capture, no accelerate hook on the layer (offloading moves weights between steps), a cache whose
layer holds a decode store stepped by the Triton kernel, and the option decode_graphs "on"
(REPLAYQUANT_DECODE_GRAPHS; "off" runs every step eagerly). The first such step for a store and
batch shape runs eagerly (Triton compiles its kernels there), the second records the graph and
replays it, the later ones replay it. A new store (a new generate or prompt), a new conv state
or another batch shape records anew. Beam reorders are applied to the store before a replay, on
the device, as an eager step does. Where recording fails, the layer warns once with the reason and
runs its steps eagerly from then on.
"""

from __future__ import annotations

import functools
import weakref

import torch

from replayquant import options

__all__ = ["graphed_decode", "LayerGraph", "GRAPHED_KINDS"]

# the layer kinds whose recorded steps were compared with their eager steps on a GPU, bit for bit
# (tests/models/test_decode_graph.py, tp4_hi16_sr, 12 steps over three flushes: tiny-qwen3.5 and
# tiny-kimi-linear on an H200 and an H100, tiny-mamba2 on an H100); a kind added to the family
# table steps eagerly until that test has run on it
GRAPHED_KINDS = ("gdn", "kda", "mamba2")


class LayerGraph:
    """The recorded decode step of one layer: the key it was recorded for (the decode store, the
    conv state, the input's shape and dtype), its input and output buffers and the graph."""

    def __init__(self):
        self.key = None
        self.store_ref = None
        self.graph = self.inp = self.out = None
        self.failed = None                     # why recording failed (then every step is eager)

    def __getstate__(self):
        return {"failed": self.failed, "key": None, "store_ref": None, "graph": None,
                "inp": None, "out": None}

    def step(self, key, store, fn, h: torch.Tensor) -> torch.Tensor:
        """fn(h) for this step: eager where the key is new, else recorded (once) and replayed."""
        if self.key != key or self.store_ref is None or self.store_ref() is not store:
            self.key, self.store_ref = key, weakref.ref(store)
            self.graph = self.inp = self.out = None
            # the warm-up step, on the stream that records (Triton compiles its kernels, cuBLAS
            # sets up its workspace for that stream)
            return _on_capture_stream(h.device, lambda: fn(h))
        if self.graph is None:
            self._record(fn, h)
            if self.graph is None:
                return fn(h)
        else:
            self.inp.copy_(h)
        self.graph.replay()
        return self.out.clone()

    def _record(self, fn, h) -> None:
        inp = h.clone()
        g = torch.cuda.CUDAGraph()

        def record():
            g.capture_begin()
            try:
                return fn(inp)
            finally:
                g.capture_end()
        try:
            out = _on_capture_stream(h.device, record)
        except Exception as e:                # a step that cannot be recorded runs eagerly
            self.failed = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            return
        if not isinstance(out, torch.Tensor):
            self.failed = f"the forward returns a {type(out).__name__}, not one tensor"
            return
        self.graph, self.inp, self.out = g, inp, out


_STREAMS: dict = {}          # device -> the side stream that records (and warms up) the graphs


def _on_capture_stream(device, fn):
    """fn() on the device's recording stream, ordered after and before the current stream's work."""
    with torch.cuda.device(device):
        cur = torch.cuda.current_stream()
        side = _STREAMS.get(device)
        if side is None:
            side = _STREAMS[device] = torch.cuda.Stream()
        side.wait_stream(cur)
        try:
            with torch.cuda.stream(side):
                return fn()
        finally:
            cur.wait_stream(side)


def _tensor_kwargs(kwargs) -> bool:
    return any(isinstance(v, torch.Tensor) for v in kwargs.values())


def graphed_decode(forward):
    """Wrap a patched layer forward (families' gdn / mamba2 / kda forwards) so that its eager
    decode steps replay a CUDA graph (module docstring)."""

    @functools.wraps(forward)
    def wrapped(self, hidden_states, cache=None, attention_mask=None, cache_params=None,
                **kwargs):
        call = functools.partial(forward, self, cache=cache, attention_mask=attention_mask,
                                 cache_params=cache_params, **kwargs)
        rt = self._replayquant
        c = cache if cache is not None else cache_params
        if (c is None or attention_mask is not None or not hidden_states.is_cuda
                or hidden_states.dim() != 3 or hidden_states.shape[1] != 1
                or torch.is_grad_enabled() or torch.compiler.is_compiling()
                or torch.cuda.is_current_stream_capturing() or _tensor_kwargs(kwargs)):
            return call(hidden_states)
        graph = rt.graph
        if rt.kind not in GRAPHED_KINDS or graph.failed is not None \
                or options.get().decode_graphs != "on" or _hooked(self):
            return call(hidden_states)
        store = rt.decode_store_for_graph(c, hidden_states.shape[0])
        if store is None:
            return call(hidden_states)
        conv = c.layers[rt.layer_idx].conv_states[0]
        key = (tuple(hidden_states.shape), hidden_states.dtype, hidden_states.device,
               None if conv is None else conv.data_ptr(), torch.is_inference_mode_enabled())
        y = graph.step(key, store, call, hidden_states)
        if graph.failed is not None:
            rt._warn_once(f"replayquant decode on {hidden_states.device}, layer {rt.layer_idx}: "
                          f"its decode step could not be recorded as a CUDA graph "
                          f"({graph.failed}); its steps run eagerly")
        return y

    return wrapped


def _hooked(module) -> bool:
    """Whether accelerate hooks the layer (offloaded weights move between steps). Asked at every
    step, not cached: a model can be dispatched after it has decoded."""
    return any(hasattr(m, "_hf_hook") for m in module.modules())
