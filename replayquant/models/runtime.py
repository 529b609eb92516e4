"""The replay state of one patched recurrent layer inside a Hugging Face cache.

Where the state lives: each linear-attention layer of an HF cache (`cache.layers[layer_idx]`, a
`LinearAttentionLayer` in transformers 5.17 and 5.24) keeps, while patched, its replay state in
the attribute `_replayquant_state`: its decode store once the layer decodes (a
`replayquant.replay.stores.ReplayStore` that knows its batch rows' slots, stepped through
`models.decode_store`), or a `replay.handoff.ScanState` (the chunked scan's) after a multi-token forward. The
layer's own `recurrent_states[0]` slot, which HF reorders on beam search (`reorder_cache`),
holds a small float tensor [B, 1] of row ids instead of the FP32 state; a permuted slot tells us
to permute the replay state the same way. The conv state is HF's, untouched.

Which path runs:
* a single-token forward with a cache and no padding (every decode step of `generate`): a step
  on the layer's decode store through the custom operator replayquant::replay_step, fed the
  layer's raw inputs (GDN: q, k, v after the short convolution, a, b, A_log, dt_bias; the step
  does the L2 norm, softplus and sigmoid; Mamba-2: x, dt, A, B, C, dt_bias, and its
  time_step_limit, which the step clamps dt to (Nemotron-H); the D skip and the gated norm stay
  in the layer; Kimi Delta Attention: q, k, v after the short convolution, the per-channel log
  decay and beta, the step doing the L2 norm). Its engine: on CUDA tensors (or with
  REPLAYQUANT_BACKEND=triton, as the formats; on the CPU that is the Triton interpreter) the
  Triton replay decode kernel `replay_gdn_step` / `replay_mamba2_step` / `replay_kda_step` of
  `replayquant.kernels.replay.decode` on a store whose ring keeps k and v in bf16, for a bf16
  model, whose activations it holds exactly; elsewhere (another device, or a float32 / float16
  model: the kernel would round its activations) the torch engine `replayquant.kernels.
  replay.engine` on a store whose ring keeps them in float32. `decode_path()` says which; a layer
  the kernel does not take runs the torch engine with one warning per layer that names the
  reason. The engine is chosen once, where the store is built.
  Where keys and queries are normalised: once, between the model's projection and the
  recurrence, by whichever consumes them: the chunked scan's front end (`replay.gdn_inputs` /
  `kda_inputs`) for a multi-token forward, the decode step for a one-token forward; a decode
  store's ring keeps raw keys (`ScanState.raw` carries a prompt's into it), which a step normalises
  where it reads them.
* any other forward (prompt, teacher forcing, segments continuing a cache): the chunked scan
  (DESIGN section 7). On CUDA tensors (or with REPLAYQUANT_BACKEND=triton) the Triton kernel
  `replayquant.kernels.chunk.kernel` runs; elsewhere the torch reference `chunk_ref.teacher_force`.
  State dimensions the kernel does not handle (not powers of two >= 16) run the torch reference
  on the GPU with a warning. `teacher_force_path()` says which. prefill="replay" gives exact
  decode semantics, prefill="exact" FP32 and one cast.

* any forward while HF records the cache's past to crop it back (`activate_past_recording`: the
  target's and the assistant's caches of HF's assisted generation, `generate(prompt_lookup_num_
  tokens=...)` or `assistant_model=...`, which `patching` lets run on a patched model): the
  speculative path (`LayerRuntime._speculate`). The forward's tokens join those since the last
  crop as drafts of the layer's decode store (built with max_drafts = L, a ring of 2L entries),
  verified together against its checkpoint, outputs only, through the custom operator
  replayquant::replay_verify (the Triton verify on CUDA, the torch reference elsewhere): a row
  whose committed entries would not leave room flushes them first (h + T > L), never a draft.
  HF's `cache.crop` then commits the drafts it keeps (replayquant::replay_accept: a pointer
  move; `croppable` gives the cache layer that crop), after cropping HF's own parts: the
  convolution states, which it records while recording the past. The path is HF's eager loop:
  HF compiles no step of a cache whose linear-attention layers record their past.

Hand-off between the two (explicit, once, never per step): segments of multi-token forwards pass
the scan's ScanState from one to the next as it is; the first decode step after them
builds the decode store straight from that state (`decode_store.from_scan`,
`replayquant.replay.convert.scan_to_store`; one host read); a multi-token forward into a static
cache (HF's compiled generate) builds it at its end, so that the first decode step, which torch.compile traces,
finds the store. Every decode step after that runs on the store alone (`kernel_decode`: the raw
inputs straight into the operator, no torch front end, no host read: a beam reorder is a gather on
the device, a non-finite input is recorded on the device and raised at the next multi-token
forward). A multi-token forward continuing the cache converts the store back into a ScanState
(`store_to_scan`, no ReplayState between) before the chunked scan runs.

Measured on one H100 (results/bench/generate.json; Qwen3.5-4B shape, random weights, bf16, 64-token
prompt, fla 0.6.0, transformers 5.17, B = 1), ms per decode step: patched eager with s32_rs 24.1
(its GDN layers replaying recorded CUDA graphs, `decode_graph`; 0 host syncs, 1916 kernel
launches against HF's 2108) against HF eager 50.9, timed in turns; patched with HF's static cache
compiled 8.46 (757 kernels) against HF's 9.22 (779).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import replace

import torch
from transformers import DynamicCache

from replayquant.formats import use_triton
from replayquant.kernels.chunk.reference import (chunk_scan_ref, cpu_threads,
                                                 initial_scan_state)
from replayquant.models import decode_store
from replayquant.models.decode_graph import LayerGraph
from replayquant.replay import ReplayState
from replayquant.replay.handoff import ScanState, append_raw, raw_of_forward, take_rows
from replayquant.replay.state import find_nonfinite
from replayquant.replay.stores import ReplayStore, dt_limit_args, pow2_16

__all__ = ["LayerRuntime", "croppable", "decode_path", "teacher_force_path",
           "recording", "STATE_ATTR"]

STATE_ATTR = "_replayquant_state"
MARKER_ATTR = "_replayquant_marker"   # the row-id tensor put_state left in the recurrent slot
# while HF records the cache's past: the raw inputs [B, n, ...] of the n tokens since the last
# crop that are drafts of the layer's decode store, uncommitted (`LayerRuntime._speculate`)
PENDING_ATTR = "_replayquant_pending"


def recording(lay) -> bool:
    """Whether HF records this cache layer's past to crop it back later (`activate_past_recording`:
    assisted generation's target and assistant caches): a patched layer then keeps the tokens
    since the last crop uncommitted, so that `crop` is a pointer move."""
    return lay is not None and bool(getattr(lay, "record_past", False))


def _n_tokens(raw: dict) -> int:
    """The token count of a layer's raw inputs (their per-token tensors are [B, T, ...])."""
    return next(t.shape[1] for t in raw.values() if isinstance(t, torch.Tensor) and t.dim() >= 2)


