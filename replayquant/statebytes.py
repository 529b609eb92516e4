"""The byte model of a decode step: what the recurrent state costs in HBM traffic and memory.

One model serves the kernels bench (`replayquant bench kernels`, whose rows' `bytes`, byte ratios
and copy-bandwidth ceilings come from the functions below) and the sweep (`replayquant sweep`,
which sums them over a model's real recurrent layers). The counts follow the layout of the
Triton kernels (`replayquant.kernels.replay.decode.ReplayStore`):

* a state matrix of d_v x d_k elements in its physical format (`state_bytes`: payload + scales);
* the ring buffer, one entry per buffered step and head: k / B in bf16 (one per key head or
  group, shared by its H / HK heads), v / x in bf16, GDN's u (the outputs' correction terms
  computed against the read copy) in bf16, in fp32 for a shared FP32 pair (`ring_u_bytes`), the
  cumulative gate and beta / dt in fp32, and for a GDN pair that does not fold its u the entry's
  row of the key factors (I + A)^{-1} (L fp32, read with the entries, `ReplayStore.Tbuf`);
* a read step (committed length h) reads the read copy and the h buffered entries (GDN: k, u, G,
  beta) and writes its own entry (GDN: k, v, u, G, beta); the flush step (the L-th) reads the
  anchor and the L - 1 entries (GDN: k, v, G, beta, to rebuild S and recompute u from the
  anchor; a shared FP32 pair: k, u, G, beta, folding its cached u), writes the anchor and, in a pair
  with a separate read copy, the read copy;
* the conventional step reads and writes the whole state every step;
* every step also reads its inputs (bf16 activations, fp32 gates) and writes its output (fp32).

Kimi Delta Attention (kind "kda": Kimi Linear, GLM-5-Next) is counted as GDN with its one
difference, the decay: a vector over the key channels instead of one scalar per head and step
(docs/DESIGN.md 3.1). So its step reads a gate input of d_k fp32 per head, and its buffered
cumulative gate G is d_k fp32 per entry and head ([B, H, L, d_k] in `ReplayState`'s buffer, as
many elements as the buffered keys), read wherever GDN reads its scalar G (the outputs' decayed
key products, the rebuild at the flush) and written with each entry. Its q / k / v heads are
equal (HK = H: no key shared by several heads). Everything else (k, v, u, beta, the state
matrices, the output) is counted as for GDN, in the GDN decode kernel's ring layout (bf16 k, v,
u; fp32 G and beta) with G widened to the d_k channels that `ReplayState(vector_gate=True)`
buffers. The kernels grid has KDA conventional rows (the conventional step's count is checked
against them); it has no KDA replay rows (the bench does not time the replay kernel's per-channel
specialization, `replay_kda_step`), so the replay count is derived, not checked against a bench.

`replay_window_bytes` is the mean over a window of L steps (L - 1 read steps at h = 0 .. L - 2,
then one flush). `StepBytes` splits the same mean per sequence into its parts (read copy, ring
entries, amortised flush, inputs / output); its total equals `replay_window_bytes / B`
(tests/sweep/test_sweep.py checks both against the `bytes` of the committed kernels grid).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["state_bytes", "io_bytes", "entry_bytes", "conventional_bytes", "replay_window_bytes",
           "replay_read_step_bytes", "replay_flush_step_bytes", "LayerShape", "StepBytes", "MemoryBytes", "layer_step_bytes", "layer_conventional_bytes",
           "layer_memory_bytes", "layer_conventional_memory", "model_step_bytes",
           "model_memory_bytes", "model_conventional"]

KINDS = ("gdn", "kda", "mamba2")


# ---------------------------------------------------------------------------- per (row, head)

def state_bytes(fmt: str, dv: int, dk: int) -> float:
    """Physical bytes of one d_v x d_k matrix stored in `fmt` (payload + scales)."""
    n = dv * dk
    table = {"fp32": 4.0 * n, "fp16": 2.0 * n, "bf16": 2.0 * n, "fp8": n + 4.0 * dv,
             "nvfp4": n / 2 + n / 16 + 4.0}
    if fmt not in table:
        raise ValueError(f"no byte count for state format {fmt!r}; known: {', '.join(table)}")
    return table[fmt]


def _gate_bytes(kind, dk):
    """fp32 bytes of one step's decay per head: a scalar (GDN, Mamba-2), d_k channels (KDA)."""
    if kind not in KINDS:
        raise ValueError(f"layer kind must be one of {KINDS}, got {kind!r}")
    return 4 * dk if kind == "kda" else 4


