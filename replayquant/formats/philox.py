"""Counter-based random bits (Philox4x32-10), the same stream in torch and in Triton.

Every stochastic rounding draws one uint32 per element: element e of a matrix (its index in
the matrix, row-major) takes word e % 4 of
    philox(key = seed (64 bit), counter = (e // 4, stream_lo, stream_hi, 0))
so one Philox evaluation serves four consecutive elements (a kernel's tile computes it once per
group), and a caller gives each (layer, head, step ...) its own reproducible stream by choosing
`stream`. (One evaluation per element, taking word 0 of counter e, would do four times the
Philox work for bits of the same distribution.)
`philox_ref` (torch) works in int64 (products of two uint32 wrap modulo 2^64; the high word is
recovered exactly with an arithmetic shift and a mask): it is the readable specification.
`random_bits_ref` computes the same words with numpy in uint32 lanes and exact uint64 products
(no masks, half the memory traffic, no thread pool), about 10-20x faster on the CPU;
`random_bits_torch` runs philox_ref on any device with torch ops alone (what random_bits_ref
does for a GPU, and what the torch decode step `replay.engine` uses everywhere: no host copy,
traceable by torch.compile); tests check the three against each other.
"""

from __future__ import annotations

import numpy as np
import torch

from replayquant.formats.constants import (PHILOX_M0, PHILOX_M1, PHILOX_ROUNDS, PHILOX_W0,
                                           PHILOX_W1)

_MASK = 0xFFFFFFFF


def split_u64(value):
    """(lo, hi) 32-bit words of a non-negative 64-bit integer (python int or int64 tensor)."""
    if isinstance(value, torch.Tensor):
        return value & _MASK, (value >> 32) & _MASK
    value = int(value) & 0xFFFFFFFFFFFFFFFF
    return value & _MASK, value >> 32


def philox_ref(c0, c1, c2, c3, k0, k1, rounds: int = PHILOX_ROUNDS):
    """Philox4x32 on int64 tensors holding uint32 values; returns the four output words."""
    k0 = torch.as_tensor(k0, dtype=torch.int64)
    k1 = torch.as_tensor(k1, dtype=torch.int64)
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in (c0, c1, c2, c3))
    for _ in range(rounds):
        p0 = c0 * PHILOX_M0
        p1 = c2 * PHILOX_M1
        c0, c1, c2, c3 = (((p1 >> 32) & _MASK) ^ c1 ^ k0, p1 & _MASK,
                          ((p0 >> 32) & _MASK) ^ c3 ^ k1, p0 & _MASK)
        k0 = (k0 + PHILOX_W0) & _MASK
        k1 = (k1 + PHILOX_W1) & _MASK
    return c0, c1, c2, c3


def _streams(shape, stream, device):
    """(per-matrix streams int64 [matrices] on `device`, elements per matrix) of random_bits_ref."""
    shape = tuple(shape)
    mat_shape = shape[:-2] if len(shape) >= 2 else ()
    per_matrix = 1
    for d in shape[len(mat_shape):]:
        per_matrix *= d
    if isinstance(stream, torch.Tensor):
        streams = torch.broadcast_to(stream.to(device=device, dtype=torch.int64), mat_shape)
    else:
        n = 1
        for d in mat_shape:
            n *= d
        streams = (int(stream) + torch.arange(n, dtype=torch.int64, device=device)).reshape(mat_shape)
    return streams.reshape(-1), per_matrix


def random_bits_ref(shape, seed: int, stream, device=None) -> torch.Tensor:
    """uint32 random bits (as int64) for a tensor of `shape` [..., R, C] (or [C]).

    `stream`: an int64 tensor broadcastable to shape[:-2] (one stream per matrix), or an int
    (matrices then get streams stream + flat matrix index). device: where the bits are made and
    returned (default the CPU, with numpy); a GPU makes them with random_bits_torch.
    """
    if device is not None and torch.device(device).type != "cpu":
        return random_bits_torch(shape, seed, stream, device)
    shape = tuple(shape)
    streams, per_matrix = _streams(shape, stream, "cpu")
    streams = streams.reshape(-1, 1).numpy().astype(np.uint64)
    s_lo = (streams & np.uint64(_MASK)).astype(np.uint32)
    s_hi = (streams >> np.uint64(32)).astype(np.uint32)
    elem = np.arange(-(-per_matrix // 4), dtype=np.uint32).reshape(1, -1)      # groups of 4
    k0, k1 = split_u64(seed)
    r = np.stack(_philox_np(elem, s_lo, s_hi, k0, k1), axis=-1)        # [streams, groups, 4]
    r = np.broadcast_to(r, (s_lo.shape[0],) + r.shape[1:]).reshape(s_lo.shape[0], 4 * elem.size)
    return torch.from_numpy(r[:, :per_matrix].astype(np.int64)).reshape(shape)


def _philox_np(c0, c1, c2, k0: int, k1: int, rounds: int = PHILOX_ROUNDS):
    """The four words of Philox4x32 with counter (c0, c1, c2, 0) on uint32 numpy arrays
    (broadcasting); the same arithmetic as `philox_ref`, products exact in uint64."""
    m0, m1, s32 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1), np.uint64(32)
    c3 = np.zeros_like(c0)
    for _ in range(rounds):
        p0 = c0.astype(np.uint64) * m0
        p1 = c2.astype(np.uint64) * m1
        c0, c1, c2, c3 = ((p1 >> s32).astype(np.uint32) ^ c1 ^ np.uint32(k0), p1.astype(np.uint32),
                          (p0 >> s32).astype(np.uint32) ^ c3 ^ np.uint32(k1), p0.astype(np.uint32))
        k0 = (k0 + PHILOX_W0) & _MASK
        k1 = (k1 + PHILOX_W1) & _MASK
    return c0, c1, c2, c3


def group_words(c0, c1, c2, c3, n: int) -> torch.Tensor:
    """Philox words of counters (groups) [..., G] -> the bits of elements [..., n]: element e
    takes word e % 4 of group e // 4 (n <= 4 G)."""
    return torch.stack((c0, c1, c2, c3), dim=-1).flatten(-2)[..., :n]


def random_bits_torch(shape, seed: int, stream, device="cpu", chunk: int = 1 << 24) -> torch.Tensor:
    """random_bits_ref's words with philox_ref's int64 torch arithmetic on `device` (a GPU
    makes a store's bits there instead of on the host), about `chunk` elements at a time to
    bound the int64 temporaries."""
    shape = tuple(shape)
    streams, per_matrix = _streams(shape, stream, device)
    out = torch.empty(streams.shape[0], per_matrix, dtype=torch.int64, device=device)
    groups = torch.arange(-(-per_matrix // 4), dtype=torch.int64, device=device).reshape(1, -1)
    k0, k1 = split_u64(seed)
    step = max(1, chunk // max(per_matrix, 1))
    for i in range(0, streams.shape[0], step):
        lo, hi = split_u64(streams[i:i + step].reshape(-1, 1))
        out[i:i + step] = group_words(*philox_ref(groups, lo, hi, 0, k0, k1), per_matrix)
    return out.reshape(shape)
