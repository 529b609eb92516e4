"""The timed rows of our decode kernels in `replayquant bench kernels`: the conventional step,
the replay window (and with detail its read and flush steps, the forced flush, the pointer
kernel) and the speculative rounds, each a CUDA graph over rotated state copies (cold L2)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from replayquant.testing import random_state
from replayquant.bench.kernels.grid import (PAIR_L, PAIRS, SHAPES, BatchInputs, kernel_fns,
                                            kernel_inputs, load_pair)
from replayquant.bench.kernels.sweep import launched, pair_config, store_options
from replayquant.bench.kernels.timing import empty_cache, rotations, time_calls, timed_row
from replayquant.kernels.replay.decode import advance_pointers
from replayquant.replay.stores import ConventionalStore, ReplayStore, make_snapshots
from replayquant.kernels.conventional.verify import conventional_accept
from replayquant.kernels.replay.verify import replay_accept
from replayquant.statebytes import (conventional_bytes, io_bytes, replay_flush_step_bytes,
                                    replay_read_step_bytes, replay_window_bytes, ring_u_bytes,
                                    state_bytes)

READ_REG_CAPS = (168, 128)  # registers a thread of the read launch's capped variants (detail rows)
ALTERNATE_MAX_B = 8         # the forced step is timed alternately with the conventional one up to here
ALTERNATE_REPEATS = 3


def conv_calls(f, kw, idx, out, stores) -> list:
    """One conventional step per (rotated) store, as calls of no arguments, pointers held (at
    the launch of the caller's `launched` block)."""
    return [lambda c=c: f["conv"](c, **kw, state_indices=idx, out=out, advance=False)
            for c in stores]


def bench_conventional(kind, B, device, copy_bw, cfg=None, S=None):
    """Conventional FP32 and BF16 steps at batch B (cold L2: state copies rotated)."""
    cfg = cfg or {}
    S = S or SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    f = kernel_fns(kind)
    init = random_state(B, H, dv, dk, seed=B, device=device)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    kw = kernel_inputs(kind, S, B, seed=1, device=device)
    out = torch.empty(B, H, dv, device=device)
    rows = []
    for fmt in ("fp32", "bf16"):
        c = cfg.get("conventional/fp32", {})
        R = rotations(B * H * state_bytes(fmt, dv, dk), device)
        css = [ConventionalStore.from_state(init, fmt) for _ in range(R)]
        calls = conv_calls(f, kw, idx, out, css)
        with launched(c):
            ms = time_calls(lambda: [g() for g in calls], 8) / R
        rows.append(timed_row(kind, "conventional", fmt, B, ms,
                              conventional_bytes(kind, fmt, B, H, HK, dv, dk), copy_bw, config=c,
                              rot=R))
        del css, calls
    del init
    empty_cache()
    return rows


class _ReplaySetup:
    """Inputs, output buffer and R rotated ReplayStore copies (cold L2) of one (pair, L) at batch
    B, with the shapes, step functions, formats (af anchor, rf read) and launch config `c`."""

    def __init__(self, kind, B, pair, L, device, cfg, S):
        S = S or SHAPES[kind]
        self.kind, self.B, self.pair, self.L = kind, B, pair, L
        self.H, self.HK, self.dv, self.dk = S["H"], S["HK"], S["dv"], S["dk"]
        init = random_state(B, self.H, self.dv, self.dk, seed=B, device=device)
        self.idx = torch.arange(B, dtype=torch.int32, device=device)
        self.kw = kernel_inputs(kind, S, B, seed=1, device=device)
        self.out = torch.empty(B, self.H, self.dv, device=device)
        P, self.af, self.rf = load_pair(pair, L)
        self.c = pair_config(cfg or {}, pair)
        per = B * self.H * (state_bytes(self.af, self.dv, self.dk)
                            + (state_bytes(self.rf, self.dv, self.dk) if self.rf else 0))
        self.R = rotations(per, device)
        self.sts = [ReplayStore.from_state(init, P, kind, key_heads=self.HK,
                                           **store_options(self.c)) for _ in range(self.R)]
        self.f = kernel_fns(kind)

    def step(self, st, **opts):
        """The replay step on store `st` with the setup's inputs, output and slots."""
        return self.f["step"](st, **self.kw, state_indices=self.idx, out=self.out, **opts)

    def read_step_bytes(self, h):
        return replay_read_step_bytes(self.kind, self.rf or self.af, h, self.B, self.H, self.HK,
                                      self.dv, self.dk, ring_u_bytes(self.af, self.rf), self.L)


@dataclass(frozen=True)
class ReplayExtras:
    """The rows bench_replay times beside the window: detail, the read step (h = L/2) and the
    flush step alone; forced, the path='flush' step (every step flushes); pointer, the pointer
    kernel alone."""
    detail: bool = False
    forced: bool = False
    pointer: bool = False


def bench_replay(kind, B, pair, L, device, copy_bw, cfg=None, extras=ReplayExtras(), S=None):
    """Replay rows of one (pair, L) at batch B, a step's two launches (pointer move inside): the
    mean step of a whole window of L steps (one flush per row; state copies rotated for a cold
    L2), and the `extras` rows (the forced flush alternated with the conventional step too, at
    batches up to ALTERNATE_MAX_B)."""
    s = _ReplaySetup(kind, B, pair, L, device, cfg, S)
    calls = [lambda st=st: s.step(st, path="replay") for st in s.sts]
    with launched(s.c):
        ms = time_calls(lambda: [g() for g in calls], L) / s.R
    rows = [timed_row(kind, "replay-window", pair, B, ms,
                      replay_window_bytes(kind, s.af, s.rf, L, B, s.H, s.HK, s.dv, s.dk), copy_bw,
                      L=L, config=s.c, rot=s.R,
                      note="mean step over a window of L steps (one flush per row), pointer "
                           "move included")]
    if extras.detail:
        rows += _detail_rows(s, copy_bw)
    if extras.forced:
        rows += _forced_rows(s, copy_bw)
        if B <= ALTERNATE_MAX_B:
            rows += _alternated(s, copy_bw)
    if extras.pointer:
        st = s.sts[0]
        ms = time_calls(lambda: advance_pointers(st, s.idx), 8)
        rows.append(timed_row(kind, "pointer-advance", "-", B, ms, None, copy_bw,
                              note="once per token for all layers of a model"))
    del s, calls
    empty_cache()
    return rows


def _detail_rows(s: _ReplaySetup, copy_bw) -> list:
    """The read step (h = L/2) alone, at the pair's config and with the read launch's registers
    capped (READ_REG_CAPS), and the flush step (h = L - 1) alone, pointers held."""
    kind, B, pair, L, c = s.kind, s.B, s.pair, s.L, s.c
    st = s.sts[0]
    h = L // 2
    st.committed.fill_(h)
    with launched(c):
        ms = time_calls(lambda: s.step(st, path="replay", advance=False), 8)
    rows = [timed_row(kind, "replay-read-step", pair, B, ms, s.read_step_bytes(h), copy_bw,
                      L=L, h=h, config=c)]
    # the same read step with the read launch's registers capped (more programs an SM,
    # ptxas spilling what does not fit): occupancy against spills, side by side
    base = (c.get("launch") or {}).get("read") or (None, None)
    for regs in READ_REG_CAPS:
        lc = {**(c.get("launch") or {}), "read": (*base[:2], regs)}
        with launched({"launch": lc}):
            ms = time_calls(lambda: s.step(st, path="replay", advance=False), 8)
        rows.append(timed_row(kind, f"replay-read-step-regs{regs}", pair, B, ms,
                              s.read_step_bytes(h), copy_bw, L=L, h=h, config={"launch": lc}))
    st.committed.fill_(L - 1)
    with launched(c):
        ms = time_calls(lambda: s.step(st, path="replay", advance=False), 4)
    rows.append(timed_row(kind, "replay-flush-step", pair, B, ms,
                          replay_flush_step_bytes(kind, s.af, s.rf, L, B, s.H, s.HK, s.dv, s.dk),
                          copy_bw, L=L, config=c))
    st.committed.zero_()
    return rows


def _forced_rows(s: _ReplaySetup, copy_bw) -> list:
    """The path='flush' step (every step flushes) over the rotated stores, with the pointer move
    and without it."""
    rows = []
    for kernel, opts, note in (
            ("replay-forced-flush", {}, "path='flush': every step flushes, pointer move "
             "included"),
            ("replay-forced-flush-layer", {"advance": False}, "path='flush' without the "
             "pointer move (a model advances the pointers once per token for all its "
             "layers)")):
        calls = [lambda st=st, o=opts: s.step(st, path="flush", **o) for st in s.sts]
        with launched(s.c):
            ms = time_calls(lambda: [g() for g in calls], 8) / s.R
        rows.append(timed_row(s.kind, kernel, s.pair, s.B, ms, None, copy_bw, L=s.L, rot=s.R,
                              note=note))
    return rows


def anchor_ways(f, kw, idx, out, sts) -> dict:
    """The two ways of running one compiled launch at small batch, each a list of calls over
    the rotated ReplayStores `sts`: the conventional FP32 kernel on ConventionalStore views of
    their anchors ('conv-on-anchor') and the replay step with path='flush' on empty buffers and
    no pointer move ('replay-forced-auto-layer')."""
    views = [ConventionalStore(s.anchor, s.n_flush, s.key) for s in sts]
    return {"conv-on-anchor": conv_calls(f, kw, idx, out, views),
            "replay-forced-auto-layer": [
                lambda st=st: f["step"](st, **kw, state_indices=idx, out=out, path="flush",
                                        advance=False) for st in sts]}


def alternate_ms(ways: dict, R: int, repeats: int, report=None) -> dict:
    """ms per step of each way (a list of R rotated calls, 8 steps each), the ways timed one
    after the other `repeats` times; report(way, repeat, ms) after each timing."""
    times = {k: [] for k in ways}
    for rep in range(repeats):
        for k, calls in ways.items():
            times[k].append(time_calls(lambda: [g() for g in calls], 8) / R)
            if report is not None:
                report(k, rep, times[k][-1])
    return times


def _alternated(s: _ReplaySetup, copy_bw) -> list:
    """anchor_ways timed alternately ALTERNATE_REPEATS times (medians): at small batch the same
    kernel timed later in one bench call read up to 11% slower on the H200 (the one kernel read
    3.07 us, then 3.42 us, in consecutive repetitions), so the batch-1 target compares these two
    rather than rows timed minutes apart."""
    kernels = {"conv-on-anchor": "conventional-alternated",
               "replay-forced-auto-layer": "replay-forced-auto-layer-alternated"}
    times = alternate_ms(anchor_ways(s.f, s.kw, s.idx, s.out, s.sts), s.R, ALTERNATE_REPEATS)
    conv = statistics.median(times["conv-on-anchor"])
    rows = []
    for way, ts in times.items():
        ms = statistics.median(ts)
        rows.append(timed_row(s.kind, kernels[way], "fp32" if way == "conv-on-anchor" else s.pair,
                              s.B, ms, None, copy_bw, L=s.L, rot=s.R, us_each=[t * 1e3 for t in ts],
                              speedup_vs_alternated_conv=conv / ms,
                              note="median of alternated timings (conventional kernel on the same "
                                   "anchors / replay-forced-auto-layer)"))
    return rows


def spec_accepts(B, T, device):
    """The accept counts of a speculative round at batch B: uniform in 0..T per row, drawn from
    a generator seeded with B (the same for our rounds and the authors')."""
    g = torch.Generator().manual_seed(B)
    return torch.randint(0, T + 1, (B,), generator=g, dtype=torch.int32).to(device)


def bench_spec(kind, B, T, device, copy_bw, cfg=None, pairs=PAIRS, L=None, S=None,
               snapshots=True):
    """Speculative rounds: replay verify + accept vs conventional per-draft snapshots + accept
    (snapshots=False: the replay rounds alone)."""
    cfg = cfg or {}
    S = S or SHAPES[kind]
    L = L or PAIR_L[kind]
    s = BatchInputs.draw(kind, S, B, device, copy_bw, state_seed=B + 1, input_seed=3, T=T)
    n = spec_accepts(B, T, device)
    rows = _replay_rounds(s, T, n, pairs, L, cfg)
    if snapshots:
        rows += _snapshot_rounds(s, T, n, cfg.get("conventional/fp32", {}))
    del s
    empty_cache()
    return rows


def _replay_rounds(s: BatchInputs, T, n, pairs, L, cfg) -> list:
    """Per pair the replay verify of T drafts + accept of n ('spec-replay-round'), and the same
    round with every draft rejected ('spec-replay-round-no-flush')."""
    kind, B, f, kw, idx, out = s.kind, s.B, s.f, s.kw, s.idx, s.out
    tokens = B * (float(n.float().mean()) + 1.0)       # accepted drafts + the bonus token
    rows = []
    # the measured round, and the same round with every draft rejected: nothing is committed,
    # so no row ever flushes; the difference between the two is what the flushes cost
    rounds = (("spec-replay-round", n), ("spec-replay-round-no-flush", torch.zeros_like(n)))
    for pair in pairs:
        c = pair_config(cfg, pair)
        for kernel, acc in rounds:
            st = ReplayStore.from_state(s.init, load_pair(pair, L)[0], kind, key_heads=s.S["HK"],
                                        max_drafts=T, **store_options(c))

            def rnd():
                f["verify"](st, **kw, state_indices=idx, out=out)
                replay_accept(st, acc, idx, check=False)
            with launched(c):
                ms = time_calls(rnd, 8)
            if acc is n:
                extra = dict(tokens_per_s=tokens / ms * 1e3, mean_accept=float(n.float().mean()))
            else:
                extra = dict(note="every draft rejected: verify + pointer move, never a flush")
            rows.append(timed_row(kind, kernel, pair, B, ms, None, s.copy_bw, T=T, L=L, **extra))
            del st
    return rows


def _snapshot_rounds(s: BatchInputs, T, n, c) -> list:
    """The conventional FP32 verify with per-draft snapshots ('spec-snapshot-verify') and its
    round: verify + restore of snapshot n ('spec-snapshot-round'), at launch config c."""
    kind, B, f, kw, idx, out = s.kind, s.B, s.f, s.kw, s.idx, s.out
    H, HK, dv, dk = s.S["H"], s.S["HK"], s.S["dv"], s.S["dk"]
    tokens = B * (float(n.float().mean()) + 1.0)
    cs = ConventionalStore.from_state(s.init, "fp32")
    snaps = make_snapshots(cs, T)
    with launched(c):
        ms = time_calls(lambda: f["cverify"](cs, snaps, **kw, state_indices=idx, out=out), 8)
    sb = state_bytes("fp32", dv, dk)
    nbv = B * H * ((1 + T) * sb + T * io_bytes(kind, H, HK, dv, dk))
    rows = [timed_row(kind, "spec-snapshot-verify", "fp32", B, ms, nbv, s.copy_bw, T=T)]

    def rndc():
        f["cverify"](cs, snaps, **kw, state_indices=idx, out=out)
        conventional_accept(cs, snaps, n, idx, check=False)
    with launched(c):
        ms = time_calls(rndc, 8)
    frac = float((n > 0).float().mean())
    rows.append(timed_row(kind, "spec-snapshot-round", "fp32", B, ms,
                          nbv + B * H * 2 * sb * frac, s.copy_bw, T=T,
                          tokens_per_s=tokens / ms * 1e3, mean_accept=float(n.float().mean()),
                          note="verify + restore of snapshot n (a copy) for rows with n > 0"))
    del cs, snaps
    return rows
