"""The kernels' casts of the stored roles (`replayquant.replay.roles.PackedRole`) in registers,
which every kernel of the package shares (the conventional step, replay decode and verify, the
chunk kernel of teacher forcing): Triton device functions that load a [BV, d_k] tile of a role
into float32 registers and store a float32 tile back with nearest or stochastic rounding.
Rounding follows `formats/casts.py` bit for bit; SR bits follow `streams.py` (Philox counter =
element index in its matrix, stream = sr_stream(flush index, role, slot, head), key = layer
seed).
"""

from __future__ import annotations

import triton
import triton.language as tl

from replayquant.formats.constants import (E2M1, E4M3, FP8_ROW_DIVISOR, NVFP4_BLOCK_SCALE_MIN,
                                           NVFP4_CARRIED_HEADROOM, NVFP4_GLOBAL_DIVISOR)
from replayquant.kernels.quant.kernel import (decode_bf16, decode_e2m1, decode_e4m3, decode_fp16,
                                              encode_bf16, encode_e2m1, encode_e4m3, encode_fp16,
                                              philox_bits_rows)

# Rounding, decoding and Philox come from kernels/quant/kernel.py (bit-exact with formats/casts.py).

_NV_DIV: tl.constexpr = tl.constexpr(NVFP4_GLOBAL_DIVISOR)
_NV_HEADROOM: tl.constexpr = tl.constexpr(NVFP4_CARRIED_HEADROOM)
_FP8_DIV: tl.constexpr = tl.constexpr(FP8_ROW_DIVISOR)
_E2M1_MAX: tl.constexpr = tl.constexpr(E2M1.max_value)
_E4M3_MAX: tl.constexpr = tl.constexpr(E4M3.max_value)
_BS_MIN: tl.constexpr = tl.constexpr(NVFP4_BLOCK_SCALE_MIN)


def split_key(key: int):
    """(lo, hi) 32-bit words of a 64-bit Philox key, as kernel arguments."""
    key = int(key) & 0xFFFFFFFFFFFFFFFF
    return key & 0xFFFFFFFF, key >> 32


@triton.jit
def _sr_bits(offs, key_lo, key_hi, flush_index, role: tl.constexpr, slot, head):
    """SR bits of the tile offs [R, C] (rows of consecutive element indices from multiples of
    4): word offs % 4 of Philox counter (offs // 4, stream lo, stream hi, 0), key = layer seed,
    where stream = flush_index << 41 | role << 40 | slot << 16 | head (streams.sr_stream)."""
    stream = (flush_index.to(tl.int64) << 41) | (role << 40) | (slot.to(tl.int64) << 16) | head
    s_lo = stream & 0xFFFFFFFF
    s_hi = (stream >> 32) & 0xFFFFFFFF
    return philox_bits_rows(key_lo, key_hi, offs, s_lo, s_hi)


@triton.jit
def _role_bits(offs, SR: tl.constexpr, key_lo, key_hi, flush_index, role: tl.constexpr, slot,
               head):
    """The rounding bits of a cast of tile offs: _sr_bits with stochastic rounding (SR), else
    the offsets themselves (nearest rounding reads no bits; the argument needs a tensor)."""
    if SR:
        return _sr_bits(offs, key_lo, key_hi, flush_index, role, slot, head)
    return offs.to(tl.uint32)


@triton.jit
def _tile_load(pay, sc, gs, mat, rows, cols, DV: tl.constexpr, DK: tl.constexpr,
               BV: tl.constexpr, FMT: tl.constexpr):
    """float32 [BV, DK] tile (rows `rows` of matrix `mat`) of a packed role."""
    if FMT == 0:
        x = tl.load(pay + mat * (DV * DK) + rows[:, None] * DK + cols[None, :])
    elif FMT == 1:
        x = decode_fp16(tl.load(pay + mat * (DV * DK) + rows[:, None] * DK + cols[None, :]))
    elif FMT == 2:
        x = decode_bf16(tl.load(pay + mat * (DV * DK) + rows[:, None] * DK + cols[None, :]))
    elif FMT == 3:
        byte = tl.load(pay + mat * (DV * DK) + rows[:, None] * DK + cols[None, :])
        x = decode_e4m3(byte) * tl.load(sc + mat * DV + rows)[:, None]
    else:
        DK2: tl.constexpr = DK // 2
        NB: tl.constexpr = DK // 16
        half = tl.arange(0, DK2)
        p = tl.load(pay + mat * (DV * DK2) + rows[:, None] * DK2 + half[None, :]).to(tl.int32)
        lo = decode_e2m1(p)
        hi = decode_e2m1(p >> 4)
        v = tl.reshape(tl.join(lo, hi), (BV, NB, 16))
        nb = tl.arange(0, NB)
        bs = decode_e4m3(tl.load(sc + mat * (DV * NB) + rows[:, None] * NB + nb[None, :]))
        x = tl.reshape(v * bs[:, :, None], (BV, DK)) * tl.load(gs + mat)
    return x


