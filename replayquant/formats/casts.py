"""Torch reference of every format's quantize / dequantize: the specification the Triton
kernels in `replayquant/kernels/quant/kernel.py` are checked against bit for bit.

Rounding to a grid uses only exact float32 operations (bit extraction, multiplication by powers
of two, floor, subtraction, comparison), so torch, the Triton interpreter and a GPU give the
same bits. For a magnitude a with exponent e = max(floor(log2 a), emin):

    t   = a * 2^-e * 2^mbits          (exact; t in [0, 2^(mbits+1)))
    q   = floor(t) + up,   rem = t - floor(t)
    up  = rem > 1/2 or (rem == 1/2 and floor(t) odd)          round to nearest even
    up  = u < rem,  u = (r >> 8) * 2^-24 from a uint32 r        stochastic rounding

Stochastic rounding therefore returns one of the two neighbouring grid values, leaves grid
values unchanged (rem = 0), and is unbiased to within 2^-24 of one grid step. It holds over the
whole range: subnormals (e clamped at emin), and overflow, where IEEE grids (fp16, bf16) follow
the cast (inf from max + half a step on, else max) and scaled grids (E4M3, E2M1) saturate.
Division, where a recipe needs one, is IEEE correctly rounded (Triton: `tl.div_rn`; here
`div_rn`, since torch on CUDA divides by a Python number as a multiplication by its reciprocal).
"""

from __future__ import annotations

import torch

from replayquant.formats.constants import (E2M1, E4M3, FP8_ROW_DIVISOR, NVFP4_BLOCK,
                                           NVFP4_BLOCK_SCALE_MIN, NVFP4_CARRIED_HEADROOM,
                                           NVFP4_GLOBAL_DIVISOR, Grid)


def pow2_ref(p: torch.Tensor) -> torch.Tensor:
    """2^p as float32 for integer p in [-149, 127], built from bits (exact, subnormals too)."""
    p = p.to(torch.int32)
    normal = (p + 127).clamp(min=1) << 23
    sub = torch.ones_like(p) << (p + 149).clamp(min=0, max=22)
    return torch.where(p >= -126, normal, sub).view(torch.float32)


def div_rn(a: torch.Tensor, b) -> torch.Tensor:
    """a / b, IEEE correctly rounded on every device. torch on CUDA computes a / (Python number
    or CPU scalar) as a * (1 / b), which can differ in the last bit (then a scale, and every
    payload code cast with it, differs from the kernels' and from the CPU's); a divisor tensor
    on a's device gets the true division there."""
    if not isinstance(b, torch.Tensor):
        b = torch.full((), float(b), dtype=a.dtype, device=a.device)   # a fill, no host copy
    return torch.div(a, b.to(a.device))


def round_to_grid_ref(y: torch.Tensor, grid: Grid, rbits: torch.Tensor | None = None):
    """Round float32 `y` to `grid`. Returns (code int32 magnitude code, sign int32 0/1).

    rbits None: round to nearest even; else stochastic rounding with uint32 bits (int64 tensor).
    """
    y = y.to(torch.float32)
    bits = y.view(torch.int32)
    sign = (bits < 0).to(torch.int32)
    mag_bits = bits & 0x7FFFFFFF
    a = mag_bits.view(torch.float32)
    e = ((mag_bits >> 23) - 127).clamp(min=grid.emin)
    t = a * pow2_ref(-e) * float(2 ** grid.mbits)
    fl = torch.floor(t)
    rem = t - fl
    if rbits is None:
        odd = torch.remainder(fl, 2.0) == 1.0
        up = (rem > 0.5) | ((rem == 0.5) & odd)
    else:
        u = (rbits.to(torch.int64) >> 8).to(torch.float32) * (2.0 ** -24)
        up = u < rem
    q = fl.to(torch.int32) + up.to(torch.int32)
    code = ((e - grid.emin) << grid.mbits) + q
    if grid.ieee_overflow:
        step_max = 2.0 ** (_exponent_of_code(grid, grid.max_code) - grid.mbits)
        over = torch.where(a >= grid.max_value + 0.5 * step_max,
                           torch.full_like(code, grid.inf_code),
                           torch.full_like(code, grid.max_code))
    else:
        over = torch.full_like(code, grid.max_code)
    code = torch.where(code > grid.max_code, over, code)
    return code, sign


def _exponent_of_code(grid: Grid, code: int) -> int:
    return max(code >> grid.mbits, 1) - 1 + grid.emin


