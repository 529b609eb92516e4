"""The decode stores of one layer and the checks of a step's inputs, shared by the Triton
kernels (`replay.decode`, `verify`, `conventional`), their torch references (`replay.reference`,
the `_ref` functions beside the kernels) and the torch engine (`replay.engine`).

`ReplayStore` (slots N, value heads H, key heads / groups HK, ring of C = L + max_drafts
entries, entry j of the window at (start + j) mod C):

    anchor      PackedRole [N, H, d_v, d_k]     high precision, written only at a flush
    read copy   PackedRole [N, H, d_v, d_k]     low precision, packed (None: shared pair)
    kbuf, vbuf  ring [N, C, HK, d_k], [N, C, H, d_v]   raw k / B and v / x
    ubuf        u_dtype [N, C, H, d_v]          GDN / KDA: u against the read copy
    Gbuf, bbuf  fp32 [N, C, H] (KDA Gbuf [.., d_k])    cumulative log gate; beta / dt
    Tbuf        fp32 [N, C, H, L]               GDN solving for u: rows of (I + A)^{-1}
    committed, start, n_flush   [N]             fill h, window start, flush index
    carried     int64 [N, H, 3]                 an NVFP4 read copy's carried scale (below)
    blob        uint8                           packed stores: every field above as a view of it

A patched layer's decode store (`models.decode_store`) is a ReplayStore that also knows its batch:
`state_indices` int32 [B] (the slot of each batch row), the pair, seed and layer its roles and
SR streams come from, its `FaultRecord`, each row's fill counted on the host (torch engine), the
engine that steps it and the custom operators' key (`meta`).

The ring's dtype (`ring_dtype`) is bf16 for the Triton kernels (half the buffer traffic) and
float32 for the torch engine, which then keeps u in float32 and no key factors (its flush
recomputes u from the anchor): the same store, stepped by either engine on its own ring.

An NVFP4 read copy keeps one FP32 scale a matrix, by default the new matrix's amax / 2688,
which only a flush tile holding the whole matrix can know. `nvfp4_scale='carried'` (a design
the kernels are timed with, docs/kernels.md; the torch engine and the replay core keep the
matrix's own scale) casts it with `formats.casts.nvfp4_carried_scale_ref` of the previous flush's
amax instead, so that a flush tile of any rows casts alone: `carried[s, h, f % 3]` holds flush f's
unrounded amax of matrix (s, h) as float32 bits in the low half and f in the high half (every
tile of flush f writes it with an atomic max, which a later flush index supersedes). A flush
takes the scale of the last flush of an earlier launch: entry (f - 1) % 3, or (f - 2) % 3 for a
flush step after its own launch's pre-flush (a forced step on a full window, or L = 1), which
the tiles of neither flush write while others read it. A matrix that outgrows its carried scale
saturates at 2688 gs; `saturated()` says where the last flush did.

`ConventionalStore`: one packed state, read-modify-written every step; `make_snapshots`: its
per-draft snapshots for a speculative verify.

`FaultRecord`: where the inputs of a decode step held NaN or infinity, and where its flush's cast
of a finite state into the anchor or the read copy was not (an FP16 role past 65504), noted by
the step itself on the device (a patched model's decode reads it at a boundary the host already
waits at).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from replayquant.formats import get_format
from replayquant.formats.constants import NVFP4_GLOBAL_DIVISOR
from replayquant.replay.roles import PackedRole, role_streams
from replayquant.pairs import PrecisionPair
from replayquant.replay.frontends import l2norm, l2norm_kda
from replayquant.statebytes import ring_u_bytes
from replayquant.streams import ANCHOR, READ, layer_seed


NO_DT_LIMIT = (0.0, math.inf)


def dt_limit_args(dt_limit):
    """(lo, hi, clamp) kernel arguments of a Mamba-2 dt_limit: dt = softplus(dt + dt_bias) is
    clamped to [lo, hi] unless dt_limit is None or (0, inf) (clamp False: no clamp at all, as
    replay.frontends.mamba2_inputs). lo and hi are runtime floats (one compile for every model)."""
    if dt_limit is None:
        return 0.0, math.inf, False
    try:
        lo, hi = (float(t) for t in dt_limit)
    except (TypeError, ValueError):
        raise ValueError(f"dt_limit must be a pair (lo, hi) of floats, e.g. (0.0, inf) for no "
                         f"clamp, got {dt_limit!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"dt_limit=({lo}, {hi}): need lo <= hi, neither NaN")
    return lo, hi, (lo, hi) != NO_DT_LIMIT


# the per-row inputs of a step that a FaultRecord watches, per kind, in the kernels' argument order
# (q_ptr, k_ptr, v_ptr, a_ptr, b_ptr): bit i of a row's flag is input i
FAULT_INPUTS = {"gdn": ("q", "k", "v", "a", "b"), "mamba2": ("C", "B", "x", "dt"),
                "kda": ("q", "k", "v", "g", "beta")}
# a FaultRecord's columns: the inputs, then the flush's cast (bit len(FAULT_INPUTS[kind]))
FAULT_COLUMNS = {kind: names + ("flush cast",) for kind, names in FAULT_INPUTS.items()}


def cast_overflows(fmt: str) -> bool:
    """Whether the cast of a finite FP32 state into format `fmt` can be infinite: fp16 and bf16,
    IEEE grids whose casts round past their largest value to infinity (fp16 past 65504); fp32
    holds the state, fp8 and NVFP4 scale each row or matrix to its largest value."""
    grid = getattr(get_format(fmt), "grid", None)
    return grid is not None and grid.ieee_overflow


def overflowing_role(pair: PrecisionPair):
    """("anchor" / "read copy", its FormatSpec) of the role of `pair` whose cast overflows first
    (cast_overflows; the smaller range, the anchor on a tie); None where neither can."""
    roles = [(r, s) for r, s in (("anchor", pair.anchor), ("read copy", pair.read))
             if s is not None and cast_overflows(s.format)]
    return min(roles, key=lambda rs: rs[1].fmt.grid.max_value, default=None)


class FaultRecord(NamedTuple):
    """What a decode step notes on the device about its faults, so that nobody reads the host
    per step: `bad` int64 [B, n + 1] the step number at which input i (FAULT_INPUTS[kind][i],
    i < n) of batch row b first held NaN or infinity, and (column n, FAULT_COLUMNS) at which a
    flush of the row first cast its finite state into a role where the cast is not finite (an
    FP16 anchor or read copy past 65504) (-1: never); `steps` int64 [B] the steps taken (a step
    adds one to its row's count and numbers itself with the sum); `flag` int32 [B] the Triton
    kernel's scratch (each program ORs in the bits of the inputs it read and of a cast that
    overflowed, the row's last program turns them into `bad` and clears them: zero between
    steps). Padding rows (negative state index) note nothing. The step itself is unchanged: a
    flush never writes a non-finite state or cast into the roles (the tile keeps its last finite
    roles)."""

    bad: torch.Tensor
    steps: torch.Tensor
    flag: torch.Tensor

    @classmethod
    def empty(cls, kind: str, B: int, device, steps: int = 0) -> "FaultRecord":
        return cls(torch.full((B, len(FAULT_COLUMNS[kind])), -1, dtype=torch.int64, device=device),
                   torch.full((B,), int(steps), dtype=torch.int64, device=device),
                   torch.zeros(B, dtype=torch.int32, device=device))

    def check(self, kind: str, B: int, device, advance: bool = True) -> None:
        """One ValueError unless this record fits a step of `kind` on B rows on `device` that
        moves its pointers (advance: the row's last program notes the step)."""
        if not advance:
            raise ValueError("a fault record is noted by a step that moves its pointers "
                             "(advance=True), not by a verify or a step with advance=False")
        n = len(FAULT_COLUMNS[kind])
        want = (("bad", (B, n), torch.int64), ("steps", (B,), torch.int64),
                ("flag", (B,), torch.int32))
        for (name, shape, dtype), t in zip(want, self):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype \
                    or t.device != torch.device(device) or not t.is_contiguous():
                raise ValueError(f"the fault record's {name} must be a contiguous {dtype} tensor "
                                 f"{list(shape)} on {device} ({kind}: {n - 1} inputs and the "
                                 f"flush cast, {B} rows; FaultRecord.empty builds one)")

    def note(self, kind: str, inputs, state_indices, advance: bool = True) -> None:
        """The torch twin of the kernels' noting, for one step (checked as `check`): inputs the
        kind's per-row inputs in FAULT_INPUTS order ([B, ...] each; None where the kind has
        fewer)."""
        bad, steps, _ = self
        B = bad.shape[0]
        self.check(kind, inputs[0].shape[0], inputs[0].device, advance)
        live = _indices(state_indices, B, bad.device) >= 0
        hit = torch.stack([~torch.isfinite(t.reshape(B, -1)).all(1)
                           for t in inputs if t is not None], 1)
        steps.add_(live.long())
        old = bad[:, :hit.shape[1]]
        old.copy_(torch.where(live[:, None] & hit & (old < 0), steps[:, None], old))

    def note_cast(self, over: torch.Tensor, state_indices) -> None:
        """The torch twin of the kernel's noting of a flush's cast that overflowed, after `note`
        numbered the step: over [B] bool, the rows whose flush at this step kept its roles for
        it."""
        bad, steps, _ = self
        live = _indices(state_indices, bad.shape[0], bad.device) >= 0
        col = bad[:, -1]
        col.copy_(torch.where(live & over & (col < 0), steps, col))


def pow2_16(d: int) -> bool:
    """Whether a state dim is one the decode kernels take: a power of two >= 16."""
    return d >= 16 and not d & (d - 1)


def _pow2_dims(shape):
    for name, d in zip(("d_v", "d_k"), shape[2:]):
        if not pow2_16(d):
            raise ValueError(f"{name} = {d}: the decode kernels need a power of two >= 16")


def _indices(state_indices, B, device):
    if state_indices is None:
        return torch.arange(B, dtype=torch.int32, device=device)
    if not isinstance(state_indices, torch.Tensor) or state_indices.shape != (B,) \
            or state_indices.is_floating_point():
        raise ValueError(f"state_indices must be an integer tensor [batch={B}] of state slots "
                         f"(negative = padding row)")
    return state_indices.to(device=device, dtype=torch.int32).contiguous()


def _check_inputs(kind, shape, B, tensors: dict, dtypes_bf16=()):
    N, H, dv, dk = shape
    for name, (t, want) in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor of shape {want}")
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(want)} "
                             f"({kind}: batch {B}, {H} heads, d_v {dv}, d_k {dk})")
        if not t.is_floating_point() and name != "state_indices":
            raise ValueError(f"{name} must be a floating-point tensor")


