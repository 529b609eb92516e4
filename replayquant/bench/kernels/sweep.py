"""The launch-config sweep of `replayquant bench kernels`: each launch's candidate configs timed
at one batch on fresh stores, and the fastest kept for the rows at large batch."""

from __future__ import annotations

import contextlib

from replayquant.bench.kernels.grid import PAIR_L, PAIRS, SHAPES, BatchInputs, load_pair
from replayquant.bench.kernels.timing import empty_cache, time_calls, timed_row
from replayquant.kernels.conventional.launch import override_conventional_launch
from replayquant.kernels.replay.launch import override_replay_launch
from replayquant.replay.stores import ConventionalStore, ReplayStore
from replayquant.statebytes import (conventional_bytes, replay_flush_step_bytes,
                                    replay_read_step_bytes, ring_u_bytes)

# Launch-config candidates of the sweep, (rows, warps[, register cap]): the read launch (any
# tile), the flush launch of pairs that write no NVFP4 role, and of those that do (whole matrices)
READ_CANDIDATES = ((16, 1), (32, 1), (32, 2), (32, 4), (64, 2), (64, 2, 168), (64, 4), (128, 4))
FLUSH_CANDIDATES = {"plain": ((16, 1), (16, 2), (32, 2), (32, 4), (64, 4)),
                    "whole": ((None, 4), (None, 8), (None, 4, 168))}
# the conventional step's (block_v, num_warps): the candidates of an earlier, wider H200 sweep
# less those that never won
CONVENTIONAL_CANDIDATES = ((16, 1), (32, 4), (64, 8))


def config_sweep(kind, B, device, copy_bw, pairs=PAIRS, L=None, S=None):
    """Launch configs timed at batch B on fresh stores (never by re-running a live in-place
    state): the conventional step (block_v, num_warps); per pair the replay read launch on a read
    step (h = L/2, pointers held) and the flush launch on a flush step (h = L - 1), each with the
    other launch at the table's config (on a read step the flush launch only reads pointers).
    Returns (rows, best config per kernel: 'conventional/fp32' and 'replay/PAIR' {'launch':
    {'read', 'flush'}})."""
    S = S or SHAPES[kind]
    L = L or PAIR_L[kind]
    s = BatchInputs.draw(kind, S, B, device, copy_bw, state_seed=B, input_seed=1)
    rows = _sweep_conventional(s)
    cfg = {"conventional/fp32": min(rows, key=lambda r: r["us"])["cfg"]}
    for pair in pairs:
        pair_rows, pick = _sweep_replay(s, pair, L)
        rows += pair_rows
        cfg[f"replay/{pair}"] = {"launch": pick}
    empty_cache()
    return rows, cfg


def _sweep_conventional(s: BatchInputs) -> list:
    """Rows 'sweep/conventional': the conventional FP32 step at each of CONVENTIONAL_CANDIDATES
    that fits d_v, pointers held."""
    kind, B, f, kw, idx, out = s.kind, s.B, s.f, s.kw, s.idx, s.out
    H, HK, dv, dk = s.S["H"], s.S["HK"], s.S["dv"], s.S["dk"]
    cs = ConventionalStore.from_state(s.init, "fp32")
    cands = []
    for bv, nw in CONVENTIONAL_CANDIDATES:
        if bv > dv:
            continue
        c = dict(block_v=bv, num_warps=nw)
        with launched(c):
            ms = time_calls(lambda: f["conv"](cs, **kw, state_indices=idx, out=out, advance=False),
                            8)
        cands.append(timed_row(kind, "sweep/conventional", "fp32", B, ms,
                               conventional_bytes(kind, "fp32", B, H, HK, dv, dk), s.copy_bw,
                               cfg=c))
    return cands


def _sweep_replay(s: BatchInputs, pair, L):
    """Rows 'sweep/replay-read-step' and 'sweep/replay-flush-step' of `pair`: the read launch's
    candidates on a read step (h = L/2), the flush launch's on a flush step (h = L - 1), pointers
    held. Returns (rows, the fastest {'read': config, 'flush': config})."""
    kind, B, f, kw, idx, out = s.kind, s.B, s.f, s.kw, s.idx, s.out
    H, HK, dv, dk = s.S["H"], s.S["HK"], s.S["dv"], s.S["dk"]
    P, af, rf = load_pair(pair, L)
    st = ReplayStore.from_state(s.init, P, kind, key_heads=HK)
    flush_c = FLUSH_CANDIDATES["whole" if "nvfp4" in (af, rf) else "plain"]
    rows, pick = [], {}
    for which, h, cands_w, nbytes in (
            ("read", L // 2, READ_CANDIDATES,
             replay_read_step_bytes(kind, rf or af, L // 2, B, H, HK, dv, dk,
                                    ring_u_bytes(af, rf), L)),
            ("flush", L - 1, flush_c,
             replay_flush_step_bytes(kind, af, rf, L, B, H, HK, dv, dk))):
        cands = []
        for c in cands_w:
            if (c[0] or dv) > dv:
                continue
            launch = {which: tuple(c)}
            st.committed.fill_(h)
            with launched({"launch": launch}):
                ms = time_calls(lambda: f["step"](st, **kw, state_indices=idx, out=out,
                                                  path="replay", advance=False),
                                8 if which == "read" else 4)
            cands.append(timed_row(kind, f"sweep/replay-{which}-step", pair, B, ms, nbytes,
                                   s.copy_bw, cfg={"launch": launch}, h=h, L=L))
        pick[which] = min(cands, key=lambda r: r["us"])["cfg"]["launch"][which]
        rows += cands
    del st
    return rows, pick


def store_options(cfg) -> dict:
    """The options a config gives ReplayStore.from_state ({'nvfp4_scale': 'carried'}: a design
    timed beside the format's own scale), {} by default."""
    return dict((cfg or {}).get("store", {}))


def pair_config(cfg, pair):
    """A pair's replay launch config, {'launch': ...} as picked by the sweep (step and verify
    alike), or {} (the launch table's)."""
    return dict(cfg.get(f"replay/{pair}", {}))


@contextlib.contextmanager
def launched(cfg):
    """For the block, the kernels launch as a config of the sweep says (the form its rows
    record): {'launch': {...}} a replay pair's (override_replay_launch), {'block_v': ...,
    'num_warps': ...} the conventional step's (override_conventional_launch); {} or None: the
    launch tables'. A 'store' entry (the stores' options, store_options) is not a launch's."""
    cfg = dict(cfg or {})
    cfg.pop("store", None)
    with override_replay_launch(cfg.pop("launch", None)), override_conventional_launch(**cfg):
        yield
