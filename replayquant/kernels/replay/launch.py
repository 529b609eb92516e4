"""The launch tables of the replay kernels: tile rows, warps and register caps of the decode
kernel's (`decode._replay_kernel`) flush and read launches and the one-pass verify's read launch
(`verify_onepass._onepass_kernel`), chosen by shape, each row with its measured reason.

The kernels ask `replay_launch_config` / `onepass_launch_config`; nobody
passes a config down a call chain. Tests and the benchmark's sweep try other configs inside
`override_replay_launch(launch)`. Plain Python: the torch references read the flush launch's
tile rows (a flush tile whose state or cast is not finite keeps its bytes, as the kernel's)
without importing Triton.
"""

from __future__ import annotations

import contextlib

from replayquant.replay.stores import ReplayStore

__all__ = ["LAUNCH_TABLE", "LAUNCHES", "ONEPASS_TABLE", "FUSED_TABLE", "fused_where",
           "replay_launch_config", "onepass_launch_config", "onepass_preflush",
           "override_replay_launch", "chosen_design", "programs_per_sm", "waves"]


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

# The one-pass launch, chosen by the roles' format ('nvfp4': either role NVFP4): rows BV of a
# program's tile, warps, columns a chunk, chunks' loads in flight, where a row's pre-flush runs
# ('inside': the row's programs fold their own tiles first, verify_onepass._inside; 'launch':
# decode's flush launch first), register cap. Reasons: tile and chunk, compile_check sass on
# sm_90 (Triton 3.9), Qwen3.5-4B GDN layer, T = 4, SASS a warp with the chunk loop's body
# counted d_k / chunk times, 64 rows (s32_rs / tp8_hi32 / tp4_hi32): 2 x 4135 / 4073 / 4417 at
# 128-137 registers; 32 rows on 1 warp: 2 x 4682 / 4398 / 4777; 64 on 1 warp: 6737 / 5820 /
# 6392 at 231-255. Pre-flush and cap: rounds of T = 4 at B = 512 on one H100, us, inside at 128
# registers / flush launch first (results/bench/fused_read_h100.json).
ONEPASS_TABLE = (   # role, rows, warps, chunk, stages, pre-flush, regs  # reason
    ("nvfp4", 64, 2, 32, 3, "launch", None),   # an NVFP4 role is cast a whole matrix at a time
    ("*", 64, 2, 32, 3, "inside", 128),   # GDN s32_rs 629.9 / 643.6, tp8_hi32 733.3 / 752.6
)   # Mamba-2 1177.6 / 1439.7, 1181.3 / 1193.9; inside uncapped (GDN 168 registers): GDN tp8 1057.2

# Where a decode step on the GPU flushes when the flush's tiles exceed one wave (below it, one
# launch on them: decode._fused), by kind and the flush launch's role: 'read', inside the read
# launch's programs; '', a flush launch before the read launch. Reasons: windows with rows
# staggered on one H100, us, inside / flush launch (results/bench/fused_read_h100.json; in
# phase within 0.3%); KDA's flush inside the read was not timed.
FUSED_TABLE = (   # kind, flush role, where  # reason
    ("gdn", "fp32 shared", "read"),      # s32_rs B = 32 42.5 / 48.8, B = 256 239.2 / 244.1
    ("mamba2", "fp32 shared", "read"),   # s32_rs B = 32 65.3 / 70.7, B = 256 434.3 / 440.8
    ("*", "*", ""),      # tp8_hi32 GDN B = 32 85.8 / 48.3, B = 256 244.7 / 207.7; Mamba-2
)                        # 0.75-0.84x

# An H100 / H200 SM (sm_90): 65536 registers in 4 sub-partitions (a warp's registers on one, in
# units of 256), 64 warps, 32 programs, 228 KiB of shared memory (1 KiB of it reserved a program)
SM90 = dict(sms=132, regs=65536, parts=4, warps=64, programs=32, smem=233472, smem_reserved=1024)


