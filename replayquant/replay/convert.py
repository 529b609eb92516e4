"""The conversions between the forms of one layer's state, in one place:

    ReplayState  --export / load / to_replay_state-->  ScanState   (replay.state, replay.handoff)
    ScanState    --scan_to_store / store_to_scan-->    ReplayStore (replay.stores)
    ReplayState  --state_to_store / store_to_state-->  ReplayStore (through the ScanState, whose
                                                                    tensors a ReplayState shares)

`ReplayState.export` gives its ScanState (its own tensors, no copy) and `load` installs one (a
copy); a store goes to a ScanState and back directly, with no ReplayState between them. Each
direction keeps the anchor and read copy bit for bit (same packed bytes, same SR streams: slot
id = the state's sequence id) and the committed buffer entries. The ring holds the layer's raw
activations, as a decode step appends them (GDN / KDA k before its L2 norm, Mamba-2 x with its
step size dt in float32 beside it; a prompt's come from `ScanState.raw`), never values derived
from them: the Triton engine's ring keeps them in bf16, exact for the bf16 model it serves (half
the buffer traffic of float32), the torch engine's in float32; GDN's u (derived) is bf16 beside
a separate read copy, where it only serves outputs, and FP32 for a shared FP32 pair (its flush
folds u). Plain torch: importing this module imports no Triton.
"""

from __future__ import annotations

import torch

from replayquant.formats import QTensor, as_bits
from replayquant.replay import core
from replayquant.replay.handoff import ScanState
from replayquant.replay.roles import PackedRole
from replayquant.replay.state import ReplayState
from replayquant.replay.stores import (ReplayStore, check_ring_dtype, default_u_dtype,
                                       fill_key_factors_ref, ring_keys, solves_u)
from replayquant.streams import layer_seed

__all__ = ["scan_state_of", "to_replay_state", "load_scan_state", "scan_to_store",
           "store_to_scan", "state_to_store", "store_to_state", "store_window"]


# ---------------------------------------------------------------- ReplayState <-> ScanState

def scan_state_of(st: ReplayState) -> ScanState:
    """The ScanState of ReplayState st (its tensors, no copy; `ReplayState.export`)."""
    return st.export()


def to_replay_state(ss: ScanState) -> ReplayState:
    """A ReplayState holding ss (a copy; GDN u recomputed against the read copy where ss has
    none), with ss's pair, seed and layer (`ReplayState.from_parts`)."""
    return ReplayState.from_parts(ss, ss.pair, delta=ss.delta, seed=ss.seed, layer=ss.layer)


def load_scan_state(st: ReplayState, ss: ScanState) -> None:
    """Make ReplayState st hold ScanState ss (in place, a copy): anchor, read copy, buffer,
    counters; GDN u of the buffered steps recomputed against the read copy where ss has none."""
    st.load(ss)


# ---------------------------------------------------------------- ScanState -> ReplayStore

def _role_to_packed(q: QTensor, spec, N: int, slots: torch.Tensor, shape) -> PackedRole:
    """A store's role [N, H, d_v, d_k] holding the packed state q ([B, H, d_v, d_k]) in `slots`
    (same bytes; other slots zero)."""
    B, H, dv, dk = shape
    role = PackedRole.empty(spec.format, spec.rounding, (N, H, dv, dk), q.device)
    for t, s in zip((role.payload, role.scale, role.gscale), (q.payload, q.scale, q.gscale)):
        if t is not None:
            as_bits(t).zero_()
            t[slots] = s.reshape((B,) + tuple(t.shape[1:]))
    return role


def _solved_u(ss: ScanState, pair) -> torch.Tensor:
    """GDN's u of the committed entries against the read copy, as ReplayState.load computes it
    where its state comes without u (the chunked scan's)."""
    read = ss.read if ss.read is not None else ss.anchor
    R32 = pair.read_spec.fmt.dequantize(read)
    k, v, G, beta = (t.float() for t in (ss.k, ss.v, ss.G, ss.beta))
    valid = core.committed_mask(ss.committed, k.shape[2])
    return core.solve_u(R32, k, v, G, beta, valid)


def _slot_count(rows: torch.Tensor) -> int | None:
    """max(rows) + 1 where the sequence ids are distinct, else None; one host read."""
    srt = rows.sort().values
    distinct = (srt[1:] != srt[:-1]).all()
    n = int(torch.where(distinct, srt[-1] + 1, 0))
    return n or None