def io_bytes(kind, H, HK, dv, dk):
    """Inputs + output of one (row, head) per step: bf16 activations, fp32 gates, fp32 out."""
    r = H / HK
    g = _gate_bytes(kind, dk)
    if kind in ("gdn", "kda"):
        return 2 * dk * 2 / r + dv * 2 + g + 4 + dv * 4      # q, k (shared by r heads), v, a, b; y
    return 2 * dk * 2 / r + 2 * dv * 2 + g + dv * 4          # B, C (per group), x, z, dt; y


def ring_u_bytes(anchor_fmt, read_fmt) -> int:
    """Bytes of one cached u element: 4 for a shared FP32 pair (read_fmt None), whose flush folds
    the FP32 u (`replay.decode.folds_u`), else 2 (bf16: outputs only, the flush solves for u; a
    shared FP16 / BF16 / NVFP4 anchor would pay 5-19% more state memory for the FP32 u)."""
    return 4 if read_fmt is None and anchor_fmt == "fp32" else 2


def entry_bytes(kind, H, HK, dv, dk, u_bytes=2, fold_u=False, L=0):
    """(bytes a read step reads per buffered entry, bytes it writes for its own entry, bytes the
    flush reads per entry), per (row, head). fold_u: the flush reads u instead of v. L > 0: a
    GDN entry that does not fold also has its row of the key factors (L fp32, Tbuf), read by a
    read step and the flush, written with the entry."""
    r = H / HK
    kb = dk * 2 / r                                          # k / B per head (shared by the group)
    gb = _gate_bytes(kind, dk) + 4                           # G (per channel for KDA), beta / dt
    if kind == "gdn" and not fold_u:
        gb += 4 * L                                          # key factors (Tbuf)
    if kind in ("gdn", "kda"):
        read_nf = kb + dv * u_bytes + gb                     # k, u, G, beta (outputs)
        write = kb + dv * 2 + dv * u_bytes + gb              # k, v, u, G, beta
        read_fl = kb + dv * (u_bytes if fold_u else 2) + gb  # k, v or u, G, beta (rebuild)
    else:
        read_nf = read_fl = kb + dv * 2 + gb                 # B, x, G, dt
        write = kb + dv * 2 + gb
    return read_nf, write, read_fl


def _read_steps_h(L: int) -> int:
    """The committed lengths h = 0 .. L - 2 of a window's read steps, summed: (L - 1)(L - 2) / 2
    in closed form, so that a count takes no time however long the window."""
    return (L - 1) * (L - 2) // 2


# ---------------------------------------------------------------------------- per batch (bench)

def conventional_bytes(kind, fmt, B, H, HK, dv, dk):
    """HBM bytes of one conventional step: read + write the state, inputs, output."""
    return B * H * (2 * state_bytes(fmt, dv, dk) + io_bytes(kind, H, HK, dv, dk))


def replay_window_bytes(kind, anchor_fmt, read_fmt, L, B, H, HK, dv, dk):
    """Mean HBM bytes per step over a window of L steps (L - 1 read steps at h = 0..L-2, then one
    flush), as the kernel moves them. read_fmt None: shared pair."""
    io = io_bytes(kind, H, HK, dv, dk)
    ub = ring_u_bytes(anchor_fmt, read_fmt)
    rd_nf, wr, rd_fl = entry_bytes(kind, H, HK, dv, dk, ub, ub == 4, L)
    R = state_bytes(read_fmt or anchor_fmt, dv, dk)
    A = state_bytes(anchor_fmt, dv, dk)
    total = (L - 1) * (R + wr + io) + _read_steps_h(L) * rd_nf
    total += 2 * A + (0 if read_fmt is None else R) + (L - 1) * rd_fl + io
    return B * H * total / L


