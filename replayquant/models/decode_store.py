"""The decode store of one patched layer, used by `replayquant.models.runtime`: a
`replayquant.replay.stores.ReplayStore` (anchor and read copy, ring buffer, per-row pointers as
device tensors, allocated once for the batch) that knows its batch (`state_indices`, the slot of
each batch row), its pair, seed and layer, and carries the device-side record of its steps'
faults; and the functions that step it through the custom operators (replayquant::replay_step,
replay_verify, replay_accept) on its engine ('triton': the replay decode kernel on a bf16 ring;
'torch': `replayquant.kernels.replay.engine` on a float32 ring).

A decode store is built once, where decode starts, from a `ScanState` (`from_scan`: the chunked
scan's state as it is after a prompt, or `from_state`: a ReplayState's export) and turned back
into one where a multi-token forward continues the cache (`to_scan_state`); the conversions
(`replayquant.replay.convert`: `scan_to_store`, `store_to_scan`) keep the anchor and read copy
bit for bit and the committed buffer entries, the ring holding the layer's raw activations as a
decode step appends them.

What a step keeps on the device instead of reading it on the host (no host synchronisation in
a step, so that torch.compile traces it whole and CUDA graphs capture it):
* a beam reorder: HF replaces the cache's marker tensor (MARKER_ATTR on the cache layer, a
  host check of identity) by its rows picked by the beam ids, and `reorder` gathers every
  slot's store on the device (`take_slots`).
* `faults`: a `replay.stores.FaultRecord` in which each step itself (inside the kernel's
  launches, or the torch engine's ops: no launch of its own) notes the decode step (1 = the
  first after the prompt) at which each input of each row first held NaN or infinity;
  `raise_nonfinite` reads it at a boundary the host already waits at. The kernel never
  writes a non-finite state into the anchor or the read copy (it keeps the roles of a flush
  whose state is not finite).
* `host_committed` (torch engine, eager steps): each row's committed count, counted on
  the host from the hand-off on (every decode step appends one entry per row, a row whose
  entry fills the buffer flushes to 0), so that a step names the rows that flush and the
  engine runs the flush branch on them alone (`replay.engine`'s `flushing`): on this
  project's 2-core CPU, one thread, the embedded models at B = 4, L = 16, a decode forward
  with the branch for every row took 1.3-2.5x one with it for the rows that flush (s32_rs
  and tp4_hi16_sr; evals/cpu_decode.py). None where it is not known: the Triton engine,
  after a beam reorder, once a step is compiled (every row then computes both branches).
"""

from __future__ import annotations

import torch

from replayquant.formats import as_bits
from replayquant.kernels.ops import (ENGINES, replay_accept, replay_step, replay_verify,
                                     store_meta, store_tensors)
from replayquant.replay import ReplayState
from replayquant.replay.convert import scan_to_store, store_to_scan, store_to_state, store_window
from replayquant.replay.handoff import ScanState
from replayquant.replay.stores import FAULT_INPUTS, FaultRecord, ReplayStore, overflowing_role

__all__ = ["from_scan", "from_state", "step", "verify", "accept", "reorder", "raise_nonfinite",
           "to_scan_state", "to_replay_state", "committed", "raw_entries", "tensors",
           "take_slots", "RING_DTYPE"]

# the ring's k and v per engine: bf16 halves the kernel's buffer traffic; the torch engine keeps
# them in float32, so that its decode equals ReplayState.step (and HF's recurrence) within float32
# reassociation
RING_DTYPE = {"triton": torch.bfloat16, "torch": torch.float32}
# The kernel's step path: 'replay' keeps ReplayState's flush schedule (a flush every L tokens), so
# the kernel and the torch reference hold the same committed / flush counters and a hand-off
# back continues the same schedule. (The kernel's 'auto' would flush every step at small batch for
# a shared FP32 anchor: lossless but another schedule; a serving choice, not the patch's.)
DECODE_KERNEL_PATH = "replay"


def from_state(st: ReplayState, key_heads: int, reuse: ReplayStore | None = None,
               engine: str = "triton") -> ReplayStore:
    """The decode store of ReplayState st (its export, through `from_scan`)."""
    return from_scan(st.export(), key_heads, reuse, engine)