@dataclass(slots=True)
class StepTensors:
    """The input tensors of a decode step ([batch, ...]) or of a verify ([batch, T drafts, ...]),
    in the decode kernels' order and under their GDN names: Mamba-2 passes C, B, x and dt as q,
    k, v and a, KDA its log decay g and beta as a and b; A (GDN: A_log), dt_bias, D and z are
    None where the kind or the caller has none."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor | None
    b: torch.Tensor | None
    A: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    D: torch.Tensor | None = None
    z: torch.Tensor | None = None


def step_inputs(kind, shape, drafts, x: StepTensors):
    """Checks of a step's (drafts False) or a verify's inputs `x` against a state of `shape`,
    named in the errors as the kind's callers name them -> (lead dims (B,) or (B, T), key heads
    HK)."""
    q, k, v, a, b, A, dt_bias, D, z = x.q, x.k, x.v, x.a, x.b, x.A, x.dt_bias, x.D, x.z
    N, HV, dv, dk = shape
    delta, vec = kind != "mamba2", kind == "kda"
    if delta and (a is None or b is None):
        raise ValueError("KDA needs g (log decay per key channel) [batch, value heads, d_k] and "
                         "beta [batch, value heads]" if vec else
                         "GDN needs b (beta logits) [batch, value heads]")
    nd = 4 if drafts else 3
    if not all(isinstance(t, torch.Tensor) and t.dim() == nd for t in (q, v)):
        raise ValueError(f"{'q, k' if delta else 'C, B'} and {'v' if delta else 'x'} must be "
                         f"tensors [batch, {'T drafts, ' if drafts else ''}heads, dim]")
    lead, HK = tuple(q.shape[:nd - 2]), q.shape[nd - 2]
    if HV % HK:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    _check_inputs(kind, shape, lead[0], {
        "q": (q, lead + (HK, dk)), "k": (k, lead + (HK, dk)), "v": (v, lead + (HV, dv)),
        "g": (a, lead + (HV, dk)), "beta": (b, lead + (HV,))} if vec else {
        "q" if delta else "C": (q, lead + (HK, dk)), "k" if delta else "B": (k, lead + (HK, dk)),
        "v" if delta else "x": (v, lead + (HV, dv)), "a" if delta else "dt": (a, lead + (HV,)),
        "b": (b, lead + (HV,)), "A_log" if delta else "A": (A, (HV,)), "dt_bias": (dt_bias, (HV,)),
        "D": (D, (HV,)), "z": (z, lead + (HV, dv))})
    return lead, HK


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _check_buffered(store: "ReplayStore", delta: bool, k, v, kernel: bool):
    """The buffered inputs (GDN / KDA k and v, Mamba-2 B and x) come in the ring's dtype; a
    Triton kernel (kernel True) reads a bf16 ring only."""
    ring = store.kbuf.dtype
    if kernel and ring != torch.bfloat16:
        raise ValueError(f"this store keeps its ring in {_dtype_name(ring)} (the torch engine's, "
                         f"ReplayStore.from_state(ring_dtype=...)); the Triton kernels read a "
                         f"bfloat16 ring: step it with replay.engine, or build it with "
                         f"ring_dtype=torch.bfloat16")
    for name, t in (("k" if delta else "B", k), ("v" if delta else "x", v)):
        if t.dtype != ring:
            raise ValueError(f"{name} must be {_dtype_name(ring)} (the replay buffer stores it in "
                             f"{_dtype_name(ring)}), got {t.dtype}")


@dataclass
class ConventionalStore:
    """Conventional state of one layer: one packed copy, read-modify-written every step.
    n_flush[s] counts the casts of slot s after the initial one (stream flush index of the
    next write = n_flush + 1, as every step of the baseline is a flush of a shared pair)."""

    state: PackedRole
    n_flush: torch.Tensor          # int64 [N]
    key: int                       # Philox key = layer_seed(seed, layer)

    @property
    def n_casts(self) -> torch.Tensor:
        """n_flush, as the conventional kernels and their references read it (the same tensor:
        they count it up in place)."""
        return self.n_flush

    @classmethod
    def from_state(cls, initial: torch.Tensor, fmt: str, rounding: str = "nearest", seed: int = 0,
                   layer: int = 0) -> "ConventionalStore":
        if not isinstance(initial, torch.Tensor) or initial.dim() != 4:
            raise ValueError("initial state must be a float tensor [slots, heads, d_v, d_k]")
        _pow2_dims(initial.shape)
        N, H = initial.shape[:2]
        role = PackedRole.empty(fmt, rounding, tuple(initial.shape), initial.device)
        key = layer_seed(seed, layer)
        role.write_(torch.arange(N), initial.float(), key, role_streams(0, ANCHOR, torch.arange(N), H))
        return cls(role, torch.zeros(N, dtype=torch.int64, device=initial.device), key)

    def clone(self) -> "ConventionalStore":
        return ConventionalStore(self.state.clone(), self.n_flush.clone(), self.key)


def make_snapshots(store: ConventionalStore, T: int) -> PackedRole:
    """Per-draft snapshot storage for T drafts: [N * T, H, d_v, d_k] in the state's format
    (snapshot t of slot s at index s * T + t). T times the state's memory."""
    N, H, dv, dk = store.state.shape
    snaps = PackedRole.empty(store.state.fmt, store.state.rounding, (N * T, H, dv, dk),
                             store.state.payload.device)
    snaps.T = T
    return snaps



