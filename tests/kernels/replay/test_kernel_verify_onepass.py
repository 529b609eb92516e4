"""The one-pass verify (design='onepass', kernels/replay/verify_onepass.py) in the Triton
interpreter against the step kernel's verify (design='step-kernel') and the torch reference,
from the same store each round: outputs (into a NaN-poisoned buffer), ring entries, key factors,
pointers, and roles (written only by the pre-flush, the same launch in both designs; a row that
does not pre-flush keeps them bit for bit). The stores reach rows in different phases, some
pre-flushing, through reference rounds with per-row accepts."""

import pytest
import torch

from replayquant.testing import (gdn_params, gdn_step_inputs, mamba2_params,
                                 mamba2_step_inputs, random_state)
from replayquant.kernels.replay.reference import (replay_accept_ref, replay_gdn_verify_ref,
                                                  replay_mamba2_verify_ref)
from replayquant.replay.stores import ReplayStore
from replayquant.kernels.replay.launch import override_replay_launch
from replayquant.kernels.replay.verify import replay_gdn_verify, replay_mamba2_verify
from replayquant.pairs import PrecisionPair
from _helpers import assert_same_store

# kind, pair, key heads, heads, d_k, d_v, batch, T, L, read launch (rows, warps), q dtype
CASES = [
    ("gdn", "s32_rs", 1, 2, 32, 16, 3, 3, 4, None, torch.bfloat16),
    ("gdn", "tp8_hi32", 1, 2, 64, 32, 2, 4, 8, (16, 1), torch.bfloat16),   # 2 chunks, 2 blocks
    ("gdn", "tp4_hi32", 2, 2, 32, 32, 1, 1, 4, None, torch.float32),       # q in 3 bf16 parts
    ("gdn", "tp4_hi32", 1, 2, 16, 16, 2, 4, 4, None, torch.bfloat16),      # T = L
    ("mamba2", "s32_rs", 1, 2, 32, 16, 3, 3, 4, None, torch.bfloat16),
    ("mamba2", "tp8_hi32", 1, 2, 16, 32, 2, 2, 8, (16, 1), torch.float32),
    ("mamba2", "tp4_hi32", 1, 2, 32, 16, 2, 4, 8, None, torch.bfloat16),
]
WARM, ROUNDS = 5, 2           # reference rounds before the first compared one; compared rounds
ROLE_FIELDS = ("payload", "scale", "gscale")


def _inputs(kind, HK, H, dk, dv, B, T, qdtype, seed):
    """(verify keyword arguments, reference keyword arguments) of T drafts on B rows."""
    if kind == "gdn":
        q, k, v, a, b = gdn_step_inputs(B, HK, H, dk, dv, T=T, seed=seed)
        A_log, dtb = gdn_params(H, seed)
        return dict(q=q.to(qdtype), k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dtb)
    x, dt, Bm, C, z = mamba2_step_inputs(B, HK, H, dk, dv, T=T, seed=seed)
    A, D, dtb = mamba2_params(H, seed)
    return dict(x=x, dt=dt, A=A, B=Bm, C=C.to(qdtype), D=D, z=z, dt_bias=dtb)


def _close(a, b, tol, flips=0.0):
    """|a - b| <= tol (relative to b's largest value), except a fraction `flips` of elements
    up to 1e-2: a u rounded to bf16 (a read copy apart from its anchor) whose float32 value
    sits on a rounding boundary, either way, changes the drafts after it."""
    scale = max(b.abs().max().item(), 1e-30)
    d = (a.float() - b.float()).abs() / scale
    assert (d > tol).float().mean().item() <= flips, d.max().item()
    assert d.max().item() <= (1e-2 if flips else tol), d.max().item()


def _same_store(one, two, bf16_u):
    """The stores after the two designs' verifies: ring and pointers, roles bit for bit."""
    for f in ("kbuf", "vbuf", "Gbuf", "bbuf", "committed", "start", "n_flush", "arrive"):
        assert torch.equal(getattr(one, f), getattr(two, f)), f
    if one.ubuf is not None:
        _close(one.ubuf, two.ubuf, 2 ** -8 if bf16_u else 1e-6)
    if one.Tbuf is not None:
        _close(one.Tbuf, two.Tbuf, 1e-5)
    for role in ("anchor", "read"):
        a, b = getattr(one, role), getattr(two, role)
        for f in ROLE_FIELDS if a is not None else ():
            if getattr(a, f) is not None:
                assert torch.equal(getattr(a, f), getattr(b, f)), (role, f)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:2] + c[4:9])))