def grid_value_ref(code: torch.Tensor, sign: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Float32 value of (code, sign) on a saturating grid (E4M3, E2M1)."""
    code = code.to(torch.int32)
    ef = code >> grid.mbits
    m = code & ((1 << grid.mbits) - 1)
    sig = torch.where(ef > 0, m + (1 << grid.mbits), m).to(torch.float32)
    v = sig * pow2_ref(ef.clamp(min=1) - 1 + grid.emin - grid.mbits)
    return torch.where(sign.to(torch.bool), -v, v)


def check_stochastic(rounding: str, rbits):
    if rounding == "stochastic" and rbits is None:
        raise ValueError("stochastic rounding needs random bits (rbits)")
    return rbits if rounding == "stochastic" else None


# ---------------------------------------------------------------- plain floats (fp16, bf16)

def cast_ref(x: torch.Tensor, grid: Grid, dtype: torch.dtype, rbits=None) -> torch.Tensor:
    """fp16 / bf16 storage of x: round to the grid, return a tensor of `dtype`."""
    code, sign = round_to_grid_ref(x, grid, rbits)
    return (code | (sign << grid.sign_shift)).to(torch.int16).view(dtype)


# ---------------------------------------------------------------- FP8 E4M3, one scale per row

def fp8_quantize_ref(x: torch.Tensor, rbits=None):
    """Returns (payload float8_e4m3fn x.shape, row scale float32 x.shape[:-1])."""
    amax = x.abs().amax(dim=-1)
    scale = div_rn(amax, FP8_ROW_DIVISOR)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    code, sign = round_to_grid_ref(x / scale.unsqueeze(-1), E4M3, rbits)
    payload = (code | (sign << E4M3.sign_shift)).to(torch.uint8).view(torch.float8_e4m3fn)
    return payload, scale


def fp8_dequantize_ref(payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return payload.to(torch.float32) * scale.unsqueeze(-1)


# ---------------------------------------------------------------- NVFP4 (E2M1 + E4M3 block scale)

def nvfp4_global_scale_ref(x3: torch.Tensor) -> torch.Tensor:
    """Per-matrix FP32 scale amax / (448 * 6); 1 for an all-zero matrix. x3: [M, R, C]."""
    gs = div_rn(x3.abs().amax(dim=(-2, -1)), NVFP4_GLOBAL_DIVISOR)
    return torch.where(gs > 0, gs, torch.ones_like(gs))


def nvfp4_carried_scale_ref(amax: torch.Tensor) -> torch.Tensor:
    """The global scale a flush tile can know alone: the least power of two gs with
    2688 gs >= 2^K amax (K = NVFP4_CARRIED_HEADROOM), amax float32 >= 0 the previous flush's
    unrounded matrix amax; 1 where amax is 0, at least 2^-126. From amax's bits, exactly:
    amax = m 2^e, m in [1, 2), 2688 = 1.3125 2^11, so gs = 2^(e + K - 11), times 2 where
    m > 1.3125. The kernels' (kernels.quant.roles.nv_carried_scale) is the same."""
    bits = amax.to(torch.float32).contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127
    E = e + NVFP4_CARRIED_HEADROOM - 11 + ((bits & 0x7FFFFF) > 0x280000).to(torch.int32)
    gs = ((E.clamp(min=-126) + 127) << 23).view(torch.float32)
    return torch.where(amax > 0, gs, torch.ones_like(gs))


def nvfp4_quantize_ref(x3: torch.Tensor, rbits=None, gs: torch.Tensor | None = None):
    """x3 float32 [M, R, C], C % 16 == 0.

    Returns (packed uint8 [M, R, C/2] (even element in the low nibble),
             block scales uint8 E4M3 bits [M, R, C/16], global scale float32 [M]).
    Recipe: gs = amax/2688; bs = E4M3_rne(clamp(block_amax / 6 / gs, 2^-9, 448));
            element = E2M1(x / (bs * gs)), saturating at 6.
    gs: a global scale [M] given instead of the matrices' own (a scale chosen before the whole
    matrix is known; elements past 2688 gs saturate).
    """
    M, R, C = x3.shape
    gs = nvfp4_global_scale_ref(x3) if gs is None else gs.to(torch.float32)
    blocks = x3.reshape(M, R, C // NVFP4_BLOCK, NVFP4_BLOCK)
    bamax = blocks.abs().amax(dim=-1)
    bs_f = (div_rn(bamax, E2M1.max_value) / gs[:, None, None]).clamp(NVFP4_BLOCK_SCALE_MIN, E4M3.max_value)
    bs_code, _ = round_to_grid_ref(bs_f, E4M3)
    bs = grid_value_ref(bs_code, torch.zeros_like(bs_code), E4M3)
    den = bs * gs[:, None, None]
    code, sign = round_to_grid_ref(blocks / den.unsqueeze(-1), E2M1,
                                   None if rbits is None else rbits.reshape(blocks.shape))
    nib = (code | (sign << E2M1.sign_shift)).reshape(M, R, C)
    packed = (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)
    return packed, bs_code.to(torch.uint8), gs


def nvfp4_dequantize_ref(packed: torch.Tensor, bscale: torch.Tensor, gs: torch.Tensor):
    M, R, C2 = packed.shape
    p = packed.to(torch.int32)
    nib = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(M, R, C2 * 2)
    v = grid_value_ref(nib & 0x7, nib >> 3, E2M1)
    bs = grid_value_ref(bscale.to(torch.int32), torch.zeros_like(bscale, dtype=torch.int32), E4M3)
    v = v.reshape(M, R, -1, NVFP4_BLOCK) * bs.unsqueeze(-1)
    return (v * gs[:, None, None, None]).reshape(M, R, C2 * 2)