def _tokens(raw: dict, lo: int, hi: int) -> dict:
    """Tokens lo..hi-1 of a layer's raw inputs (parameters as they are)."""
    return {n: (t[:, lo:hi] if isinstance(t, torch.Tensor) and t.dim() >= 2 else t)
            for n, t in raw.items()}


def _cat_tokens(a: dict, b: dict) -> dict:
    """The raw inputs of a's tokens then b's (parameters b's: the same layer's)."""
    return {n: (torch.cat([a[n], t], 1) if isinstance(t, torch.Tensor) and t.dim() >= 2 else t)
            for n, t in b.items()}


_CROP_CLASSES: dict = {}


def croppable(lay) -> None:
    """Make the linear-attention cache layer lay, which a patched layer holds its replay state in
    while HF records the past, croppable: HF's assisted generation asks `is_croppable` after its
    first forward and refuses a recurrent state, which it cannot roll back; here a crop is a
    pointer move. lay's class becomes a subclass of its own (one per HF layer class; only this
    cache layer object changes) whose `is_croppable` is True and whose `crop` crops HF's own
    parts first (the convolution states it recorded, an attention part's keys), then commits the
    drafts the crop keeps (`crop_pending`)."""
    base = type(lay)
    if getattr(base, "_replayquant_crop", False):
        return
    if base not in _CROP_CLASSES:
        def crop(self, tokens_to_remove: int) -> None:
            n = _check_crop(self, -int(tokens_to_remove))
            base.crop(self, tokens_to_remove)
            crop_pending(self, n + int(tokens_to_remove))

        _CROP_CLASSES[base] = type(base.__name__, (base,), {
            "__module__": base.__module__, "__doc__": croppable.__doc__, "crop": crop,
            "is_croppable": property(lambda self: True), "_replayquant_crop": True})
    lay.__class__ = _CROP_CLASSES[base]


