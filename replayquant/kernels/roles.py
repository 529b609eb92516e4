"""The stored roles of a layer's state and their casts in registers, which every kernel of the
package shares (the conventional step, replay decode and verify, the chunk kernel of teacher
forcing):

* `PackedRole`: one stored copy of the state of all slots of a layer, physically packed
  (fp32 / fp16 / bf16 tensors, fp8 bytes + one FP32 scale per row, NVFP4 nibbles two per
  byte + E4M3 block scales + one FP32 scale per matrix). Layout [slots, heads, d_v, d_k],
  d_k contiguous (the NVFP4 block runs along d_k).
* Triton device functions that load a [BV, d_k] tile of a role into float32 registers and
  store a float32 tile back with nearest or stochastic rounding. Rounding follows
  `formats/casts.py` bit for bit; SR bits follow `streams.py` (Philox counter = element
  index in its matrix, stream = sr_stream(flush index, role, slot, head), key = layer seed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from replayquant.formats import casts as qref
from replayquant.formats.philox import random_bits_ref
from replayquant.formats.constants import (BF16, E2M1, E4M3, FP8_ROW_DIVISOR, FP16,
                                           NVFP4_BLOCK, NVFP4_BLOCK_SCALE_MIN,
                                           NVFP4_GLOBAL_DIVISOR, ROUNDINGS)
from replayquant.kernels.quant import (decode_bf16, decode_e2m1, decode_e4m3, decode_fp16,
                                       encode_bf16, encode_e2m1, encode_e4m3, encode_fp16,
                                       philox_bits_rows)
from replayquant.streams import sr_stream

FMT_IDS = {"fp32": 0, "fp16": 1, "bf16": 2, "fp8": 3, "nvfp4": 4}


@dataclass
class PackedRole:
    """One stored copy (anchor or read copy) of the state of every slot of one layer.

    payload: fp32 / fp16 / bf16 [N, H, dv, dk]; fp8: float8_e4m3fn [N, H, dv, dk];
             nvfp4: uint8 [N, H, dv, dk/2] (even element in the low nibble).
    scale:   fp8: float32 row scales [N, H, dv]; nvfp4: uint8 E4M3 block scales [N, H, dv, dk/16].
    gscale:  nvfp4: float32 per-matrix scales [N, H].
    """

    fmt: str
    rounding: str
    shape: tuple
    payload: torch.Tensor
    scale: torch.Tensor | None = None
    gscale: torch.Tensor | None = None

    @classmethod
    def empty(cls, fmt: str, rounding: str, shape, device="cpu") -> "PackedRole":
        if fmt not in FMT_IDS:
            raise ValueError(f"unknown state format {fmt!r}; use one of {', '.join(FMT_IDS)}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"unknown rounding {rounding!r}; use one of {ROUNDINGS}")
        N, H, dv, dk = shape
        scale = gscale = None
        if fmt == "fp32":
            payload = torch.empty(shape, dtype=torch.float32, device=device)
        elif fmt in ("fp16", "bf16"):
            payload = torch.empty(shape, dtype=getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[fmt]),
                                  device=device)
        elif fmt == "fp8":
            payload = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
            scale = torch.empty(N, H, dv, dtype=torch.float32, device=device)
        else:
            if dk % NVFP4_BLOCK:
                raise ValueError(f"nvfp4 state needs d_k % {NVFP4_BLOCK} == 0 (got d_k={dk})")
            payload = torch.empty(N, H, dv, dk // 2, dtype=torch.uint8, device=device)
            scale = torch.empty(N, H, dv, dk // NVFP4_BLOCK, dtype=torch.uint8, device=device)
            gscale = torch.empty(N, H, dtype=torch.float32, device=device)
        return cls(fmt, rounding, tuple(shape), payload, scale, gscale)

    # -- bytes
    def matrix_bytes(self) -> int:
        """Physical bytes of one (slot, head) matrix: payload plus its scales."""
        N, H = self.shape[:2]
        total = sum(t.numel() * t.element_size() for t in (self.payload, self.scale, self.gscale)
                    if t is not None)
        return total // (N * H)

    # -- torch access (the references and tests use these; kernels read the tensors directly)
    def dequantize(self, slots=None) -> torch.Tensor:
        """float32 [n, H, dv, dk] of the given slots (all when None)."""
        sl = slice(None) if slots is None else torch.as_tensor(slots, dtype=torch.long,
                                                                device=self.payload.device)
        pay = self.payload[sl]
        if self.fmt == "fp32":
            return pay.clone()
        if self.fmt in ("fp16", "bf16"):
            return pay.to(torch.float32)
        if self.fmt == "fp8":
            return pay.to(torch.float32) * self.scale[sl].unsqueeze(-1)
        n, H, dv, dk2 = pay.shape
        out = qref.nvfp4_dequantize_ref(pay.reshape(n * H, dv, dk2),
                                   self.scale[sl].reshape(n * H, dv, -1), self.gscale[sl].reshape(-1))
        return out.reshape(n, H, dv, 2 * dk2)

    def write_(self, slots, x: torch.Tensor, key: int, streams: torch.Tensor) -> None:
        """Quantize float32 x [n, H, dv, dk] (rounding of this role, SR streams [n, H]) into
        `slots` with the torch reference of the format (the specification)."""
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.payload.device)
        for t, e in zip((self.payload, self.scale, self.gscale), self.encode(x, key, streams)):
            if e is not None:
                t[slots] = e

    def encode(self, x: torch.Tensor, key: int, streams: torch.Tensor, bits=random_bits_ref):
        """The packed tensors (payload, scale, gscale; None where the format has none) of
        float32 x [n, H, dv, dk] cast with this role's rounding, as write_ stores them. SR bits
        come from `bits` with streams [n, H]: random_bits_ref (numpy on the CPU) or
        random_bits_torch (torch ops only, on any device), the same words."""
        x = x.to(torch.float32)
        if self.fmt == "fp32":
            return x, None, None
        rbits = None
        if self.rounding == "stochastic":
            rbits = bits(x.shape, key, torch.as_tensor(streams), device=x.device)
        n, H, dv, dk = x.shape
        if self.fmt in ("fp16", "bf16"):
            grid, dtype = (FP16, torch.float16) if self.fmt == "fp16" else (BF16, torch.bfloat16)
            return qref.cast_ref(x, grid, dtype, rbits), None, None
        if self.fmt == "fp8":
            pay, scale = qref.fp8_quantize_ref(x, rbits)
            return pay, scale, None
        x3 = x.reshape(n * H, dv, dk)
        pay, bs, gs = qref.nvfp4_quantize_ref(x3, None if rbits is None else rbits.reshape(x3.shape))
        return pay.reshape(n, H, dv, -1), bs.reshape(n, H, dv, -1), gs.reshape(n, H)

    def clone(self) -> "PackedRole":
        c = lambda t: None if t is None else t.clone()  # noqa: E731
        return PackedRole(self.fmt, self.rounding, self.shape, c(self.payload), c(self.scale),
                          c(self.gscale))

    def kernel_args(self):
        """(payload, scale, gscale, fmt id) as the kernels take them (fp8 viewed as bytes,
        fp16/bf16 as int16 so that rounded bit patterns can be stored)."""
        pay = self.payload
        if self.fmt == "fp8":
            pay = pay.view(torch.uint8)
        elif self.fmt in ("fp16", "bf16"):
            pay = pay.view(torch.int16)
        sc = self.scale if self.scale is not None else pay
        gs = self.gscale if self.gscale is not None else pay
        return pay, sc, gs, FMT_IDS[self.fmt]


def role_streams(flush_index, role: int, slots, heads: int) -> torch.Tensor:
    """sr_stream for a set of slots (the slot id is the sequence id of the stream)."""
    return sr_stream(flush_index, role, torch.as_tensor(slots, dtype=torch.int64).cpu(), heads)


# ============================================================================ Triton helpers
# Rounding, decoding and Philox come from kernels/quant.py (bit-exact with formats/casts.py).

_NV_DIV: tl.constexpr = tl.constexpr(NVFP4_GLOBAL_DIVISOR)
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
        _nv_store(x, tl.max(tl.max(tl.abs(x), axis=1), axis=0), pay, sc, gs, mat, rows, rb,
                  DV, DK, BV, SR)


@triton.jit
def _nv_store(x, amax, pay, sc, gs, mat, rows, rb, DV: tl.constexpr, DK: tl.constexpr,
              BV: tl.constexpr, SR: tl.constexpr):
    """NVFP4 rows `rows` of matrix mat from x [BV, DK], given the whole matrix's amax (its
    global scale amax / 448 / 6): a tile of the matrix cast alone equals the whole-matrix cast."""
    DK2: tl.constexpr = DK // 2
    NB: tl.constexpr = DK // 16
    g = tl.div_rn(amax, _NV_DIV)
    g = tl.where(g > 0, g, 1.0)
    nibs, bcode = nv_block_encode(x, g, rb, BV, DK, SR)
    lo, hi = tl.split(tl.reshape(nibs, (BV, DK2, 2)))
    half = tl.arange(0, DK2)
    tl.store(pay + mat * (DV * DK2) + rows[:, None] * DK2 + half[None, :],
             (lo | (hi << 4)).to(tl.uint8))
    nb = tl.arange(0, NB)
    tl.store(sc + mat * (DV * NB) + rows[:, None] * NB + nb[None, :], bcode.to(tl.uint8))
    tl.store(gs + mat, g)
