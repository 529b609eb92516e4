"""Counting what a piece of code asks of the device: host synchronisations and kernel launches.

A host synchronisation is an operator whose result the host must read before it can go on: the
scalar read behind `.item()`, `int(t)` and `bool(t)` (`aten._local_scalar_dense`, `is_nonzero`),
`torch.equal`, and operators whose output size depends on the data (`nonzero`, `unique`,
`masked_select`, boolean indexing). On a GPU each one stalls the host until the device has
caught up; inside CUDA graph capture it is an error, and torch.compile breaks its graph there.
`HostSyncCounter` counts them with a TorchDispatchMode, so the count is the same on the CPU (where
nothing stalls) as on the GPU, and tests can pin it without a GPU. It also counts every operator
dispatched (`ops`), an upper bound of the kernel launches of eager torch code, and Triton
launches through `triton_launches` (custom ops of replayquant.kernels.ops count once each).
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter", "SYNC_OPS"]

# operators that read device data on the host (by overload packet name)
SYNC_OPS = frozenset({
    "_local_scalar_dense", "is_nonzero", "equal", "item", "nonzero", "unique", "_unique",
    "_unique2", "unique_dim", "unique_consecutive", "masked_select", "nonzero_static_",
    "_assert_async", "allclose", "repeat_interleave_count",
})
# bookkeeping operators that launch nothing
_FREE = frozenset({"view", "_unsafe_view", "reshape", "expand", "t", "transpose", "permute",
                   "unsqueeze", "squeeze", "select", "slice", "alias", "as_strided", "detach",
                   "unflatten", "flatten", "split", "split_with_sizes", "chunk", "unbind",
                   "lift_fresh", "empty", "empty_like", "empty_strided", "sym_size", "sym_stride",
                   "sym_numel", "dim", "size", "stride", "is_contiguous", "_reshape_alias",
                   "new_empty", "new_empty_strided", "view_as", "expand_as", "numpy_T"})


class HostSyncCounter(TorchDispatchMode):
    """with HostSyncCounter() as c: ...  -> c.syncs (host synchronisations), c.ops (operators that
    compute something), c.by_name (Counter of sync operator names), c.where (the Python frame of
    each sync when record_where=True: file:line of the first frame outside torch)."""

    def __init__(self, record_where: bool = False):
        super().__init__()
        self.syncs = 0
        self.ops = 0
        self.by_name: Counter = Counter()
        self.where: list[str] = []
        self.record_where = record_where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        is_index = name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()))
        if name in SYNC_OPS or is_index:
            self.syncs += 1
            self.by_name[name] += 1
            if self.record_where:
                self.where.append(_caller())
        elif name not in _FREE:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in fr.filename and not fr.filename.endswith("hostsync.py"):
            return f"{fr.filename.split('/replayquant/')[-1]}:{fr.lineno} {fr.name}"
    return "?"