def test_onepass_verify(case):
    kind, pair, HK, H, dk, dv, B, T, L, rows, qdtype = case
    N = B + 1
    idx = torch.cat([torch.randperm(N, generator=torch.Generator().manual_seed(B))[:B],
                     torch.tensor([-1])])                  # a padding row last
    st = ReplayStore.from_state(random_state(N, H, dv, dk, seed=T + 7),
                                PrecisionPair.load(pair).with_buffer_len(L), kind,
                                key_heads=HK, seed=5, max_drafts=T)
    ver, ref = (replay_gdn_verify, replay_gdn_verify_ref) if kind == "gdn" else \
        (replay_mamba2_verify, replay_mamba2_verify_ref)
    launch = {} if rows is None else {"read": rows}
    bf16_u = st.ubuf is not None and st.ubuf.dtype == torch.bfloat16
    phases = set()
    for rnd in range(WARM + ROUNDS):
        kw = _inputs(kind, HK, H, dk, dv, B + 1, T, qdtype, seed=100 * rnd + dk)
        n = torch.where((torch.arange(B + 1) + rnd) % 3 > 0, T, 0)   # rows drift apart
        if rnd >= WARM:
            h = st.committed[idx[:B]]
            phases |= set(((h + T > L) & (h > 0)).tolist())       # pre-flushes or not
            one, two = st.clone(), st.clone()
            out = torch.full((B + 1, T, H, dv), float("nan"))
            with override_replay_launch(launch):
                y1 = ver(one, **kw, state_indices=idx, out=out, design="onepass")
            assert y1 is out and torch.isfinite(y1).all() and (y1[B] == 0).all()
            y0 = ver(two, **kw, state_indices=idx, design="step-kernel")
            _close(y1, y0, 1e-5, 0.02 if bf16_u else 0.0)
            _same_store(one, two, bf16_u)
            assert one.pending_T == T
            kept = idx[:B][~((h + T > L) & (h > 0))].long()     # rows that did not pre-flush
            for role in ("anchor", "read"):
                if getattr(st, role) is not None:
                    assert torch.equal(getattr(one, role).payload[kept],
                                       getattr(st, role).payload[kept]), role
        yr = ref(st, **kw, state_indices=idx)
        if rnd >= WARM:
            if pair == "s32_rs":
                _close(y1, yr, 1e-5)
            else:   # a lossy copy: as close to the reference as the step kernel's verify
                sc = yr.abs().max()
                assert (y1 - yr).abs().max() <= min((y0 - yr).abs().max() + 1e-5 * sc,
                                                    0.05 * sc)
        replay_accept_ref(st, n, idx)
    assert phases == {True, False}, phases


def test_onepass_bad_design():
    st = ReplayStore.from_state(random_state(2, 2, 16, 16), PrecisionPair.load("s32_rs"), "gdn",
                                key_heads=1, max_drafts=2)
    kw = _inputs("gdn", 1, 2, 16, 16, 2, 2, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="design must be one of 'onepass', 'step-kernel'"):
        replay_gdn_verify(st, **kw, design="one-pass")
    assert st.pending_T is None


# kind, pair, d_k, d_v, L, T: the read tile holds d_v rows, two sub-tiles of the flush's (GDN
# tp8_hi32: 16-row tiles, key factors; Mamba-2 s32_rs: 32-row tiles of a shared FP32 pair)
INSIDE = [("gdn", "tp8_hi32", 32, 32, 4, 3), ("mamba2", "s32_rs", 16, 64, 4, 3)]


@pytest.mark.parametrize("case", INSIDE, ids=lambda c: f"{c[0]}-{c[1]}")
def test_preflush_inside_the_read_program_equals_the_flush_launch(case):
    """override_replay_launch({'fused': 'read'}): each program of a row that pre-flushes folds
    its own tile (sub-tiles of the flush launch's rows), then verifies: the outputs and the
    whole store bit for bit the flush launch's then the one-pass kernel's, over rounds with
    rows in different phases (some pre-flushing, one a window full of accepted drafts) and a
    padding row; 'fused' True and an NVFP4
    role are refused with one error each."""
    kind, pair, dk, dv, L, T = case
    HK, H, B = 1, 2, 3
    idx = torch.tensor([2, 0, -1, 3])
    st = ReplayStore.from_state(random_state(B + 1, H, dv, dk, seed=3),
                                PrecisionPair.load(pair).with_buffer_len(L), kind,
                                key_heads=HK, seed=5, max_drafts=T)
    ver, ref = (replay_gdn_verify, replay_gdn_verify_ref) if kind == "gdn" else \
        (replay_mamba2_verify, replay_mamba2_verify_ref)
    pre, full = [], False
    for rnd in range(5):
        kw = _inputs(kind, HK, H, dk, dv, B + 1, T, torch.bfloat16, seed=7 * rnd + dk)
        if rnd >= 2:
            h = st.committed[idx[idx >= 0]]
            pre += ((h + T > L) & (h > 0)).tolist()
            full |= bool((h == L).any())             # a window filled by accepted drafts
            one, two = st.clone(), st.clone()
            out = torch.full((B + 1, T, H, dv), float("nan"))
            with override_replay_launch({"fused": "read"}):
                y1 = ver(one, **kw, state_indices=idx, out=out)
            with override_replay_launch({"fused": False}):
                y0 = ver(two, **kw, state_indices=idx)
            assert torch.equal(y1, y0)
            assert_same_store(one, two)
        ref(st, **kw, state_indices=idx)
        replay_accept_ref(st, torch.tensor([T, 1, 0, 2]).roll(rnd), idx)
    assert True in pre and False in pre and full, pre
    with pytest.raises(ValueError, match="a decode step's"), \
            override_replay_launch({"fused": True}):
        ver(st.clone(), **kw, state_indices=idx)
    nv = ReplayStore.from_state(random_state(B + 1, H, dv, dk), PrecisionPair.load("tp4_hi32"),
                                kind, key_heads=HK, max_drafts=T)
    with pytest.raises(ValueError, match="without an NVFP4 role"), \
            override_replay_launch({"fused": "read"}):
        ver(nv, **kw, state_indices=idx)