def _check_crop(lay, removed: int) -> int:
    """The uncommitted token count n of cache layer lay, after checking that a crop of `removed`
    tokens stays within them (a ValueError naming the layer and its L otherwise)."""
    pend = getattr(lay, PENDING_ATTR, None)
    n = 0 if pend is None else _n_tokens(pend)
    if removed > n:
        st = getattr(lay, STATE_ATTR, None)
        at = "" if st is None else f" (layer {st.layer}, buffer L = {st.pair.buffer_len})"
        raise ValueError(f"crop of {removed} tokens, but the replay state{at} holds its last {n} "
                         f"tokens uncommitted, no more: the draft length of speculative decoding "
                         f"must not exceed the pair's L")
    return n


def crop_pending(lay, keep: int | None) -> None:
    """Commit the first `keep` (None: all) uncommitted tokens of cache layer lay (accept on its
    decode store); the others are dropped. Nothing where it holds none (or lay is None)."""
    pend = None if lay is None else getattr(lay, PENDING_ATTR, None)
    if pend is None:
        return
    decode_store.accept(getattr(lay, STATE_ATTR), _n_tokens(pend) if keep is None else keep)
    setattr(lay, PENDING_ATTR, None)


def decode_path(x: torch.Tensor | None = None, d_k: int | None = None, d_v: int | None = None,
                dt_limit=None, vector_gate: bool = False, activations=None) -> str:
    """Which implementation a decode step runs for inputs like x with d_k x d_v states:
    'triton' (the replay decode kernel, replayquant.kernels.replay.decode), 'torch'
    (the torch engine on the same store, replayquant.kernels.replay.engine) or
    'torch (<why the kernel cannot run>)'. x None: the CPU
    (REPLAYQUANT_BACKEND decides). dt_limit: a Mamba-2 layer's time_step_limit (the kernel
    clamps dt to it, so it never forces the torch path; a malformed one raises ValueError).
    vector_gate: a decay per key channel (Kimi Delta Attention; the kernel's replay_kda_step).
    activations: the dtype of the layer's buffered activations (GDN / KDA k and v, Mamba-2 x and
    B): the kernel's ring keeps them in bfloat16, which holds a bfloat16 model's exactly and
    rounds any other's (float32 k and v: 2^-9 relative per entry), so only bfloat16 runs the
    kernel (None: not checked)."""
    if not use_triton(x if x is not None else torch.empty(0)):
        return "torch"
    why = []
    if d_k is not None and d_v is not None and not (pow2_16(d_k) and pow2_16(d_v)):
        why.append(f"the Triton replay decode kernel needs d_k, d_v powers of two >= 16, got "
                   f"d_k={d_k}, d_v={d_v}")
    if activations is not None and activations != torch.bfloat16:
        why.append(f"the Triton replay decode kernel keeps the layer's activations in its ring "
                   f"in bfloat16, exact for a bfloat16 model only; these are "
                   f"{str(activations).removeprefix('torch.')} (load the model in bfloat16 "
                   f"for the kernel)")
    if dt_limit is not None:
        dt_limit_args(dt_limit)
    if why:
        return "torch (" + "; ".join(why) + ")"
    return "triton"


def teacher_force_path(x: torch.Tensor, d_k: int, d_v: int) -> str:
    """Which implementation a teacher-forcing / prompt forward runs for inputs like x with
    d_k x d_v states: 'triton' (replayquant.kernels.chunk.kernel), 'torch' (chunk_ref) or
    'torch (kernel does not support d_k=.., d_v=..)'."""
    if not use_triton(x):
        return "torch"
    from replayquant.kernels.chunk import kernel as chunk   # Triton (Linux only): where it runs
    if chunk.supports(d_k, d_v):
        return "triton"
    return f"torch (the Triton chunk kernel needs powers of two >= 16, got d_k={d_k}, d_v={d_v})"


