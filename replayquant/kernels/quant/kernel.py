"""Triton kernels of every format's quantize / dequantize, bit for bit equal to `formats/casts.py`.

Device functions other kernels import (the replay decode kernels call them):

    philox4(seed_lo, seed_hi, c0, c1, c2)         Philox4x32-10's four words, counter
                                                  (c0, c1, c2, 0)
    philox_bits(seed_lo, seed_hi, elem, s_lo, s_hi)        SR bits of elements (any shape)
    philox_bits_rows(seed_lo, seed_hi, elem, s_lo, s_hi)   the same for a tile [R, C] whose rows
                                                  are runs of elements from a multiple of 4:
                                                  one Philox per 4 elements
    round_to_grid(y, rbits, MBITS, EMIN, MAX_CODE, MAX_VALUE, IEEE, INF_CODE, STOCHASTIC)
                                                  -> (code int32, sign int32) = round_to_grid_ref
    encode_fp16 / encode_bf16 / encode_e4m3 / encode_e2m1 (y, rbits, STOCHASTIC) -> int32 bits
    decode_fp16 / decode_bf16 / decode_e4m3 / decode_e2m1 (bits) -> float32 (= grid_value_ref)

`round_to_grid` works on integers only: for the float32 magnitude a = S * 2^(max(E,1) - 150)
(S the 24-bit significand, E the biased exponent) and e = max(E - 127, EMIN), the scaled value
t = a * 2^(MBITS - e) of the reference is S / 2^sh with sh = 150 - MBITS + e - max(E, 1) >= 13,
so floor(t) = S >> sh and the remainder rem = (S mod 2^sh) / 2^sh are exact shifts. Stochastic
rounding rounds up iff u < rem with u = (r >> 8) * 2^-24, i.e. iff (r >> 8) < ceil(rem * 2^24).
No float rounding, subnormal arithmetic or flush-to-zero setting enters, so the interpreter and
a GPU give the reference's bits. IEEE grids (fp16, bf16) overflow to inf exactly where the
nearest-even code passes MAX_CODE (= from max + half a step on, the reference's threshold, since
their max codes have odd mantissas); otherwise they and the scaled grids saturate at MAX_CODE.
Divisions use `tl.div_rn` (IEEE correctly rounded, as torch on the CPU).

Host functions (called by `replayquant.formats`): `cast_quantize`, `fp8_quantize`,
`fp8_dequantize`, `nvfp4_quantize`, `nvfp4_dequantize`. Stochastic rounding bits of element e
(its index in its matrix) are word e % 4 of `philox4(seed, counter = (e // 4, stream_lo,
stream_hi))`, exactly as `replayquant.formats.philox.random_bits_ref`. Launch settings are
chosen from the shape (`launch`: the NVFP4 plan, warps by tile size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayquant.formats.constants import (BF16, E2M1, E4M3, FP8_ROW_DIVISOR, FP16, NVFP4_BLOCK,
                                           NVFP4_BLOCK_SCALE_MIN, NVFP4_GLOBAL_DIVISOR,
                                           PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1, Grid)
from replayquant.kernels.quant.launch import _warps, quant_launch_config

__all__ = [
    "philox4", "philox_bits", "philox_bits_rows", "round_to_grid",
    "encode_fp16", "encode_bf16", "encode_e4m3", "encode_e2m1",
    "decode_fp16", "decode_bf16", "decode_e4m3", "decode_e2m1",
    "cast_quantize", "fp8_quantize", "fp8_dequantize", "nvfp4_quantize", "nvfp4_dequantize",
]

_M0: tl.constexpr = tl.constexpr(PHILOX_M0)
_M1: tl.constexpr = tl.constexpr(PHILOX_M1)
_W0: tl.constexpr = tl.constexpr(PHILOX_W0)
_W1: tl.constexpr = tl.constexpr(PHILOX_W1)
_E2M1_MAX: tl.constexpr = tl.constexpr(E2M1.max_value)
_E4M3_MAX: tl.constexpr = tl.constexpr(E4M3.max_value)
_GLOBAL_DIV: tl.constexpr = tl.constexpr(NVFP4_GLOBAL_DIVISOR)
_FP8_DIV: tl.constexpr = tl.constexpr(FP8_ROW_DIVISOR)
_BS_MIN: tl.constexpr = tl.constexpr(NVFP4_BLOCK_SCALE_MIN)


# ============================================================================ device functions

@triton.jit
def philox4(seed_lo, seed_hi, c0, c1, c2):
    """Philox4x32-10 with key (seed_lo, seed_hi) and counter (c0, c1, c2, 0); returns its four
    words as uint32 (equal to `philox_ref(c0, c1, c2, 0, seed_lo, seed_hi)`).

    Every argument must be a tensor (integer type); c1, c2 may be scalars or broadcast to c0.
    Kernels taking seeds or streams as scalar arguments mark them
    `@triton.jit(do_not_specialize=[...])`: Triton turns an integer argument equal to 1 into a
    constexpr, which has no `.to`."""
    k0 = seed_lo.to(tl.uint32)
    k1 = seed_hi.to(tl.uint32)
    x0 = c0.to(tl.uint32)
    x1 = c1.to(tl.uint32) + (x0 ^ x0)      # broadcast every word to c0's shape
    x2 = c2.to(tl.uint32) + (x0 ^ x0)
    x3 = x0 ^ x0
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(x0, _M0)
        hi2 = tl.umulhi(x2, _M1)
        lo0 = x0 * _M0
        lo2 = x2 * _M1
        x0 = hi2 ^ x1 ^ k0
        x1 = lo2
        x2 = hi0 ^ x3 ^ k1
        x3 = lo0
        k0 = k0 + _W0
        k1 = k1 + _W1
    return x0, x1, x2, x3


@triton.jit
def philox_bits(seed_lo, seed_hi, elem, s_lo, s_hi):
    """Stochastic-rounding bits (uint32) of elements with indices `elem` in their matrix (any
    shape; s_lo / s_hi broadcast to it): word elem % 4 of Philox counter (elem // 4, s_lo, s_hi,
    0). One Philox evaluation per element: philox_bits_rows shares one between four."""
    e = elem.to(tl.uint32)
    x0, x1, x2, x3 = philox4(seed_lo, seed_hi, e >> 2, s_lo, s_hi)
    w = e & 3
    return tl.where(w == 0, x0, tl.where(w == 1, x1, tl.where(w == 2, x2, x3)))


@triton.jit
def philox_bits_rows(seed_lo, seed_hi, elem, s_lo, s_hi):
    """philox_bits of a tile elem [R, C] whose rows each hold consecutive element indices from
    a multiple of 4 (C a multiple of 4; s_lo / s_hi scalars or [R, 1]): one Philox evaluation
    per group of four, its words interleaved back along the row."""
    R: tl.constexpr = elem.shape[0]
    C: tl.constexpr = elem.shape[1]
    # each group's counter as the min of its four indices (an in-thread reduction). Taking
    # elem[:, 4j] by two tl.split instead cuts static SASS on Triton 3.9 but, on the H200's
    # Triton 3.6, raises the Mamba-2 tp4_hi16_sr flush program (NH = 8) from 128 to 196
    # registers: flush step at B = 256 2345.4 us against 1731.5 with the min.
    g = tl.min(tl.reshape(elem, (R, C // 4, 4)), axis=2).to(tl.uint32) >> 2
    x0, x1, x2, x3 = philox4(seed_lo, seed_hi, g, s_lo, s_hi)
    # join(join(x0, x2), join(x1, x3)) is [R, C // 4, 2, 2] with word 2a + b at (a, b)
    return tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), (R, C))


@triton.jit
def _round_nearest_saturating(y, MBITS: tl.constexpr, EMIN: tl.constexpr, MAX_CODE: tl.constexpr):
    """Nearest-even rounding to a saturating grid with MBITS - EMIN <= 126 (E4M3, E2M1), in
    fewer integer operations: t = a * 2^(MBITS - e) is exact (a power-of-two scale of a normal
    float, or tiny enough to give q = 0 under any denormal mode), and t + 2^23 rounds t to the
    nearest even integer in float32 arithmetic, leaving it in the mantissa field."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits < 0).to(tl.int32)
    mag = bits & 0x7FFFFFFF
    e = tl.maximum((mag >> 23) - 127, EMIN)
    t = mag.to(tl.float32, bitcast=True) * ((MBITS + 127 - e) << 23).to(tl.float32, bitcast=True)
    q = (t + 8388608.0).to(tl.int32, bitcast=True) & 0x7FFFFF
    code = tl.minimum(((e - EMIN) << MBITS) + q, MAX_CODE)
    return code, sign


