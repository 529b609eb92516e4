"""Assertions shared by several test files (pytest puts tests/ on sys.path)."""

import json
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import torch


def stable_seed(*parts) -> int:
    """A generator seed from a test's parameters that is the same in every process (Python's
    hash() of a string changes per process, so a seed from it made a tolerance a coin toss)."""
    return zlib.crc32(repr(parts).encode())




def assert_states_close(a: torch.Tensor, b: torch.Tensor, tight=1e-5, frac=0.02):
    """Dequantized states: equal within float32 reassociation, except a few elements where the
    tiny difference of the unrounded values crossed a rounding boundary (one grid step)."""
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    scale = b.abs().max().clamp(min=1e-30)
    d = (a - b).abs()
    assert (d > tight * scale).float().mean() <= frac, (d.max() / scale).item()
    assert d.max() <= 0.5 * scale


def scan_inputs(gen, B, T, H, dk, dv, delta, a_min=0.9):
    """Random recurrence inputs [B, T, H, ...]: q scaled by 1/sqrt(dk), L2-normalised k, decay
    a in [a_min, 1), beta in [0, 1) for GDN (delta) else None."""
    q = torch.randn(B, T, H, dk, generator=gen) / dk ** 0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, dv, generator=gen)
    log_a = torch.log(a_min + (1 - a_min) * torch.rand(B, T, H, generator=gen))
    beta = torch.rand(B, T, H, generator=gen) if delta else None
    return q, k, v, log_a, beta


def vector_log_a(gen, B, T, H, dk, a_min=0.9):
    """Per-channel log decays [B, T, H, d_k] (Kimi Delta Attention) whose channels differ
    strongly, so that a decay applied on the wrong axis shows: the first quarter of the
    channels forgets within a step (log a down to -40), the rest decay as in scan_inputs
    (a in [a_min, 1)), a channel in eight hardly at all (a in [0.999, 1))."""
    la = torch.log(a_min + (1 - a_min) * torch.rand(B, T, H, dk, generator=gen))
    la[..., : dk // 4] = -40.0 * torch.rand(B, T, H, dk // 4, generator=gen)
    la[..., dk // 4:: 8] = torch.log(0.999 + 0.001 * torch.rand(B, T, H, len(range(dk // 4, dk, 8)),
                                                                 generator=gen))
    return la


def _compile_check(args, cwd, interpret: bool):
    """`python -m replayquant.kernels.compile_check ARGS` on this tree: (exit code, output)."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-m", "replayquant.kernels.compile_check", *args],
                       env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    return r.returncode, r.stdout + r.stderr


def recorded_launches(drive: Path, kernel: str, tmp_path: Path) -> list:
    """The launches of `kernel` that the driver script `drive` makes, recorded in the Triton
    interpreter (compile_check record)."""
    out = tmp_path / "launches.json"
    rc, log = _compile_check(["record", str(out), "--", str(drive)], tmp_path, True)
    assert rc == 0, log[-3000:]
    return [ln for ln in json.loads(out.read_text()) if ln["kernel"] == kernel]


def assert_compile_for_sm90(launches: list, tmp_path: Path) -> None:
    """Every distinct specialization among `launches` compiles for sm_90 (Triton's compiler and
    ptxas, compile_check compile; no GPU)."""
    out = tmp_path / "chosen.json"
    out.write_text(json.dumps(launches))
    rc, log = _compile_check(["compile", str(out), "--arch", "90"], tmp_path, False)
    assert rc == 0, log[-4000:]
    assert re.search(r"^compile_check: (\d+)/\1 specializations .* compile for sm_90$", log,
                     flags=re.M), log[-2000:]


def assert_same_store(a, b):
    """Bit-identical stores (pointers, both roles, buffers, a carried scale's record;
    NaN-poisoned entries where both are), and the arrival counters of the in-kernel pointer
    move back at zero."""
    for name in ("committed", "n_flush", "start"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for role in ("anchor", "read"):
        ra, rb = getattr(a, role), getattr(b, role)
        if ra is not None:
            for t in ("payload", "scale", "gscale"):
                if getattr(ra, t, None) is not None:
                    assert torch.equal(getattr(ra, t).view(torch.uint8),
                                       getattr(rb, t).view(torch.uint8)), (role, t)
    for name in ("kbuf", "vbuf", "ubuf", "Gbuf", "bbuf", "Tbuf", "carried"):
        ta, tb = getattr(a, name), getattr(b, name)
        if ta is not None:
            assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), name
    assert a.arrive is None or not a.arrive.any()
