"""Every constant of every storage format, in one place.

A *grid* is a sign-magnitude minifloat: `mbits` mantissa bits, smallest normal exponent
`emin`, and the code of its largest finite magnitude. Codes are the format's own bit patterns
without the sign bit, so code = ((e - emin) << mbits) + q, where q in [0, 2^(mbits+1)) is the
significand in units of the grid step at exponent e (subnormals have e = emin, q < 2^mbits).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Grid:
    name: str
    mbits: int          # stored mantissa bits
    emin: int           # exponent of the smallest normal value
    max_code: int       # code of the largest finite magnitude
    max_value: float    # value of max_code
    ieee_overflow: bool  # True: past max rounds to inf (IEEE casts); False: saturate at max
    inf_code: int = -1  # code of +inf where ieee_overflow
    sign_shift: int = 0  # position of the sign bit in the stored element


FP16 = Grid("fp16", mbits=10, emin=-14, max_code=0x7BFF, max_value=65504.0,
            ieee_overflow=True, inf_code=0x7C00, sign_shift=15)
BF16 = Grid("bf16", mbits=7, emin=-126, max_code=0x7F7F, max_value=3.3895313892515355e38,
            ieee_overflow=True, inf_code=0x7F80, sign_shift=15)
E4M3 = Grid("e4m3", mbits=3, emin=-6, max_code=0x7E, max_value=448.0,
            ieee_overflow=False, sign_shift=7)
E2M1 = Grid("e2m1", mbits=1, emin=0, max_code=0x7, max_value=6.0,
            ieee_overflow=False, sign_shift=3)

E4M3_MAX = E4M3.max_value
E2M1_MAX = E2M1.max_value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

NVFP4_BLOCK = 16                       # contiguous elements of the last dim per E4M3 block scale
NVFP4_GLOBAL_DIVISOR = E4M3_MAX * E2M1_MAX   # per-matrix FP32 scale = amax / 2688
# Lower clamp of the E4M3 block scale (as a multiple of the per-matrix scale): 2^-9, the smallest
# positive E4M3 value (ModelOpt's choice). torchao clamps at 2^-6 (smallest normal), TE not at all.
# SSM states span many decades inside one matrix: with the per-matrix scale set by the largest
# block, a block 1e-4 times smaller needs a block scale near 2^-9 * 6 / 6; clamping at 2^-6 would
# round all of its elements to zero (or to the smallest E2M1 step) 8x earlier. Below 2^-9 a block is
# at least ~4.4e-6 of the matrix amax and is stored as zeros or the smallest levels.
NVFP4_BLOCK_SCALE_MIN = 2.0 ** -9
# A global scale carried from the previous flush (formats.casts.nvfp4_carried_scale_ref): the
# least power of two gs with 2688 gs >= 2^K amax_prev. K = 1: on drift's inputs no matrix of
# 2976 a kind grew past it between flushes of L = 16, at the own scale's error (docs/kernels.md)
NVFP4_CARRIED_HEADROOM = 1

FP8_ROW_DIVISOR = E4M3_MAX              # per-row FP32 scale = amax / 448

ROUNDINGS = ("nearest", "stochastic")

# Philox4x32-10 constants (as in Salmon et al. 2011 and triton.language.random)
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
