"""The replay state of one patched recurrent layer inside a Hugging Face cache.

Where the state lives: each linear-attention layer of an HF cache (`cache.layers[layer_idx]`, a
`LinearAttentionLayer` in transformers 5.17 and 5.24) keeps, while patched, a `ReplayState` in the
attribute `_replayquant_state` (anchor, read copy, replay buffer, counters). The layer's own
`recurrent_states[0]` slot, which HF reorders on beam search (`reorder_cache`), holds a small
float tensor [B, 1] of row ids instead of the FP32 state; a permuted slot tells us to permute the
replay state the same way. The conv state is HF's, untouched.

Which path runs:
* a single-token forward with a cache and no padding (every decode step of `generate`):
  `ReplayState.step`, the torch reference, on every device. `decode_step` below is the one place
  where the GPU replay decode kernel of `replayquant.kernels` (issue 4) is to be dispatched on
  CUDA once it exists; `decode_path()` says what runs.
* any other forward (prompt, teacher forcing, segments continuing a cache): the chunked scan
  (DESIGN section 7). On CUDA tensors (or with REPLAYQUANT_BACKEND=triton, as the formats) the
  Triton kernel `replayquant.kernels.chunk` runs; elsewhere the torch reference
  `chunk_ref.teacher_force`. State dimensions the kernel does not handle (not powers of two
  >= 16) run the torch reference on the GPU with a warning. `teacher_force_path()` says which.
  prefill="replay" gives exact decode semantics, prefill="exact" FP32 and one cast.
"""

from __future__ import annotations

import torch

import warnings

from replayquant.formats import use_triton
from replayquant.kernels.chunk_ref import teacher_force
from replayquant.replay import ReplayState

__all__ = ["LayerRuntime", "decode_step", "decode_path", "teacher_force_path", "STATE_ATTR"]

STATE_ATTR = "_replayquant_state"


def decode_path(device=None) -> str:
    """Which implementation a decode step runs on `device` (today always the torch reference)."""
    return "torch reference (ReplayState.step)"


def teacher_force_path(x: torch.Tensor, d_k: int, d_v: int) -> str:
    """Which implementation a teacher-forcing / prompt forward runs for inputs like x with
    d_k x d_v states: 'triton' (replayquant.kernels.chunk), 'torch' (chunk_ref) or
    'torch (kernel does not support d_k=.., d_v=..)'."""
    if not use_triton(x):
        return "torch"
    from replayquant.kernels import chunk
    if chunk.supports(d_k, d_v):
        return "triton"
    return f"torch (the Triton chunk kernel needs powers of two >= 16, got d_k={d_k}, d_v={d_v})"


def _teacher_force(st: ReplayState, q, k, v, log_a, beta, valid, exact: bool):
    path = teacher_force_path(q, q.shape[-1], v.shape[-1])
    if path == "triton":
        from replayquant.kernels import chunk
        return chunk.teacher_force(st, q, k, v, log_a, beta, valid=valid, exact=exact)
    if path != "torch":
        warnings.warn(f"replayquant teacher forcing on {q.device}: {path}", stacklevel=3)
    return teacher_force(st, q, k, v, log_a, beta, valid=valid, exact=exact)


def decode_step(st: ReplayState, q, k, v, log_a, beta):
    """One decode step of one layer: q, k [B, H, d_k], v [B, H, d_v], log_a, beta [B, H].

    CUDA hook: when replayquant.kernels provides the Triton replay decode step (issue 4), call it
    here for q.is_cuda (it must match ReplayState.step bit for bit on the same state)."""
    return st.step(q, k, v, log_a, beta)


