"""The decode store of one patched layer (`DecodeStore`), used by `replayquant.models.runtime`.

A `DecodeStore` is a `replayquant.replay.stores.ReplayStore` (anchor and read copy, ring buffer,
per-row pointers as device tensors, allocated once for the batch), the engine that steps it
through the custom operator replayquant::replay_step ('triton': the replay decode kernel on a
bf16 ring; 'torch': `replayquant.kernels.replay.engine` on a float32 ring), the slot of each
batch row, and the device-side record of non-finite inputs. It is built once, where decode
starts, from a `ScanState` (the chunked scan's state as it is after a prompt, or a ReplayState's
export) and turned back into one where a multi-token forward continues the cache; the
conversions (`replayquant.replay.convert`: `scan_to_store`, `store_to_scan`) keep the anchor
and read copy bit for bit and the committed buffer entries, the ring holding the layer's raw
activations as a decode step appends them.
"""

from __future__ import annotations

import torch

from replayquant.formats import as_bits
from replayquant.kernels.ops import (ENGINES, replay_accept, replay_step, replay_verify,
                                     store_meta, store_tensors)
from replayquant.replay import ReplayState
from replayquant.replay.convert import scan_to_store, store_to_scan, store_to_state, store_window
from replayquant.replay.handoff import ScanState
from replayquant.replay.stores import FAULT_INPUTS, FaultRecord, overflowing_role

__all__ = ["DecodeStore", "take_slots", "RING_DTYPE"]

# the ring's k and v per engine: bf16 halves the kernel's buffer traffic; the torch engine keeps
# them in float32, so that its decode equals ReplayState.step (and HF's recurrence) within float32
# reassociation
RING_DTYPE = {"triton": torch.bfloat16, "torch": torch.float32}
# The kernel's step path: 'replay' keeps ReplayState's flush schedule (a flush every L tokens), so
# the kernel and the torch reference hold the same committed / flush counters and a hand-off
# back continues the same schedule. (The kernel's 'auto' would flush every step at small batch for
# a shared FP32 anchor: lossless but another schedule; a serving choice, not the patch's.)
DECODE_KERNEL_PATH = "replay"


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
    * `host_committed` (torch engine, eager steps): each row's committed count, counted on
      the host from the hand-off on (every decode step appends one entry per row, a row whose
      entry fills the buffer flushes to 0), so that a step names the rows that flush and the
      engine runs the flush branch on them alone (`replay.engine`'s `flushing`): on this
      project's 2-core CPU,
      one thread, the embedded models at B = 4, L = 16, a decode forward with the branch for
      every row took 1.3-2.5x one with it for the rows that flush (s32_rs and tp4_hi16_sr;
      evals/cpu_decode.py).
      None where it is not known: the Triton engine, after a beam reorder, once a step is
      compiled (every row then computes both branches).
    Built from a ReplayState, or straight from the chunked scan's state (`from_scan`), by
    `replay.convert.scan_to_store`; turned back by `to_scan_state()` / `to_replay_state()`."""

    def __init__(self, st: ReplayState, key_heads: int, reuse: "DecodeStore | None" = None,
                 engine: str = "triton"):
        self._build(st.export(), key_heads, reuse, engine)

    @classmethod
    def from_scan(cls, ss: ScanState, key_heads: int, reuse: "DecodeStore | None" = None,
                  engine: str = "triton", max_drafts: int = 0) -> "DecodeStore":
        """The decode store of ScanState ss (`replay.convert.scan_to_store`: the chunked scan's
        state straight into the store, no ReplayState in between; max_drafts as there)."""
        self = cls.__new__(cls)
        self._build(ss, key_heads, reuse, engine, max_drafts)
        return self

    def _build(self, ss: ScanState, key_heads, reuse, engine, max_drafts=0):
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.pair, self.delta, self.seed, self.layer = ss.pair, ss.delta, ss.seed, ss.layer
        self.vector_gate, self.engine = ss.vector_gate, engine
        self.B, self.H, self.d_v, self.d_k = ss.anchor.shape
        self.device = ss.k.device
        self.ring = RING_DTYPE[engine]
        self.store, slots = scan_to_store(ss, key_heads, ring_dtype=self.ring,
                                          max_drafts=max_drafts)
        # int32, as the kernels index: a step converts nothing
        self.state_indices = slots.to(torch.int32)
        self.bad_names = FAULT_INPUTS[self.store.kind]
        self.faults = FaultRecord.empty(self.store.kind, self.B, self.device)
        self.host_committed = ss.committed.tolist() if engine == "torch" else None
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

    def to_scan_state(self) -> ScanState:
        """The ScanState of this store's rows, its raw ring entries included (a multi-token
        forward continuing a decoded cache; `replay.convert.store_to_scan`)."""
        return store_to_scan(self.store, self.state_indices.long(), self.pair, self.seed,
                             self.layer)

    def committed(self) -> torch.Tensor:
        """Each batch row's committed entries (the fill h of its ring), int32 [B]."""
        return self.store.committed[self.state_indices.long()]

    def raw_entries(self) -> dict:
        """The ring's raw entries of each batch row in window order, [B, L, ...] each (the
        `raw` of a ScanState: GDN / KDA k, Mamba-2 x and dt)."""
        take = store_window(self.store, self.state_indices.long())
        if self.delta:
            return {"k": take(self.store.kbuf)}
        return {"x": take(self.store.vbuf), "dt": take(self.store.bbuf)}

    def reorder(self, ids: torch.Tensor) -> None:
        """Batch row i continues row ids[i] (a device tensor; repeats allowed: beam search)."""
        ids = ids.to(self.device)
        take_slots(self.store, self.state_indices, self.state_indices[ids])
        for t in self.faults:
            t.copy_(t[ids])
        self.host_committed = None                     # the rows' fills moved on the device

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
        self.host_committed = None                     # the rows' fills move on the device
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
        """The rows whose entry fills the buffer at this step, from `host_committed` (advanced here), or
        None where the host does not know them (a compiled step: the graph takes none)."""
        # asked before `host_committed` is read: a compiled step then guards nothing on it, so the
        # step after a hand-off (a list) and the later ones (None) share one graph
        if torch.compiler.is_compiling():
            self.host_committed = None
            return None
        if self.host_committed is None:
            return None
        buffer_len = self.store.buffer_len
        rows = [r for r, h in enumerate(self.host_committed) if h + 1 == buffer_len]
        self.host_committed = [0 if h + 1 == buffer_len else h + 1 for h in self.host_committed]
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