@triton.jit
def nv_block_encode(x, g, rb, BV: tl.constexpr, DK: tl.constexpr, SR: tl.constexpr):
    """NVFP4 codes of a float32 tile x [BV, DK] with matrix scale g: (E2M1 codes [BV, DK] as
    integers, E4M3 block-scale codes [BV, DK // 16]), the steps of formats/casts in float32."""
    NB: tl.constexpr = DK // 16
    xb = tl.reshape(x, (BV, NB, 16))
    bamax = tl.max(tl.abs(xb), axis=2)
    bsf = tl.div_rn(tl.div_rn(bamax, _E2M1_MAX), g)
    bsf = tl.minimum(tl.maximum(bsf, _BS_MIN), _E4M3_MAX)
    bcode = encode_e4m3(bsf, bsf.to(tl.uint32, bitcast=True), False)
    den = decode_e4m3(bcode) * g
    y = tl.reshape(tl.div_rn(xb, den[:, :, None]), (BV, DK))
    return encode_e2m1(y, rb, SR), bcode


@triton.jit
def _tile_store(x, pay, sc, gs, mat, rows, cols, key_lo, key_hi, flush_index, slot, head,
                DV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, FMT: tl.constexpr,
                SR: tl.constexpr, ROLE: tl.constexpr):
    """Quantize float32 tile x [BV, DK] into a packed role (nvfp4 needs BV == DV: one scale
    per matrix). SR bits: _sr_bits(element index, key, flush_index, ROLE, slot, head)."""
    offs = rows[:, None] * DK + cols[None, :]
    ptrs = pay + mat * (DV * DK) + offs
    rb = _role_bits(offs, SR, key_lo, key_hi, flush_index, ROLE, slot, head)
    if FMT == 0:
        tl.store(ptrs, x)
    elif FMT == 1:
        tl.store(ptrs, encode_fp16(x, rb, SR).to(tl.int16))
    elif FMT == 2:
        tl.store(ptrs, encode_bf16(x, rb, SR).to(tl.int16))
    elif FMT == 3:
        amax = tl.max(tl.abs(x), axis=1)
        s = tl.div_rn(amax, _FP8_DIV)
        s = tl.where(s > 0, s, 1.0)
        tl.store(ptrs, encode_e4m3(tl.div_rn(x, s[:, None]), rb, SR).to(tl.uint8))
        tl.store(sc + mat * DV + rows, s)
    else:
        g = tl.div_rn(tl.max(tl.max(tl.abs(x), axis=1), axis=0), _NV_DIV)
        nv_store(x, tl.where(g > 0, g, 1.0), pay, sc, gs, mat, rows, rb, DV, DK, BV, SR)


@triton.jit
def nv_carried_scale(amax):
    """formats.casts.nvfp4_carried_scale_ref of a float32 amax >= 0 (a scalar), from its bits."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    E = e + (_NV_HEADROOM - 11) + ((bits & 0x7FFFFF) > 0x280000).to(tl.int32)
    g = ((tl.maximum(E, -126) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(amax > 0, g, 1.0)


@triton.jit
def nv_store(x, g, pay, sc, gs, mat, rows, rb, DV: tl.constexpr, DK: tl.constexpr,
             BV: tl.constexpr, SR: tl.constexpr):
    """NVFP4 rows `rows` of matrix mat from x [BV, DK] with the matrix's global scale g (the
    whole matrix's amax / 448 / 6, or a carried scale): a tile of the matrix cast alone equals
    the whole-matrix cast with g."""
    DK2: tl.constexpr = DK // 2
    NB: tl.constexpr = DK // 16
    nibs, bcode = nv_block_encode(x, g, rb, BV, DK, SR)
    lo, hi = tl.split(tl.reshape(nibs, (BV, DK2, 2)))
    half = tl.arange(0, DK2)
    tl.store(pay + mat * (DV * DK2) + rows[:, None] * DK2 + half[None, :],
             (lo | (hi << 4)).to(tl.uint8))
    nb = tl.arange(0, NB)
    tl.store(sc + mat * (DV * NB) + rows[:, None] * NB + nb[None, :], bcode.to(tl.uint8))
    tl.store(gs + mat, g)
