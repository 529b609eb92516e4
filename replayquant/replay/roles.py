"""The stored roles of a layer's decode state (`PackedRole`), which every decode store, kernel
and reference of the package shares: one stored copy of the state of all slots of a layer,
physically packed (fp32 / fp16 / bf16 tensors, fp8 bytes + one FP32 scale per row, NVFP4 nibbles
two per byte + E4M3 block scales + one FP32 scale per matrix). Layout [slots, heads, d_v, d_k],
d_k contiguous (the NVFP4 block runs along d_k). `PackedRole` is `replayquant.formats.QTensor`,
the package's one packed type (a format's quantize returns the same type), named here for its
use as a store's role. Its torch casts are the format specification (`formats/casts.py`, Philox
bits of `formats/philox.py` with the streams of `streams.py`); the kernels' casts of a tile in
registers are in `kernels/quant/roles.py`. Plain torch: importing this module imports no Triton.
"""

from __future__ import annotations

import torch

from replayquant.formats import FMT_IDS, QTensor
from replayquant.streams import sr_stream

__all__ = ["PackedRole", "FMT_IDS", "role_streams"]

# one stored copy (anchor or read copy) of the state of every slot of one layer
PackedRole = QTensor


def role_streams(flush_index, role: int, slots, heads: int) -> torch.Tensor:
    """sr_stream for a set of slots (the slot id is the sequence id of the stream)."""
    return sr_stream(flush_index, role, torch.as_tensor(slots, dtype=torch.int64).cpu(), heads)
