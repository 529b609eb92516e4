"""What a `replayquant bench kernels` call runs: its sections in priority order, each with an
estimate of its seconds, so that a time budget skips the lowest priorities first."""

from __future__ import annotations

import math
from dataclasses import dataclass

from replayquant.bench.kernels.grid import PAIR_L, SHAPES, SPEC_KINDS, KernelGrid, check_names
from replayquant.bench.kernels.rows import ALTERNATE_MAX_B, ALTERNATE_REPEATS, READ_REG_CAPS
from replayquant.bench.kernels.sweep import READ_CANDIDATES
from replayquant.pairs import PrecisionPair

# Seconds per timed measurement: a fixed cost (do_bench warmup + reps, graph capture), a compile
# per new kernel specialization, setup + timed replays that grow with the bytes of the states,
# and Python launches of the rotated small-batch windows (captured, warmed up twice), and the
# casts of stores with a stochastic-rounding role (sr_per_GB). The GPU checks compile every
# kernel on a fresh machine. Fitted by non-negative least squares to the section_s times of 470
# sections (868 s) of H200 grids on fresh machines (cold-L2 rotations): the grid in four calls
# (333 s, nothing skipped) and in one call with checks and sweep (535 s of sections). A store
# built on a GPU draws its Philox bits there (philox.random_bits_torch), so the SR casts cost
# nothing measurable (sr_per_GB 0; the term stays for the model's shape), nor do the Python
# launches of the small-batch windows (launch 0). The whole grid, checks and sweep included,
# is ~520 s by this fit: two device calls (e.g. --kinds gdn / --kinds mamba2), not one.
_EST = dict(fixed=0.26, compile=1.46, per_GB=0.098, checks=49.0, copy=3.0, peer=0.12, launch=0.0,
            sr_per_GB=0.0)


def _sr_pair(name) -> bool:
    """Whether pair `name` has a role with stochastic rounding."""
    P = PrecisionPair.load(name)
    return any(r is not None and r.rounding == "stochastic" for r in (P.anchor, P.read))


def _launches(kind, B, L, S, rot=True):
    """Python kernel launches of one rotated window measurement (3 passes: 2 warm-ups, capture)."""
    if not rot:
        return 0
    gb = _gb(kind, B, S)
    R = min(64, max(1, math.ceil(0.1 / max(gb, 1e-9))))      # 2x a 50 MB L2
    return 3 * 3 * R * L


def _gb(kind, B, S=None):
    S = S or SHAPES[kind]
    return B * S["H"] * S["dv"] * S["dk"] * 4 / 1e9


@dataclass
class _Grid:
    """One plan's grid: the kinds measured, their shapes and main L, the pairs (sr: which have a
    stochastic-rounding role) and batches."""
    kinds: tuple
    shapes: dict
    pairs: tuple
    batches: tuple
    Ls: tuple
    spec_batches: tuple
    mainL: dict
    sr: dict

    def gb(self, kind, B):
        return _gb(kind, B, self.shapes[kind])

    def spec_kinds(self):
        return [k for k in self.kinds if k in SPEC_KINDS]


def plan(grid: KernelGrid, authors=False):
    """The benchmark's sections of `grid` in priority order, each (key, estimated seconds, what):
    the targets first (conventional, every pair at the kind's main L, the authors' windows and
    the staggered windows, T = 4 at the largest spec batch), then the peers, the other L values
    (none with main_L_only) and the other T values. authors: the authors' rows (bench.authors).
    Speculative rounds, the authors' rows and the accuracy comparison for SPEC_KINDS only."""
    shapes = grid.shapes or SHAPES
    kinds = tuple(shapes) if grid.kinds is None else tuple(grid.kinds)
    pairs, Ls, Ts = grid.pairs, grid.Ls, grid.Ts
    check_names(pairs, kinds)
    g = _Grid(kinds, shapes, tuple(pairs), tuple(grid.batches), tuple(Ls),
              tuple(grid.spec_batches),
              mainL={k: (PAIR_L[k] if PAIR_L[k] in Ls else Ls[0]) for k in kinds},
              sr={p: _sr_pair(p) for p in pairs})       # stores of these pairs are slow to build
    sec = []
    if grid.checks:
        sec.append(("checks", _EST["checks"], ("checks",)))
    if grid.accuracy:        # against float64: ours, the authors' (bench.authors)
        sec += _accuracy_sections(g, authors)
    if grid.sweep:
        sec += _sweep_sections(g)
    sec += _main_sections(g, grid.detail_batches)
    # beside the authors' kernels (replayquant.bench.authors): their windows and our staggered
    # windows, then (below) their GDN speculative round
    sec += _authors_sections(g, authors, grid.staggered_batches)
    bigT = max(Ts) if Ts else None
    if bigT:
        sec += _spec_sections(g, bigT)
        if authors:
            sec += _spec_authors_sections(g, bigT)
    if grid.peers:                      # fla / mamba_ssm: before the other L values
        sec += _peer_sections(g)
    if not grid.main_L_only:
        sec += _other_L_sections(g)
    for T in Ts:
        if T != bigT:
            sec += _spec_sections(g, T)
    return sec


def _accuracy_sections(g: _Grid, authors) -> list:
    E = _EST
    return [(f"accuracy/{kind}", E["compile"] * (2 * len(g.pairs) + 4 * authors) + 2.0,
             ("accuracy", kind)) for kind in g.spec_kinds()]


