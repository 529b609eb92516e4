"""`replayquant bench formats`: quantize / dequantize throughput of every format on the GPU.

Input: float32 [N, 128, 128] matrices (state-like: rows scaled over decades), `mbytes` MiB in
all (>= 256). For each format and rounding the Triton kernels of `replayquant.kernels.quant` are
timed with `triton.testing.do_bench` (median, L2 flushed between repetitions); bytes are counted
explicitly as the fewest a kernel must move: quantize reads the float32 input and writes payload
plus scales; dequantize reads payload plus scales and writes float32. The device copy bandwidth
(torch `copy_` of a same-size float32 tensor, read + write bytes) is measured in the same run and
every rate is also given as a share of it. fp16 / bf16 dequantize is torch's own cast (what
`Format.dequantize` runs). NVFP4 quantize is also timed under each launch plan (`nvfp4_plan`
modes) and through the public `Format.quantize` (which adds the finite-input check).

Before timing, every kernel's output on a slice of the input (and on edge values) is compared
bit for bit with the CPU torch reference; the result is stored with the timings.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import triton.testing

from replayquant.formats import get_format
from replayquant.formats.constants import BF16, FP16
from replayquant.kernels.quant import kernel as quant
from replayquant.kernels.quant.launch import nvfp4_plan, override_quant_launch
from replayquant.formats import casts as ref
from replayquant.formats.philox import random_bits_ref
from replayquant.outputs import check_owned, check_writable_folder, output_lock, write_json, write_text
from replayquant.provenance import provenance

D = 128


def _bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _state_like(n: int, device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    z = torch.randn((n, D, D), generator=gen, device=device)
    rows = torch.randn((n, D, 1), generator=gen, device=device)
    return z * torch.pow(10.0, rows)


def _validate(device) -> dict:
    """Bit-exact check of every GPU kernel against the CPU reference (slice + edge values)."""
    x = _state_like(6, device, seed=1)
    x[0, 0, :16] = 0.0
    x[1] = 0.0
    x[2, 3, :8] = torch.tensor([1e-40, -1e-45, 65519.99, 65520.0, 3.3961e38, 2.0 ** -25,
                                1 + 2.0 ** -11, -0.0])
    xc = x.cpu()
    out = {}
    for sr in (False, True):
        rnd = "stochastic" if sr else "nearest"
        rb = random_bits_ref(xc.shape, 5, 9) if sr else None
        for name, grid, dt in (("fp16", FP16, torch.float16), ("bf16", BF16, torch.bfloat16)):
            a = quant.cast_quantize(x, grid, dt, rnd, 5, 9).cpu()
            out[f"{name}/{rnd}"] = torch.equal(a.view(torch.int16),
                                               ref.cast_ref(xc, grid, dt, rb).view(torch.int16))
        xf = x.clone()
        xf[2, 3, :8] = torch.tensor([1e-40, -1e-45, 447.9, 448.0, 3e-3, 2.0 ** -10, 1.0, -0.0])
        p, s = quant.fp8_quantize(xf, rnd, 5, 9)
        p2, s2 = ref.fp8_quantize_ref(xf.cpu(), rb)
        out[f"fp8/{rnd}"] = (torch.equal(p.cpu().view(torch.uint8), p2.view(torch.uint8))
                             and torch.equal(s.cpu(), s2)
                             and torch.equal(quant.fp8_dequantize(p, s).cpu(),
                                             ref.fp8_dequantize_ref(p2, s2)))
        want = ref.nvfp4_quantize_ref(xc, rb)
        dq_want = ref.nvfp4_dequantize_ref(*want)
        for mode in (0, 1, 2):
            for nb in ((None,) if mode == 0 else (64, 128)):
                with override_quant_launch("nvfp4_quantize", mode=mode, nb=nb):
                    got = quant.nvfp4_quantize(x, rnd, 5, 9)
                ok = all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
                ok = ok and torch.equal(quant.nvfp4_dequantize(*got).cpu(), dq_want)
                out[f"nvfp4/{rnd}/mode{mode}" + (f"/nb{nb}" if nb else "")] = ok
    return out


FORMATS_KIND = "replayquant.bench.formats"    # the "kind" of formats.json


def _is_formats(old: dict) -> bool:
    """A formats.json written before they carried a "kind"."""
    return {"params", "copy", "bit_exact_vs_cpu_reference", "rows"} <= set(old)


def check_formats_out(out) -> Path:
    """OUT/formats.json, checked before any work: OUT is a folder that can be written, and holds
    no formats.json / formats.md but this benchmark's (`replayquant.outputs.check_owned`)."""
    outdir = Path(out)
    if outdir.exists() and not outdir.is_dir():
        raise ValueError(f"--out {out} is a file; bench formats writes formats.json and formats.md "
                         f"into a folder: give a folder (created if missing)")
    check_writable_folder(outdir, out)
    path = outdir / "formats.json"
    check_owned(path, FORMATS_KIND, "replayquant bench formats", beside=(outdir / "formats.md",),
                unkinded=_is_formats)
    return path


