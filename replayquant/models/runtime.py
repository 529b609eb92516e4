"""The replay state of one patched recurrent layer inside a Hugging Face cache.

Where the state lives: each linear-attention layer of an HF cache (`cache.layers[layer_idx]`, a
`LinearAttentionLayer` in transformers 5.17 and 5.24) keeps, while patched, its replay state in
the attribute `_replayquant_state`: a `DecodeStore` once the layer decodes (a
`replayquant.kernels.stores.ReplayStore`, the engine that steps it and the batch-row -> slot
map), or a `ScanHeld` (the chunked scan's ScanState) after a multi-token forward. The
layer's own `recurrent_states[0]` slot, which HF reorders on beam search (`reorder_cache`),
holds a small float tensor [B, 1] of row ids instead of the FP32 state; a permuted slot tells us
to permute the replay state the same way. The conv state is HF's, untouched.

Which path runs:
* a single-token forward with a cache and no padding (every decode step of `generate`): a step
  on the layer's decode store through the custom operator replayquant::replay_step, fed the
  layer's raw inputs (GDN: q, k, v after the short convolution, a, b, A_log, dt_bias; the step
  does the L2 norm, softplus and sigmoid; Mamba-2: x, dt, A, B, C, dt_bias, and its
  time_step_limit, which the step clamps dt to (Nemotron-H); the D skip and the gated norm stay
  in the layer; Kimi Delta Attention: the core's q, k, v, per-channel log decay and beta, the
  step re-normalising q and k). Its engine: on CUDA tensors (or with REPLAYQUANT_BACKEND=triton,
  as the formats; on the CPU that is the Triton interpreter) the Triton replay decode kernel
  `replay_gdn_step` / `replay_mamba2_step` / `replay_kda_step` of
  `replayquant.kernels.replay_decode` on a store whose ring keeps k and v in bf16; elsewhere the
  torch engine `replayquant.kernels.replay_torch` on a store whose ring keeps them in float32
  (so that decode equals `ReplayState.step` within float32 reassociation). `decode_path()` says
  which; a layer the kernel does not take (d_k or d_v not a power of two >= 16) runs the torch
  engine with one warning per layer that names the reason. The engine is chosen once, where
  the store is built.
* any other forward (prompt, teacher forcing, segments continuing a cache): the chunked scan
  (DESIGN section 7). On CUDA tensors (or with REPLAYQUANT_BACKEND=triton) the Triton kernel
  `replayquant.kernels.chunk` runs; elsewhere the torch reference `chunk_ref.teacher_force`.
  State dimensions the kernel does not handle (not powers of two >= 16) run the torch reference
  on the GPU with a warning. `teacher_force_path()` says which. prefill="replay" gives exact
  decode semantics, prefill="exact" FP32 and one cast.

Hand-off between the two (explicit, once, never per step): segments of multi-token forwards
pass the scan's ScanState from one to the next as it is (`ScanHeld`); the
first decode step after them builds the decode store (`state_to_store`, a `DecodeStore`); a
multi-token forward into a static cache (HF's compiled generate) builds it at its end, so that
the first decode step, which torch.compile traces, finds the store. Every decode step after
that runs on the store alone (`kernel_decode`: the raw inputs straight into the operator, no
torch front end, no host read: a beam reorder is a gather on the device, a non-finite input is
recorded on the device and raised at the next multi-token forward). A multi-token forward
continuing the cache converts the store back (`store_to_state`) before the chunked scan runs.
The conversion keeps the anchor and read copy bit for bit (same packed bytes, same SR streams:
slot id = the state's sequence id) and the committed buffer entries; the Triton engine's ring
keeps k and v in bf16 and GDN's u in bf16 beside a separate read copy (half the buffer traffic
of the decode kernels), in FP32 for a shared FP32 pair (its flush folds u), so buffered entries
are rounded to bf16 on the way in; the torch engine's ring rounds nothing.

Measured on one H200 (results/bench/generate.json; Qwen3.5-4B shape, random weights, bf16, 64-token
prompt, fla 0.6.0, transformers 5.17): ms per decode step at B = 1, HF eager 94.5, patched eager
s32_rs 66.9 (0 host syncs, 2252 kernel launches against HF's 2108), patched with HF's static cache
compiled 9.45 (tp4_hi16_sr 5.65).
"""