def _sweep_sections(g: _Grid) -> list:
    E = _EST
    n = 3 + len(g.pairs) * (len(READ_CANDIDATES) + 5)
    return [(f"sweep/{kind}", n * (E["fixed"] + E["compile"] * 0.6)
             + n * 1.5 * _gb(kind, 256, g.shapes[kind]) * E["per_GB"], ("sweep", kind))
            for kind in g.kinds]


def _main_sections(g: _Grid, detail_batches) -> list:
    """Per kind and batch the conventional steps, then every pair at the kind's main L (detail
    rows at detail_batches; the forced flush, and at small batch its alternated timing, for
    s32_rs; the pointer kernel with the first pair)."""
    E, pairs, batches = _EST, g.pairs, g.batches
    sec = []
    for kind in g.kinds:
        L = g.mainL[kind]
        for B in batches:
            gb = g.gb(kind, B)
            sec.append((f"{kind}/B{B}/conventional", 2 * (E["fixed"] + gb * E["per_GB"])
                        + 2 * E["launch"] * _launches(kind, B, 8, g.shapes[kind])
                        + 2 * E["compile"] * (kind == "kda" and B == batches[0]),
                        ("conv", kind, B)))
            for pair in pairs:
                det = B in detail_batches
                forced = pair == "s32_rs"
                alt = 2 * ALTERNATE_REPEATS * (forced and B <= ALTERNATE_MAX_B)
                n = 1 + (2 + len(READ_REG_CAPS)) * det + 2 * forced + (pair == pairs[0]) + alt
                sec.append((f"{kind}/B{B}/{pair}/L{L}",
                            n * E["fixed"] + (1 + det) * gb * E["per_GB"] * (L / 8)
                            + (E["compile"] * 2 if B == batches[0] else 0)
                            + (1 + 2 * forced + alt) * E["launch"]
                            * _launches(kind, B, L, g.shapes[kind])
                            + g.sr[pair] * E["sr_per_GB"] * gb,
                            ("replay", kind, B, pair, L, det, forced, pair == pairs[0],
                             )))
    return sec


def _spec_sections(g: _Grid, T) -> list:
    """Speculative rounds of T drafts per spec kind, the largest batch first."""
    E, P = _EST, len(g.pairs)
    n_sr = sum(g.sr.values())
    sec = []
    for kind in g.spec_kinds():
        for B in sorted(g.spec_batches, reverse=True):
            gb = g.gb(kind, B)
            rounds = (2 + (B >= 128)) * P + 2       # + the block-read round at B >= 128
            sec.append((f"spec/{kind}/B{B}/T{T}",
                        rounds * (E["fixed"] + gb * E["per_GB"] * (1 + T / 2))
                        + P * E["compile"] + 2 * n_sr * E["sr_per_GB"] * gb,
                        ("spec", kind, B, T)))
    return sec


def _authors_sections(g: _Grid, authors, staggered_batches) -> list:
    """The authors' windows (with authors) and, at staggered_batches, our windows with rows out
    of phase."""
    E = _EST
    sec = []
    for kind in g.spec_kinds():
        L = g.mainL[kind]
        for B in g.batches:
            gb = g.gb(kind, B)
            stag = B in staggered_batches
            if authors:
                sec.append((f"authors/{kind}/B{B}", (1 + stag) * (E["fixed"] + gb * E["per_GB"]
                                                                  * (L / 8))
                            + (2 * E["compile"] if B == g.batches[0] else 0),
                            ("authors", kind, B, stag)))
            for pair in g.pairs if stag else ():
                sec.append((f"staggered/{kind}/B{B}/{pair}", E["fixed"] + gb * E["per_GB"]
                            * (L / 8), ("staggered", kind, B, pair)))
    return sec


def _spec_authors_sections(g: _Grid, T) -> list:
    E = _EST
    return [(f"spec-authors/{kind}/B{B}/T{T}", E["compile"] * 2 + E["fixed"]
             + g.gb(kind, B) * E["per_GB"] * (1 + T / 2), ("spec-authors", kind, B, T))
            for kind in g.spec_kinds() for B in sorted(g.spec_batches, reverse=True)]


def _peer_sections(g: _Grid) -> list:
    E = _EST
    return [(f"peers/{kind}/B{B}", 3 * (E["peer"] + g.gb(kind, B) * E["per_GB"])
             + E["compile"] * (kind == "kda" and B == g.batches[0]), ("peers", kind, B))
            for kind in g.kinds for B in g.batches]


def _other_L_sections(g: _Grid) -> list:
    """Every pair at the L values other than the kind's main L (the forced flush does not depend
    on L: main L only)."""
    E = _EST
    sec = []
    for kind in g.kinds:
        for L in g.Ls:
            if L == g.mainL[kind]:
                continue
            for B in g.batches:
                gb = g.gb(kind, B)
                for pair in g.pairs:
                    sec.append((f"{kind}/B{B}/{pair}/L{L}",
                                E["fixed"] + gb * E["per_GB"] * (L / 8)
                                + (E["compile"] * 2 if B == g.batches[0] else 0)
                                + E["launch"] * _launches(kind, B, L, g.shapes[kind])
                                + g.sr[pair] * E["sr_per_GB"] * gb,
                                ("replay", kind, B, pair, L, False, False, False)))
    return sec


def estimate_s(sections) -> float:
    return _EST["copy"] + sum(s[1] for s in sections)
