"""The launch table of the conventional decode kernel (`kernel._conventional_kernel`, step and
verify): rows BV of a program's [BV, d_k] tile and warps, chosen by shape (never by re-running
an in-place kernel), each choice with its measured reason.

The kernel asks `launch_config`; nobody passes a config down a call chain. Tests and the
benchmark's sweep try other configs inside `override_conventional_launch(block_v=...,
num_warps=...)`. Plain Python: importing it imports no Triton.
"""

from __future__ import annotations

import contextlib

__all__ = ["launch_config", "small_block", "override_conventional_launch"]

# (block_v, num_warps) that override_conventional_launch gives for its block (None: the table's)
_given: tuple = (None, None)


@contextlib.contextmanager
def override_conventional_launch(block_v=None, num_warps=None):
    """Within the block, the conventional kernel launches with tiles of block_v rows on
    num_warps warps (None: the table's choice) instead of the table's. An inner override
    replaces an outer one for its block; the outer one holds again after it. For tests and the
    benchmark's sweep; the values are checked where the kernel asks for them (launch_config)."""
    global _given
    outer, _given = _given, (block_v, num_warps)
    try:
        yield
    finally:
        _given = outer


def small_block(n_matrices: int, dv: int) -> tuple[int, int]:
    """(rows, warps) of a decode program below 1024 state matrices, where a step is latency-bound:
    one warp on 16 rows while that still gives 2048 programs, else on 8 rows. H200, us per step,
    conventional FP32 / s32_rs forced flush, blocks (8, 1) (16, 1) (16, 2): GDN B = 1 3.05 3.71
    4.04 / 3.46 3.66 3.83; GDN B = 8
    10.80 10.26 10.78 / 10.72 10.34 12.05; Mamba-2 B = 1 4.39 4.61 4.66 / 4.83 5.03 5.05."""
    return min(dv, 16 if n_matrices * (dv // 16) >= 2048 else 8), 1


def launch_config(fmt_written: str, n_programs_heads: int, dv: int, dk: int):
    """(BV, num_warps) chosen from the shape, or as override_conventional_launch gives them.
    A written NVFP4 matrix needs the whole matrix in one program (one FP32 scale per matrix)."""
    block_v, num_warps = _given
    if block_v is None:
        if fmt_written == "nvfp4":
            block_v = dv
        elif n_programs_heads >= 1024:
            block_v = min(dv, max(16, 4096 // dk))
        else:
            block_v, small_warps = small_block(n_programs_heads, dv)
            num_warps = small_warps if num_warps is None else num_warps
    if fmt_written == "nvfp4" and block_v != dv:
        raise ValueError("an NVFP4 state is written a whole matrix at a time: block_v must be d_v")
    if dv % block_v or block_v & (block_v - 1):
        raise ValueError(f"block_v={block_v} must be a power of two dividing d_v={dv}")
    if num_warps is None:
        num_warps = max(1, min(8, block_v * dk // 1024))
    return block_v, num_warps
