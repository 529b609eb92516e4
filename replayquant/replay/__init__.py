"""Replay core: the dual-precision state machine (DESIGN sections 2-4), torch reference.

    from replayquant.replay import ReplayState, ConventionalState
    from replayquant.replay import mamba2_inputs, gdn_inputs, kda_inputs, recurrent_reference

* `ReplayState`: anchor (high precision, written at flushes), read copy (low precision, read by
  non-flush steps), replay buffer of L raw step inputs; speculative verify / accept.
* `ConventionalState`: the read-modify-write baseline (one shared format, per-draft snapshots).
* `core`: the formulas and the buffer layout that GPU kernels and teacher forcing must match.
* `frontends`: Mamba-2, Gated DeltaNet and Kimi Delta Attention tensors -> the generic core
  (q, k, v, log_a[, beta]); KDA's log_a is per key channel (states built with vector_gate=True).
* `recurrent_reference`: the unrounded sequential FP32 recurrence.
* `stores`: the decode stores of a layer (`ReplayStore`, `ConventionalStore`, the packed layout,
  the fault record) and the checks of a step's inputs, which the Triton kernels, their torch
  references and the torch engine step; `roles`: their packed roles (`PackedRole`).
* `ScanState` (`handoff`): the whole state of a layer as it passes between the parts (the
  chunked scan, a patched layer between forwards, `ReplayState.export` / `load`, a store's
  hand-off); `convert`: every conversion between ReplayState, ScanState and the stores.
Plain torch: importing this package imports no Triton.
"""

from replayquant.replay.frontends import gdn_inputs, kda_inputs, kda_log_decay, l2norm, mamba2_inputs
from replayquant.replay.handoff import ScanState
from replayquant.replay.reference import recurrent_reference
from replayquant.replay.state import ConventionalState, ReplayState
from replayquant.replay.stores import ConventionalStore, ReplayStore
from replayquant.replay import convert  # after the classes it converts

__all__ = ["ReplayState", "ConventionalState", "ScanState", "ReplayStore", "ConventionalStore",
           "convert", "mamba2_inputs",
           "gdn_inputs", "kda_inputs", "kda_log_decay", "l2norm", "recurrent_reference"]