def programs_per_sm(warps: int, regs: int, smem: int = 0, sm: dict = SM90) -> int:
    """The programs of `warps` warps at `regs` registers a thread (ptxas's count) and `smem` bytes
    of shared memory that one SM holds at once: the least of its register, warp, program and
    shared-memory limits (CUDA's occupancy rule for sm_90)."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = (sm["regs"] // sm["parts"] // per_warp) * sm["parts"] // warps
    by_smem = sm["smem"] // (smem + sm["smem_reserved"]) if smem else sm["programs"]
    return min(by_regs, sm["warps"] // warps, sm["programs"], by_smem)


def waves(programs: int, warps: int, regs: int, smem: int = 0, sm: dict = SM90) -> float:
    """The waves of a launch of `programs` programs: programs over what all SMs hold at once
    (programs_per_sm); evals/replay_waves.py gives every launch's at the bench's batches."""
    return programs / (sm["sms"] * programs_per_sm(warps, regs, smem, sm))


# The launch that override_replay_launch gives for the length of its block ({}: the tables')
_given: dict = {}


@contextlib.contextmanager
def override_replay_launch(launch):
    """Within the block, the replay kernels launch as `launch` says instead of the tables: a
    mapping {'read' / 'flush': (rows, warps) or (rows, warps, regs), 'fused': True / 'read' /
    False} whose entries may be None (the table's). 'read' gives the one-pass verify's read
    launch too ('fused' 'read': its pre-flushes inside it); regs caps the registers a thread
    (ptxas's maxnreg, _max_regs);
    'fused' runs a decode step as one launch on the flush's tiles (True) or on the read's, the
    flush inside the read program ('read'), or as two launches (False; decode._fused). An inner
    override replaces an outer one for its block; the outer one holds again after it. For tests
    and the benchmark's sweep; the values are checked where a kernel asks for them."""
    global _given
    launch = dict(launch or {})
    bad = set(launch) - set(LAUNCHES) - {"fused"}
    if bad:
        raise ValueError(f"launch takes the keys 'flush' and 'read' -> (rows, warps) and 'fused' "
                         f"-> True / 'read' / False, got {sorted(bad)}")
    outer, _given = _given, launch
    try:
        yield
    finally:
        _given = outer


def given_launch() -> dict:
    """The launch of the innermost override_replay_launch block ({} outside any)."""
    return _given


def _role(store: ReplayStore, which: str) -> str:
    """The role of `which` launch that LAUNCH_TABLE's rows match."""
    if which == "read":
        return store.read_role.fmt
    if "nvfp4" in (store.anchor.fmt, store.read_role.fmt) and store.carried is None:
        return "nvfp4"              # (a carried scale: an NVFP4 read copy cast in any tile)
    return "fp32 shared" if store.shared and store.anchor.fmt == "fp32" else "*"


def _table(store: ReplayStore, which: str):
    """LAUNCH_TABLE's first row for this store's launch `which`: (rows, per_thread, regs,
    chunk)."""
    role = _role(store, which)
    for launch, kind, r, *cfg in LAUNCH_TABLE:
        if launch == which and kind in ("*", store.kind) and r in ("*", role):
            return cfg
    raise AssertionError("LAUNCH_TABLE ends with a catch-all row for each launch")


def _max_regs(store: ReplayStore, which: str, T: int = 1):
    """The register cap of a launch given (override_replay_launch) as (rows, warps, regs); of a
    launch not given, LAUNCH_TABLE's, except for a verify's read (T > 1, whose drafts' entries
    stay live across the read copy's pass: the caps spill, docs/kernels.md); else None (ptxas's
    choice)."""
    c = _given.get(which) or ()
    if len(c) > 2 and c[2] is not None and not 16 <= int(c[2]) <= 255:
        raise ValueError(f"{which} launch regs={c[2]} must lie in 16..255")
    if len(c) > 2 and c[2] is not None:
        return int(c[2])
    if any(x is not None for x in c) or (which == "read" and T > 1):
        return None
    return _table(store, which)[2]


def replay_launch_config(store: ReplayStore, which: str = "read"):
    """(BV, num_warps) of the flush or the read launch (`which`) of _replay_kernel for this
    store: tile rows and warps, from LAUNCH_TABLE, or as override_replay_launch gives them
    (rows / warps None: the table's)."""
    if which not in LAUNCHES:
        raise ValueError(f"which must be 'flush' or 'read', got {which!r}")
    block_v, num_warps = (_given.get(which) or (None, None))[:2]
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


def _onepass_row(store: ReplayStore) -> tuple:
    role = "nvfp4" if "nvfp4" in (store.anchor.fmt, store.read_role.fmt) else store.read_role.fmt
    return next(r[1:] for r in ONEPASS_TABLE if r[0] in ("*", role))


def onepass_preflush(store: ReplayStore) -> tuple:
    """(whether a row's programs run its pre-flush themselves, register cap) of the one-pass
    launch by ONEPASS_TABLE, where override_replay_launch gives neither."""
    row = _onepass_row(store)
    return row[4] == "inside", row[5]


def fused_where(store: ReplayStore) -> str:
    """FUSED_TABLE's choice for the store's flush role: 'read' or ''."""
    role = _role(store, "flush")
    return next(w for k, r, w in FUSED_TABLE if k in ("*", store.kind) and r in ("*", role))


def onepass_launch_config(store: ReplayStore):
    """(BV, num_warps, CK, stages) of the one-pass read launch: ONEPASS_TABLE's row for the
    store's roles, rows and warps as override_replay_launch's 'read' gives them (None: the
    table's)."""
    rows, warps, ck, stages = _onepass_row(store)[:4]
    N, HV, dv, dk = store.shape
    given = _given.get("read") or (None, None)
    rows = min(dv, rows) if given[0] is None else int(given[0])
    warps = warps if given[1] is None else int(given[1])
    if rows < 16 or dv % rows or rows & (rows - 1):
        raise ValueError(f"read launch rows={rows} must be a power of two >= 16 dividing "
                         f"d_v={dv}")
    if warps < 1 or warps & (warps - 1):
        raise ValueError(f"read launch warps={warps} must be a power of two")
    return rows, warps, min(ck, dk), stages


def chosen_design(design, designs: tuple) -> str:
    """`design` when it is one of `designs` (a replay kernel's design switch: the first is the
    default), else one ValueError naming them."""
    if design not in designs:
        raise ValueError(f"design must be one of {', '.join(map(repr, designs))}, "
                         f"got {design!r}")
    return design