RING_DTYPES = (torch.bfloat16, torch.float32)


def check_ring_dtype(ring_dtype) -> None:
    if ring_dtype not in RING_DTYPES:
        raise ValueError(f"ring_dtype must be torch.bfloat16 (the Triton kernels) or "
                         f"torch.float32 (the torch engine), got {ring_dtype}")


def ring_keys(kind: str, K: torch.Tensor) -> torch.Tensor:
    """Keys read from the ring (float32, d_k last) as a step uses them: the ring keeps raw keys,
    which GDN re-normalises as its front end does (l2norm) and KDA in transformers' form
    (l2norm_kda); Mamba-2's B as it is."""
    if kind == "gdn":
        return l2norm(K)
    if kind == "kda":
        return l2norm_kda(K)
    return K


def default_u_dtype(anchor_fmt: str, read_fmt: str | None, ring_dtype=torch.bfloat16):
    """GDN / KDA u in the ring: float32 for a shared FP32 pair (its flush folds the cached u,
    folds_u) and wherever the ring is float32 (the torch engine), else bfloat16."""
    if ring_dtype == torch.float32 or ring_u_bytes(anchor_fmt, read_fmt) == 4:
        return torch.float32
    return torch.bfloat16


def _pair_roles(pair):
    """(anchor (fmt, rounding), read (fmt, rounding) or None, L) of a PrecisionPair."""
    if not isinstance(pair, PrecisionPair):
        raise TypeError(f"a store takes a PrecisionPair (policy.resolve_pair makes one of a pair "
                        f"name or YAML path), got {type(pair).__name__} {pair!r}")
    anchor = (pair.anchor.format, pair.anchor.rounding)
    read = None if pair.read is None else (pair.read.format, pair.read.rounding)
    return anchor, read, pair.buffer_len


