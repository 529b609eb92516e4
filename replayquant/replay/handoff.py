"""`ScanState`: one layer's whole replay state as it passes between the package's parts (the
chunked scan's input and output, a patched layer's state between multi-token forwards, the
contents of `ReplayState.export` / `load`, the source and result of a decode store's hand-off;
`replayquant.replay.convert` converts it to and from the other forms). Plain torch: importing
this module imports no Triton.

Same content and buffer layout as `ReplayState` (replayquant.replay.core), B sequences:

    anchor      QTensor [B, H, d_v, d_k]       high precision
    read        QTensor or None                low precision (None: a shared pair, the anchor read)
    k, v        [B, H, L, d_k], [B, H, L, d_v] the buffered steps' inputs (k normalised; Mamba-2
                                               v = dt x)
    G           [B, H, L] (KDA: [B, H, L, d_k]) cumulative log gate since the checkpoint
    beta        [B, H, L] (GDN, KDA) or None (Mamba-2)
    committed   int64 [B]                      buffered (committed) entries per row, 0..L
    n_flush     int64 [B]                      flush index of the current anchor (0: initial cast)
    state_indices int64 [B]                    the sequence ids that key the SR streams
    u           [B, H, L, d_v] or None         GDN / KDA u of the entries against the read copy,
                                               where the source kept it (a ReplayState); None:
                                               solved against the read copy where it is needed
    raw         dict or None                   the buffered entries' raw inputs as a decode
                                               store's ring takes them (`raw_names`): entry
                                               j < committed[b] of row b at [b, j], zeros
                                               after; None: not kept
                                               (the ring then takes k and v as they are)
    pair, seed, layer                          the pair and SR key the state was made with (None,
                                               0, 0 where the holder passes them itself)
    n_slots     int or None                    the decode store's slot count where the host knows
                                               it (B for a new state, rows 0..B-1); None: counted
                                               from the rows where a store is built (one host read)

Slots >= committed are ignored. The part names (`PART_NAMES`) can be read as keys, ss["anchor"],
as from a dict of parts (`ReplayState.load` takes either; "flushes" is read as "n_flush").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayquant.formats import QTensor
from replayquant.replay.core import qt_take
from replayquant.replay.frontends import mamba2_dt

__all__ = ["ScanState", "PART_NAMES", "OTHER_NAMES", "raw_names", "raw_of_forward", "append_raw", "take_rows"]

# the parts of a layer's state, as ReplayState.load takes them
PART_NAMES = ("anchor", "read", "k", "v", "G", "beta", "u", "committed", "n_flush", "state_indices")
# part names that dicts of parts may still use, and the part each names
OTHER_NAMES = {"flushes": "n_flush"}


@dataclass
class ScanState:
    """One layer's replay state for B sequences (module docstring for the fields)."""

    anchor: QTensor
    read: QTensor | None
    k: torch.Tensor
    v: torch.Tensor
    G: torch.Tensor
    beta: torch.Tensor | None
    committed: torch.Tensor
    n_flush: torch.Tensor
    state_indices: torch.Tensor
    u: torch.Tensor | None = None
    raw: dict | None = None
    pair: object = None
    seed: int = 0
    layer: int = 0
    n_slots: int | None = None

    @property
    def batch(self) -> int:
        return self.committed.shape[0]

    B = batch

    @property
    def heads(self) -> int:
        return self.k.shape[1]

    @property
    def buffer_len(self) -> int:
        return self.k.shape[2]

    @property
    def delta(self) -> bool:
        return self.beta is not None

    @property
    def vector_gate(self) -> bool:
        """Whether the gates are per key channel (G [B, H, L, d_k], KDA)."""
        return self.G.dim() == 4

    @property
    def device(self) -> torch.device:
        return self.committed.device

    # -- read as the parts mapping (ReplayState.export's keys)
    def keys(self):
        return PART_NAMES

    def __iter__(self):
        return iter(PART_NAMES)

    def __getitem__(self, name: str):
        name = OTHER_NAMES.get(name, name)
        if name not in PART_NAMES:
            raise KeyError(name)
        return getattr(self, name)

    def get(self, name: str, default=None):
        name = OTHER_NAMES.get(name, name)
        return getattr(self, name) if name in PART_NAMES else default

    def items(self):
        return [(n, getattr(self, n)) for n in PART_NAMES]


def raw_names(kind: str) -> tuple:
    """The raw inputs a decode store's ring keeps per entry: GDN and KDA the key before its L2
    norm, Mamba-2 x and its step size dt (float32)."""
    return ("x", "dt") if kind == "mamba2" else ("k",)


def raw_of_forward(kind: str, raw: dict) -> dict:
    """The raw entries [B, T, ...] of a forward's raw inputs, as a decode step would append them
    (Mamba-2's dt as `frontends.mamba2_dt` forms it for the chunked scan's v = dt x)."""
    if kind != "mamba2":
        return {"k": raw["k"]}
    return {"x": raw["x"], "dt": mamba2_dt(raw["dt"], raw["dt_bias"],
                                           dt_limit=raw.get("dt_limit"))}


def append_raw(raw: dict | None, committed: torch.Tensor, new: dict, valid,
               after: torch.Tensor, buffer_len: int) -> dict:
    """The raw entries after a segment: the last after[b] of row b's committed[b] buffered entries
    (raw, None: none kept, zeros) followed by its valid new tokens new [B, T, ...] (valid [B, T]
    bool or None: all), in buffer order, zeros after (what a scan that leaves after[b] buffered
    entries buffers). Copies only, on the device, no host read."""
    any_t = next(iter(new.values()))
    B, T = any_t.shape[:2]
    dev = any_t.device
    L = buffer_len
    if raw is None:
        raw = {n: t.new_zeros((B, L) + tuple(t.shape[2:])) for n, t in new.items()}
    ok = torch.ones(B, T, dtype=torch.bool, device=dev) if valid is None else valid.bool()
    had = torch.arange(L, device=dev)[None, :] < committed.to(dev).long()[:, None]
    m = torch.cat([had, ok], 1)                                     # [B, L + T]
    later = m.flip(1).cumsum(1).flip(1)                             # valid entries at or after
    n = after.to(dev).long()[:, None]
    dest = torch.where(m & (later <= n), n - later, L)              # L: dropped
    rows = torch.arange(B, device=dev)[:, None]
    out = {}
    for name, old in raw.items():
        both = torch.cat([old, new[name].to(old.dtype)], 1)
        o = old.new_zeros((B, L + 1) + tuple(old.shape[2:]))
        o[rows, dest] = both
        out[name] = o[:, :L]
    return out


def take_rows(ss: ScanState, ids: torch.Tensor) -> ScanState:
    """The state whose row i is row ids[i] of ss (a beam reorder; repeats allowed). SR stream
    ids follow the rows."""
    ids = ids.to(ss.device)
    B = ss.batch

    def take(t):
        return None if t is None else t[ids].contiguous()

    return ScanState(anchor=qt_take(ss.anchor, ids, B),
                     read=None if ss.read is None else qt_take(ss.read, ids, B),
                     k=take(ss.k), v=take(ss.v), G=take(ss.G), beta=take(ss.beta),
                     committed=take(ss.committed), n_flush=take(ss.n_flush),
                     state_indices=take(ss.state_indices),
                     u=take(ss.u),
                     raw=None if ss.raw is None else {n: t[ids] for n, t in ss.raw.items()},
                     pair=ss.pair, seed=ss.seed, layer=ss.layer)