def run_formats_bench(mbytes: int = 512, out: str = "build/bench", formats=None,
                      git_commit: str | None = None) -> dict:
    """`replayquant bench formats` into the folder `out`, holding its lock from the checks to
    the last write."""
    path = check_formats_out(out)
    with output_lock(path):
        check_formats_out(out)        # again, holding the lock
        return _run_formats_bench(mbytes, out, formats, git_commit)


def _run_formats_bench(mbytes, out, formats, git_commit) -> dict:
    """`replayquant bench formats` after its output checks: the kernels checked bit for bit, the
    copy bandwidth, then each format's quantize and dequantize timed; formats.json and
    formats.md written into `out`."""
    if mbytes < 256:
        raise ValueError(f"bench formats: mbytes={mbytes}; use >= 256 MiB so that the input is "
                         f"several times the L2 cache")
    if not torch.cuda.is_available():
        raise ValueError("bench formats needs a CUDA GPU (the Triton kernels run there)")
    dev = torch.device("cuda")
    formats = list(formats or ("fp16", "bf16", "fp8", "nvfp4"))
    n = (mbytes << 20) // (D * D * 4)
    x = _state_like(n, dev)
    in_bytes = n * D * D * 4
    print(f"input: float32 [{n}, {D}, {D}] = {in_bytes / 1e9:.3f} GB on {torch.cuda.get_device_name()}",
          flush=True)

    validation = _validate(dev)
    print("bit-exact vs CPU reference:", "all" if all(validation.values()) else validation,
          flush=True)

    dst = torch.empty_like(x)
    copy_ms = _bench(lambda: dst.copy_(x))
    copy_gbs = 2 * in_bytes / copy_ms / 1e6
    print(f"copy: {copy_ms:.4f} ms, {copy_gbs:.1f} GB/s (read + write)", flush=True)
    del dst

    rows = _Rows(copy_gbs)
    for name in formats:
        for rounding in ("nearest", "stochastic"):
            if name in ("fp16", "bf16"):
                _cast_rows(rows, x, name, rounding)
            elif name == "fp8":
                _fp8_rows(rows, x, rounding)
            elif name == "nvfp4":
                _nvfp4_rows(rows, x, rounding)
            else:
                raise ValueError(f"bench formats: unknown format {name!r}")

    result = {
        "kind": FORMATS_KIND,
        "provenance": provenance(dev, **({"git_commit": git_commit} if git_commit else {})),
        "params": {"mbytes": mbytes, "shape": [n, D, D], "input": "float32 N(0,1) * 10^N(0,1) per row",
                   "timer": "triton.testing.do_bench median, warmup 25 ms, rep 100 ms",
                   "bytes": "quantize: input + payload + scales; dequantize: payload + scales + "
                            "output; copy: read + write"},
        "copy": {"ms": copy_ms, "bytes": 2 * in_bytes, "GBps": copy_gbs},
        "bit_exact_vs_cpu_reference": validation,
        "rows": rows.rows,
    }
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    write_json(outdir / "formats.json", result, indent=2)
    write_text(outdir / "formats.md", render_markdown(result))
    print(f"wrote {outdir / 'formats.json'} and {outdir / 'formats.md'}", flush=True)
    return result


class _Rows:
    """The timed rows, each printed as it is added with its share of the copy bandwidth."""

    def __init__(self, copy_gbs):
        self.rows, self.copy_gbs = [], copy_gbs

    def add(self, fmt, rounding, op, variant, ms, nbytes):
        gbs = nbytes / ms / 1e6
        self.rows.append({"format": fmt, "rounding": rounding, "op": op, "variant": variant,
                          "ms": ms, "bytes": nbytes, "GBps": gbs,
                          "pct_copy": 100 * gbs / self.copy_gbs})
        print(f"{fmt:6s} {rounding:10s} {op:10s} {variant:28s} {ms:8.4f} ms {gbs:8.1f} GB/s "
              f"{100 * gbs / self.copy_gbs:6.1f}% of copy", flush=True)


def _cast_rows(rows: _Rows, x, name, rounding) -> None:
    """fp16 / bf16: the Triton cast, and torch's cast back to float32."""
    numel, in_bytes = x.numel(), x.numel() * 4
    grid, dt = (FP16, torch.float16) if name == "fp16" else (BF16, torch.bfloat16)
    q = quant.cast_quantize(x, grid, dt, rounding, 1, 0)
    ms = _bench(lambda: quant.cast_quantize(x, grid, dt, rounding, 1, 0))
    rows.add(name, rounding, "quantize", "triton", ms, in_bytes + numel * 2)
    ms = _bench(lambda: q.to(torch.float32))
    rows.add(name, rounding, "dequantize", "torch cast", ms, numel * 2 + in_bytes)