def replay_read_step_bytes(kind, read_fmt, h, B, H, HK, dv, dk, u_bytes=2, L=0):
    """HBM bytes of one non-flush step at committed length h (u_bytes: ring_u_bytes of the
    pair; L: its buffer length, for the key factors of a GDN pair that does not fold)."""
    rd_nf, wr, _ = entry_bytes(kind, H, HK, dv, dk, u_bytes, u_bytes == 4, L)
    return B * H * (state_bytes(read_fmt, dv, dk) + h * rd_nf + wr + io_bytes(kind, H, HK, dv, dk))


def replay_flush_step_bytes(kind, anchor_fmt, read_fmt, L, B, H, HK, dv, dk):
    ub = ring_u_bytes(anchor_fmt, read_fmt)
    _, _, rd_fl = entry_bytes(kind, H, HK, dv, dk, ub, ub == 4, L)
    A = state_bytes(anchor_fmt, dv, dk)
    R = 0 if read_fmt is None else state_bytes(read_fmt, dv, dk)
    return B * H * (2 * A + R + (L - 1) * rd_fl + io_bytes(kind, H, HK, dv, dk))


# ---------------------------------------------------------------------------- one model layer

@dataclass(frozen=True)
class LayerShape:
    """The state shape of one recurrent layer: kind ('gdn' | 'kda' | 'mamba2'), value heads H,
    key heads (GDN; KDA: H) or groups (Mamba-2) HK, d_v x d_k per head; name and index in the
    model."""
    kind: str
    H: int
    HK: int
    dv: int
    dk: int
    name: str = ""
    index: int = -1

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"layer kind must be one of {KINDS}, got {self.kind!r}")
        for f in ("H", "HK", "dv", "dk"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"layer shape {f} must be an integer >= 1, got {v!r}")
        if self.H % self.HK:
            raise ValueError(f"layer shape: HK={self.HK} must divide H={self.H}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LayerShape":
        return cls(**{k: d[k] for k in ("kind", "H", "HK", "dv", "dk", "name", "index") if k in d})


def _fmts(pair):
    """(anchor format, read format or None) of a PrecisionPair."""
    return pair.anchor.format, (None if pair.read is None else pair.read.format)


class _Parts:
    """Byte counts in named parts that add part by part (a model's sum over its layers)."""

    KEYS: tuple[str, ...] = ()          # to_dict's keys in order: the parts and their sums

    def __add__(self, o):
        return type(self)(*(getattr(self, f.name) + getattr(o, f.name) for f in fields(self)))

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.KEYS}


@dataclass
class StepBytes(_Parts):
    """Mean HBM bytes per decode step of one sequence, split by what moves them. `state` (read
    copy + ring + flush) is what the precision pair and L change; `io` (inputs, output) is the
    same for every pair and for the conventional step."""
    read_copy: float = 0.0
    ring: float = 0.0
    flush: float = 0.0
    io: float = 0.0
    KEYS = ("read_copy", "ring", "flush", "state", "io", "total")

    @property
    def state(self) -> float:
        return self.read_copy + self.ring + self.flush

    @property
    def total(self) -> float:
        return self.state + self.io


@dataclass
class MemoryBytes(_Parts):
    """State memory of one sequence: anchor, read copy (0 for a shared pair), ring buffer."""
    anchor: float = 0.0
    read_copy: float = 0.0
    ring: float = 0.0
    KEYS = ("anchor", "read_copy", "ring", "total")

    @property
    def total(self) -> float:
        return self.anchor + self.read_copy + self.ring


