"""State storage formats: a registry of small classes with quantize / dequantize / fake_quantize.

    from replayquant.formats import get_format, FORMATS
    fmt = get_format("nvfp4")
    q = fmt.quantize(x, rounding="nearest", seed=0)     # x float32 [..., d]
    x_hat = fmt.dequantize(q)                          # float32, x's shape
    q.nbytes                                           # physical bytes: payload + scales

Stochastic rounding draws Philox bits keyed by (seed, stream): each matrix (the last two dims;
the whole tensor for 1-D input) takes stream `stream + its flat index` when `stream` is an int,
or its own entry when `stream` is an int64 tensor of shape x.shape[:-2]. Element i of a matrix
uses counter i, so a caller can give every (layer, head, step) an independent stream.

Backend: CUDA tensors run the Triton kernels of `replayquant.kernels.quant.kernel`; CPU tensors
run the torch reference of `replayquant.formats.casts` (both give the same bits). Setting
REPLAYQUANT_BACKEND=triton forces the Triton kernels (on the CPU with TRITON_INTERPRET=1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayquant import options
from replayquant.formats import casts as ref
from replayquant.formats.constants import BF16, FP16, NVFP4_BLOCK, ROUNDINGS, Grid
from replayquant.formats.philox import random_bits_ref
from replayquant.streams import check_seed

__all__ = ["FORMATS", "FMT_IDS", "Format", "QTensor", "as_bits", "get_format", "use_triton"]


def use_triton(x: torch.Tensor) -> bool:
    """True where the Triton kernels run: CUDA tensors, or the option backend = triton
    (REPLAYQUANT_BACKEND, replayquant.options; a CPU tensor then needs TRITON_INTERPRET=1, else
    one ValueError says so)."""
    choice = options.get().backend
    if choice == "auto":
        return x.is_cuda
    if choice == "triton":
        options.check_backend(on_cuda=x.is_cuda)
    return choice == "triton"



def _quant_kernels():
    """kernels/quant/kernel.py, the Triton casts that run where use_triton holds: imported there,
    since it imports Triton, which replayquant installs on Linux only (the torch casts of
    formats/casts.py, the specification, run everywhere else)."""
    from replayquant.kernels.quant import kernel as quant
    return quant

def as_bits(t: torch.Tensor) -> torch.Tensor:
    """t as operators that have no float8 kernel can take it (torch.equal, zero_, copies
    compared bit for bit): an FP8 payload viewed as its bytes, any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _check_stream(stream, fmt: str) -> None:
    """One ValueError unless `stream` is an int or an integer tensor (one stream per matrix)."""
    if isinstance(stream, torch.Tensor):
        ok = not (stream.is_floating_point() or stream.is_complex() or stream.dtype == torch.bool)
    else:
        ok = isinstance(stream, int) and not isinstance(stream, bool)
    if not ok:
        got = stream.dtype if isinstance(stream, torch.Tensor) else repr(stream)
        raise ValueError(f"{fmt}: stream {got}: give an integer or an integer tensor of the "
                         f"input's leading shape (one stream per matrix)")


# the id of each format as the kernels take it (QTensor.kernel_args, the FMT constexpr)
FMT_IDS = {"fp32": 0, "fp16": 1, "bf16": 2, "fp8": 3, "nvfp4": 4}
# the names of a packed tensor's scales as `QTensor.scales` gives them, per format
SCALE_NAMES = {"fp8": ("row", None), "nvfp4": ("block", "matrix")}


