"""The decode store of one patched layer (`DecodeStore`) and its hand-off from and to a
`ReplayState`, used by `replayquant.models.runtime`.

A `DecodeStore` is a `replayquant.replay.stores.ReplayStore` (anchor and read copy, ring buffer,
per-row pointers as device tensors, allocated once for the batch), the engine that steps it
through the custom operator replayquant::replay_step ('triton': the replay decode kernel on a
bf16 ring; 'torch': `replayquant.kernels.replay.engine` on a float32 ring), the slot of each
batch row, and the device-side record of non-finite inputs. `parts_to_store` builds the store once,
where decode starts, from a state's parts: the chunked scan's state as it is after a prompt, or a
ReplayState's (`state_to_store`); `store_to_state` turns it back where a multi-token forward
continues the cache. Both keep the anchor and read copy bit for bit (same packed bytes, same SR
streams: slot id = the state's sequence id) and the committed buffer entries. The ring holds
the layer's raw activations, as a decode step appends them (GDN / KDA k before its L2 norm,
Mamba-2 x with its step size dt in float32 beside it; a prompt's come from
`runtime.RawTail`), never values derived from them: the Triton engine's ring keeps them in bf16,
exact for the bf16 model it serves (half the buffer traffic of float32), the torch engine's in
float32; GDN's u (derived) is bf16 beside a separate read copy, where it only serves outputs,
and FP32 for a shared FP32 pair (its flush folds u).
"""

from __future__ import annotations

import torch

from replayquant.formats import QTensor, as_bits
from replayquant.kernels.ops import (ENGINES, replay_accept, replay_step, replay_verify,
                                     store_meta, store_tensors)
from replayquant.kernels.replay.reference import fill_key_factors_ref
from replayquant.replay import ReplayState, core
from replayquant.replay.roles import PackedRole
from replayquant.replay.stores import (FAULT_INPUTS, FaultRecord, ReplayStore, check_ring_dtype,
                                       default_u_dtype, overflowing_role, ring_keys, solves_u)
from replayquant.streams import layer_seed

__all__ = ["DecodeStore", "state_to_store", "parts_to_store", "store_to_state", "take_slots",
           "RING_DTYPE"]

# the ring's k and v per engine: bf16 halves the kernel's buffer traffic; the torch engine keeps
# them in float32, so that its decode equals ReplayState.step (and HF's recurrence) within float32
# reassociation
RING_DTYPE = {"triton": torch.bfloat16, "torch": torch.float32}
# The kernel's step path: 'replay' keeps ReplayState's flush schedule (a flush every L tokens), so
# the kernel and the torch reference hold the same committed / flush counters and a hand-off
# back continues the same schedule. (The kernel's 'auto' would flush every step at small batch for
# a shared FP32 anchor: lossless but another schedule; a serving choice, not the patch's.)
DECODE_KERNEL_PATH = "replay"


def _role_to_packed(q: QTensor, spec, N: int, slots: torch.Tensor, shape):
    """A PackedRole [N, H, d_v, d_k] holding the packed QTensor q ([B, H, d_v, d_k]) in `slots`
    (same bytes; other slots zero)."""
    B, H, dv, dk = shape
    role = PackedRole.empty(spec.format, spec.rounding, (N, H, dv, dk), q.device)
    for t in (role.payload, role.scale, role.gscale):
        if t is not None:
            as_bits(t).zero_()
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
    """Convert a ReplayState into (ReplayStore, state_indices), the decode store of either engine
    (`parts_to_store` of its parts)."""
    return parts_to_store(st.export(), st.pair, st.delta, st.seed, st.layer, key_heads,
                          u_dtype=u_dtype, ring_dtype=ring_dtype)


def _solved_u(parts: dict, pair) -> torch.Tensor:
    """GDN's u of the committed entries against the read copy, as ReplayState.load computes it
    where its parts come without u (the chunked scan's)."""
    read = parts["read"] if parts["read"] is not None else parts["anchor"]
    R32 = pair.read_spec.fmt.dequantize(read)
    k, v, G, beta = (parts[n].float() for n in ("k", "v", "G", "beta"))
    valid = core.committed_mask(parts["committed"], k.shape[2])
    return core.solve_u(R32, k, v, G, beta, valid)


def _slot_count(rows: torch.Tensor) -> int | None:
    """max(rows) + 1 where the sequence ids are distinct, else None; one host read."""
    srt = rows.sort().values
    distinct = (srt[1:] != srt[:-1]).all()
    n = int(torch.where(distinct, srt[-1] + 1, 0))
    return n or None


