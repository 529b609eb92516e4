"""The launch plans of the format kernels (`kernel`): warps by tile size, and the NVFP4
quantize plan by blocks per matrix, each with its measured reason.

The kernels ask `quant_launch_config`; nobody passes a plan down a call chain. Tests and the
`replayquant bench formats` sweep try others inside `override_quant_launch(kernel, ...)`; every
plan gives the same bits. Plain Python: importing it imports no Triton.
"""

from __future__ import annotations

import contextlib

__all__ = ["nvfp4_plan", "quant_launch_config", "override_quant_launch", "KERNELS",
           "NVFP4_WHOLE_MAX_BLOCKS", "NVFP4_WHOLE_MAX_BLOCKS_SR", "NVFP4_LOOP_MAX_BLOCKS",
           "NVFP4_CHUNK_BLOCKS", "NVFP4_DEQUANT_BLOCKS"]

# Launch plan of nvfp4_quantize by blocks per matrix (bpm). MODE 0 (one program holds its matrix
# in one tile) up to NVFP4_WHOLE_MAX_BLOCKS (nearest) / NVFP4_WHOLE_MAX_BLOCKS_SR (stochastic:
# Philox needs registers); MODE 1 (one program loops over NVFP4_CHUNK_BLOCKS-block tiles twice)
# up to NVFP4_LOOP_MAX_BLOCKS; MODE 2 (amax from torch first, one program per tile) beyond.
# Chosen from an H200 sweep of the modes (128 x 128 matrices: nearest MODE 0 with 8 warps,
# stochastic MODE 1 with 128-block tiles and 4 warps were fastest; `replayquant bench formats`
# times the chosen plan, results/bench/formats.json).
NVFP4_WHOLE_MAX_BLOCKS = 1024
NVFP4_WHOLE_MAX_BLOCKS_SR = 256
NVFP4_LOOP_MAX_BLOCKS = 8192
NVFP4_CHUNK_BLOCKS = 128
# blocks a program of nvfp4_dequantize ('triton NB 128' beside NB 256 in the same benchmark)
NVFP4_DEQUANT_BLOCKS = 128

# What override_quant_launch may give each kernel: nvfp4_quantize's plan (mode, nb: NB of modes
# 1 and 2), warps and fast path (False: the integer rounding path); nvfp4_dequantize's blocks a
# program and warps
KERNELS = {"nvfp4_quantize": ("mode", "nb", "num_warps", "fast"),
           "nvfp4_dequantize": ("nb", "num_warps")}
# The entries override_quant_launch gives for its block, per kernel ({}: the plans by shape)
_given: dict = {}


@contextlib.contextmanager
def override_quant_launch(kernel: str, **cfg):
    """Within the block, `kernel` (a key of KERNELS) launches with the given entries (None: the
    plan's) in place of its plan by shape; the other kernel keeps its own. An inner override
    replaces an outer one for its block; the outer one holds again after it. For tests and the
    benchmark's sweep: every plan gives the same bits."""
    global _given
    if kernel not in KERNELS:
        raise ValueError(f"override_quant_launch: kernel must be one of {list(KERNELS)}, "
                         f"got {kernel!r}")
    bad = set(cfg) - set(KERNELS[kernel])
    if bad:
        raise ValueError(f"override_quant_launch({kernel!r}) takes {', '.join(KERNELS[kernel])}, "
                         f"got {sorted(bad)}")
    outer, _given = _given, {kernel: {k: v for k, v in cfg.items() if v is not None}}
    try:
        yield
    finally:
        _given = outer


def _warps(n_elements: int) -> int:
    return 1 if n_elements <= 256 else 2 if n_elements <= 1024 else 4 if n_elements <= 4096 else 8


def nvfp4_plan(bpm: int, mode: int | None = None, nb: int | None = None,
               stochastic: bool = False):
    """(mode, NB, NCHUNK, EVEN) for matrices of bpm blocks (mode / nb force a plan)."""
    if mode is None:
        whole = NVFP4_WHOLE_MAX_BLOCKS_SR if stochastic else NVFP4_WHOLE_MAX_BLOCKS
        mode = 0 if bpm <= whole else 1 if bpm <= NVFP4_LOOP_MAX_BLOCKS else 2
    if mode == 0:
        NB = 1 << (bpm - 1).bit_length()            # the next power of two >= bpm
    else:
        NB = nb or NVFP4_CHUNK_BLOCKS
    nchunk = -(-bpm // NB)
    return mode, NB, nchunk, bpm % NB == 0


def quant_launch_config(kernel: str, bpm: int, stochastic: bool = False) -> dict:
    """The launch of `kernel` on matrices of bpm NVFP4 blocks: nvfp4_quantize {'plan': (mode,
    NB, NCHUNK, EVEN), 'num_warps', 'fast'}, nvfp4_dequantize {'nb', 'num_warps'}; by shape,
    or as override_quant_launch gives them."""
    given = _given.get(kernel, {})
    if kernel == "nvfp4_quantize":
        plan = nvfp4_plan(bpm, given.get("mode"), given.get("nb"), stochastic)
        return {"plan": plan, "num_warps": given.get("num_warps") or _warps(plan[1] * 16),
                "fast": given.get("fast", True)}
    if kernel == "nvfp4_dequantize":
        nb = given.get("nb") or NVFP4_DEQUANT_BLOCKS
        return {"nb": nb, "num_warps": given.get("num_warps") or _warps(nb * 16)}
    raise ValueError(f"kernel must be one of {list(KERNELS)}, got {kernel!r}")