def carried_entry(amax: torch.Tensor, flush: int) -> torch.Tensor:
    """A carried scale's record entry (ReplayStore.carried) of float32 amax >= 0 at flush index
    `flush`: amax's bits in the low half, the index in the high half (the kernels write the
    same with an atomic max)."""
    bits = amax.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    return bits | (int(flush) << 32)


def carried_amax(entry: torch.Tensor) -> torch.Tensor:
    """The float32 amax of record entries (carried_entry's low half)."""
    return (entry & 0xFFFFFFFF).to(torch.int32).view(torch.float32)


def _carried_scale(nvfp4_scale: str, afmt: str, read, ring_dtype) -> bool:
    """Whether a store of these roles keeps a carried NVFP4 scale (one ValueError if it cannot)."""
    if nvfp4_scale not in ("matrix", "carried"):
        raise ValueError(f"nvfp4_scale must be 'matrix' or 'carried', got {nvfp4_scale!r}")
    if nvfp4_scale == "matrix":
        return False
    if read is None or read[0] != "nvfp4" or afmt == "nvfp4":
        raise ValueError("nvfp4_scale='carried' takes an NVFP4 read copy beside an anchor in "
                         "another format (its flush tiles read the anchor's own scales)")
    if ring_dtype != torch.bfloat16:
        raise ValueError("nvfp4_scale='carried' is the Triton kernels' design; the torch engine "
                         "(ring_dtype float32) casts with the matrix's own scale")
    return True