class LayerRuntime:
    """Configuration of one patched layer and its state handling (one per patched module)."""

    def __init__(self, pair, prefill: str, seed: int, layer_idx: int, delta: bool, kind: str):
        self.pair, self.prefill, self.seed = pair, prefill, int(seed)
        self.layer_idx, self.delta, self.kind = int(layer_idx), bool(delta), kind

    # ------------------------------------------------------------ cache access (5.17 and 5.24)
    def cache_layer(self, cache):
        layers = getattr(cache, "layers", None)
        if layers is None or self.layer_idx >= len(layers):
            raise ValueError(f"{type(cache).__name__} has no layer {self.layer_idx}; the replay patch "
                             f"needs a transformers Cache with linear-attention layers (DynamicCache)")
        lay = layers[self.layer_idx]
        if not hasattr(lay, "has_previous_state") or not hasattr(lay, "recurrent_states"):
            raise ValueError(f"cache layer {self.layer_idx} is a {type(lay).__name__}, not a "
                             f"linear-attention cache layer")
        return lay

    @staticmethod
    def has_previous(lay) -> bool:
        return bool(lay.has_previous_state[0])

    def _fresh(self, B, H, dv, dk, device, S0=None):
        if S0 is None:
            S0 = torch.zeros(B, H, dv, dk, device=device)
        return ReplayState(S0, self.pair, delta=self.delta, seed=self.seed, layer=self.layer_idx)

    def get_state(self, lay, had_prev: bool, B, H, dv, dk, device) -> ReplayState:
        """The layer's ReplayState for this forward (new, continued, reordered or adopted)."""
        if lay is None or not had_prev:
            return self._fresh(B, H, dv, dk, device)
        st = getattr(lay, STATE_ATTR, None)
        slot = lay.recurrent_states[0]
        if st is None:
            # the cache was filled by the unpatched model: adopt its FP32 state as S0
            if slot is None or slot.dim() != 4:
                return self._fresh(B, H, dv, dk, device)
            S0 = slot.to(torch.float32)
            if self.delta:                       # HF GDN keeps [B, H, d_k, d_v]
                S0 = S0.transpose(-1, -2)
            return self._fresh(B, H, dv, dk, device, S0.contiguous())
        if slot is not None and slot.dim() == 2 and slot.shape[1] == 1:
            ids = slot[:, 0].round().long().to(st.device)
            if ids.shape[0] != st.B or not torch.equal(ids, torch.arange(st.B, device=st.device)):
                st = reorder_state(st, ids)
        if st.B != B:
            raise ValueError(f"layer {self.layer_idx}: the cache holds {st.B} sequences but the "
                             f"input has {B}; the replay patch follows HF's reorder_cache only")
        return st

    def put_state(self, cache, lay, st: ReplayState) -> None:
        setattr(lay, STATE_ATTR, st)
        marker = torch.arange(st.B, dtype=torch.float32, device=st.device).view(st.B, 1)
        slot = lay.recurrent_states[0]
        if slot is not None and tuple(slot.shape) != (st.B, 1):
            # a slot of another shape (an adopted HF state): replace it by the marker
            lay.recurrent_states[0] = marker
        else:
            cache.update_recurrent_state(marker, self.layer_idx)

    # ------------------------------------------------------------ the recurrence
    def run(self, cache, had_prev: bool, q, k, v, log_a, beta, valid):
        """q, k [B, T, H, d_k]; v [B, T, H, d_v]; log_a, beta [B, T, H]; valid [B, T] or None.
        Returns y float32 [B, T, H, d_v]."""
        B, T, H, dk = q.shape
        dv = v.shape[-1]
        lay = None if cache is None else self.cache_layer(cache)
        st = self.get_state(lay, had_prev, B, H, dv, dk, q.device)
        if T == 1 and had_prev and (valid is None or bool(valid.all())):
            y = decode_step(st, q[:, 0], k[:, 0], v[:, 0], log_a[:, 0],
                            None if beta is None else beta[:, 0]).unsqueeze(1)
        else:
            y = _teacher_force(st, q, k, v, log_a, beta, valid, self.prefill == "exact")
        if lay is not None:
            self.put_state(cache, lay, st)
        return y


def reorder_state(st: ReplayState, ids: torch.Tensor) -> ReplayState:
    """A ReplayState whose row i is row ids[i] of st (beam search). SR stream ids follow the rows."""
    from replayquant.replay import core

    parts = st.export()
    ids = ids.to(st.device)
    new = {}
    for name, t in parts.items():
        if t is None:
            new[name] = None
        elif name in ("anchor", "read"):
            new[name] = core.qt_take(t, ids, st.B)
        else:
            new[name] = t[ids].contiguous()
    return ReplayState.from_parts(new, st.pair, delta=st.delta, seed=st.seed, layer=st.layer)