from __future__ import annotations

import math
import warnings
import weakref

import torch

from replayquant.formats import QTensor, use_triton
from replayquant.kernels.chunk_ref import chunk_scan_ref, cpu_threads
from replayquant.replay import ReplayState
from replayquant.replay.frontends import l2norm, l2norm_kda
from replayquant.replay.state import find_nonfinite

__all__ = ["LayerRuntime", "DecodeStore", "ScanHeld", "decode_path",
           "teacher_force_path", "state_to_store", "store_to_state", "STATE_ATTR"]

STATE_ATTR = "_replayquant_state"
MARKER_ATTR = "_replayquant_marker"   # the row-id tensor put_state left in the recurrent slot
# the ring's k and v per engine: bf16 halves the kernel's buffer traffic; the torch engine keeps
# them in float32, so that its decode equals ReplayState.step (and HF's recurrence) within float32
# reassociation
RING_DTYPE = {"triton": torch.bfloat16, "torch": torch.float32}
# The kernel's step path: 'replay' keeps ReplayState's flush schedule (a flush every L tokens), so
# the kernel and the torch reference hold the same committed / flush counters and a hand-off
# back continues the same schedule. (The kernel's 'auto' would flush every step at small batch for
# a shared FP32 anchor: lossless but another schedule; a serving choice, not the patch's.)
DECODE_KERNEL_PATH = "replay"


def _pow2_16(d: int) -> bool:
    return d >= 16 and not d & (d - 1)


def decode_path(x: torch.Tensor | None = None, d_k: int | None = None, d_v: int | None = None,
                dt_limit=None, vector_gate: bool = False) -> str:
    """Which implementation a decode step runs for inputs like x with d_k x d_v states:
    'triton' (the replay decode kernel, replayquant.kernels.replay_decode), 'torch'
    (the torch engine on the same store, replayquant.kernels.replay_torch) or
    'torch (<why the kernel cannot run>)'. x None: the CPU
    (REPLAYQUANT_BACKEND decides). dt_limit: a Mamba-2 layer's time_step_limit (the kernel
    clamps dt to it, so it never forces the torch path; a malformed one raises ValueError).
    vector_gate: a decay per key channel (Kimi Delta Attention; the kernel's replay_kda_step)."""
    if not use_triton(x if x is not None else torch.empty(0)):
        return "torch"
    why = []
    if d_k is not None and d_v is not None and not (_pow2_16(d_k) and _pow2_16(d_v)):
        why.append(f"the Triton replay decode kernel needs d_k, d_v powers of two >= 16, got "
                   f"d_k={d_k}, d_v={d_v}")
    if dt_limit is not None:
        from replayquant.kernels.stores import dt_limit_args
        dt_limit_args(dt_limit)
    if why:
        return "torch (" + "; ".join(why) + ")"
    return "triton"


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


class ScanHeld:
    """The replay state of one layer between multi-token forwards, on either path: the chunked
    scan's ScanState as it came out (same anchor, read copy, buffer and counters a ReplayState
    would hold), so that the next segment's scan (Triton kernel or torch reference) takes it as
    it is, without a ReplayState round trip per segment (copies, the read copy's dequantization
    and GDN's u recomputed, measured at ~2.7 ms per layer call on the H200). It becomes a
    ReplayState (`to_replay_state`, u recomputed against the read copy, as ReplayState.load
    does) only where the decode store is built from it (`state_to_store`)."""

    def __init__(self, ss, pair, delta: bool, seed: int, layer: int):
        self.ss, self.pair, self.delta, self.seed, self.layer = ss, pair, delta, seed, layer

    @classmethod
    def of(cls, st: ReplayState) -> "ScanHeld":
        """The ScanHeld holding ReplayState st's parts (its tensors, no copy)."""
        from replayquant.kernels.chunk_ref import scan_state_of
        return cls(scan_state_of(st), st.pair, st.delta, st.seed, st.layer)

    @property
    def B(self) -> int:
        return self.ss.batch

    @property
    def device(self) -> torch.device:
        return self.ss.count.device

    def to_replay_state(self) -> ReplayState:
        from replayquant.kernels.chunk_ref import scan_parts
        return ReplayState.from_parts(scan_parts(self.ss), self.pair, delta=self.delta,
                                      seed=self.seed, layer=self.layer)