@dataclass
class ReplayStore:
    """Replay state of one layer for N slots (module docstring for the layout)."""

    kind: str
    anchor: PackedRole
    read: PackedRole | None
    buffer_len: int
    key_heads: int
    kbuf: torch.Tensor
    vbuf: torch.Tensor
    ubuf: torch.Tensor | None
    Gbuf: torch.Tensor
    bbuf: torch.Tensor
    committed: torch.Tensor
    n_flush: torch.Tensor
    key: int
    start: torch.Tensor | None = None
    max_drafts: int = 0
    pending_T: int | None = None     # drafts verified and not yet accepted
    last_force: bool = False         # path of the last step: True = it flushed every row (force)
    arrive: torch.Tensor | None = None   # int32 [N]: arrival counters of the pointer move (zero)
    Tbuf: torch.Tensor | None = None     # fp32 [N, C, H, L]: key factors (solves_u stores)
    carried: torch.Tensor | None = None  # int64 [N, H, 3]: the carried scale's amax (above)
    blob: torch.Tensor | None = None     # uint8: every tensor above as a view of it (`pack`)
    blob_layout: list | None = None      # [name, dtype, shape, byte offset] of each view
    # A patched layer's decode store (models.decode_store builds it) also knows its batch:
    pair: PrecisionPair | None = None    # the pair its roles hold, seed and layer of its SR key
    seed: int = 0
    layer: int = 0
    state_indices: torch.Tensor | None = None   # int32 [B]: the slot of each batch row
    faults: FaultRecord | None = None    # what its steps noted of their faults, per batch row
    host_committed: list | None = None   # each row's fill, counted on the host (torch engine)
    engine: str | None = None            # what steps it: 'triton' or 'torch' (kernels.ops)
    meta: str | None = None              # the custom operators' key (kernels.ops.store_meta)

    @property
    def capacity(self) -> int:
        return self.buffer_len + self.max_drafts

    @classmethod
    def from_state(cls, initial: torch.Tensor, pair, kind: str, key_heads: int | None = None,
                   seed: int = 0, layer: int = 0, u_dtype=None,
                   max_drafts: int = 0,
                   ring_dtype=torch.bfloat16, nvfp4_scale: str = "matrix") -> "ReplayStore":
        """Cast float32 initial [N, H, d_v, d_k] into anchor and read copy of `pair` (a
        PrecisionPair; flush index 0, independently, as ReplayState), empty buffers.
        key_heads: GDN key heads / Mamba-2 groups (default H). max_drafts: the largest T of
        speculative verify (0: plain decode). kind 'kda': the delta rule with a gate per key
        channel (Gbuf per channel). u_dtype (GDN / KDA u in the ring): None is float32 for a shared
        FP32 pair (its flush folds the cached u, folds_u), else bfloat16, the flush solving for u
        (statebytes.ring_u_bytes). ring_dtype: the ring's k and v, bfloat16 for the Triton kernels,
        float32 for the torch engine (`replay.engine`, which then keeps u in float32 too and no key
        factors: its flush recomputes u from the anchor). nvfp4_scale: 'matrix' (the format's own
        scale) or 'carried' (an NVFP4 read copy beside another anchor, Triton kernels; module
        docstring)."""
        if kind not in ("gdn", "mamba2", "kda"):
            raise ValueError(f"kind must be 'gdn', 'mamba2' or 'kda', got {kind!r}")
        if not isinstance(initial, torch.Tensor) or initial.dim() != 4 or not initial.is_floating_point():
            raise ValueError("initial state must be a float tensor [slots, heads, d_v, d_k]")
        check_ring_dtype(ring_dtype)
        (afmt, arnd), read, buffer_len = _pair_roles(pair)
        N, H, dv, dk = initial.shape
        HK = H if key_heads is None else int(key_heads)
        if HK < 1 or H % HK:
            raise ValueError(f"key_heads={HK} must divide the {H} heads")
        _pow2_dims(initial.shape)
        dev = initial.device
        key = layer_seed(seed, layer)
        slots = torch.arange(N)
        x = initial.float()
        anchor = PackedRole.empty(afmt, arnd, tuple(initial.shape), dev)
        anchor.write_(slots, x, key, role_streams(0, ANCHOR, slots, H))
        rrole = None
        if read is not None:
            rrole = PackedRole.empty(read[0], read[1], tuple(initial.shape), dev)
            rrole.write_(slots, x, key, role_streams(0, READ, slots, H))
        if u_dtype is None:
            u_dtype = default_u_dtype(afmt, None if read is None else read[0], ring_dtype)
        if u_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError("u_dtype must be torch.bfloat16 or torch.float32")
        if max_drafts < 0 or max_drafts > buffer_len:
            raise ValueError(f"max_drafts={max_drafts} must lie in 0..buffer_len={buffer_len}")
        C = buffer_len + int(max_drafts)
        store = cls(kind, anchor, rrole, buffer_len, HK,
                   kbuf=torch.zeros(N, C, HK, dk, dtype=ring_dtype, device=dev),
                   vbuf=torch.zeros(N, C, H, dv, dtype=ring_dtype, device=dev),
                   ubuf=torch.zeros(N, C, H, dv, dtype=u_dtype, device=dev) if kind != "mamba2" else None,
                   Gbuf=torch.zeros((N, C, H, dk) if kind == "kda" else (N, C, H),
                                    dtype=torch.float32, device=dev),
                   bbuf=torch.zeros(N, C, H, dtype=torch.float32, device=dev),
                   committed=torch.zeros(N, dtype=torch.int32, device=dev),
                   n_flush=torch.zeros(N, dtype=torch.int64, device=dev), key=key,
                   start=torch.zeros(N, dtype=torch.int32, device=dev), max_drafts=int(max_drafts),
                   arrive=torch.zeros(N, dtype=torch.int32, device=dev))
        if solves_u(store) and ring_dtype == torch.bfloat16:
            store.Tbuf = torch.zeros(N, C, H, buffer_len, device=dev)
        if _carried_scale(nvfp4_scale, afmt, read, ring_dtype):
            store.carried = torch.zeros(N, H, 3, dtype=torch.int64, device=dev)
            store.carried[..., 0] = carried_entry(x.abs().amax(dim=(-2, -1)), 0)
        return store

    @property
    def shape(self):
        return self.anchor.shape

    @property
    def B(self) -> int:
        """Batch rows: those of state_indices (a decode store), else one a slot."""
        return self.anchor.shape[0] if self.state_indices is None else self.state_indices.shape[0]

    @property
    def device(self) -> torch.device:
        return self.committed.device

    @property
    def shared(self) -> bool:
        return self.read is None

    @property
    def read_role(self) -> PackedRole:
        return self.anchor if self.read is None else self.read

    def saturated(self) -> torch.Tensor:
        """bool [N, H]: where the last flush cast the read copy with a carried NVFP4 scale that
        its matrix outgrew (some element past 2688 gs, stored as 2688 gs: the record's amax of
        that flush against the scale it was cast with). A store without a carried scale:
        nowhere."""
        N, H = self.shape[:2]
        if self.carried is None:
            return torch.zeros(N, H, dtype=torch.bool, device=self.device)
        last = self.carried.gather(2, (self.n_flush % 3).view(N, 1, 1).expand(N, H, 1))[..., 0]
        # (flush 0 cast with the matrix's own scale, amax / 2688 rounded: nothing saturated)
        return (self.n_flush > 0)[:, None] & \
            (carried_amax(last) > NVFP4_GLOBAL_DIVISOR * self.read.gscale)

    def clone(self) -> "ReplayStore":
        c = dataclasses.replace(self, blob=None, blob_layout=None, **{
            f.name: getattr(self, f.name).clone() for f in dataclasses.fields(self)
            if f.name != "blob" and isinstance(getattr(self, f.name), (torch.Tensor, PackedRole))})
        if self.faults is not None:
            c.faults = FaultRecord(*(t.clone() for t in self.faults))
        if self.host_committed is not None:
            c.host_committed = list(self.host_committed)
        if self.blob is not None:
            c.pack()
        return c

    def fields(self) -> tuple[list[str], list[torch.Tensor]]:
        """(names, tensors) of the store's tensors that are not None, in a fixed order (roles'
        payload, scale, gscale, then the ring and its counters); the arrival counters are
        allocated here if the store has none yet."""
        if self.arrive is None:
            self.arrive = torch.zeros_like(self.committed)
        names, ts = [], []
        for role in ("anchor", "read"):
            r = getattr(self, role)
            for f in () if r is None else ("payload", "scale", "gscale"):
                if getattr(r, f) is not None:
                    names.append(f"{role}.{f}")
                    ts.append(getattr(r, f))
        for f in _RING_FIELDS:
            if getattr(self, f) is not None:
                names.append(f)
                ts.append(getattr(self, f))
        return names, ts

    def pack_layout(self) -> list:
        """The layout `pack` gives this store: [name, dtype, shape, byte offset] of each field,
        each starting on a PACK_ALIGN boundary; the blob's size is layout_bytes(layout)."""
        layout, total = [], 0
        for n, t in zip(*self.fields()):
            if not t.is_contiguous():
                raise ValueError(f"store field {n} is not contiguous")
            layout.append([n, str(t.dtype).removeprefix("torch."), list(t.shape), total])
            total += _aligned(t.numel() * t.element_size())
        return layout

    def pack(self, into: torch.Tensor | None = None) -> None:
        """Move every tensor of the store into one uint8 buffer, `blob`, each field becoming a
        contiguous view of it (each starting on a 256-byte boundary, as an allocation does): the
        decode operators then take one tensor for the store, so that a compiled decode step
        guards one tensor a layer instead of one per field. torch.compile checks the guards of
        every tensor a compiled step reads at every call, on the host, before the step's CUDA
        graph launches: for a decode forward of the Qwen3.5-4B layer layout (24 GDN layers,
        tp4_hi16_sr, small dims, B = 8; this project's 2-core CPU) a check took 408 us with a
        tensor a field, 329 us packed, 256 us for HF's unpatched model. Values are kept bit for
        bit; a field assigned after packing is not in the blob, so the store is packed last.
        into: the blob of a packed store of the same layout, which nobody steps any more: the
        fields go into it (its padding is zero from its own packing, and no step writes
        there), so that its address is kept and nothing is allocated."""
        if self.blob is not None:
            raise ValueError("the store is packed already")
        layout = self.pack_layout()
        ts = self.fields()[1]
        total = layout_bytes(layout)
        if into is None:
            # zeros: the padding between views holds no stale bytes (stores compare bit for bit)
            blob = torch.zeros(total, dtype=torch.uint8, device=ts[0].device)
        elif into.dtype != torch.uint8 or into.shape != (total,) or into.device != ts[0].device:
            raise ValueError(f"pack(into=...) takes a uint8 buffer of {total} bytes on "
                             f"{ts[0].device}, got {into.dtype} {tuple(into.shape)} on "
                             f"{into.device}")
        else:
            blob = into
        views = packed_views(blob, layout)
        for (n, *_), t in zip(layout, ts):
            views[n].copy_(t)
            role, _, f = n.rpartition(".")
            setattr(getattr(self, role) if role else self, f, views[n])
        self.blob, self.blob_layout = blob, layout