def _fp8_rows(rows: _Rows, x, rounding) -> None:
    """fp8: quantize (payload + one float32 scale per row) and dequantize."""
    numel, in_bytes, n = x.numel(), x.numel() * 4, x.shape[0]
    p, s = quant.fp8_quantize(x, rounding, 1, 0)
    qb = numel + 4 * n * D
    ms = _bench(lambda: quant.fp8_quantize(x, rounding, 1, 0))
    rows.add("fp8", rounding, "quantize", "triton", ms, in_bytes + qb)
    ms = _bench(lambda: quant.fp8_dequantize(p, s))
    rows.add("fp8", rounding, "dequantize", "triton", ms, qb + in_bytes)


# NVFP4 quantize launch plans timed beside the default: (mode, NB, warps, fast path)
_NVFP4_SWEEP = {"nearest": [(0, None, 8, False), (0, None, 4, True), (0, None, 16, True),
                            (1, 128, 4, True), (1, 256, 8, True), (1, 512, 8, True),
                            (2, 128, 4, True)],
                "stochastic": [(0, None, 8, True), (0, None, 16, True), (1, 64, 4, True),
                               (1, 256, 4, True)]}


def _nvfp4_rows(rows: _Rows, x, rounding) -> None:
    """nvfp4: quantize at the default plan and each of _NVFP4_SWEEP, through Format.quantize
    (round to nearest), and dequantize at NB 128 and 256."""
    numel, in_bytes, n = x.numel(), x.numel() * 4, x.shape[0]
    name = "nvfp4"
    qb = numel // 2 + numel // 16 + 4 * n
    packed = quant.nvfp4_quantize(x, rounding, 1, 0)
    plan = nvfp4_plan(D * D // 16, stochastic=rounding == "stochastic")
    ms = _bench(lambda: quant.nvfp4_quantize(x, rounding, 1, 0))
    rows.add(name, rounding, "quantize", f"default (mode {plan[0]}, NB {plan[1]})", ms,
             in_bytes + qb)
    for mode, nb, nw, fast in _NVFP4_SWEEP[rounding]:
        with override_quant_launch("nvfp4_quantize", mode=mode, nb=nb, num_warps=nw, fast=fast):
            ms = _bench(lambda: quant.nvfp4_quantize(x, rounding, 1, 0))
        rows.add(name, rounding, "quantize",
                 f"mode {mode} NB {nb or 1024} warps {nw}" + ("" if fast else " int-path"),
                 ms, in_bytes + qb)
    if rounding == "nearest":
        fmt = get_format("nvfp4")
        ms = _bench(lambda: fmt.quantize(x, rounding))
        rows.add(name, rounding, "quantize", "Format.quantize (finite check)", ms,
                 in_bytes + qb)
    ms = _bench(lambda: quant.nvfp4_dequantize(*packed))
    rows.add(name, rounding, "dequantize", "triton NB 128", ms, qb + in_bytes)
    with override_quant_launch("nvfp4_dequantize", nb=256, num_warps=8):
        ms = _bench(lambda: quant.nvfp4_dequantize(*packed))
    rows.add(name, rounding, "dequantize", "triton NB 256", ms, qb + in_bytes)


def render_markdown(result: dict) -> str:
    p = result["provenance"]
    c = result["copy"]
    lines = [
        f"# Format kernels: throughput on {p['device']}",
        "",
        f"Input float32 {result['params']['shape']} ({result['params']['input']}); "
        f"{result['params']['timer']}; bytes counted as {result['params']['bytes']}.",
        f"Copy bandwidth measured in the same run: **{c['GBps']:.0f} GB/s** ({c['ms']:.4f} ms).",
        f"Kernels bit-exact vs the CPU reference: "
        f"{'all' if all(result['bit_exact_vs_cpu_reference'].values()) else result['bit_exact_vs_cpu_reference']}.",
        f"git {p['git_commit']}, torch {p['versions']['torch']}, triton {p['versions']['triton']}, "
        f"{p['date']}. Generated by `replayquant bench formats` from formats.json.",
        "",
        "| format | rounding | op | variant | ms | GB/s | % of copy |",
        "| --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['format']} | {r['rounding']} | {r['op']} | {r['variant']} | "
                     f"{r['ms']:.4f} | {r['GBps']:.0f} | {r['pct_copy']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_formats_bench(mbytes=int(os.environ.get("MBYTES", "512")),
                      out=os.environ.get("OUT", "build/bench"))