@triton.jit
def _round_integer(y, rbits, MBITS: tl.constexpr, EMIN: tl.constexpr, MAX_CODE: tl.constexpr,
                   IEEE: tl.constexpr, INF_CODE: tl.constexpr, STOCHASTIC: tl.constexpr):
    """The general path of round_to_grid: integer shifts only (module docstring)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits < 0).to(tl.int32)
    mag = bits & 0x7FFFFFFF
    E = mag >> 23
    S = mag & 0x7FFFFF
    S = tl.where(E > 0, S | 0x800000, S)
    e = tl.maximum(E - 127, EMIN)
    sh = (150 - MBITS) + e - tl.maximum(E, 1)          # >= 23 - MBITS
    shc = tl.minimum(sh, 25)
    fl = S >> shc
    R = S - (fl << shc)
    half = (sh * 0 + 1) << (shc - 1)
    up_n = (R > half) | ((R == half) & ((fl & 1) == 1))
    if STOCHASTIC:
        k = (rbits.to(tl.uint32) >> 8).to(tl.int32)
        d = tl.minimum(tl.maximum(sh - 24, 0), 25)
        t_small = R << tl.maximum(24 - sh, 0)            # rem * 2^24, exact for sh <= 24
        t_large = (S + ((sh * 0 + 1) << d) - 1) >> d     # ceil(rem * 2^24) for sh > 24
        up = k < tl.where(sh <= 24, t_small, t_large)
    else:
        up = up_n
    base = ((e - EMIN) << MBITS) + fl
    code = base + up.to(tl.int32)
    if IEEE:
        over = tl.where(base + up_n.to(tl.int32) > MAX_CODE, INF_CODE, MAX_CODE)
    else:
        over = code * 0 + MAX_CODE
    code = tl.where(code > MAX_CODE, over, code)
    return code, sign


@triton.jit
def round_to_grid(y, rbits, MBITS: tl.constexpr, EMIN: tl.constexpr, MAX_CODE: tl.constexpr,
                  MAX_VALUE: tl.constexpr, IEEE: tl.constexpr, INF_CODE: tl.constexpr,
                  STOCHASTIC: tl.constexpr, FAST: tl.constexpr = True):
    """Round float32 y to a sign-magnitude grid; (code int32, sign int32) as round_to_grid_ref.

    rbits: uint32 random bits (ignored unless STOCHASTIC). MAX_VALUE documents the grid; the
    overflow rule is decided in code space (see the module docstring). FAST (default) takes the
    shorter float path for nearest rounding on saturating grids (same bits; False: integer path)."""
    if FAST and (not STOCHASTIC) and (not IEEE) and (MBITS - EMIN <= 126):
        code, sign = _round_nearest_saturating(y, MBITS, EMIN, MAX_CODE)
    else:
        code, sign = _round_integer(y, rbits, MBITS, EMIN, MAX_CODE, IEEE, INF_CODE, STOCHASTIC)
    return code, sign


@triton.jit
def encode_fp16(y, rbits, STOCHASTIC: tl.constexpr):
    """float32 -> IEEE binary16 bit pattern (int32 holding 16 bits), IEEE overflow to inf."""
    code, sign = round_to_grid(y, rbits, 10, -14, 0x7BFF, 65504.0, True, 0x7C00, STOCHASTIC)
    return code | (sign << 15)


@triton.jit
def encode_bf16(y, rbits, STOCHASTIC: tl.constexpr):
    """float32 -> bfloat16 bit pattern (int32 holding 16 bits), IEEE overflow to inf."""
    code, sign = round_to_grid(y, rbits, 7, -126, 0x7F7F, 3.3895313892515355e38, True, 0x7F80,
                               STOCHASTIC)
    return code | (sign << 15)


@triton.jit
def encode_e4m3(y, rbits, STOCHASTIC: tl.constexpr, FAST: tl.constexpr = True):
    """float32 -> E4M3FN bit pattern (int32 holding 8 bits), saturating at 448."""
    code, sign = round_to_grid(y, rbits, 3, -6, 0x7E, 448.0, False, -1, STOCHASTIC, FAST)
    return code | (sign << 7)


@triton.jit
def encode_e2m1(y, rbits, STOCHASTIC: tl.constexpr, FAST: tl.constexpr = True):
    """float32 -> E2M1 nibble (int32 holding 4 bits), saturating at 6."""
    code, sign = round_to_grid(y, rbits, 1, 0, 0x7, 6.0, False, -1, STOCHASTIC, FAST)
    return code | (sign << 3)


@triton.jit
def decode_fp16(bits):
    """binary16 bit pattern (any int type, low 16 bits) -> float32 (exact)."""
    b = bits.to(tl.int32) & 0xFFFF
    return b.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def decode_bf16(bits):
    """bfloat16 bit pattern (low 16 bits) -> float32 (exact: the high half of a float32)."""
    return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _decode_small_float(bits, EBITS: tl.constexpr, MBITS: tl.constexpr):
    """Sign-magnitude code of a small float format (1 + EBITS + MBITS <= 8 bits, exponent bias
    2^(EBITS - 1) - 1, subnormals, no inf) -> float32, without a select: exponent and mantissa
    placed so the mantissa's top bit is float16 bit 9, the sign at bit 15, read as a float16
    that is the value times 2^(bias - 15) (subnormals to subnormals; the float16 -> float32
    conversion is exact, so no flush-to-zero setting can change it), then one exact multiply by
    2^(15 - bias). Fewer instructions than a general grid decode, which matters in the NVFP4 /
    FP8 read kernels (they are instruction bound)."""
    SCALE: tl.constexpr = 2.0 ** (16 - 2 ** (EBITS - 1))
    return small_float_at(bits.to(tl.int32), 0, EBITS, MBITS) * SCALE


@triton.jit
def small_float_at(words, SHIFT: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr):
    """The small-float code at bits SHIFT.. of int32 `words` (several codes packed per word), as
    float32 times 2^(bias - 15): _decode_small_float without its final multiply, which a
    caller that decodes many codes folds into its scales."""
    NB: tl.constexpr = EBITS + MBITS
    c = words >> SHIFT
    h = ((c & ((1 << NB) - 1)) << (10 - MBITS)) | ((c & (1 << NB)) << (15 - NB))
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def small_float_pair_at(words, SHIFT: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr):
    """The two small-float codes at bits SHIFT.. and SHIFT + 16.. of int32 `words`, as
    small_float_at gives each: both placed as float16 bit patterns in the two halves of one
    int32 by the same shifts and masks (two codes per integer operation), then each half read as
    a float16 and converted. The same values as two small_float_at calls, bit for bit."""
    NB: tl.constexpr = EBITS + MBITS
    MS: tl.constexpr = 10 - MBITS - SHIFT              # shift of the magnitude bits
    SS: tl.constexpr = 15 - NB - SHIFT                 # shift of the sign bit
    MMASK: tl.constexpr = (((1 << NB) - 1) << (10 - MBITS)) * 0x10001
    if MS >= 0:
        m = words << MS
    else:
        m = words >> (-MS)
    if SS >= 0:
        sg = words << SS
    else:
        sg = words >> (-SS)
    h = (m & MMASK) | (sg & -0x7FFF8000)                # 0x80008000: both halves' sign bits
    lo = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (h >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def decode_e4m3(bits):
    """E4M3FN bit pattern (low 8 bits; 0x7F/0xFF NaN codes are never produced) -> float32."""
    return _decode_small_float(bits, 4, 3)


@triton.jit
def decode_e2m1(bits):
    """E2M1 nibble (low 4 bits) -> float32."""
    return _decode_small_float(bits, 2, 1)


@triton.jit
def _stream_of(stream_ptr, stream_base, m, HAS_STREAMS: tl.constexpr):
    """(lo, hi) uint32 words of matrix m's stream: stream_ptr[m] or stream_base + m (int64)."""
    if HAS_STREAMS:
        s = tl.load(stream_ptr + m).to(tl.int64)
    else:
        s = stream_base.to(tl.int64) + m.to(tl.int64)
    return (s & 0xFFFFFFFF).to(tl.uint32), ((s >> 32) & 0xFFFFFFFF).to(tl.uint32)


