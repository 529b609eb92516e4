"""The stored roles of a layer's decode state (`PackedRole`), which every decode store, kernel
and reference of the package shares: one stored copy of the state of all slots of a layer,
physically packed (fp32 / fp16 / bf16 tensors, fp8 bytes + one FP32 scale per row, NVFP4 nibbles
two per byte + E4M3 block scales + one FP32 scale per matrix). Layout [slots, heads, d_v, d_k],
d_k contiguous (the NVFP4 block runs along d_k). Its torch casts are the format specification
(`formats/casts.py`, Philox bits of `formats/philox.py` with the streams of `streams.py`); the
kernels' casts of a tile in registers are in `kernels/quant/roles.py`. Plain torch: importing this
module imports no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayquant.formats import casts as qref
from replayquant.formats.constants import BF16, FP16, NVFP4_BLOCK, ROUNDINGS
from replayquant.formats.philox import random_bits_ref
from replayquant.streams import sr_stream

# the id of each format as the kernels take it (PackedRole.kernel_args, the FMT constexpr)
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
