"""The launch parameters of the chunked scan (`kernel`): row and column blocks and warps of
its four launches, the NVFP4 chain's form and the windows a launch group takes, chosen by shape,
each with its measured reason.

The kernel asks `chunk_launch_config` and `group_windows`; nobody passes a config down a call
chain. Tests and sweeps try others inside `override_chunk_launch(...)`. Plain Python: importing
it imports no Triton.
"""

from __future__ import annotations

import contextlib

import torch

from replayquant import options

__all__ = ["chunk_launch_config", "group_windows", "nvfp4_chain_programs", "device_sms",
           "override_chunk_launch", "SCRATCH_BYTES", "MAX_GROUP_WINDOWS", "NVFP4_CHAIN_BLOCK",
           "CHOICES"]

SCRATCH_BYTES = 1 << 30          # group scratch bound per call (bytes)
MAX_GROUP_WINDOWS = 512          # windows per launch group at most

# An NVFP4 anchor's chain (one scale per matrix, from the matrix amax) runs one of two ways:
# split: the rows of a matrix on NP programs, one row block each in registers, exchanging their
# amax every window (_matrix_amax); they must all be resident at once, so the split is taken
# only where (sequences x heads) x NP programs fit one per SM (NP >= 2, rows >= 16 per program);
# two-pass: one program per matrix, row blocks of NVFP4_CHAIN_BLOCK[0] rows on
# NVFP4_CHAIN_BLOCK[1] warps, an amax pass then a cast pass through the FP32 scratch (the
# GPU is full of matrices then). H200, Qwen3.5-4B layer at 8K tokens, two-pass: (64, 8)
# 23.1 ms per call, (32, 8) 24.4, (64, 16) 23.7.
# The option nvfp4_chain_split (REPLAYQUANT_NVFP4_CHAIN_SPLIT, replayquant.options): unset
# chooses by shape (CUDA; the interpreter runs programs one after another, so there it is
# two-pass), 0 forces two-pass, NP >= 1 forces the split on NP programs (tests: NP = 1 in the
# interpreter); 0 suits a GPU shared with other work, where the split's programs may not all be
# resident together.
NVFP4_CHAIN_BLOCK = (64, 8)

# What chunk_launch_config returns besides buffer_tile (the window's slots, not a choice)
CHOICES = ("chain_rows", "chain_bv", "chain_split", "chain_warps", "terms_bv", "terms_warps",
           "cast_bv", "cast_warps", "out_bv", "out_warps")
# The entries override_chunk_launch gives for its block ({}: the choices by shape)
_given: dict = {}


@contextlib.contextmanager
def override_chunk_launch(**entries):
    """Within the block, chunk_launch_config returns the given entries (any of CHOICES) in
    place of its choices by shape, and group_windows takes at most `max_group_windows` windows
    a launch group. An inner override replaces an outer one for its block; the outer one holds
    again after it. For tests and sweeps: the kernel asserts what its launches cannot take (a
    split chain needs an NVFP4 anchor; several chain row blocks a two-pass one)."""
    global _given
    bad = set(entries) - set(CHOICES) - {"max_group_windows"}
    if bad:
        raise ValueError(f"override_chunk_launch takes {', '.join(CHOICES)} and "
                         f"max_group_windows, got {sorted(bad)}")
    outer, _given = _given, dict(entries)
    try:
        yield
    finally:
        _given = outer


def _next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length()


def device_sms(dev) -> int | None:
    """The SM count of CUDA device `dev` (what the split NVFP4 chain is sized by), None
    elsewhere (the interpreter)."""
    dev = torch.device(dev)
    return torch.cuda.get_device_properties(dev).multi_processor_count \
        if dev.type == "cuda" else None


def nvfp4_chain_programs(BH: int, d_v: int, sms: int | None) -> int:
    """Programs per matrix of a split NVFP4 chain (0: two-pass), from the option
    nvfp4_chain_split or the shape: the most (a power of two, each with >= 16 rows) with
    BH * NP <= sms."""
    forced = options.get().nvfp4_chain_split
    if forced is not None:
        return forced
    if not sms:
        return 0
    np_ = 1
    while np_ * 2 * 16 <= d_v and BH * np_ * 2 <= sms:
        np_ *= 2
    return np_ if np_ >= 2 else 0


def chunk_launch_config(pair, B: int, H: int, d_v: int, d_k: int, buffer_len: int,
                        sms: int | None = None) -> dict:
    """Launch parameters from the shape (sms: the device's SM count, None in the interpreter).

    buffer_tile: window slots (L rounded up to a power of two >= 16, for tl.dot).
    chain_rows, chain_bv, chain_warps: the sequential pass gives each program chain_rows rows of
    a matrix, chain_bv at a time; chain_split: NP of a split NVFP4 chain (0: none). Anchors
    other than NVFP4 split the rows over programs (one program per row block keeps every
    program's chain short); an NVFP4 anchor too where its programs fit (nvfp4_chain_programs),
    else one program holds a matrix, cast in row blocks.
    terms_bv, cast_bv, out_bv (and warps): column / row blocks of the parallel passes, small
    enough that no program holds a whole matrix. override_chunk_launch replaces any of these
    but buffer_tile for its block."""
    buffer_tile = max(16, _next_power_of_2(buffer_len))
    bv = min(d_v, 16 if B * H * d_v // 32 < 264 else 32)
    warps, split = None, 0
    if pair.anchor.format == "nvfp4":
        split = nvfp4_chain_programs(B * H, d_v, sms)
        if split:
            if d_v % split or d_v // split < 16:
                raise ValueError(f"REPLAYQUANT_NVFP4_CHAIN_SPLIT={split} does not split "
                                 f"d_v = {d_v} into row blocks of >= 16 rows")
            rows = bv = d_v // split
            warps = 8 if bv >= 32 else 4
        else:
            rows, bv = d_v, min(d_v, NVFP4_CHAIN_BLOCK[0])
            warps = NVFP4_CHAIN_BLOCK[1]
    else:
        rows = bv
    cfg = {"buffer_tile": buffer_tile, "chain_rows": rows, "chain_bv": bv, "chain_split": split,
           "chain_warps": warps or (8 if rows // bv >= 4 else 4),
           "terms_bv": min(d_v, 32), "terms_warps": 8,
           "cast_bv": min(d_v, 32), "cast_warps": 4,
           "out_bv": min(d_v, 32), "out_warps": 4}
    cfg.update((k, v) for k, v in _given.items() if k in CHOICES)
    return cfg


def group_windows(BH: int, d_k: int, d_v: int, buffer_tile: int, delta: bool, sr_bits: bool = False,
                  vector_gate: bool = False) -> int:
    """Windows per launch group: at most MAX_GROUP_WINDOWS (override_chunk_launch's
    max_group_windows in its block) and SCRATCH_BYTES of scratch (each window and matrix holds
    K, P (, W), q_L, U, C, G (vector gates: G_L [d_k]), one FP32 checkpoint and, with sr_bits,
    the flush's SR bits), at least one."""
    per = 4 * (buffer_tile * d_k * (3 if delta else 2) + d_k + 2 * buffer_tile * d_v
               + (d_k if vector_gate else buffer_tile) + d_v * d_k * (2 if sr_bits else 1))
    most = _given.get("max_group_windows", MAX_GROUP_WINDOWS)
    return max(1, min(most, SCRATCH_BYTES // (BH * per)))