def parts_to_store(parts: dict, pair, delta: bool, seed: int, layer: int, key_heads: int,
                   u_dtype=None, ring_dtype=torch.bfloat16, n_slots: int | None = None,
                   raw: dict | None = None, max_drafts: int = 0):
    """(ReplayStore, state_indices), the decode store of either engine, from a state's parts
    (the dict ReplayState.export returns, or the chunked scan's state as `scan_parts` gives it:
    GDN u None, computed here against the read copy as ReplayState.load does). One host read
    (the slot count), none where the caller knows it (`n_slots`: the rows are then distinct and
    below it, as a new state's 0..B-1); the parts are the engine's own, so they are not checked
    again.

    Slots are the state's sequence ids (`rows`, which key the SR streams in both), so the store
    has max(rows) + 1 slots and state_indices = rows. Sequence ids that repeat (a beam reorder
    before the first decode step) take the slots 0..B-1 instead: each row then draws its slot's
    SR streams from its next flush on, as after a reorder on the store (`take_slots`). The
    anchor and read copy move bit for bit. The committed entries move into the ring (start 0) in
    the store's layout, as the decode steps would have appended them: with `raw` (the entries'
    raw inputs in buffer order, [B, L, ...] each: GDN / KDA "k" per key head before its L2 norm,
    Mamba-2 "x" and its step size "dt", as `runtime.RawTail.entries` gives them) the ring holds
    the raw k (normalised once, where it is read) and Mamba-2's raw x with dt beside it (its
    v = dt x formed where it is read, in float32, as the chunked scan formed it); without (a
    ReplayState's parts, whose raw inputs are gone) it holds the parts' keys as they are (GDN /
    KDA: already normalised, so that reading normalises them a second time: a relative change
    of about 1e-6 / |k_raw|^2) and Mamba-2's v as x = v with dt = 1. v (GDN, KDA) is the model's
    own. k and v / x in ring_dtype (bf16 for the Triton kernels: exact for a bf16 model's
    activations, not for derived values; float32 for the torch engine), G and beta in fp32, GDN u in
    u_dtype (None: the store's default, stores.default_u_dtype: float32 for a shared FP32 pair,
    whose flush folds it, or a float32 ring, else bf16) and, where the kernel's flush solves for
    u, GDN's key factors (Tbuf, computed from the entries; a float32 ring keeps none).
    max_drafts: the most drafts a speculative verify appends (`ReplayStore.from_state`), the ring
    then holding L + max_drafts entries."""
    check_ring_dtype(ring_dtype)
    if u_dtype is None:
        u_dtype = default_u_dtype(pair.anchor.format, None if pair.read is None
                                  else pair.read.format, ring_dtype)
    B, H, dv, dk = parts["anchor"].shape
    buffer_len = parts["k"].shape[2]
    if H % key_heads:
        raise ValueError(f"key_heads={key_heads} must divide the {H} heads")
    r = H // key_heads
    rows = parts["rows"]
    N = _slot_count(rows) if n_slots is None else n_slots
    if N is None:
        rows, N = torch.arange(B, dtype=torch.int64, device=rows.device), B
    slots = rows.long()
    dev, f32 = parts["k"].device, torch.float32
    if delta and parts.get("u") is None:
        parts = dict(parts, u=_solved_u(parts, pair))
    anchor = _role_to_packed(parts["anchor"], pair.anchor, N, slots, (B, H, dv, dk))
    read = None if pair.read is None else _role_to_packed(parts["read"], pair.read, N, slots,
                                                         (B, H, dv, dk))

    C = buffer_len + max_drafts

    def ring(t, tail):                   # [B, H(or HK), L, ...] -> [N, C, H, ...] in slots
        out = torch.zeros((N, C) + tail, dtype=t.dtype, device=dev)
        out[slots, :buffer_len] = t.transpose(1, 2)
        return out

    def ring_raw(name, tail):            # raw entries [B, L, ...] -> [N, C, ...] in slots
        out = torch.zeros((N, C) + tail, dtype=raw[name].dtype, device=dev)
        out[slots, :buffer_len] = raw[name]
        return out

    vec = parts["G"].dim() == 4          # KDA: G per key channel
    kbuf = (ring_raw("k", (key_heads, dk)) if raw is not None and delta
            else ring(parts["k"][:, ::r], (key_heads, dk))).to(ring_dtype)
    if delta:
        vbuf = ring(parts["v"], (H, dv)).to(ring_dtype)
        ubuf = ring(parts["u"], (H, dv)).to(u_dtype)
        bbuf = ring(parts["beta"], (H,)).to(f32)
    elif raw is not None:                # raw x, dt beside it
        vbuf = ring_raw("x", (H, dv)).to(ring_dtype)
        ubuf = None
        bbuf = ring_raw("dt", (H,)).to(f32)
    else:
        vbuf = ring(parts["v"], (H, dv)).to(ring_dtype)  # x := v, dt := 1
        ubuf = None
        bbuf = ring(torch.ones_like(parts["G"]), (H,)).to(f32)
    Gbuf = ring(parts["G"], (H, dk) if vec else (H,)).to(f32)
    committed = torch.zeros(N, dtype=torch.int32, device=dev)
    committed[slots] = parts["committed"].to(torch.int32)
    n_flush = torch.zeros(N, dtype=torch.int64, device=dev)
    n_flush[slots] = parts["flushes"].to(torch.int64)
    store = ReplayStore("kda" if vec else "gdn" if delta else "mamba2", anchor, read, buffer_len,
                        key_heads,
                        kbuf=kbuf, vbuf=vbuf, ubuf=ubuf, Gbuf=Gbuf, bbuf=bbuf,
                        committed=committed, n_flush=n_flush, key=layer_seed(seed, layer),
                        start=torch.zeros(N, dtype=torch.int32, device=dev),
                        max_drafts=max_drafts)
    if solves_u(store) and ring_dtype == torch.bfloat16:   # the kernel flush's key factors
        store.Tbuf = torch.zeros(N, C, H, buffer_len, dtype=f32, device=dev)
        fill_key_factors_ref(store, slots)
    return store, rows.to(torch.int32)