def from_scan(ss: ScanState, key_heads: int, reuse: ReplayStore | None = None,
              engine: str = "triton", max_drafts: int = 0) -> ReplayStore:
    """The decode store of ScanState ss (`replay.convert.scan_to_store`: the chunked scan's
    state straight into the store, no ReplayState in between; max_drafts as there), its batch
    rows in `state_indices`, an empty fault record. reuse: a decode store nobody steps any more;
    where its layout is this one's, this content goes into its tensors, so that a compiled step's CUDA graphs replay on the addresses they recorded (a new address
    re-records every graph: about 300 ms a generate, H200)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    store, slots = scan_to_store(ss, key_heads, ring_dtype=RING_DTYPE[engine],
                                 max_drafts=max_drafts)
    store.pair, store.seed, store.layer, store.engine = ss.pair, ss.seed, ss.layer, engine
    # int32, as the kernels index: a step converts nothing
    store.state_indices = slots.to(torch.int32)
    B = store.state_indices.shape[0]
    store.faults = FaultRecord.empty(store.kind, B, store.device)
    store.host_committed = ss.committed.tolist() if engine == "torch" else None
    # the operator's meta, the packed layout in it: a store of an equal meta is packed alike
    # (one tensor for the store's fields: a compiled step guards it alone, ReplayStore.pack)
    store.meta = store_meta(store, engine, packed=store.pack_layout())
    mine = [store.state_indices, *store.faults]
    theirs = None if reuse is None else [reuse.state_indices, *reuse.faults]
    if reuse is not None and reuse.meta == store.meta and all(
            a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            for a, b in zip(theirs, mine)):
        store.pack(into=reuse.blob)
        for a, b in zip(theirs, mine):
            a.copy_(b)
        store.state_indices, store.faults = reuse.state_indices, reuse.faults
    else:
        store.pack()
    # every tensor a step reads or writes keeps its address, as HF's static cache tensors:
    # CUDA graphs replay a compiled step on them (torch.compile skips graphs that mutate
    # others, and copies any other input into the graph's own at every replay)
    for t in tensors(store):
        torch._dynamo.mark_static_address(t)
    return store


def tensors(store: ReplayStore) -> list[torch.Tensor]:
    """Every tensor of a decode store a step reads or writes (store, slots, counters)."""
    return store_tensors(store) + [store.state_indices, *store.faults]


def to_replay_state(store: ReplayStore) -> ReplayState:
    return store_to_state(store, store.state_indices.long(), store.pair, store.seed, store.layer)


def to_scan_state(store: ReplayStore) -> ScanState:
    """The ScanState of this store's rows, its raw ring entries included (a multi-token
    forward continuing a decoded cache; `replay.convert.store_to_scan`)."""
    return store_to_scan(store, store.state_indices.long(), store.pair, store.seed, store.layer)


def committed(store: ReplayStore) -> torch.Tensor:
    """Each batch row's committed entries (the fill h of its ring), int32 [B]."""
    return store.committed[store.state_indices.long()]


def raw_entries(store: ReplayStore) -> dict:
    """The ring's raw entries of each batch row in window order, [B, L, ...] each (the
    `raw` of a ScanState: GDN / KDA k, Mamba-2 x and dt)."""
    take = store_window(store, store.state_indices.long())
    if store.kind != "mamba2":
        return {"k": take(store.kbuf)}
    return {"x": take(store.vbuf), "dt": take(store.bbuf)}


def reorder(store: ReplayStore, ids: torch.Tensor) -> None:
    """Batch row i continues row ids[i] (a device tensor; repeats allowed: beam search)."""
    ids = ids.to(store.device)
    take_slots(store, store.state_indices, store.state_indices[ids])
    for t in store.faults:
        t.copy_(t[ids])
    store.host_committed = None                    # the rows' fills moved on the device


def raise_nonfinite(store: ReplayStore) -> None:
    """One ValueError naming the layer, the row and the decode step, if since the store was
    built a flush's cast into the anchor or read copy overflowed (named first: the role and
    its format, as replay.state.flush_overflow_error), else if an input of a decode step
    held NaN or infinity (naming the input); one host read."""
    bad = store.faults.bad.cpu()
    if not bool((bad >= 0).any()):
        return
    first = torch.where(bad >= 0, bad, torch.iinfo(torch.int64).max)
    layer, pair = store.layer, store.pair
    if bool((bad[:, -1] >= 0).any()):            # stores.FAULT_COLUMNS: the flush's cast
        row = int(first[:, -1].argmin())
        role, spec = overflowing_role(pair)
        raise ValueError(
            f"layer {layer}: the {role} ({spec.format} of pair {pair.label()}) "
            f"overflows at the flush of decode step {int(bad[row, -1])} after the prompt, "
            f"batch row {row} (sequence {int(store.state_indices[row])}): the state rebuilt "
            f"there is larger than {spec.format} holds ({spec.fmt.grid.max_value:g}); that "
            f"flush kept the anchor and read copy as they were, so the row's outputs from "
            f"there on are not the pair's. Give the {role} a wider format (fp32, or bf16, "
            f"which keeps fp32's range), or check the model's activations (the inputs were "
            f"finite: their size made the state this large)")
    row, col = divmod(int(first.argmin()), bad.shape[1])
    raise ValueError(
        f"layer {layer} ({store.kind}): input {FAULT_INPUTS[store.kind][col]} held NaN or "
        f"infinity at decode step {int(bad[row, col])} after the prompt, batch row {row}; the "
        f"anchor and read copy keep the last finite flush. The inputs are the layer's "
        f"projections of its hidden states: find where the model's activations first become "
        f"non-finite (e.g. a float16 overflow)")