def _teacher_force(held: ScanState, q, k, v, log_a, beta, valid, exact: bool, raw_in: dict):
    """A multi-token forward of one layer from `held` -> (y, the ScanState after it), through
    the Triton chunk kernel or its torch reference (teacher_force_path); raw_in: the forward's
    raw entries (`handoff.raw_of_forward`), from which the state's raw entries follow."""
    path = teacher_force_path(q, q.shape[-1], v.shape[-1])
    if path == "triton":
        # Triton (Linux only): loaded where a kernel runs
        from replayquant.kernels.chunk.kernel import chunk_scan as scan
    else:
        if path != "torch":
            warnings.warn(f"replayquant teacher forcing on {q.device}: {path}", stacklevel=3)
        scan = chunk_scan_ref
    with cpu_threads(q.device):
        y, ss = scan(held, q, k, v, log_a, beta, pair=held.pair, seed=held.seed,
                     layer=held.layer, valid=valid, exact=exact)
    raw = append_raw(held.raw, held.committed, raw_in, valid, ss.committed, ss.buffer_len)
    return y, replace(ss, u=None, raw=raw, pair=held.pair, seed=held.seed, layer=held.layer,
                      n_slots=held.n_slots)


def _one_token(raw: dict) -> dict:
    """The raw decode inputs of a one-token forward without their token axis (parameters as
    they are)."""
    return {n: (t[:, 0] if isinstance(t, torch.Tensor) and t.dim() >= 2 else t)
            for n, t in raw.items()}


def _key_heads(raw: dict, delta: bool) -> int:
    """Key heads (GDN, KDA) or groups (Mamba-2) of a layer's raw decode inputs."""
    return raw["k" if delta else "B"].shape[-2]


def _static(cache) -> bool:
    """Whether cache is one that HF's generate compiles the decode step for (as
    GenerationMixin._valid_auto_compile_criteria: compileable and not a DynamicCache)."""
    return cache is not None and bool(getattr(cache, "is_compileable", False)) \
        and type(cache) is not DynamicCache