# the ring's and counters' fields of a ReplayStore, in the order of ReplayStore.fields
_RING_FIELDS = ("kbuf", "vbuf", "ubuf", "Gbuf", "bbuf", "Tbuf", "committed", "start", "n_flush",
                "arrive", "carried")
PACK_ALIGN = 256


def _aligned(nbytes: int) -> int:
    """nbytes rounded up to a multiple of PACK_ALIGN."""
    return -(-nbytes // PACK_ALIGN) * PACK_ALIGN


def _view_bytes(dtype: str, shape) -> int:
    return math.prod(shape) * getattr(torch, dtype).itemsize


def layout_bytes(layout: list) -> int:
    """The size of the blob of a packed layout (ReplayStore.pack_layout)."""
    if not layout:
        return 0
    _, dtype, shape, off = layout[-1]
    return off + _aligned(_view_bytes(dtype, shape))


def packed_views(blob: torch.Tensor, layout: list) -> dict[str, torch.Tensor]:
    """name -> the view of `blob` that `layout` (ReplayStore.blob_layout) gives it."""
    return {name: blob[off:off + _view_bytes(dtype, shape)].view(getattr(torch, dtype)).view(shape)
            for name, dtype, shape, off in layout}


def solves_u(store: ReplayStore) -> bool:
    """Whether the GDN flush solves for u against the anchor (a separate read copy, or a shared
    anchor with bf16 u): the read steps append the rows of the key factors (I + A)^{-1} of
    DESIGN section 4 (Tbuf), which depend on the keys, gates and betas alone, so the flush
    forms U = T (beta (V - e^G W)) with one product and no triangular solve. A store that
    folds (folds_u) and KDA (whose solve is the sequential fold) keep none."""
    return store.kind == "gdn" and not folds_u(store)


def folds_u(store: ReplayStore) -> bool:
    """Whether the flush folds the ring's cached u as it is (a shared GDN / KDA pair with FP32 u:
    its read steps computed u against the anchor itself, to FP32 rounding) instead of solving
    for u against the anchor (DESIGN section 4): S = e^{G_n} S0 + (U e^{G_n - G})^T K, one
    tensor-core product, no W = K S0^T, no triangular solve."""
    return store.shared and store.ubuf is not None and store.ubuf.dtype == torch.float32


PATHS = ("auto", "replay", "flush")


def resolve_path(store: ReplayStore, n_rows: int, path: str = "auto") -> str:
    """'replay' (the ReplayState schedule: a row flushes when its buffer fills) or 'flush'
    (every row flushes this step: with a shared pair and empty buffers the conventional
    read-modify-write, bit for bit). 'auto', the default, is 'replay' at every batch."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(map(repr, PATHS))}, got {path!r}")
    return "flush" if path == "flush" else "replay"


def _default_force(store, step, accepted, force_flush):
    if force_flush is None:     # the path the last step of this store took
        return bool(store.last_force) if step and accepted is None else False
    return bool(force_flush)


def _begin(store: ReplayStore, kind: str, step: bool, path) -> bool:
    """The checks of a step or verify (kernel and reference) before it touches the store; returns
    whether the step flushes every row (force, resolve_path)."""
    if store.kind != kind:
        raise ValueError(f"this {'step' if step else 'verify'} needs a store built with "
                         f"kind={kind!r}, got {store.kind!r}")
    if store.pending_T:
        raise ValueError(f"{'step' if step else 'verify'}: {store.pending_T} drafts are pending; "
                         f"call replay_accept first")
    return step and resolve_path(store, 0, path) == "flush"


def _check_accept(n, B, T, device, check=True):
    if not check:                     # no host synchronisation (CUDA graph capture)
        return n if n.dtype == torch.int32 else n.to(device=device, dtype=torch.int32)
    if isinstance(n, int) and not isinstance(n, bool):
        n = torch.full((B,), n, dtype=torch.int32, device=device)
    if not isinstance(n, torch.Tensor) or n.is_floating_point() or n.dtype == torch.bool \
            or n.shape != (B,):
        raise ValueError(f"accept: n must be an int or an integer tensor [batch={B}]")
    if T is not None and bool(((n < 0) | (n > T)).any()):
        raise ValueError(f"accept: every n must lie in 0..T={T}")
    return n.to(device=device, dtype=torch.int32).contiguous()


def key_factors_ref(K, G, Bt, live=None):
    """(I + A)^{-1} [..., H, n, n] of n GDN entries (K [..., H, n, dk] normalised, G, Bt
    [..., H, n]): A[j, i] = Bt_j e^{G_j - G_i} (k_j . k_i) for i < j, the unit lower triangular
    system of DESIGN section 4, whose rows a store that solves for u keeps in Tbuf (solves_u).
    live [..., n] (broadcast over H): the entries that count; the rows of the others are zero
    (and, the system being lower triangular, the live rows equal those of the live entries
    alone)."""
    n = K.shape[-2]
    low = torch.ones(n, n, dtype=torch.bool, device=K.device).tril(-1)
    if live is not None:
        low = low & live[..., :, None]
    d = torch.where(low, G[..., :, None] - G[..., None, :], 0.0)
    A = torch.where(low, Bt[..., :, None] * torch.exp(d) * (K @ K.transpose(-1, -2)), 0.0)
    eye = torch.eye(n, device=K.device).expand_as(A)
    T = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
    return T if live is None else torch.where(live[..., :, None], T, 0.0)


def fill_key_factors_ref(store: ReplayStore, slots) -> None:
    """The key factors of every committed entry of the given slots (a store built from a
    ScanState, replay.convert.scan_to_store), all slots at once (no host read); the
    rows of the uncommitted entries become zero; nothing for a store without Tbuf."""
    if store.Tbuf is None:
        return
    slots = slots.long()
    n, H, dev = store.buffer_len, store.shape[1], store.kbuf.device
    jj = torch.arange(n, device=dev)
    pos = (store.start[slots].long()[:, None] + jj) % store.capacity          # [S, n]
    at = (slots[:, None], pos)
    K = ring_keys(store.kind, store.kbuf[at].float().transpose(1, 2)
                  .repeat_interleave(H // store.key_heads, dim=1))             # [S, H, n, dk]
    live = jj[None, :] < store.committed[slots].long()[:, None]                # [S, n]
    T = key_factors_ref(K, store.Gbuf[at].transpose(1, 2), store.bbuf[at].transpose(1, 2),
                        live[:, None, :])                                      # [S, H, n, n]
    store.Tbuf[at] = T.transpose(1, 2)