def layer_step_bytes(shape: LayerShape, pair, L: int | None = None) -> StepBytes:
    """Mean bytes per decode step of one sequence in one layer holding `pair` with buffer length
    L (default the pair's own): the parts of `replay_window_bytes` for B = 1."""
    L = pair.buffer_len if L is None else int(L)
    af, rf = _fmts(pair)
    s = shape
    ub = ring_u_bytes(af, rf)
    rd_nf, wr, rd_fl = entry_bytes(s.kind, s.H, s.HK, s.dv, s.dk, ub, ub == 4, L)
    R = state_bytes(rf or af, s.dv, s.dk)
    A = state_bytes(af, s.dv, s.dk)
    read_copy = (L - 1) * R
    ring = _read_steps_h(L) * rd_nf + (L - 1) * (wr + rd_fl)
    flush = 2 * A + (0 if rf is None else R)
    io = L * io_bytes(s.kind, s.H, s.HK, s.dv, s.dk)
    return StepBytes(s.H * read_copy / L, s.H * ring / L, s.H * flush / L, s.H * io / L)


def layer_conventional_bytes(shape: LayerShape, fmt: str = "fp32") -> StepBytes:
    """Bytes per decode step of one sequence in one layer for the conventional read-modify-write
    step in `fmt` (the state read and written every step: counted as `flush`)."""
    s = shape
    return StepBytes(0.0, 0.0, s.H * 2 * state_bytes(fmt, s.dv, s.dk),
                     s.H * io_bytes(s.kind, s.H, s.HK, s.dv, s.dk))


def layer_memory_bytes(shape: LayerShape, pair, L: int | None = None,
                       max_drafts: int = 0) -> MemoryBytes:
    """State memory of one sequence in one layer: the bytes a ReplayStore slot holds (anchor,
    read copy, ring of L + max_drafts entries: k per key head / group, v, GDN / KDA u, G (KDA:
    per key channel), beta / dt and GDN's key factors where it does not fold)."""
    L = pair.buffer_len if L is None else int(L)
    af, rf = _fmts(pair)
    s = shape
    ub = ring_u_bytes(af, rf)
    _, wr, _ = entry_bytes(s.kind, s.H, s.HK, s.dv, s.dk, ub, ub == 4, L)
    return MemoryBytes(s.H * state_bytes(af, s.dv, s.dk),
                       0.0 if rf is None else s.H * state_bytes(rf, s.dv, s.dk),
                       s.H * (L + max_drafts) * wr)


def layer_conventional_memory(shape: LayerShape, fmt: str = "fp32") -> MemoryBytes:
    return MemoryBytes(shape.H * state_bytes(fmt, shape.dv, shape.dk), 0.0, 0.0)


# ---------------------------------------------------------------------------- whole model

def _per_layer(shapes, assign):
    """[(shape, pair)] from a pair (every layer) or a callable shape -> pair."""
    return [(s, assign(s) if callable(assign) else assign) for s in shapes]


def model_step_bytes(shapes: list[LayerShape], assign, L: int | None = None) -> StepBytes:
    """Bytes per decode step of one sequence summed over the layers; `assign` is a pair (every
    layer) or a callable giving each LayerShape its pair (a layer policy); L overrides every
    pair's buffer length."""
    total = StepBytes()
    for s, p in _per_layer(shapes, assign):
        total = total + layer_step_bytes(s, p, L)
    return total


def model_memory_bytes(shapes: list[LayerShape], assign, L: int | None = None) -> MemoryBytes:
    total = MemoryBytes()
    for s, p in _per_layer(shapes, assign):
        total = total + layer_memory_bytes(s, p, L)
    return total


def model_conventional(shapes: list[LayerShape], fmt: str = "fp32") -> tuple[StepBytes, MemoryBytes]:
    """(bytes per step, memory) of one sequence for the conventional step in `fmt`, all layers."""
    b, m = StepBytes(), MemoryBytes()
    for s in shapes:
        b = b + layer_conventional_bytes(s, fmt)
        m = m + layer_conventional_memory(s, fmt)
    return b, m
