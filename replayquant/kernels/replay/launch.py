"""The launch table of the replay decode kernel (`decode._replay_kernel`): tile rows,
warps and register caps of its flush and read launches, chosen by shape, each row with its
measured reason. Plain Python: the torch references read the flush launch's tile rows (a flush
tile whose state or cast is not finite keeps its bytes, as the kernel's) without importing
Triton.
"""

from __future__ import annotations

from replayquant.replay.stores import ReplayStore

__all__ = ["LAUNCH_TABLE", "LAUNCHES", "replay_launch_config"]


# The launch table, chosen by shape: (launch, kind, role) -> rows BV of a program's [BV, d_k]
# tile, state elements a thread holds (warps = BV d_k / (32 per_thread), 1..8), register cap
# (None: ptxas's), columns a chunk of the read (0: one chunk loaded before the row's pointers;
# d_k: one chunk loaded at the pass). The first matching row wins ('*': any). role: the read
# launch's read copy; the flush's 'nvfp4' (either role in NVFP4, one FP32 scale per matrix: whole
# matrices), 'fp32 shared' (an FP32 anchor that is also the read copy; GDN's flush folds its
# cached u), else '*'. Reasons: read / flush steps, H200, B = 256, us, docs/kernels.md.
LAUNCH_TABLE = (   # launch, kind, role, rows, per_thread, regs, chunk  # reason
    ("read", "gdn", "fp8", 64, 256, 128, 32),       # 96.5 vs 133.8 uncapped, 151.3 whole
    ("read", "gdn", "nvfp4", 64, 256, 128, 64),     # 100.1 vs 125.0 uncapped, 134.2 whole
    ("read", "kda", "fp8", 64, 128, 128, 128),      # 165.2 vs 184.4 loaded early at 168
    ("read", "kda", "nvfp4", 64, 128, 128, 128),    # 159.3 vs 168.6 loaded early
    ("read", "*", "fp32", 64, 256, None, 32),       # GDN 171.6 vs 187.9 whole, 196.0 at 16
    ("read", "*", "*", 64, 128, None, 0),           # GDN 199.1 vs 205.4 on 1 warp, 218.9 on 4
    ("flush", "mamba2", "nvfp4", None, 64, 168, 0),  # 1129.0 vs 1423.4 uncapped, 2305.5 on 8 warps
    ("flush", "*", "nvfp4", None, 64, None, 0),      # whole matrices; GDN 1145.5 vs 1727.3 on 4
    ("flush", "gdn", "fp32 shared", 32, 128, None, 0),      # s32_rs 417.7 vs 506.8 at 16 rows
    ("flush", "mamba2", "fp32 shared", 32, 128, None, 0),   # s32_rs 676.8 vs 702.5 at 16, 168
    ("flush", "mamba2", "*", 16, 64, 168, 0),       # s32_rs 698.8 vs 761.8 uncapped
    ("flush", "*", "*", 16, 64, None, 0),           # smallest dot tile; GDN 1274.5 at 168
)
LAUNCHES = ("flush", "read")


def _role(store: ReplayStore, which: str) -> str:
    """The role of `which` launch that LAUNCH_TABLE's rows match."""
    if which == "read":
        return store.read_role.fmt
    if "nvfp4" in (store.anchor.fmt, store.read_role.fmt):
        return "nvfp4"
    return "fp32 shared" if store.shared and store.anchor.fmt == "fp32" else "*"


def _table(store: ReplayStore, which: str):
    """LAUNCH_TABLE's first row for this store's launch `which`: (rows, per_thread, regs,
    chunk)."""
    role = _role(store, which)
    for launch, kind, r, *cfg in LAUNCH_TABLE:
        if launch == which and kind in ("*", store.kind) and r in ("*", role):
            return cfg
    raise AssertionError("LAUNCH_TABLE ends with a catch-all row for each launch")


def _max_regs(store: ReplayStore, launch, which: str, T: int = 1):
    """The register cap of a launch given as (rows, warps, regs); of a launch not given,
    LAUNCH_TABLE's, except for a verify's read (T > 1, whose drafts' entries stay live across
    the read copy's pass: the caps spill, docs/kernels.md); else None (ptxas's choice)."""
    c = (launch or {}).get(which) or ()
    if len(c) > 2 and c[2] is not None and not 16 <= int(c[2]) <= 255:
        raise ValueError(f"{which} launch regs={c[2]} must lie in 16..255")
    if len(c) > 2 and c[2] is not None:
        return int(c[2])
    if any(x is not None for x in c) or (which == "read" and T > 1):
        return None
    return _table(store, which)[2]


def replay_launch_config(store: ReplayStore, which: str = "read", launch=None):
    """(BV, num_warps) of the flush or the read launch (`which`) of _replay_kernel for this
    store: tile rows and warps, from LAUNCH_TABLE, or as given in launch: a mapping
    {'read' / 'flush': (rows, warps) or (rows, warps, regs)} whose entries may be None (the
    table's); regs caps the registers a thread (ptxas's maxnreg; the bench's variants), see
    _max_regs."""
    if which not in LAUNCHES:
        raise ValueError(f"which must be 'flush' or 'read', got {which!r}")
    launch = dict(launch or {})
    bad = set(launch) - set(LAUNCHES) - {"fused"}
    if bad:
        raise ValueError(f"launch takes the keys 'flush' and 'read' -> (rows, warps) and "
                         f"'fused' -> bool, got {sorted(bad)}")
    block_v, num_warps = (launch.get(which) or (None, None))[:2]
    N, HV, dv, dk = store.shape
    rows, per_thread, _, _ = _table(store, which)
    if block_v is None:
        block_v = dv if rows is None else min(dv, rows)
    if which == "flush" and _role(store, which) == "nvfp4" and block_v != dv:
        raise ValueError(f"an NVFP4 role is cast a whole matrix at a time (one FP32 scale per "
                         f"matrix): the flush launch's rows must be d_v = {dv}, got {block_v}")
    if block_v < 16 or dv % block_v or block_v & (block_v - 1):
        raise ValueError(f"{which} launch rows={block_v} must be a power of two >= 16 dividing "
                         f"d_v={dv} (the flush's tensor-core products take tiles of 16 rows or "
                         f"more)")
    if num_warps is None:
        num_warps = max(1, min(8, block_v * dk // (32 * per_thread)))
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"{which} launch warps={num_warps} must be a power of two")
    return block_v, num_warps