@dataclass(init=False)
class QTensor:
    """A physically packed tensor: payload plus the scales its format needs, the one packed type
    of the package: what a format's quantize returns and dequantize takes, the roles (anchor,
    read copy) of a layer's states, and the stored roles of its decode stores, which the kernels
    read (`kernel_args`).

    format:  the format's name (`fmt` is the same, as the kernels spell it).
    shape:   the logical (unpacked) shape.
    payload: fp32 / fp16 / bf16 as the shape; fp8 float8_e4m3fn as the shape; nvfp4 uint8, two
             elements a byte along the last dim (even element in the low nibble).
    scale:   fp8 float32 row scales (one per row of the last dim); nvfp4 uint8 E4M3 scales, one
             per 16 elements of the last dim. None for the other formats.
    gscale:  nvfp4 float32 scale per matrix (the last two dims). None for the other formats.
    rounding: the rounding its writes use ("nearest" / "stochastic"; None where not recorded).

    Every component keeps the leading dims outermost in row-major order: a store's roles are laid
    out per slot ([N, H, d_v, d_k / 2], scales [N, H, d_v, d_k / 16] and [N, H]); a format's
    NVFP4 quantize gives the same bytes with the matrices flattened ([M, d_v, d_k / 2], [M, d_v,
    d_k / 16], [M]). `scales` names the scales as the format API does: {"row": scale} for fp8,
    {"block": scale, "matrix": gscale} for nvfp4, {} otherwise; QTensor(format, shape, payload,
    scales) builds one from them."""

    format: str
    shape: tuple
    payload: torch.Tensor
    scale: torch.Tensor | None = None
    gscale: torch.Tensor | None = None
    rounding: str | None = None

    def __init__(self, format: str, shape, payload: torch.Tensor, scales: dict | None = None, *,
                 scale: torch.Tensor | None = None, gscale: torch.Tensor | None = None,
                 rounding: str | None = None):
        if scales:
            row, matrix = SCALE_NAMES[format]
            scale, gscale = scales.get(row), scales.get(matrix) if matrix else None
        self.format, self.shape, self.payload = format, tuple(shape), payload
        self.scale, self.gscale, self.rounding = scale, gscale, rounding

    @property
    def fmt(self) -> str:
        return self.format

    @property
    def scales(self) -> dict:
        """The scales by the names of the format API ({"row"} fp8, {"block", "matrix"} nvfp4)."""
        names = SCALE_NAMES.get(self.format, (None, None))
        return {n: t for n, t in zip(names, (self.scale, self.gscale)) if n is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.payload, *self.scales.values()))

    @property
    def device(self):
        return self.payload.device

    # -- a store's roles: slots outermost, [N, H, d_v, d_k]
    @classmethod
    def empty(cls, fmt: str, rounding: str, shape, device="cpu") -> "QTensor":
        """Uninitialised storage of format `fmt` for a state [N, H, d_v, d_k] (a store's role)."""
        if fmt not in FMT_IDS:
            raise ValueError(f"unknown state format {fmt!r}; use one of {', '.join(FMT_IDS)}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"unknown rounding {rounding!r}; use one of {ROUNDINGS}")
        N, H, dv, dk = shape
        scale = gscale = None
        if fmt == "fp32":
            payload = torch.empty(shape, dtype=torch.float32, device=device)
        elif fmt in ("fp16", "bf16"):
            dtype = torch.float16 if fmt == "fp16" else torch.bfloat16
            payload = torch.empty(shape, dtype=dtype, device=device)
        elif fmt == "fp8":
            payload = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
            scale = torch.empty(N, H, dv, dtype=torch.float32, device=device)
        else:
            if dk % NVFP4_BLOCK:
                raise ValueError(f"nvfp4 state needs d_k % {NVFP4_BLOCK} == 0 (got d_k={dk})")
            payload = torch.empty(N, H, dv, dk // 2, dtype=torch.uint8, device=device)
            scale = torch.empty(N, H, dv, dk // NVFP4_BLOCK, dtype=torch.uint8, device=device)
            gscale = torch.empty(N, H, dtype=torch.float32, device=device)
        return cls(fmt, shape, payload, scale=scale, gscale=gscale, rounding=rounding)

    def matrix_bytes(self) -> int:
        """Physical bytes of one (slot, head) matrix: payload plus its scales."""
        N, H = self.shape[:2]
        total = sum(t.numel() * t.element_size() for t in (self.payload, self.scale, self.gscale)
                    if t is not None)
        return total // (N * H)

    def dequantize(self, slots=None) -> torch.Tensor:
        """float32 [n, H, dv, dk] of the given slots (all when None) of a store's role (the
        references and tests use this; kernels read the tensors directly)."""
        sl = slice(None) if slots is None else torch.as_tensor(slots, dtype=torch.long,
                                                                device=self.payload.device)
        pay = self.payload[sl]
        if self.format == "fp32":
            return pay.clone()
        if self.format in ("fp16", "bf16"):
            return pay.to(torch.float32)
        if self.format == "fp8":
            return pay.to(torch.float32) * self.scale[sl].unsqueeze(-1)
        n, H, dv, dk2 = pay.shape
        out = ref.nvfp4_dequantize_ref(pay.reshape(n * H, dv, dk2),
                                       self.scale[sl].reshape(n * H, dv, -1),
                                       self.gscale[sl].reshape(-1))
        return out.reshape(n, H, dv, 2 * dk2)

    def write_(self, slots, x: torch.Tensor, key: int, streams: torch.Tensor,
               gscale: torch.Tensor | None = None) -> None:
        """Quantize float32 x [n, H, dv, dk] (rounding of this role, SR streams [n, H]) into
        `slots` with the torch reference of the format (the specification); gscale as encode."""
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.payload.device)
        for t, e in zip((self.payload, self.scale, self.gscale),
                        self.encode(x, key, streams, gscale=gscale)):
            if e is not None:
                t[slots] = e

    def encode(self, x: torch.Tensor, key: int, streams: torch.Tensor, bits=random_bits_ref,
               gscale: torch.Tensor | None = None):
        """The packed tensors (payload, scale, gscale; None where the format has none) of
        float32 x [n, H, dv, dk] cast with this role's rounding, as write_ stores them. SR bits
        come from `bits` with streams [n, H]: random_bits_ref (numpy on the CPU) or
        random_bits_torch (torch ops only, on any device), the same words. gscale (NVFP4 only):
        the matrices' global scales [n, H] given instead of their own (a carried scale,
        casts.nvfp4_carried_scale_ref)."""
        if gscale is not None and self.format != "nvfp4":
            raise ValueError(f"a global scale is NVFP4's; this role is {self.format}")
        x = x.to(torch.float32)
        if self.format == "fp32":
            return x, None, None
        rbits = None
        if self.rounding == "stochastic":
            rbits = bits(x.shape, key, torch.as_tensor(streams), device=x.device)
        n, H, dv, dk = x.shape
        if self.format in ("fp16", "bf16"):
            grid, dtype = (FP16, torch.float16) if self.format == "fp16" else (BF16, torch.bfloat16)
            return ref.cast_ref(x, grid, dtype, rbits), None, None
        if self.format == "fp8":
            pay, scale = ref.fp8_quantize_ref(x, rbits)
            return pay, scale, None
        x3 = x.reshape(n * H, dv, dk)
        pay, bs, gs = ref.nvfp4_quantize_ref(x3, None if rbits is None else rbits.reshape(x3.shape),
                                             None if gscale is None else gscale.reshape(-1))
        return pay.reshape(n, H, dv, -1), bs.reshape(n, H, dv, -1), gs.reshape(n, H)

    def clone(self) -> "QTensor":
        c = lambda t: None if t is None else t.clone()  # noqa: E731
        return QTensor(self.format, self.shape, c(self.payload), scale=c(self.scale),
                       gscale=c(self.gscale), rounding=self.rounding)

    def kernel_args(self):
        """(payload, scale, gscale, fmt id) as the kernels take them (fp8 viewed as bytes,
        fp16/bf16 as int16 so that rounded bit patterns can be stored)."""
        pay = self.payload
        if self.format == "fp8":
            pay = pay.view(torch.uint8)
        elif self.format in ("fp16", "bf16"):
            pay = pay.view(torch.int16)
        sc = self.scale if self.scale is not None else pay
        gs = self.gscale if self.gscale is not None else pay
        return pay, sc, gs, FMT_IDS[self.format]


class Format:
    """Base class: subclasses implement _quantize(x, rbits_or_None, seed, stream) and _dequantize."""

    name: str = ""
    description: str = ""

    def bytes_per_element(self, d: int = 128, rows: int = 128) -> float:
        raise NotImplementedError

    # -- public API
    def quantize(self, x: torch.Tensor, rounding: str = "nearest", seed: int = 0, stream=0,
                 rbits: torch.Tensor | None = None) -> QTensor:
        x = self._check(x, rounding)
        check_seed(seed, f"{self.name}: seed")
        _check_stream(stream, self.name)
        if rbits is not None:
            self._check_bits(rbits, x)
        if rounding == "stochastic" and rbits is None and not use_triton(x):
            rbits = random_bits_ref(x.shape, seed, stream, device=x.device)
        return self._quantize(x, rounding, seed, stream, rbits)

    def dequantize(self, q: QTensor) -> torch.Tensor:
        if q.format != self.name:
            raise ValueError(f"{self.name}: cannot dequantize a {q.format} tensor")
        return self._dequantize(q)

    def zeros(self, shape, device=None) -> QTensor:
        """What quantize gives for torch.zeros(shape) under either rounding, any seed and stream
        (zero lies on every grid and sets no scale), without quantize's finiteness check and its
        host read: the roles of a new sequence's state."""
        x = self._check_shape(torch.zeros(shape, dtype=torch.float32, device=device))
        return self._quantize(x, "nearest", 0, 0, None)

    def fake_quantize(self, x: torch.Tensor, rounding: str = "nearest", seed: int = 0, stream=0,
                      rbits: torch.Tensor | None = None) -> torch.Tensor:
        return self.dequantize(self.quantize(x, rounding, seed, stream, rbits))

    # -- helpers
    def _check(self, x: torch.Tensor, rounding: str) -> torch.Tensor:
        if rounding not in ROUNDINGS:
            raise ValueError(f"{self.name}: unknown rounding {rounding!r}; use one of {ROUNDINGS}")
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{self.name}: input must be a floating-point tensor")
        if x.numel() == 0:
            raise ValueError(f"{self.name}: input has no elements (shape {list(x.shape)}); give a "
                             f"tensor with at least one element")
        x = self._check_shape(x.to(torch.float32).contiguous())
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{self.name}: input contains NaN or infinity; states must be finite")
        return x

    def _check_bits(self, rbits, x: torch.Tensor) -> None:
        """One ValueError unless `rbits` are random bits for `x`: an integer tensor of its shape
        on its device (uint32 values, as `random_bits_ref` gives them in int64)."""
        if (not isinstance(rbits, torch.Tensor) or rbits.is_floating_point() or rbits.is_complex()
                or rbits.dtype == torch.bool or rbits.shape != x.shape
                or rbits.device != x.device):
            got = (f"{rbits.dtype} of shape {list(rbits.shape)} on {rbits.device}"
                   if isinstance(rbits, torch.Tensor) else type(rbits).__name__)
            raise ValueError(f"{self.name}: rbits is {got}; stochastic rounding takes one random "
                             f"uint32 per element: an integer tensor of the input's shape "
                             f"{list(x.shape)} on {x.device} (or rbits=None, drawn from seed and "
                             f"stream)")

    def _check_shape(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0:
            raise ValueError(f"{self.name}: input must have at least one dimension")
        return x

    def __repr__(self) -> str:
        return f"<format {self.name}>"


class FP32Format(Format):
    name = "fp32"
    description = "IEEE binary32 (identity)"

    def bytes_per_element(self, d=128, rows=128):
        return 4.0

    def _quantize(self, x, rounding, seed, stream, rbits):
        return QTensor(self.name, tuple(x.shape), x.clone(), rounding=rounding)

    def _dequantize(self, q):
        return q.payload.clone()


class CastFormat(Format):
    """fp16 / bf16: a plain cast (IEEE overflow to inf, as torch's cast)."""

    def __init__(self, name: str, grid: Grid, dtype: torch.dtype, description: str):
        self.name, self.grid, self.dtype, self.description = name, grid, dtype, description

    def bytes_per_element(self, d=128, rows=128):
        return 2.0

    def _quantize(self, x, rounding, seed, stream, rbits):
        if use_triton(x):
            payload = _quant_kernels().cast_quantize(x, self.grid, self.dtype, rounding, seed,
                                                     stream)
        else:
            payload = ref.cast_ref(x, self.grid, self.dtype, rbits)
        return QTensor(self.name, tuple(x.shape), payload, rounding=rounding)

    def _dequantize(self, q):
        return q.payload.to(torch.float32)


class FP8Format(Format):
    name = "fp8"
    description = "E4M3FN, saturating, one FP32 scale per row (amax/448)"

    def bytes_per_element(self, d=128, rows=128):
        return 1.0 + 4.0 / d

    def _quantize(self, x, rounding, seed, stream, rbits):
        if use_triton(x):
            payload, scale = _quant_kernels().fp8_quantize(x, rounding, seed, stream)
        else:
            payload, scale = ref.fp8_quantize_ref(x, rbits)
        return QTensor(self.name, tuple(x.shape), payload, {"row": scale}, rounding=rounding)

    def _dequantize(self, q):
        if use_triton(q.payload):
            return _quant_kernels().fp8_dequantize(q.payload, q.scales["row"])
        return ref.fp8_dequantize_ref(q.payload, q.scales["row"])


class NVFP4Format(Format):
    name = "nvfp4"
    description = "E2M1 packed 2/byte, E4M3 scale per 16 elements, FP32 scale per matrix"

    def bytes_per_element(self, d=128, rows=128):
        return 0.5 + 1.0 / NVFP4_BLOCK + 4.0 / (d * rows)

    def _check_shape(self, x):
        x = super()._check_shape(x)
        if x.shape[-1] % NVFP4_BLOCK:
            raise ValueError(f"nvfp4: the last dim ({x.shape[-1]}) must be a multiple of "
                             f"{NVFP4_BLOCK} (one E4M3 scale per {NVFP4_BLOCK} elements); pad it "
                             f"or choose another format")
        return x

    @staticmethod
    def _as_matrices(x):
        if x.dim() == 1:
            return x.reshape(1, 1, -1)
        return x.reshape(-1, x.shape[-2], x.shape[-1])

    def _quantize(self, x, rounding, seed, stream, rbits):
        x3 = self._as_matrices(x)
        if use_triton(x):
            if isinstance(stream, torch.Tensor):   # one stream per matrix, in x3's order
                stream = torch.broadcast_to(stream.to(torch.int64), x.shape[:-2]).reshape(-1)
            packed, bscale, gscale = _quant_kernels().nvfp4_quantize(x3, rounding, seed, stream)
        else:
            packed, bscale, gscale = ref.nvfp4_quantize_ref(
                x3, None if rbits is None else rbits.reshape(x3.shape))
        return QTensor(self.name, tuple(x.shape), packed, {"block": bscale, "matrix": gscale},
                       rounding=rounding)

    def _dequantize(self, q):
        if use_triton(q.payload):
            out = _quant_kernels().nvfp4_dequantize(q.payload, q.scales["block"],
                                                    q.scales["matrix"])
        else:
            out = ref.nvfp4_dequantize_ref(q.payload, q.scales["block"], q.scales["matrix"])
        return out.reshape(q.shape)


FORMATS: dict[str, Format] = {
    f.name: f for f in (
        FP32Format(),
        CastFormat("fp16", FP16, torch.float16, "IEEE binary16"),
        CastFormat("bf16", BF16, torch.bfloat16, "bfloat16"),
        FP8Format(),
        NVFP4Format(),
    )
}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; known formats: {', '.join(FORMATS)}") from None