def scan_to_store(ss: ScanState, key_heads: int, u_dtype=None, ring_dtype=torch.bfloat16,
                  max_drafts: int = 0):
    """(ReplayStore, state_indices), the decode store of either engine, from ScanState ss (the
    chunked scan's state, or a ReplayState's export; ss.pair, ss.seed and ss.layer are the
    store's): GDN u, where ss has none, computed here against the read copy as
    ReplayState.load does. One host read (the slot count), none where ss.n_slots is known (the
    rows are then distinct and below it, as a new state's 0..B-1); the state is the engine's
    own, so it is not checked again.

    Slots are the state's sequence ids (`state_indices`, which key the SR streams in both), so the store
    has max(state_indices) + 1 slots and the store's state_indices are the same. Sequence ids that repeat (a beam reorder
    before the first decode step) take the slots 0..B-1 instead: each row then draws its slot's
    SR streams from its next flush on, as after a reorder on the store (`take_slots`). The
    anchor and read copy move bit for bit. The committed entries move into the ring (start 0) in
    the store's layout, as the decode steps would have appended them: with ss.raw (the entries'
    raw inputs in buffer order, [B, L, ...] each: GDN / KDA "k" per key head before its L2 norm,
    Mamba-2 "x" and its step size "dt") the ring holds the raw k (normalised once, where it is
    read) and Mamba-2's raw x with dt beside it (its v = dt x formed where it is read, in
    float32, as the chunked scan formed it); without (a ReplayState's, whose raw inputs are
    gone) it holds the state's keys as they are (GDN / KDA: already normalised, so that reading
    normalises them a second time: a relative change of about 1e-6 / |k_raw|^2) and Mamba-2's v
    as x = v with dt = 1. v (GDN, KDA) is the model's own. k and v / x in ring_dtype (bf16 for
    the Triton kernels: exact for a bf16 model's activations, not for derived values; float32
    for the torch engine), G and beta in fp32, GDN u in u_dtype (None: the store's default,
    stores.default_u_dtype: float32 for a shared FP32 pair, whose flush folds it, or a float32
    ring, else bf16) and, where the kernel's flush solves for u, GDN's key factors (Tbuf,
    computed from the entries; a float32 ring keeps none). max_drafts: the most drafts a
    speculative verify appends (`ReplayStore.from_state`), the ring then holding L + max_drafts
    entries."""
    pair, delta, raw = ss.pair, ss.delta, ss.raw
    check_ring_dtype(ring_dtype)
    if u_dtype is None:
        u_dtype = default_u_dtype(pair.anchor.format, None if pair.read is None
                                  else pair.read.format, ring_dtype)
    B, H, dv, dk = ss.anchor.shape
    buffer_len = ss.k.shape[2]
    if H % key_heads:
        raise ValueError(f"key_heads={key_heads} must divide the {H} heads")
    r = H // key_heads
    rows = ss.state_indices
    N = _slot_count(rows) if ss.n_slots is None else ss.n_slots
    if N is None:
        rows, N = torch.arange(B, dtype=torch.int64, device=rows.device), B
    slots = rows.long()
    dev, f32 = ss.k.device, torch.float32
    u = ss.u
    if delta and u is None:
        u = _solved_u(ss, pair)
    anchor = _role_to_packed(ss.anchor, pair.anchor, N, slots, (B, H, dv, dk))
    read = None if pair.read is None else _role_to_packed(ss.read, pair.read, N, slots,
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

    vec = ss.vector_gate                 # KDA: G per key channel
    kbuf = (ring_raw("k", (key_heads, dk)) if raw is not None and delta
            else ring(ss.k[:, ::r], (key_heads, dk))).to(ring_dtype)
    if delta:
        vbuf = ring(ss.v, (H, dv)).to(ring_dtype)
        ubuf = ring(u, (H, dv)).to(u_dtype)
        bbuf = ring(ss.beta, (H,)).to(f32)
    elif raw is not None:                # raw x, dt beside it
        vbuf = ring_raw("x", (H, dv)).to(ring_dtype)
        ubuf = None
        bbuf = ring_raw("dt", (H,)).to(f32)
    else:
        vbuf = ring(ss.v, (H, dv)).to(ring_dtype)  # x := v, dt := 1
        ubuf = None
        bbuf = ring(torch.ones_like(ss.G), (H,)).to(f32)
    Gbuf = ring(ss.G, (H, dk) if vec else (H,)).to(f32)
    committed = torch.zeros(N, dtype=torch.int32, device=dev)
    committed[slots] = ss.committed.to(torch.int32)
    n_flush = torch.zeros(N, dtype=torch.int64, device=dev)
    n_flush[slots] = ss.n_flush.to(torch.int64)
    store = ReplayStore("kda" if vec else "gdn" if delta else "mamba2", anchor, read, buffer_len,
                        key_heads,
                        kbuf=kbuf, vbuf=vbuf, ubuf=ubuf, Gbuf=Gbuf, bbuf=bbuf,
                        committed=committed, n_flush=n_flush, key=layer_seed(ss.seed, ss.layer),
                        start=torch.zeros(N, dtype=torch.int32, device=dev),
                        max_drafts=max_drafts)
    if solves_u(store) and ring_dtype == torch.bfloat16:   # the kernel flush's key factors
        store.Tbuf = torch.zeros(N, C, H, buffer_len, dtype=f32, device=dev)
        fill_key_factors_ref(store, slots)
    return store, rows.to(torch.int32)


def state_to_store(st: ReplayState, key_heads: int, u_dtype=None, ring_dtype=torch.bfloat16):
    """(ReplayStore, state_indices), the decode store of either engine, of ReplayState st
    (`scan_to_store` of its ScanState)."""
    return scan_to_store(st.export(), key_heads, u_dtype=u_dtype, ring_dtype=ring_dtype)


# ---------------------------------------------------------------- ReplayStore -> ScanState

def _packed_to_role(role: PackedRole, slots: torch.Tensor) -> QTensor:
    """The packed state [B, H, d_v, d_k] of `slots` of a store's role (a copy), laid out as a
    format's quantize lays it out (NVFP4: the matrices flattened, [B * H, d_v, d_k / 2])."""
    _, H, dv, dk = role.shape
    B = len(slots)
    shape = (B, H, dv, dk)
    if role.fmt == "nvfp4":
        return QTensor("nvfp4", shape, role.payload[slots].reshape(B * H, dv, dk // 2).clone(),
                       scale=role.scale[slots].reshape(B * H, dv, dk // 16).clone(),
                       gscale=role.gscale[slots].reshape(B * H).clone(), rounding=role.rounding)
    scale = role.scale[slots].clone() if role.fmt == "fp8" else None
    return QTensor(role.fmt, shape, role.payload[slots].clone(), scale=scale,
                   rounding=role.rounding)


def store_window(store: ReplayStore, slots: torch.Tensor):
    """take(buf): the ring buffer buf [N, C, ...] of a ReplayStore at `slots`, its entries in
    window order, [len(slots), L, ...]."""
    dev = store.kbuf.device
    pos = (store.start[slots].long()[:, None]
           + torch.arange(store.buffer_len, device=dev)[None, :]) % store.capacity
    bi = torch.arange(len(slots), device=dev)[:, None]
    return lambda buf: buf[slots][bi, pos]


def store_to_scan(store: ReplayStore, state_indices: torch.Tensor, pair, seed: int, layer: int,
                  with_u: bool = False) -> ScanState:
    """The ScanState of the batch rows state_indices of a ReplayStore (the inverse of
    scan_to_store, without any cast): anchor and read copy bit for bit, the committed ring
    entries in window order as the kernel reads them (GDN / KDA k normalised, Mamba-2 v = dt x),
    flush indices, rows = the slots (the SR sequence ids), and the ring's raw entries (`raw`:
    GDN / KDA k, Mamba-2 x and dt; entries past the committed ones zero). with_u: GDN's u as the
    steps computed it (a ReplayState keeps it); else None, solved against the read copy where
    a store is built from the state again."""
    slots = state_indices.long()
    r = store.shape[1] // store.key_heads
    delta = store.kind != "mamba2"
    window = store_window(store, slots)

    def take(buf):                      # [N, C, X, ...] -> [B, X, L, ...] float32
        return window(buf).float().transpose(1, 2).contiguous()

    k = ring_keys(store.kind, take(store.kbuf)).repeat_interleave(r, dim=1)
    G = take(store.Gbuf)
    bt = take(store.bbuf)
    v = take(store.vbuf)
    committed = store.committed[slots].long()
    live = torch.arange(store.buffer_len, device=committed.device)[None, :] < committed[:, None]
    raw = {}
    for name, buf in (("k", store.kbuf),) if delta else (("x", store.vbuf), ("dt", store.bbuf)):
        e = window(buf)
        raw[name] = torch.where(live.reshape(live.shape + (1,) * (e.dim() - 2)), e, 0)
    ss = ScanState(anchor=_packed_to_role(store.anchor, slots),
                   read=None if store.read is None else _packed_to_role(store.read, slots),
                   k=k, v=v if delta else bt.unsqueeze(-1) * v, G=G,
                   beta=bt if delta else None, committed=committed,
                   n_flush=store.n_flush[slots].long(), state_indices=slots,
                   u=take(store.ubuf) if delta and with_u else None, raw=raw,
                   pair=pair, seed=seed, layer=layer)
    return ss


def store_to_state(store: ReplayStore, state_indices: torch.Tensor, pair, seed: int,
                   layer: int) -> ReplayState:
    """The ReplayState of the batch rows state_indices of a ReplayStore (the inverse of
    state_to_store, without any cast; `store_to_scan`, u as the kernel computed it)."""
    return to_replay_state(store_to_scan(store, state_indices, pair, seed, layer, with_u=True))