def step(store: ReplayStore, raw: dict) -> torch.Tensor:
    """One decode step from the layer's raw inputs (one token each, see LayerRuntime.run)
    -> y float32 [B, H, d_v] (Mamba-2: without the D skip), through the custom operator
    replayquant::replay_step (replayquant.kernels.ops) on the store's engine, which notes
    the inputs' faults in `faults`."""
    return replay_step(store, _inputs(store, raw), store.state_indices, DECODE_KERNEL_PATH,
                       store.meta, flushing=_flushing(store), record=store.faults)


def verify(store: ReplayStore, raw: dict) -> torch.Tensor:
    """Speculative decoding's verify of T drafts per row from the layer's raw inputs (each
    [B, T, ...], as a multi-token forward gives them; T at most the store's max_drafts)
    -> y float32 [B, T, H, d_v] (Mamba-2: without the D skip), through the custom operator
    replayquant::replay_verify: all drafts read against one checkpoint, outputs only, each
    appended to the ring after the committed entries, uncommitted until `accept`. A row whose
    committed entries would not leave T free slots (h + T > L, h > 0) folds them first (DESIGN
    section 4); a flush never folds drafts."""
    store.host_committed = None                    # the rows' fills move on the device
    return replay_verify(store, _inputs(store, raw), store.state_indices, store.meta)


def accept(store: ReplayStore, n: int) -> None:
    """Commit the first n of the drafts the last `verify` appended, in every row (a pointer
    move, replayquant::replay_accept; the rest are overwritten by later entries)."""
    n_rows = torch.full((store.B,), int(n), dtype=torch.int32, device=store.device)
    replay_accept(store, n_rows, store.state_indices, store.meta, check=False)


def _inputs(store: ReplayStore, raw: dict) -> dict:
    """The operator's inputs of a step or verify from the layer's raw inputs: the buffered
    ones in the ring's dtype, each made contiguous here, outside the operator, where
    torch.compile fuses the copy into the kernel that produced them (GDN's q, k and v are
    views of the convolution's output)."""
    ring = store.kbuf.dtype               # the buffered inputs go in at the ring's dtype

    def c(name, dtype=None):
        t = raw[name]
        return (t if dtype is None else t.to(dtype)).contiguous()

    if store.kind == "kda":
        return dict(q=c("q"), k=c("k", ring), v=c("v", ring), g=c("g"), beta=c("beta"),
                    scale=raw["scale"])
    if store.kind == "gdn":
        return dict(q=c("q"), k=c("k", ring), v=c("v", ring), a=c("a"), b=c("b"),
                    A_log=raw["A_log"], dt_bias=raw["dt_bias"],
                    beta_scale=raw.get("beta_scale", 1.0))
    return dict(x=c("x", ring), dt=c("dt"), A=raw["A"], B=c("B", ring), C=c("C"),
                dt_bias=raw["dt_bias"], dt_limit=raw.get("dt_limit"))


def _flushing(store: ReplayStore) -> list[int] | None:
    """The rows whose entry fills the buffer at this step, from `host_committed` (advanced
    here), or None where the host does not know them (a compiled step: the graph takes none)."""
    # asked before `host_committed` is read: a compiled step then guards nothing on it, so the
    # step after a hand-off (a list) and the later ones (None) share one graph
    if torch.compiler.is_compiling():
        store.host_committed = None
        return None
    if store.host_committed is None:
        return None
    L = store.buffer_len
    rows = [r for r, h in enumerate(store.host_committed) if h + 1 == L]
    store.host_committed = [0 if h + 1 == L else h + 1 for h in store.host_committed]
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