# ============================================================================ kernels

@triton.jit(do_not_specialize=["stream_base", "seed_lo", "seed_hi"])
def _cast_quant_kernel(x_ptr, out_ptr, stream_ptr, stream_base, seed_lo, seed_hi, P, NBLK,
                       BLOCK: tl.constexpr, IS_BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
                       HAS_STREAMS: tl.constexpr):
    pid = tl.program_id(0)
    m = pid // NBLK
    offs = (pid % NBLK) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P
    base = m.to(tl.int64) * P
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0)
    rbits = offs.to(tl.uint32)
    if STOCHASTIC:
        s_lo, s_hi = _stream_of(stream_ptr, stream_base, m, HAS_STREAMS)
        rbits = tl.reshape(philox_bits_rows(seed_lo, seed_hi, tl.reshape(offs, (1, BLOCK)),
                                            s_lo, s_hi), (BLOCK,))
    if IS_BF16:
        b = encode_bf16(x, rbits, STOCHASTIC)
    else:
        b = encode_fp16(x, rbits, STOCHASTIC)
    tl.store(out_ptr + base + offs, b.to(tl.int16), mask=mask)


@triton.jit(do_not_specialize=["stream_base", "seed_lo", "seed_hi"])
def _fp8_quant_kernel(x_ptr, out_ptr, scale_ptr, stream_ptr, stream_base, seed_lo, seed_hi,
                      n_rows, R, C, ROWS: tl.constexpr, BC: tl.constexpr, NCHUNK: tl.constexpr,
                      STOCHASTIC: tl.constexpr, HAS_STREAMS: tl.constexpr,
                      ALIGNED: tl.constexpr = False):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    cols = tl.arange(0, BC)
    row_base = rows.to(tl.int64) * C
    m = rows // R
    if NCHUNK == 1:
        mask = rmask[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + row_base[:, None] + cols[None, :], mask=mask, other=0.0)
        amax = tl.max(tl.abs(x), axis=1)
    else:
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for c0 in range(0, NCHUNK * BC, BC):
            cc = c0 + cols
            mask = rmask[:, None] & (cc[None, :] < C)
            xc = tl.load(x_ptr + row_base[:, None] + cc[None, :], mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(xc), axis=1))
    scale = tl.div_rn(amax, _FP8_DIV)
    scale = tl.where(scale > 0, scale, 1.0)
    tl.store(scale_ptr + rows, scale, mask=rmask)
    s_lo = m.to(tl.uint32)
    s_hi = s_lo
    if STOCHASTIC:
        s_lo, s_hi = _stream_of(stream_ptr, stream_base, m, HAS_STREAMS)
    for c0 in tl.static_range(0, NCHUNK * BC, BC):
        cc = c0 + cols
        mask = rmask[:, None] & (cc[None, :] < C)
        if NCHUNK == 1:
            xc = x
        else:
            xc = tl.load(x_ptr + row_base[:, None] + cc[None, :], mask=mask, other=0.0)
        y = tl.div_rn(xc, scale[:, None])
        elem = (rows - m * R)[:, None] * C + cc[None, :]
        rbits = elem.to(tl.uint32)
        if STOCHASTIC:
            if ALIGNED:     # C a multiple of 4: every row starts a group of four
                rbits = philox_bits_rows(seed_lo, seed_hi, elem, s_lo[:, None], s_hi[:, None])
            else:
                rbits = philox_bits(seed_lo, seed_hi, elem, s_lo[:, None], s_hi[:, None])
        b = encode_e4m3(y, rbits, STOCHASTIC)
        tl.store(out_ptr + row_base[:, None] + cc[None, :], b.to(tl.uint8), mask=mask)