def _window(store, slots: torch.Tensor):
    """take(buf): the ring buffer buf [N, C, ...] of a ReplayStore at `slots`, its entries in
    window order, [len(slots), L, ...]."""
    dev = store.kbuf.device
    pos = (store.start[slots].long()[:, None]
           + torch.arange(store.buffer_len, device=dev)[None, :]) % store.capacity
    bi = torch.arange(len(slots), device=dev)[:, None]
    return lambda buf: buf[slots][bi, pos]


def store_to_state(store, state_indices: torch.Tensor, pair, seed: int, layer: int) -> ReplayState:
    """The ReplayState of the batch rows state_indices of a ReplayStore (the inverse of
    state_to_store, without any cast): anchor and read copy bit for bit, the committed ring
    entries in window order as the kernel reads them (GDN / KDA k normalised, Mamba-2 v = dt x),
    u as the kernel computed it, flush indices, and rows = the slots (the SR sequence ids)."""
    slots = state_indices.long()
    r = store.shape[1] // store.key_heads
    delta = store.kind != "mamba2"
    window = _window(store, slots)

    def take(buf):                      # [N, C, X, ...] -> [B, X, L, ...] float32
        return window(buf).float().transpose(1, 2).contiguous()

    k = ring_keys(store.kind, take(store.kbuf)).repeat_interleave(r, dim=1)
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
    ('triton': the replay decode kernel, a bf16 ring; 'torch': `replay.engine`, a float32 ring),
    the slot of each batch row, and what a decode step keeps on the device instead of reading it
    on the host (no host synchronisation in a step, so that torch.compile traces it whole and
    CUDA graphs capture it):
    * a beam reorder: HF replaces the cache's marker tensor (MARKER_ATTR on the cache layer, a
      host check of identity) by its rows picked by the beam ids, and `reorder` gathers every
      slot's store on the device (`take_slots`).
    * `faults`: a `replay.stores.FaultRecord` in which each step itself (inside the kernel's
      launches, or the torch engine's ops: no launch of its own) notes the decode step (1 = the
      first after the prompt) at which each input of each row first held NaN or infinity;
      `raise_nonfinite` reads it at a boundary the host already waits at. The kernel never
      writes a non-finite state into the anchor or the read copy (it keeps the roles of a flush
      whose state is not finite).
    * `phase` (torch engine, eager steps): each row's committed count, counted on the host from
      the hand-off on (every decode step appends one entry per row, a row whose entry fills the
      buffer flushes to 0), so that a step names the rows that flush and the engine runs the
      flush branch on them alone (`replay.engine`'s `flushing`): on this project's 2-core CPU,
      one thread, the embedded models at B = 4, L = 16, a decode forward with the branch for
      every row took 1.3-2.5x one with it for the rows that flush (s32_rs and tp4_hi16_sr;
      evals/cpu_decode.py).
      None where it is not known: the Triton engine, after a beam reorder, once a step is
      compiled (every row then computes both branches).
    Built from a ReplayState, or straight from the chunked scan's state (`from_parts`), by
    `parts_to_store`; turned back by `to_replay_state()`."""

    def __init__(self, st: ReplayState, key_heads: int, reuse: "DecodeStore | None" = None,
                 engine: str = "triton"):
        self._build(st.export(), st.pair, st.delta, st.seed, st.layer, key_heads, reuse, engine)

    @classmethod
    def from_parts(cls, parts: dict, pair, delta: bool, seed: int, layer: int, key_heads: int,
                   reuse: "DecodeStore | None" = None, engine: str = "triton",
                   n_slots: int | None = None, raw: dict | None = None,
                   max_drafts: int = 0) -> "DecodeStore":
        """The decode store of a state's parts (`parts_to_store`: the chunked scan's state
        straight into the store, no ReplayState in between; n_slots, raw and max_drafts as
        there)."""
        self = cls.__new__(cls)
        self._build(parts, pair, delta, seed, layer, key_heads, reuse, engine, n_slots, raw,
                    max_drafts)
        return self

    def _build(self, parts, pair, delta, seed, layer, key_heads, reuse, engine, n_slots=None,
               raw=None, max_drafts=0):
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.pair, self.delta, self.seed, self.layer = pair, delta, seed, layer
        self.vector_gate, self.engine = parts["G"].dim() == 4, engine
        self.B, self.H, self.d_v, self.d_k = parts["anchor"].shape
        self.device = parts["k"].device
        self.ring = RING_DTYPE[engine]
        self.store, slots = parts_to_store(parts, pair, delta, seed, layer, key_heads,
                                           ring_dtype=self.ring, n_slots=n_slots, raw=raw,
                                           max_drafts=max_drafts)
        # int32, as the kernels index: a step converts nothing
        self.state_indices = slots.to(torch.int32)
        self.bad_names = FAULT_INPUTS[self.store.kind]
        self.faults = FaultRecord.empty(self.store.kind, self.B, self.device)
        self.phase = parts["committed"].tolist() if engine == "torch" else None
        # one tensor for the store's fields: a compiled step guards it alone (ReplayStore.pack)
        # the operator's meta, the packed layout in it: a store of an equal meta is packed alike
        self.meta = store_meta(self.store, engine, packed=self.store.pack_layout())
        mine = [self.state_indices, *self.faults]
        theirs = None if reuse is None else [reuse.state_indices, *reuse.faults]
        if reuse is not None and reuse.meta == self.meta and all(
                a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                for a, b in zip(theirs, mine)):
            # the same layout as a store nobody holds any more: this content goes into its
            # tensors, so that a compiled step's CUDA graphs replay on the addresses they
            # recorded (a new address re-records every graph: about 300 ms a generate, H200)
            self.store.pack(into=reuse.store.blob)
            for a, b in zip(theirs, mine):
                a.copy_(b)
            self.store, self.state_indices = reuse.store, reuse.state_indices
            self.faults = reuse.faults
            self.store.pending_T, self.store.last_force = None, False
        else:
            self.store.pack()
        # every tensor a step reads or writes keeps its address, as HF's static cache tensors:
        # CUDA graphs replay a compiled step on them (torch.compile skips graphs that mutate
        # others, and copies any other input into the graph's own at every replay)
        for t in self.tensors():
            torch._dynamo.mark_static_address(t)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of this state a decode step reads or writes (store, slots, counters)."""
        return store_tensors(self.store) + [self.state_indices, *self.faults]

    def to_replay_state(self) -> ReplayState:
        return store_to_state(self.store, self.state_indices.long(), self.pair, self.seed,
                              self.layer)

    def committed(self) -> torch.Tensor:
        """Each batch row's committed entries (the fill h of its ring), int32 [B]."""
        return self.store.committed[self.state_indices.long()]

    def raw_entries(self) -> dict:
        """The ring's raw entries of each batch row in window order, [B, L, ...] each (the
        `raw` of parts_to_store: GDN / KDA k, Mamba-2 x and dt)."""
        take = _window(self.store, self.state_indices.long())
        if self.delta:
            return {"k": take(self.store.kbuf)}
        return {"x": take(self.store.vbuf), "dt": take(self.store.bbuf)}

    def reorder(self, ids: torch.Tensor) -> None:
        """Batch row i continues row ids[i] (a device tensor; repeats allowed: beam search)."""
        ids = ids.to(self.device)
        take_slots(self.store, self.state_indices, self.state_indices[ids])
        for t in self.faults:
            t.copy_(t[ids])
        self.phase = None                     # the rows' phases moved on the device

    def raise_nonfinite(self) -> None:
        """One ValueError naming the layer, the row and the decode step, if since the store was
        built a flush's cast into the anchor or read copy overflowed (named first: the role and
        its format, as replay.state.flush_overflow_error), else if an input of a decode step
        held NaN or infinity (naming the input); one host read."""
        bad = self.faults.bad.cpu()
        if not bool((bad >= 0).any()):
            return
        first = torch.where(bad >= 0, bad, torch.iinfo(torch.int64).max)
        if bool((bad[:, -1] >= 0).any()):            # stores.FAULT_COLUMNS: the flush's cast
            row = int(first[:, -1].argmin())
            role, spec = overflowing_role(self.pair)
            raise ValueError(
                f"layer {self.layer}: the {role} ({spec.format} of pair {self.pair.label()}) "
                f"overflows at the flush of decode step {int(bad[row, -1])} after the prompt, "
                f"batch row {row} (sequence {int(self.state_indices[row])}): the state rebuilt "
                f"there is larger than {spec.format} holds ({spec.fmt.grid.max_value:g}); that "
                f"flush kept the anchor and read copy as they were, so the row's outputs from "
                f"there on are not the pair's. Give the {role} a wider format (fp32, or bf16, "
                f"which keeps fp32's range), or check the model's activations (the inputs were "
                f"finite: their size made the state this large)")
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
        replayquant::replay_step (replayquant.kernels.ops) on this state's engine, which notes
        the inputs' faults in `faults`."""
        return replay_step(self.store, self._inputs(raw), self.state_indices, DECODE_KERNEL_PATH,
                           self.meta, flushing=self._flushing(), record=self.faults)

    def verify(self, raw: dict) -> torch.Tensor:
        """Speculative decoding's verify of T drafts per row from the layer's raw inputs (each
        [B, T, ...], as a multi-token forward gives them; T at most the store's max_drafts)
        -> y float32 [B, T, H, d_v] (Mamba-2: without the D skip), through the custom operator
        replayquant::replay_verify: all drafts read against one checkpoint, outputs only, each
        appended to the ring after the committed entries, uncommitted until `accept`. A row whose
        committed entries would not leave T free slots (h + T > L, h > 0) folds them first (DESIGN
        section 4); a flush never folds drafts."""
        self.phase = None                     # the rows' fills move on the device
        ins = self._inputs(raw)
        return replay_verify(self.store, ins, self.state_indices, self.meta)

    def accept(self, n: int) -> None:
        """Commit the first n of the drafts the last `verify` appended, in every row (a pointer
        move, replayquant::replay_accept; the rest are overwritten by later entries)."""
        n_rows = torch.full((self.B,), int(n), dtype=torch.int32, device=self.device)
        replay_accept(self.store, n_rows, self.state_indices, self.meta, check=False)

    def _inputs(self, raw: dict) -> dict:
        """The operator's inputs of a step or verify from the layer's raw inputs: the buffered
        ones in the ring's dtype, each made contiguous here, outside the operator, where
        torch.compile fuses the copy into the kernel that produced them (GDN's q, k and v are
        views of the convolution's output)."""
        ring = self.ring                      # the buffered inputs go in at the ring's dtype

        def c(name, dtype=None):
            t = raw[name]
            return (t if dtype is None else t.to(dtype)).contiguous()

        if self.vector_gate:
            return dict(q=c("q"), k=c("k", ring), v=c("v", ring), g=c("g"), beta=c("beta"),
                        scale=raw["scale"])
        if self.delta:
            return dict(q=c("q"), k=c("k", ring), v=c("v", ring), a=c("a"), b=c("b"),
                        A_log=raw["A_log"], dt_bias=raw["dt_bias"],
                        beta_scale=raw.get("beta_scale", 1.0))
        return dict(x=c("x", ring), dt=c("dt"), A=raw["A"], B=c("B", ring), C=c("C"),
                    dt_bias=raw["dt_bias"], dt_limit=raw.get("dt_limit"))

    def _flushing(self) -> list[int] | None:
        """The rows whose entry fills the buffer at this step, from `phase` (advanced here), or
        None where the host does not know them (a compiled step: the graph takes none)."""
        # asked before `phase` is read: a compiled step then guards nothing on it, so the
        # step after a hand-off (phase a list) and the later ones (None) share one graph
        if torch.compiler.is_compiling():
            self.phase = None
            return None
        if self.phase is None:
            return None
        buffer_len = self.store.buffer_len
        rows = [r for r, h in enumerate(self.phase) if h + 1 == buffer_len]
        self.phase = [0 if h + 1 == buffer_len else h + 1 for h in self.phase]
        return rows


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
            t = as_bits(t)
            t.index_copy_(0, dst, t.index_select(0, src))