class LayerRuntime:
    """Configuration of one patched layer and its state handling (one per patched module)."""

    def __init__(self, pair, prefill: str, seed: int, layer_idx: int, delta: bool, kind: str,
                 vector_gate: bool = False):
        self.pair, self.prefill, self.seed = pair, prefill, int(seed)
        self.layer_idx, self.delta, self.kind = int(layer_idx), bool(delta), kind
        self.vector_gate = bool(vector_gate)     # log_a per key channel [.., H, d_k] (KDA)
        self._warned = set()
        # (weak reference to the cache layer holding it, the decode store) of the last prefill
        # into a static cache, which the next one reuses (`_decode_ready`); None before any
        self._spare = None
        self.graph = LayerGraph()             # the recorded eager decode step (decode_graph)

    def __getstate__(self):
        """A pickled patch keeps its configuration, not the last generate's decode store."""
        return {**self.__dict__, "_spare": None}

    def _warn_once(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            warnings.warn(msg, stacklevel=4)

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

    def _fresh(self, B, H, dv, dk, device, S0=None) -> ScanState:
        """A new state: S0 cast into both roles, flush index 0, an empty buffer. Zeros (a new
        sequence) go straight into the chunked scan's state (`initial_scan_state` of their shape:
        the state ReplayState starts from, without its checks' host reads); an S0 adopted from an
        unpatched model's cache through ReplayState's construction, which refuses one that is
        not finite or overflows a role's format."""
        if S0 is None:
            ss = initial_scan_state((B, H, dv, dk), self.pair, delta=self.delta,
                                    seed=self.seed, layer=self.layer_idx,
                                    vector_gate=self.vector_gate, device=device)
            return replace(ss, pair=self.pair, seed=self.seed, layer=self.layer_idx, n_slots=B)
        st = ReplayState(S0, self.pair, delta=self.delta, seed=self.seed, layer=self.layer_idx,
                         vector_gate=self.vector_gate)
        return replace(st.export(), u=None)

    def get_state(self, lay, had_prev: bool, B, H, dv, dk, device):
        """The layer's state for this forward (new, continued, reordered or adopted): the
        decode store (a ReplayStore) decode left there, or a ScanState (new, adopted from an unpatched model's
        cache, or the one the last multi-token forward left there)."""
        if lay is None or not had_prev:
            return self._fresh(B, H, dv, dk, device)
        st = getattr(lay, STATE_ATTR, None)
        slot = lay.recurrent_states[0]
        if st is None:
            # the cache was filled by the unpatched model: adopt its FP32 state as S0
            if slot is None or slot.dim() != 4:
                return self._fresh(B, H, dv, dk, device)
            S0 = slot.to(torch.float32)
            if self.delta:                       # HF GDN and KDA keep [B, H, d_k, d_v]
                S0 = S0.transpose(-1, -2)
            return self._fresh(B, H, dv, dk, device, S0.contiguous())
        if slot is not getattr(lay, MARKER_ATTR, None) and slot is not None and slot.dim() == 2 \
                and slot.shape[1] == 1:
            # HF replaced the marker (a beam reorder): it holds the row each row continues
            ids = slot[:, 0].round().long().to(st.device)
            if isinstance(st, ReplayStore) and ids.shape[0] == st.B:
                decode_store.reorder(st, ids)
            else:
                if isinstance(st, ReplayStore):
                    st = decode_store.to_scan_state(st)
                st = take_rows(st, ids)
            setattr(lay, MARKER_ATTR, None)          # put_state writes a fresh marker
        if st.B != B:
            raise ValueError(f"layer {self.layer_idx}: the cache holds {st.B} sequences but the "
                             f"input has {B}; the replay patch follows HF's reorder_cache only")
        return st

    def put_state(self, cache, lay, st) -> None:
        setattr(lay, STATE_ATTR, st)
        slot = lay.recurrent_states[0]
        if slot is not None and slot is getattr(lay, MARKER_ATTR, None):
            return                                   # the marker is in place (a decode step)
        marker = torch.arange(st.B, dtype=torch.float32, device=st.device).view(st.B, 1)
        if slot is not None and tuple(slot.shape) != (st.B, 1):
            # a slot of another shape (an adopted HF state): replace it by the marker
            lay.recurrent_states[0] = marker
        else:
            cache.update_recurrent_state(marker, self.layer_idx)
        setattr(lay, MARKER_ATTR, lay.recurrent_states[0])

    def decode_path(self, x, d_k, d_v, raw=None) -> str:
        """decode_path for this layer (raw: its raw decode inputs, whose Mamba-2 dt_limit the
        kernel takes and whose buffered activations' dtype decides whether its ring holds them
        exactly)."""
        raw = raw if isinstance(raw, dict) else {}
        dtypes = {raw[n].dtype for n in (("k", "v") if self.delta else ("x", "B")) if n in raw}
        act = None if not dtypes else dtypes.pop() if len(dtypes) == 1 else torch.float32
        return decode_path(x, d_k, d_v, raw.get("dt_limit"), self.vector_gate, act)

    # ------------------------------------------------------------ the recurrence
    def run(self, cache, had_prev: bool, q, k, v, log_a, beta, valid, raw: dict):
        """q, k [B, T, H, d_k]; v [B, T, H, d_v]; log_a [B, T, H] ([B, T, H, d_k] for a layer built
        with vector_gate), beta [B, T, H]; valid [B, T] or None.
        raw: the layer's raw inputs for the decode store, each [B, T, ...] (per-head
        parameters unbatched): GDN q, k [.., HK, d_k], v, a, b, A_log, dt_bias, beta_scale
        (beta = beta_scale sigmoid(b)); Mamba-2 x, dt, A, B, C [.., G, N], dt_bias, dt_limit;
        KDA q, k [.., HK, d_k] (before their L2 norm), v, g (log decay per key channel), beta,
        scale (q's, d_k^-1/2). Returns y float32 [B, T, H, d_v]."""
        if not isinstance(raw, dict):
            raise ValueError(f"layer {self.layer_idx} ({self.kind}): a forward needs the layer's "
                             f"raw inputs (the patched forward passes them as raw=)")
        B, T, H, dk = q.shape
        dv = v.shape[-1]
        lay = None if cache is None else self.cache_layer(cache)
        st = self.get_state(lay, had_prev, B, H, dv, dk, q.device)
        if recording(lay):
            y, st = self._speculate(lay, st, q, k, v, log_a, beta, valid, raw)
            self.put_state(cache, lay, st)
            croppable(lay)
            return y
        crop_pending(lay, None)                            # HF stopped recording: keep them all
        decode = T == 1 and had_prev and (valid is None or bool(valid.all()))
        y = self._kernel_step(st, q, k, v, log_a, beta, raw) if decode else None
        if y is None:
            if isinstance(st, ReplayStore):
                decode_store.raise_nonfinite(st)           # a boundary: the steps before it
            self._check_inputs(q, k, v, log_a, beta, valid, decode=T == 1 and had_prev)
            if decode:
                st, y = self._decode(st, q, k, v, log_a, beta, raw)
            else:
                if isinstance(st, ReplayStore):      # hand back to the chunked scan
                    st = decode_store.to_scan_state(st)
                y, st = _teacher_force(st, q, k, v, log_a, beta, valid, self.prefill == "exact",
                                       raw_of_forward(self.kind, raw))
                if _static(cache):
                    st = self._decode_ready(st, q, k, v, log_a, beta, raw, lay)
        if lay is not None:
            self.put_state(cache, lay, st)
        return y

    def kernel_decode(self, cache, had_prev: bool, raw, valid):
        """The decode step of a layer whose state is already its decode store, from its
        raw inputs alone (the torch front end is not computed): y float32 [B, 1, H, d_v], or
        None where `run` must take the step (no cache or previous state, more than one token, a
        padding mask, no store yet, no raw inputs)."""
        if cache is None or not had_prev or not isinstance(raw, dict) or valid is not None:
            return None
        lead = raw["v" if self.delta else "x"]
        if lead.shape[1] != 1:
            return None
        lay = self.cache_layer(cache)
        st = getattr(lay, STATE_ATTR, None)
        if not isinstance(st, ReplayStore) or recording(lay) \
                or getattr(lay, PENDING_ATTR, None) is not None:
            return None
        st = self.get_state(lay, had_prev, lead.shape[0], *st.shape[1:], lead.device)
        y = self._kernel_step(st, None, None, None, None, None, raw)
        self.put_state(cache, lay, st)
        return y

    def decode_store_for_graph(self, cache, B: int):
        """The layer's decode store where its next step may replay a recorded CUDA graph
        (`decode_graph`): the cache layer holds a store of the Triton engine for B rows; a pending
        beam reorder is applied to it first, as an eager step would. None otherwise."""
        lay = self.cache_layer(cache)
        st = getattr(lay, STATE_ATTR, None)
        if not isinstance(st, ReplayStore) or st.engine != "triton" or st.B != B \
                or not self.has_previous(lay) or recording(lay) \
                or getattr(lay, PENDING_ATTR, None) is not None:
            return None
        st = self.get_state(lay, True, B, *st.shape[1:], st.device)
        if not isinstance(st, ReplayStore):
            return None
        self.put_state(cache, lay, st)
        return st

    def _kernel_step(self, st, q, k, v, log_a, beta, raw):
        """A decode step on the store a previous decode step (or a prefill into a static cache)
        left, with no host read: y [B, 1, H, d_v], or None where the state is not a store yet."""
        if not isinstance(st, ReplayStore):
            return None
        return decode_store.step(st, _one_token(raw)).unsqueeze(1)

    def _engine(self, q, v, raw) -> str:
        """The engine of this layer's decode store for inputs like q: 'triton' where decode_path
        chooses the kernel, else 'torch' (`replay.engine`), warned once per layer where the kernel
        cannot take the layer (the warning names why)."""
        path = self.decode_path(q, q.shape[-1], v.shape[-1], raw)
        if path not in ("triton", "torch"):
            self._warn_once(f"replayquant decode on {q.device}, layer {self.layer_idx}: {path}")
        return "triton" if path == "triton" else "torch"

    def _to_store(self, st, q, v, raw, reuse=None, max_drafts: int = 0):
        """The hand-off of a ScanState into this layer's decode store (once, where
        decode starts or a prefill into a static cache ends, or a speculative verify starts:
        max_drafts as `replay.convert.scan_to_store`)."""
        if not isinstance(raw, dict):
            raise ValueError(f"layer {self.layer_idx} ({self.kind}): a decode step needs the "
                             f"layer's raw inputs (the patched forward passes them as raw=)")
        heads, engine = _key_heads(raw, self.delta), self._engine(q, v, raw)
        return decode_store.from_scan(st, heads, reuse=reuse, engine=engine,
                                      max_drafts=max_drafts)

    def _decode_ready(self, st, q, k, v, log_a, beta, raw, lay=None):
        """The state a multi-token forward leaves in a static cache (a compiled generate's):
        already the decode store, so that the first decode step, which torch.compile traces,
        finds the store and converts nothing.

        HF's generate makes a new static cache each call; the store of the previous call's
        cache is reused (same shapes, its owner gone or this very cache layer), so that the
        compiled step's CUDA graphs keep their addresses from one generate to the next. The
        layer keeps that one store alive after its cache is gone (`unpatch` drops it)."""
        owner, spare = self._spare or (None, None)
        free = spare is not None and (owner() is None or owner() is lay)
        ds = self._to_store(st, q, v, raw, reuse=spare if free else None)
        if lay is not None:
            try:
                self._spare = (weakref.ref(lay), ds)
            except TypeError:                 # a cache layer without weak references
                pass
        return ds

    def _check_inputs(self, q, k, v, log_a, beta, valid, decode: bool) -> None:
        """A NaN or infinity in this forward's recurrence inputs (valid tokens only) is one
        ValueError naming the layer, the input and the token, raised before the state is touched
        and before any kernel launch, whichever path runs next (decode kernel, chunk kernel, torch
        reference): one sum per input and one host read per forward (`find_nonfinite`)."""
        bad = find_nonfinite({"q": q, "k": k, "v": v, "log_a (the decay gate)": log_a,
                              "beta": beta}, valid)
        if bad is None:
            return
        name, row, t, n = bad
        at = "the decode step" if decode else f"token {t} of a {q.shape[1]}-token forward"
        raise ValueError(
            f"layer {self.layer_idx} ({self.kind}): input {name} holds NaN or infinity at {at}, "
            f"batch row {row} ({n} element(s)); the replay state is unchanged. The inputs are the "
            f"layer's projections of its hidden states: find where the model's activations first "
            f"become non-finite (e.g. a float16 overflow)")

    def _speculate(self, lay, st, q, k, v, log_a, beta, valid, raw):
        """A multi-token or one-token forward while HF records the cache's past (assisted
        generation: the target's prompt with its first drafts, then each round's last token with
        its drafts; an assistant's own steps) -> (y, the state after it). Its tokens join those
        since the last crop, which stay uncommitted so that the crop is a pointer move: the last
        min(N, L) of those N tokens are drafts of the decode store (built with max_drafts = L),
        verified together against its checkpoint; older ones are committed first (those of an
        earlier forward through verify and accept, this forward's through the chunked scan: a
        prompt longer than L). Drafts verified by an earlier forward are verified again with this
        one's (an assistant's decode steps between two crops: at most L tokens each)."""
        L, T = self.pair.buffer_len, q.shape[1]
        pend = getattr(lay, PENDING_ATTR, None)
        n_old = 0 if pend is None else _n_tokens(pend)
        c = max(0, n_old + T - L)                          # tokens committed now
        c_old, c_new = min(c, n_old), max(0, c - n_old)
        if valid is not None and not bool(valid[:, c_new:].all()):
            raise ValueError(f"layer {self.layer_idx} ({self.kind}): a speculative verify takes "
                             f"no padding in its last {T - c_new} tokens (HF's assisted "
                             f"generation runs one unpadded sequence)")
        self._check_inputs(q, k, v, log_a, beta, valid, decode=False)
        if isinstance(st, ReplayStore):
            decode_store.raise_nonfinite(st)
            if n_old:
                decode_store.accept(st, 0)
        both = raw if pend is None else _cat_tokens(pend, raw)
        if c_old:
            decode_store.verify(st, _tokens(both, 0, c_old))
            decode_store.accept(st, c_old)
        ys = []
        if c_new:
            if isinstance(st, ReplayStore):
                st = decode_store.to_scan_state(st)
            head = [None if t is None else t[:, :c_new] for t in (q, k, v, log_a, beta, valid)]
            y, st = _teacher_force(st, *head, self.prefill == "exact",
                                   raw_of_forward(self.kind, _tokens(raw, 0, c_new)))
            ys.append(y)
        if not isinstance(st, ReplayStore) or st.max_drafts < L:
            st = self._to_store(st if isinstance(st, ScanState) else decode_store.to_scan_state(st), q, v,
                                raw, max_drafts=L)
        drafts = _tokens(both, c, n_old + T)
        ys.append(decode_store.verify(st, drafts)[:, c_new - T:])
        setattr(lay, PENDING_ATTR, drafts)
        return torch.cat(ys, 1), st

    def _decode(self, st, q, k, v, log_a, beta, raw):
        """The first decode step after a multi-token forward: the hand-off into the store
        (`_to_store`), then the step on it."""
        st = self._to_store(st, q, v, raw)
        return st, decode_store.step(st, _one_token(raw)).unsqueeze(1)