@triton.jit
def _fp8_dequant_kernel(p_ptr, scale_ptr, out_ptr, n_rows, C, ROWS: tl.constexpr,
                        BC: tl.constexpr, NCHUNK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    cols = tl.arange(0, BC)
    row_base = rows.to(tl.int64) * C
    scale = tl.load(scale_ptr + rows, mask=rmask, other=1.0)
    for c0 in tl.static_range(0, NCHUNK * BC, BC):
        cc = c0 + cols
        mask = rmask[:, None] & (cc[None, :] < C)
        b = tl.load(p_ptr + row_base[:, None] + cc[None, :], mask=mask, other=0)
        tl.store(out_ptr + row_base[:, None] + cc[None, :], decode_e4m3(b) * scale[:, None],
                 mask=mask)


@triton.jit
def _nvfp4_tile(x, blk, bmask, gs, packed_ptr, bscale_ptr, mbase, seed_lo, seed_hi, s_lo, s_hi,
                NB: tl.constexpr, STOCHASTIC: tl.constexpr, FAST: tl.constexpr,
                EVEN: tl.constexpr):
    """Quantize NB 16-element blocks x [NB, 16] (block indices blk within matrix; mbase = the
    matrix's first block) with the matrix scale gs; store packed bytes and block scales."""
    bamax = tl.max(tl.abs(x), axis=1)
    bs_f = tl.div_rn(tl.div_rn(bamax, _E2M1_MAX), gs)
    bs_f = tl.minimum(tl.maximum(bs_f, _BS_MIN), _E4M3_MAX)
    bs_code = encode_e4m3(bs_f, bs_f.to(tl.uint32, bitcast=True), False, FAST)
    den = decode_e4m3(bs_code) * gs
    y = tl.div_rn(x, den[:, None])
    elem = blk[:, None] * 16 + tl.arange(0, 16)[None, :]         # element index in the matrix
    rbits = elem.to(tl.uint32)
    if STOCHASTIC:
        rbits = philox_bits_rows(seed_lo, seed_hi, elem, s_lo, s_hi)
    nib = encode_e2m1(y, rbits, STOCHASTIC, FAST)
    lo, hi = tl.split(tl.reshape(nib, (NB, 8, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    p_off = (mbase + blk)[:, None] * 8 + tl.arange(0, 8)[None, :]
    if EVEN:
        tl.store(packed_ptr + p_off, packed)
        tl.store(bscale_ptr + mbase + blk, bs_code.to(tl.uint8))
    else:
        tl.store(packed_ptr + p_off, packed, mask=bmask[:, None])
        tl.store(bscale_ptr + mbase + blk, bs_code.to(tl.uint8), mask=bmask)


@triton.jit
def _nvfp4_load(x_ptr, mbase, blk, bmask, EVEN: tl.constexpr):
    off = (mbase + blk)[:, None] * 16 + tl.arange(0, 16)[None, :]
    if EVEN:
        x = tl.load(x_ptr + off)
    else:
        x = tl.load(x_ptr + off, mask=bmask[:, None], other=0.0)
    return x


@triton.jit(do_not_specialize=["stream_base", "seed_lo", "seed_hi"])
def _nvfp4_quant_kernel(x_ptr, amax_ptr, packed_ptr, bscale_ptr, gscale_ptr, stream_ptr,
                        stream_base, seed_lo, seed_hi, BPM, NCHUNK,
                        NB: tl.constexpr, MODE: tl.constexpr, STOCHASTIC: tl.constexpr,
                        HAS_STREAMS: tl.constexpr, FAST: tl.constexpr, EVEN: tl.constexpr):
    """NVFP4 quantize of matrices of BPM 16-element blocks, NB blocks per tile.

    MODE 0: one program per matrix, one tile holds it (x read once, amax in registers).
    MODE 1: one program per matrix, NCHUNK tiles: an amax pass, then a quantize pass (the
            second read mostly hits L2).
    MODE 2: NCHUNK programs per matrix, each one tile; amax_ptr[m] holds the matrix amax."""
    pid = tl.program_id(0)
    if MODE == 2:
        m = pid // NCHUNK
        chunk = pid % NCHUNK
    else:
        m = pid
        chunk = 0
    mbase = m.to(tl.int64) * BPM
    s_lo = m.to(tl.uint32)
    s_hi = s_lo
    if STOCHASTIC:
        s_lo, s_hi = _stream_of(stream_ptr, stream_base, m, HAS_STREAMS)
    ar = tl.arange(0, NB)
    if MODE == 0:
        bmask = ar < BPM
        x = _nvfp4_load(x_ptr, mbase, ar, bmask, EVEN)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        gs = tl.div_rn(amax, _GLOBAL_DIV)
        gs = tl.where(gs > 0, gs, 1.0)
        _nvfp4_tile(x, ar, bmask, gs, packed_ptr, bscale_ptr, mbase, seed_lo, seed_hi, s_lo, s_hi,
                    NB, STOCHASTIC, FAST, EVEN)
    elif MODE == 1:
        acc = tl.zeros([NB], dtype=tl.float32)
        for c in range(0, NCHUNK):
            blk = c * NB + ar
            bmask = blk < BPM
            x = _nvfp4_load(x_ptr, mbase, blk, bmask, EVEN)
            acc = tl.maximum(acc, tl.max(tl.abs(x), axis=1))
        gs = tl.div_rn(tl.max(acc, axis=0), _GLOBAL_DIV)
        gs = tl.where(gs > 0, gs, 1.0)
        for c in range(0, NCHUNK):
            blk = c * NB + ar
            bmask = blk < BPM
            x = _nvfp4_load(x_ptr, mbase, blk, bmask, EVEN)
            _nvfp4_tile(x, blk, bmask, gs, packed_ptr, bscale_ptr, mbase, seed_lo, seed_hi, s_lo,
                        s_hi, NB, STOCHASTIC, FAST, EVEN)
    else:
        blk = chunk * NB + ar
        bmask = blk < BPM
        x = _nvfp4_load(x_ptr, mbase, blk, bmask, EVEN)
        gs = tl.div_rn(tl.load(amax_ptr + m), _GLOBAL_DIV)
        gs = tl.where(gs > 0, gs, 1.0)
        _nvfp4_tile(x, blk, bmask, gs, packed_ptr, bscale_ptr, mbase, seed_lo, seed_hi, s_lo, s_hi,
                    NB, STOCHASTIC, FAST, EVEN)
    if chunk == 0:
        tl.store(gscale_ptr + m, gs)


@triton.jit
def _nvfp4_dequant_kernel(packed_ptr, bscale_ptr, gscale_ptr, out_ptr, n_blocks, BPM,
                          NB: tl.constexpr, EVEN: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64) * NB + tl.arange(0, NB)   # global block index
    m = blk // BPM
    p_off = blk[:, None] * 8 + tl.arange(0, 8)[None, :]
    o_off = blk[:, None] * 16 + tl.arange(0, 16)[None, :]
    if EVEN:
        gs = tl.load(gscale_ptr + m)
        bcode = tl.load(bscale_ptr + blk)
        byte = tl.load(packed_ptr + p_off).to(tl.int32)
    else:
        bmask = blk < n_blocks
        gs = tl.load(gscale_ptr + m, mask=bmask, other=1.0)
        bcode = tl.load(bscale_ptr + blk, mask=bmask, other=0)
        byte = tl.load(packed_ptr + p_off, mask=bmask[:, None], other=0).to(tl.int32)
    nib = tl.reshape(tl.join(byte & 0xF, byte >> 4), (NB, 16))
    v = decode_e2m1(nib) * decode_e4m3(bcode)[:, None]
    v = v * gs[:, None]
    if EVEN:
        tl.store(out_ptr + o_off, v)
    else:
        tl.store(out_ptr + o_off, v, mask=bmask[:, None])


# ============================================================================ host functions

def _empty(shape, dtype, device) -> torch.Tensor:
    """Output allocation (the tests replace it to poison outputs before the kernels write)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _split_seed(seed: int):
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return seed & 0xFFFFFFFF, seed >> 32


def _streams(stream, mat_shape, device):
    """(stream tensor or None, base int): per-matrix streams as in random_bits_ref."""
    if isinstance(stream, torch.Tensor):
        s = torch.broadcast_to(stream.to(device=device, dtype=torch.int64), mat_shape)
        return s.contiguous().reshape(-1), 0
    return None, int(stream)


def _as_mrc(x: torch.Tensor):
    """(M, R, C, matrix shape) of x viewed as matrices (1-D: one matrix of one row)."""
    if x.dim() == 1:
        return 1, 1, x.shape[0], ()
    M = 1
    for d in x.shape[:-2]:
        M *= d
    return M, x.shape[-2], x.shape[-1], tuple(x.shape[:-2])


def _check_rounding(rounding):
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"unknown rounding {rounding!r}; use 'nearest' or 'stochastic'")
    return rounding == "stochastic"


def cast_quantize(x: torch.Tensor, grid: Grid, dtype: torch.dtype, rounding: str = "nearest",
                  seed: int = 0, stream=0) -> torch.Tensor:
    """fp16 / bf16 storage of float32 x (contiguous): a tensor of `dtype`, x's shape."""
    if grid not in (FP16, BF16):
        raise ValueError(f"cast_quantize: grid {grid.name} is not fp16 or bf16")
    sr = _check_rounding(rounding)
    x = x.to(torch.float32).contiguous()
    out = _empty(x.shape, dtype, x.device)
    if x.numel() == 0:
        return out
    M, R, C, mat_shape = _as_mrc(x)
    P = R * C
    streams, base = _streams(stream, mat_shape, x.device)
    BLOCK = min(triton.next_power_of_2(P), 2048)
    nblk = triton.cdiv(P, BLOCK)
    lo, hi = _split_seed(seed)
    _cast_quant_kernel[(M * nblk,)](
        x, out.view(torch.int16), streams if streams is not None else x, base, lo, hi, P, nblk,
        BLOCK=BLOCK, IS_BF16=grid is BF16, STOCHASTIC=sr, HAS_STREAMS=streams is not None,
        num_warps=_warps(BLOCK))
    return out


def _row_tiling(C: int):
    BC = min(triton.next_power_of_2(C), 4096)
    nchunk = triton.cdiv(C, BC)
    rows = max(1, min(64, 2048 // BC)) if nchunk == 1 else 1
    return rows, BC, nchunk


def fp8_quantize(x: torch.Tensor, rounding: str = "nearest", seed: int = 0, stream=0):
    """(payload float8_e4m3fn x.shape, row scale float32 x.shape[:-1]) as fp8_quantize_ref."""
    sr = _check_rounding(rounding)
    x = x.to(torch.float32).contiguous()
    payload = _empty(x.shape, torch.float8_e4m3fn, x.device)
    scale = _empty(x.shape[:-1], torch.float32, x.device)
    if x.numel() == 0:
        return payload, scale
    M, R, C, mat_shape = _as_mrc(x)
    n_rows = M * R
    streams, base = _streams(stream, mat_shape, x.device)
    ROWS, BC, nchunk = _row_tiling(C)
    lo, hi = _split_seed(seed)
    _fp8_quant_kernel[(triton.cdiv(n_rows, ROWS),)](
        x, payload.view(torch.uint8), scale, streams if streams is not None else x, base, lo, hi,
        n_rows, R, C, ROWS=ROWS, BC=BC, NCHUNK=nchunk, STOCHASTIC=sr,
        HAS_STREAMS=streams is not None, ALIGNED=C % 4 == 0, num_warps=_warps(ROWS * BC))
    return payload, scale


def fp8_dequantize(payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 payload * row scale, as fp8_dequantize_ref."""
    payload = payload.contiguous()
    scale = scale.to(torch.float32).contiguous()
    out = _empty(payload.shape, torch.float32, payload.device)
    if payload.numel() == 0:
        return out
    C = payload.shape[-1]
    n_rows = payload.numel() // C
    ROWS, BC, nchunk = _row_tiling(C)
    _fp8_dequant_kernel[(triton.cdiv(n_rows, ROWS),)](
        payload.view(torch.uint8), scale, out, n_rows, C, ROWS=ROWS, BC=BC, NCHUNK=nchunk,
        num_warps=_warps(ROWS * BC))
    return out


def nvfp4_quantize(x3: torch.Tensor, rounding: str = "nearest", seed: int = 0, stream=0):
    """x3 float32 [M, R, C], C % 16 == 0 -> (packed uint8 [M, R, C/2], block scales uint8
    [M, R, C/16] (E4M3 bits), per-matrix scale float32 [M]), as nvfp4_quantize_ref.

    `stream`: int (matrix m takes stream + m) or int64 tensor broadcastable to [M]. The launch
    plan is launch.quant_launch_config's (launch.override_quant_launch tries others: same
    bits)."""
    sr = _check_rounding(rounding)
    if x3.dim() != 3 or x3.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"nvfp4_quantize: need float32 [M, R, C] with C % {NVFP4_BLOCK} == 0, "
                         f"got shape {tuple(x3.shape)}")
    x3 = x3.to(torch.float32).contiguous()
    M, R, C = x3.shape
    dev = x3.device
    packed = _empty((M, R, C // 2), torch.uint8, dev)
    bscale = _empty((M, R, C // NVFP4_BLOCK), torch.uint8, dev)
    gscale = _empty((M,), torch.float32, dev)
    if x3.numel() == 0:
        gscale.fill_(1.0)
        return packed, bscale, gscale
    bpm = R * C // NVFP4_BLOCK
    streams, base = _streams(stream, (M,), dev)
    cfg = quant_launch_config("nvfp4_quantize", bpm, sr)
    mode, NB, nchunk, even = cfg["plan"]
    if mode == 2:
        mn, mx = torch.aminmax(x3.reshape(M, -1), dim=1)
        amax = torch.maximum(mn.abs(), mx.abs())
    else:
        amax = gscale                                  # unused
    lo, hi = _split_seed(seed)
    _nvfp4_quant_kernel[(M * nchunk if mode == 2 else M,)](
        x3, amax, packed, bscale, gscale, streams if streams is not None else x3, base, lo, hi,
        bpm, nchunk, NB=NB, MODE=mode, STOCHASTIC=sr, HAS_STREAMS=streams is not None,
        FAST=cfg["fast"], EVEN=even, num_warps=cfg["num_warps"])
    return packed, bscale, gscale


def nvfp4_dequantize(packed: torch.Tensor, bscale: torch.Tensor, gscale: torch.Tensor):
    """float32 [M, R, C] from (packed [M, R, C/2], block scales [M, R, C/16], scale [M]);
    blocks a program and warps from launch.quant_launch_config."""
    M, R, C2 = packed.shape
    packed = packed.contiguous()
    bscale = bscale.contiguous()
    gscale = gscale.to(torch.float32).contiguous()
    out = _empty((M, R, C2 * 2), torch.float32, packed.device)
    if out.numel() == 0:
        return out
    bpm = R * C2 * 2 // NVFP4_BLOCK
    n_blocks = M * bpm
    cfg = quant_launch_config("nvfp4_dequantize", bpm)
    nb = cfg["nb"]
    _nvfp4_dequant_kernel[(triton.cdiv(n_blocks, nb),)](
        packed, bscale.view(torch.uint8), gscale, out, n_blocks, bpm, NB=nb,
        EVEN=n_blocks % nb == 0, num_warps=cfg["num_warps"])
    return out