def _teacher_force(held: ScanHeld, q, k, v, log_a, beta, valid, exact: bool):
    """A multi-token forward of one layer from `held` -> (y, the ScanHeld after it), through
    the Triton chunk kernel or its torch reference (teacher_force_path)."""
    path = teacher_force_path(q, q.shape[-1], v.shape[-1])
    if path == "triton":
        from replayquant.kernels.chunk import chunk_scan as scan
    else:
        if path != "torch":
            warnings.warn(f"replayquant teacher forcing on {q.device}: {path}", stacklevel=3)
        scan = chunk_scan_ref
    with cpu_threads(q.device):
        y, ss = scan(held.ss, q, k, v, log_a, beta, pair=held.pair, seed=held.seed,
                     layer=held.layer, valid=valid, exact=exact)
    return y, ScanHeld(ss, held.pair, held.delta, held.seed, held.layer)


# ==================================================================== ReplayState <-> ReplayStore

def _role_to_packed(q: QTensor, spec, N: int, slots: torch.Tensor, shape):
    """A PackedRole [N, H, d_v, d_k] holding the packed QTensor q ([B, H, d_v, d_k]) in `slots`
    (same bytes; other slots zero)."""
    from replayquant.kernels.roles import PackedRole
    B, H, dv, dk = shape
    role = PackedRole.empty(spec.format, spec.rounding, (N, H, dv, dk), q.device)
    for t in (role.payload, role.scale, role.gscale):
        if t is not None:
            t.view(torch.uint8).zero_() if t.dtype == torch.float8_e4m3fn else t.zero_()
    if spec.format == "nvfp4":
        role.payload[slots] = q.payload.reshape(B, H, dv, dk // 2)
        role.scale[slots] = q.scales["block"].reshape(B, H, dv, dk // 16)
        role.gscale[slots] = q.scales["matrix"].reshape(B, H)
    else:
        role.payload[slots] = q.payload.reshape(B, H, dv, dk)
        if spec.format == "fp8":
            role.scale[slots] = q.scales["row"].reshape(B, H, dv)
    return role


def _packed_to_role(role, slots: torch.Tensor) -> QTensor:
    """The QTensor [B, H, d_v, d_k] (layout of replayquant.formats) of `slots` of a PackedRole."""
    _, H, dv, dk = role.shape
    B = len(slots)
    shape = (B, H, dv, dk)
    if role.fmt == "nvfp4":
        return QTensor("nvfp4", shape, role.payload[slots].reshape(B * H, dv, dk // 2).clone(),
                       {"block": role.scale[slots].reshape(B * H, dv, dk // 16).clone(),
                        "matrix": role.gscale[slots].reshape(B * H).clone()})
    scales = {"row": role.scale[slots].clone()} if role.fmt == "fp8" else {}
    return QTensor(role.fmt, shape, role.payload[slots].clone(), scales)


def state_to_store(st: ReplayState, key_heads: int, u_dtype=None, ring_dtype=torch.bfloat16):
    """Convert a ReplayState into (ReplayStore, state_indices), the decode store of either engine.

    Slots are the state's sequence ids (`rows`, which key the SR streams in both), so the store
    has max(rows) + 1 slots and state_indices = rows. Sequence ids that repeat (a beam reorder
    before the first decode step) take the slots 0..B-1 instead: each row then draws its slot's
    SR streams from its next flush on, as after a reorder on the store (`take_slots`). The
    anchor and read copy move bit for bit. The committed entries move into the ring (start 0) in
    the store's layout: k per key head / group (GDN: the normalised k, re-normalised on read),
    v (GDN: v; Mamba-2: v = dt x stored as x = v with dt = 1), both in ring_dtype (bf16 for the
    Triton kernels, float32 for the torch engine: no rounding), G and beta in fp32, GDN u in
    u_dtype (None: the store's default, stores.default_u_dtype: float32 for a shared FP32 pair,
    whose flush folds it, or a float32 ring, else bf16) and, where the kernel's flush solves for
    u, GDN's key factors (Tbuf, computed from the entries; a float32 ring keeps none)."""
    from replayquant.kernels.stores import RING_DTYPES, ReplayStore, default_u_dtype, solves_u
    from replayquant.kernels.replay_ref import fill_key_factors_ref
    from replayquant.streams import layer_seed
    if ring_dtype not in RING_DTYPES:
        raise ValueError(f"ring_dtype must be one of {RING_DTYPES}, got {ring_dtype}")
    if u_dtype is None:
        u_dtype = default_u_dtype(st.pair.anchor.format, None if st.pair.read is None
                                  else st.pair.read.format, ring_dtype)
    parts = st.export()
    B, H, dv, dk, L = st.B, st.H, st.d_v, st.d_k, st.L
    if H % key_heads:
        raise ValueError(f"key_heads={key_heads} must divide the {H} heads")
    r = H // key_heads
    rows = parts["rows"]
    if len(torch.unique(rows)) != B:
        rows = torch.arange(B, dtype=torch.int64, device=rows.device)
    N = int(rows.max()) + 1
    slots = rows.long()
    dev, bf, f32 = st.device, ring_dtype, torch.float32
    pair = st.pair
    anchor = _role_to_packed(parts["anchor"], pair.anchor, N, slots, (B, H, dv, dk))
    read = None if pair.read is None else _role_to_packed(parts["read"], pair.read, N, slots,
                                                         (B, H, dv, dk))

    def ring(t, tail):                   # [B, H(or HK), L, ...] -> [N, L, H, ...] in slots
        out = torch.zeros((N, L) + tail, dtype=t.dtype, device=dev)
        out[slots] = t.transpose(1, 2)
        return out

    vec = st.vector_gate                 # KDA: G per key channel
    kbuf = ring(parts["k"][:, ::r], (key_heads, dk)).to(bf)
    if st.delta:
        vbuf = ring(parts["v"], (H, dv)).to(bf)
        ubuf = ring(parts["u"], (H, dv)).to(u_dtype)
        bbuf = ring(parts["beta"], (H,)).to(f32)
    else:
        vbuf = ring(parts["v"], (H, dv)).to(bf)          # x := v, dt := 1
        ubuf = None
        bbuf = ring(torch.ones_like(parts["G"]), (H,)).to(f32)
    Gbuf = ring(parts["G"], (H, dk) if vec else (H,)).to(f32)
    committed = torch.zeros(N, dtype=torch.int32, device=dev)
    committed[slots] = parts["committed"].to(torch.int32)
    n_flush = torch.zeros(N, dtype=torch.int64, device=dev)
    n_flush[slots] = parts["flushes"].to(torch.int64)
    store = ReplayStore("kda" if vec else "gdn" if st.delta else "mamba2", anchor, read, L,
                        key_heads,
                        kbuf=kbuf, vbuf=vbuf, ubuf=ubuf, Gbuf=Gbuf, bbuf=bbuf,
                        committed=committed, n_flush=n_flush, key=layer_seed(st.seed, st.layer),
                        start=torch.zeros(N, dtype=torch.int32, device=dev), max_drafts=0)
    if solves_u(store) and ring_dtype == torch.bfloat16:   # the kernel flush's key factors
        store.Tbuf = torch.zeros(N, L, H, L, dtype=f32, device=dev)
        fill_key_factors_ref(store, slots)
    return store, rows.to(torch.int32)


def store_to_state(store, state_indices: torch.Tensor, pair, seed: int, layer: int) -> ReplayState:
    """The ReplayState of the batch rows state_indices of a ReplayStore (the inverse of
    state_to_store, without any cast): anchor and read copy bit for bit, the committed ring
    entries in window order as the kernel reads them (GDN k re-normalised, Mamba-2 v = dt x),
    u as the kernel computed it, flush indices, and rows = the slots (the SR sequence ids)."""
    slots = state_indices.long()
    B = len(slots)
    N, H, dv, dk = store.shape
    L, C = store.L, store.capacity
    r = H // store.key_heads
    delta = store.kind != "mamba2"
    dev = store.kbuf.device
    pos = (store.start[slots].long()[:, None] + torch.arange(L, device=dev)[None, :]) % C
    bi = torch.arange(B, device=dev)[:, None]

    def take(buf):                      # [N, C, X, ...] -> [B, X, L, ...] float32
        return buf[slots][bi, pos].float().transpose(1, 2).contiguous()

    k = take(store.kbuf)
    if store.kind == "gdn":
        k = l2norm(k)
    elif store.kind == "kda":                            # KDA's own form of the norm
        k = l2norm_kda(k)
    k = k.repeat_interleave(r, dim=1)
    G = take(store.Gbuf)
    bt = take(store.bbuf)
    v = take(store.vbuf)
    parts = {"anchor": _packed_to_role(store.anchor, slots),
             "read": None if store.read is None else _packed_to_role(store.read, slots),
             "k": k, "G": G, "committed": store.committed[slots].long(),
             "flushes": store.n_flush[slots].long(), "rows": slots}
    if delta:
        parts.update(v=v, beta=bt, u=take(store.ubuf))
    else:
        parts.update(v=bt.unsqueeze(-1) * v, beta=None, u=None)
    return ReplayState.from_parts(parts, pair, delta=delta, seed=seed, layer=layer)


class DecodeStore:
    """The replay state of one layer while it decodes: a ReplayStore, the engine that steps it
    ('triton': the replay decode kernel, a bf16 ring; 'torch': `replay_torch`, a float32 ring),
    the slot of each batch row, and what a decode step keeps on the device instead of reading it
    on the host (no host synchronisation in a step, so that torch.compile traces it whole and
    CUDA graphs capture it):
    * a beam reorder: HF replaces the cache's marker tensor (MARKER_ATTR on the cache layer, a
      host check of identity) by its rows picked by the beam ids, and `reorder` gathers every
      slot's store on the device (`take_slots`).
    * `bad`: int64 [B, n inputs] the decode step (1 = the first after the prompt) at which each
      input of each row first held NaN or infinity (-1: never), `steps` the decode steps run;
      `raise_nonfinite` reads them at a boundary the host already waits at. The kernel never writes a non-finite state into
      the anchor or the read copy (it keeps the roles of a flush whose state is not finite).
    Built from a ReplayState by `state_to_store`, turned back by `to_replay_state()`."""

    def __init__(self, st: ReplayState, key_heads: int, steps_done: int = 0,
                 reuse: "DecodeStore | None" = None, engine: str = "triton"):
        from replayquant.kernels.ops import ENGINES, store_meta
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.pair, self.delta, self.seed, self.layer = st.pair, st.delta, st.seed, st.layer
        self.vector_gate, self.engine = st.vector_gate, engine
        self.B, self.H, self.d_v, self.d_k, self.device = st.B, st.H, st.d_v, st.d_k, st.device
        self.ring = RING_DTYPE[engine]
        self.store, self.state_indices = state_to_store(st, key_heads, ring_dtype=self.ring)
        self.meta = store_meta(self.store, engine)
        self.bad_names = _PER_ROW[self.store.kind]
        self.bad = torch.full((self.B, len(self.bad_names)), -1, dtype=torch.int64,
                              device=self.device)
        # decode steps taken before the store's first (1 where the hand-off step is one)
        self.steps = torch.full((), int(steps_done), dtype=torch.int64, device=self.device)
        if reuse is not None and reuse.meta == self.meta and all(
                a.shape == b.shape and a.dtype == b.dtype
                for a, b in zip(reuse.tensors(), self.tensors())):
            # the same shapes as a store nobody holds any more: this content goes into its
            # tensors, so that a compiled step's CUDA graphs replay on the addresses they
            # recorded (a new address re-records every graph: about 300 ms a generate, H200)
            for a, b in zip(reuse.tensors(), self.tensors()):
                a.copy_(b)
            self.store, self.state_indices = reuse.store, reuse.state_indices
            self.bad, self.steps = reuse.bad, reuse.steps
            self.store.pending_T, self.store.last_force = None, False
        # every tensor a step reads or writes keeps its address, as HF's static cache tensors:
        # CUDA graphs replay a compiled step on them (torch.compile skips graphs that mutate
        # others, and copies any other input into the graph's own at every replay)
        for t in self.tensors():
            torch._dynamo.mark_static_address(t)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of this state a decode step reads or writes (store, slots, counters)."""
        from replayquant.kernels.ops import store_tensors
        return store_tensors(self.store) + [self.state_indices, self.bad, self.steps]

    def to_replay_state(self) -> ReplayState:
        return store_to_state(self.store, self.state_indices, self.pair, self.seed, self.layer)

    def reorder(self, ids: torch.Tensor) -> None:
        """Batch row i continues row ids[i] (a device tensor; repeats allowed: beam search)."""
        ids = ids.to(self.device)
        take_slots(self.store, self.state_indices, self.state_indices[ids])
        self.bad.copy_(self.bad[ids])

    def record_nonfinite(self, inputs: dict) -> None:
        """Note, on the device, the step at which an input of a row first held NaN or infinity."""
        sums = torch.stack([inputs[n].reshape(self.B, -1).sum(1, dtype=torch.float32)
                            for n in self.bad_names], 1)
        self.steps.add_(1)                  # this step's number, counted from 1 after the prompt
        self.bad.copy_(torch.where((self.bad < 0) & ~torch.isfinite(sums), self.steps, self.bad))

    def raise_nonfinite(self) -> None:
        """One ValueError naming the layer, the input, the row and the decode step, if an input
        of a decode step since the store was built held NaN or infinity (one host read)."""
        bad = self.bad.cpu()
        if not bool((bad >= 0).any()):
            return
        first = torch.where(bad >= 0, bad, torch.iinfo(torch.int64).max)
        row, col = divmod(int(first.argmin()), bad.shape[1])
        kind = self.store.kind
        raise ValueError(
            f"layer {self.layer} ({kind}): input {self.bad_names[col]} held NaN or infinity at "
            f"decode step {int(bad[row, col])} after the prompt, batch row {row}; the anchor and "
            f"read copy keep the last finite flush. The inputs are the layer's projections of its "
            f"hidden states: find where the model's activations first become non-finite (e.g. a "
            f"float16 overflow)")

    def step(self, raw: dict) -> torch.Tensor:
        """One decode step from the layer's raw inputs (one token each, see LayerRuntime.run)
        -> y float32 [B, H, d_v] (Mamba-2: without the D skip), through the custom operator
        replayquant::replay_step (replayquant.kernels.ops) on this state's engine."""
        from replayquant.kernels.ops import replay_step
        bf = self.ring
        if self.vector_gate:
            ins = dict(q=raw["q"], k=raw["k"].to(bf), v=raw["v"].to(bf), g=raw["g"],
                       beta=raw["beta"], scale=raw["scale"])
        elif self.delta:
            ins = dict(q=raw["q"], k=raw["k"].to(bf), v=raw["v"].to(bf), a=raw["a"], b=raw["b"],
                       A_log=raw["A_log"], dt_bias=raw["dt_bias"],
                       beta_scale=raw.get("beta_scale", 1.0))
        else:
            ins = dict(x=raw["x"].to(bf), dt=raw["dt"], A=raw["A"], B=raw["B"].to(bf), C=raw["C"],
                       dt_bias=raw["dt_bias"], dt_limit=raw.get("dt_limit"))
        return replay_step(self.store, ins, self.state_indices, DECODE_KERNEL_PATH, self.meta)


def take_slots(store, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Slot dst[i] of every per-slot tensor of a ReplayStore becomes a copy of slot src[i] (on
    the device, no host read; src may repeat). Streams of stochastic rounding are keyed by slot,
    so a row copied into another slot draws that slot's streams from its next flush on."""
    dst, src = dst.long(), src.long()
    roles = [r for r in (store.anchor, store.read) if r is not None]
    for t in [x for r in roles for x in (r.payload, r.scale, r.gscale)] + [
            store.kbuf, store.vbuf, store.ubuf, store.Gbuf, store.bbuf, store.Tbuf,
            store.committed, store.start, store.n_flush]:
        if t is not None:
            t = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            t.index_copy_(0, dst, t.index_select(0, src))


# the raw decode inputs that hold one value per batch row (the rest are the layer's parameters)
_PER_ROW = {"gdn": ("q", "k", "v", "a", "b"), "mamba2": ("x", "dt", "B", "C"),
            "kda": ("q", "k", "v", "g", "beta")}


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
    from transformers import DynamicCache
    return cache is not None and bool(getattr(cache, "is_compileable", False)) \
        and type(cache) is not DynamicCache


def _kda_raw(q, k, v, log_a, beta) -> dict:
    """The decode kernel's KDA inputs from the core's (q, k unit vectors per value head, q times
    d_k^-1/2): q back to unit length and the scale passed apart, so that the kernel's
    re-normalisation (which the bf16 k of its ring buffer needs) leaves q and k as they are."""
    dk = q.shape[-1]
    return {"q": q * math.sqrt(dk), "k": k, "v": v, "g": log_a, "beta": beta,
            "scale": 1.0 / math.sqrt(dk)}


class LayerRuntime:
    """Configuration of one patched layer and its state handling (one per patched module)."""

    def __init__(self, pair, prefill: str, seed: int, layer_idx: int, delta: bool, kind: str,
                 vector_gate: bool = False):
        self.pair, self.prefill, self.seed = pair, prefill, int(seed)
        self.layer_idx, self.delta, self.kind = int(layer_idx), bool(delta), kind
        self.vector_gate = bool(vector_gate)     # log_a per key channel [.., H, d_k] (KDA)
        self._warned = set()
        # (weak reference to the cache layer holding it, the DecodeStore) of the last prefill
        # into a static cache, which the next one reuses (`_decode_ready`); None before any
        self._spare = None

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

    def _fresh(self, B, H, dv, dk, device, S0=None) -> ScanHeld:
        """A new state: S0 (default zeros) cast into both roles, flush index 0, an empty buffer
        (ReplayState's construction, which refuses an S0 that is not finite or overflows a
        role's format)."""
        if S0 is None:
            S0 = torch.zeros(B, H, dv, dk, device=device)
        return ScanHeld.of(ReplayState(S0, self.pair, delta=self.delta, seed=self.seed,
                                       layer=self.layer_idx, vector_gate=self.vector_gate))

    def get_state(self, lay, had_prev: bool, B, H, dv, dk, device):
        """The layer's state for this forward (new, continued, reordered or adopted): the
        DecodeStore decode left there, or a ScanHeld (new, adopted from an unpatched model's
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
            if isinstance(st, DecodeStore) and ids.shape[0] == st.B:
                st.reorder(ids)
            else:
                if isinstance(st, DecodeStore):
                    st = ScanHeld.of(st.to_replay_state())
                st = reorder_state(st, ids)
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
        kernel takes)."""
        return decode_path(x, d_k, d_v, raw.get("dt_limit") if isinstance(raw, dict) else None,
                           self.vector_gate)

    # ------------------------------------------------------------ the recurrence
    def run(self, cache, had_prev: bool, q, k, v, log_a, beta, valid,
            raw: dict | None = None):
        """q, k [B, T, H, d_k]; v [B, T, H, d_v]; log_a [B, T, H] ([B, T, H, d_k] for a layer built
        with vector_gate), beta [B, T, H]; valid [B, T] or None.
        raw: the layer's raw inputs for the decode store, each [B, T, ...] (per-head
        parameters unbatched): GDN q, k [.., HK, d_k], v, a, b, A_log, dt_bias, beta_scale
        (beta = beta_scale sigmoid(b)); Mamba-2 x, dt, A, B, C [.., G, N], dt_bias, dt_limit;
        None for KDA (built from the core inputs, `_kda_raw`). Returns y float32 [B, T, H, d_v]."""
        B, T, H, dk = q.shape
        dv = v.shape[-1]
        lay = None if cache is None else self.cache_layer(cache)
        st = self.get_state(lay, had_prev, B, H, dv, dk, q.device)
        decode = T == 1 and had_prev and (valid is None or bool(valid.all()))
        y = self._kernel_step(st, q, k, v, log_a, beta, raw) if decode else None
        if y is None:
            if isinstance(st, DecodeStore):
                st.raise_nonfinite()                       # a boundary: the steps before it
            self._check_inputs(q, k, v, log_a, beta, valid, decode=T == 1 and had_prev)
            if decode:
                st, y = self._decode(st, q, k, v, log_a, beta, raw)
            else:
                if isinstance(st, DecodeStore):      # hand back to the chunked scan
                    st = ScanHeld.of(st.to_replay_state())
                y, st = _teacher_force(st, q, k, v, log_a, beta, valid, self.prefill == "exact")
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
        if not isinstance(st, DecodeStore):
            return None
        st = self.get_state(lay, had_prev, lead.shape[0], st.H, st.d_v, st.d_k, lead.device)
        y = self._kernel_step(st, None, None, None, None, None, raw)
        self.put_state(cache, lay, st)
        return y

    def _kernel_step(self, st, q, k, v, log_a, beta, raw):
        """A decode step on the store a previous decode step (or a prefill into a static cache)
        left, with no host read: y [B, 1, H, d_v], or None where the state is not a store yet."""
        if not isinstance(st, DecodeStore):
            return None
        if self.vector_gate and raw is None:
            raw = _kda_raw(q, k, v, log_a, beta)
        one = _one_token(raw)
        st.record_nonfinite(one)
        return st.step(one).unsqueeze(1)

    def _engine(self, q, v, raw) -> str:
        """The engine of this layer's decode store for inputs like q: 'triton' where decode_path
        chooses the kernel, else 'torch' (`replay_torch`), warned once per layer where the kernel
        cannot take the layer (the warning names why)."""
        path = self.decode_path(q, q.shape[-1], v.shape[-1], raw)
        if path not in ("triton", "torch"):
            self._warn_once(f"replayquant decode on {q.device}, layer {self.layer_idx}: {path}")
        return "triton" if path == "triton" else "torch"

    def _to_store(self, st, q, k, v, log_a, beta, raw, steps_done=0, reuse=None):
        """The hand-off of a ScanHeld into this layer's DecodeStore (once, where
        decode starts or a prefill into a static cache ends)."""
        if self.vector_gate and raw is None:
            raw = _kda_raw(q, k, v, log_a, beta)
        if not isinstance(raw, dict):
            raise ValueError(f"layer {self.layer_idx} ({self.kind}): a decode step needs the "
                             f"layer's raw inputs (the patched forward passes them as raw=)")
        if isinstance(st, ScanHeld):
            st = st.to_replay_state()
        return DecodeStore(st, _key_heads(raw, self.delta), steps_done=steps_done, reuse=reuse,
                           engine=self._engine(q, v, raw))

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
        ds = self._to_store(st, q, k, v, log_a, beta, raw, reuse=spare if free else None)
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

    def _decode(self, st, q, k, v, log_a, beta, raw):
        """The first decode step after a multi-token forward: the hand-off into the store
        (`_to_store`), then the step on it."""
        st = self._to_store(st, q, k, v, log_a, beta, raw, steps_done=1)
        if self.vector_gate and raw is None:
            raw = _kda_raw(q, k, v, log_a, beta)
        return st, st.step(_one_token(raw)).unsqueeze(1)


def reorder_state(held: ScanHeld, ids: torch.Tensor) -> ScanHeld:
    """The state whose row i is row ids[i] of `held` (beam search before decode starts). SR
    stream ids follow the rows."""
    from dataclasses import fields
    from replayquant.replay import core

    ss, ids = held.ss, ids.to(held.device)
    parts = {}
    for f in fields(ss):
        t = getattr(ss, f.name)
        parts[f.name] = None if t is None else core.qt_take(t, ids, ss.batch) \
            if f.name in ("anchor", "read") else t[ids].contiguous()
    return ScanHeld(type(ss)(**parts), held.pair, held.delta, held.seed, held.layer)
