"""Stochastic-rounding streams of the replay state: one Philox stream per
(seed, layer, flush index, role, batch row, head), shared by every backend.

Decode (ReplayState, the Triton decode kernel) and teacher forcing (the chunked kernel) call
these two functions, so the same seed gives the same SR bits element by element.
Flush index 0 is the cast of the initial state; flush n >= 1 is the n-th flush of that sequence.
"""

from __future__ import annotations

import operator

import torch

ANCHOR, READ = 0, 1
SEED_LIMIT = 1 << 63            # layer_seed keeps 63 bits


def check_seed(seed, what: str = "seed") -> int:
    """`seed` as an int, or one ValueError (naming it as `what`) unless it is an integer in
    [0, 2^63): `layer_seed` keeps 63 bits of seed * 1000003 + layer, a bijection of the seeds in
    that range, so a seed outside it would repeat one inside and a fraction would be dropped."""
    try:
        s = None if isinstance(seed, bool) else operator.index(seed)
    except TypeError:
        s = None
    if s is None or not 0 <= s < SEED_LIMIT:
        raise ValueError(f"{what} {seed!r}: give an integer in [0, 2^63) (stochastic rounding "
                         f"keys on 63 bits of it: a seed outside them repeats one inside, a "
                         f"fraction would be dropped)")
    return s


def layer_seed(seed: int, layer: int = 0) -> int:
    """Philox key of one layer: distinct layers get unrelated streams (`check_seed`: one
    ValueError for a seed that would repeat another's streams)."""
    return (check_seed(seed) * 1_000_003 + int(layer)) & (SEED_LIMIT - 1)


def sr_stream(flush_index, role: int, batch_rows, heads: int) -> torch.Tensor:
    """int64 streams [B, H] for the matrices of one flush.

    flush_index: int or int64 tensor [B] (sequences flush at different times);
    role: ANCHOR or READ; batch_rows: int64 tensor [B] of sequence ids (batch row or state slot).
    Layout: flush_index << 41 | role << 40 | batch_row << 16 | head.
    """
    rows = torch.as_tensor(batch_rows, dtype=torch.int64)
    fi = torch.as_tensor(flush_index, dtype=torch.int64, device=rows.device)
    fi = torch.broadcast_to(fi, rows.shape)
    h = torch.arange(heads, dtype=torch.int64, device=rows.device)
    return ((fi << 41) | (role << 40) | (rows << 16)).unsqueeze(-1) | h
