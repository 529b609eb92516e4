"""The deferred-fold decode step (design='deferred-fold', kernels/replay/fold.py) in the Triton
interpreter, over three windows and more, rows in phase and out of phase (two rows in phase,
one two steps ahead), NaN-poisoned ring and outputs, a padding row, fresh inputs each step:

* against today's kernel in the same schedule (replay_decode's verify of one draft, accepted,
  from a clone of the same store each step): outputs, anchor, ring and pointers;
* against today's eager schedule (the default step, its own chain): outputs every step, the
  anchor where both have just folded a window, and the pointers' correspondence (a row at
  h == L here is a row at h == 0 there, one flush ahead);
* against the torch reference of the schedule (replay/reference.py, its own chain);
* the anchor against a float64 recurrence after each row's third window;
* advance=False then fold_advance_pointers equals advance=True;
* the store converted to a ReplayState (models.decode_store.store_to_state) with rows at
  h == L, stepped by ReplayState: the same outputs.
"""

import pytest
import torch

from replayquant.kernels.conventional.reference import (gdn_frontend_ref, mamba2_frontend_ref,
                                                        mamba2_post_ref)
from replayquant.kernels.replay.fold import (fold_advance_pointers, replay_gdn_step,
                                             replay_mamba2_step)
from replayquant.kernels.replay.launch import override_replay_launch
from replayquant.kernels.replay.reference import (replay_gdn_fold_step_ref,
                                                  replay_mamba2_fold_step_ref)
from replayquant.kernels.replay.verify import (replay_accept, replay_gdn_verify,
                                               replay_mamba2_verify)
from replayquant.models.decode_store import store_to_state
from replayquant.pairs import PrecisionPair
from replayquant.replay.stores import ReplayStore
from replayquant.testing import (gdn_params, gdn_step_inputs, mamba2_params,
                                 mamba2_step_inputs, random_state)

# kind, key heads, heads, d_k, d_v, L, fold launch (rows, warps, chunk, stages, qload; None:
# the table's): GDN in two chunks of 32 columns, q and k chunks loaded from the inputs; Mamba-2
# in two row blocks and two chunks of 16, with L = 3 (a buffer tile larger than L)
CASES = [("gdn", 1, 2, 64, 16, 4, (None, None, None, None, True)),
         ("mamba2", 1, 2, 32, 32, 3, (16, 1))]
AHEAD = (0, 0, 2)            # steps each batch row is ahead: two rows in phase, one staggered
RING = ("kbuf", "vbuf", "ubuf", "Gbuf", "bbuf")
MAX_REL = {}                 # the largest relative differences seen in a test, by comparison


def _inputs(kind, B, HK, H, dk, dv, seed):
    """One step's inputs of B rows; gates that keep the state for hundreds of steps, so that
    every fold's rounding stays in the anchor the float64 check reads."""
    if kind == "gdn":
        q, k, v, a, b = gdn_step_inputs(B, HK, H, dk, dv, seed=seed)
        return (q, k, v, a - 6.0, b) + gdn_params(H, seed)
    x, dt, Bm, C, z = mamba2_step_inputs(B, HK, H, dk, dv, seed=seed)
    return (x, dt - 4.0, Bm, C, z) + mamba2_params(H, seed)


def _sub(inp, rows):
    """The inputs of the given batch rows (the per-head parameters as they are)."""
    return tuple(t[rows] if i < 5 else t for i, t in enumerate(inp))


def _step(kind, fn, store, inp, idx, **kw):
    if kind == "gdn":
        q, k, v, a, b, A_log, dtb = inp
        return fn(store, q, k, v, a, b, A_log, dtb, state_indices=idx, **kw)
    x, dt, Bm, C, z, A, D, dtb = inp
    return fn(store, x, dt, A, Bm, C, state_indices=idx, D=D, z=z, dt_bias=dtb, **kw)


def _verify_one(kind, store, inp, idx):
    """Today's kernel in the deferred schedule: a verify of one draft, accepted."""
    drafts = tuple(t.unsqueeze(1) if i < 5 else t for i, t in enumerate(inp))
    if kind == "gdn":
        q, k, v, a, b, A_log, dtb = drafts
        y = replay_gdn_verify(store, q, k, v, a, b, A_log, dtb, state_indices=idx)
    else:
        x, dt, Bm, C, z, A, D, dtb = drafts
        y = replay_mamba2_verify(store, x, dt, A, Bm, C, state_indices=idx, D=D, z=z,
                                 dt_bias=dtb)
    replay_accept(store, torch.ones(idx.shape[0], dtype=torch.int32), idx)
    return y[:, 0]


def _frontend(kind, inp):
    """(q, k, v, log_a, beta) float64 of a step (the references' front end, per value head)."""
    if kind == "gdn":
        q, k, v, a, b, A_log, dtb = inp
        fe = gdn_frontend_ref(q, k, v, a, b, A_log, dtb)
    else:
        x, dt, Bm, C, z, A, D, dtb = inp
        fe = mamba2_frontend_ref(x, dt, A, Bm, C, dtb)[:4] + (None,)
    return tuple(None if t is None else t.double() for t in fe)


def _f64_step(kind, S, fe):
    q, k, v, log_a, beta = fe
    S = S * torch.exp(log_a)[..., None, None]
    u = beta[..., None] * (v - (S * k[:, :, None, :]).sum(-1)) if kind == "gdn" else v
    return S + u[..., :, None] * k[:, :, None, :]


def _close(name, a, b, tol):
    """max |a - b| relative to b's largest value, within tol; NaN (a poisoned ring entry never
    written) where both are."""
    a, b = a.double(), b.double()
    both = torch.isnan(a) & torch.isnan(b)
    a, b = torch.where(both, 0.0, a), torch.where(both, 0.0, b)
    d = ((a - b).abs().max() / max(b.abs().max().item(), 1e-30)).item()
    MAX_REL[name] = max(MAX_REL.get(name, 0.0), d)
    assert d <= tol, (name, d)


def _bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-L{c[5]}")
def test_fold_step_over_three_windows(case):
    kind, HK, H, dk, dv, L, rows = case
    MAX_REL.clear()
    B = len(AHEAD)
    N = B + 1
    gen = torch.Generator().manual_seed(dk + L)
    slots = torch.randperm(N, generator=gen)[:B].to(torch.int32)
    idx = torch.cat([slots, torch.tensor([-1], dtype=torch.int32)])     # a padding row last
    init = random_state(N, H, dv, dk, seed=L)
    pair = PrecisionPair.load("s32_rs").with_buffer_len(L)
    store = ReplayStore.from_state(init, pair, kind, key_heads=HK, seed=3, max_drafts=1)
    for t in RING:
        if getattr(store, t) is not None:
            getattr(store, t).view(torch.uint8).fill_(0xFF)             # NaN: never read
    step_fn = replay_gdn_step if kind == "gdn" else replay_mamba2_step
    ref_fn = replay_gdn_fold_step_ref if kind == "gdn" else replay_mamba2_fold_step_ref
    launch = {} if rows is None else {"fold": rows}
    S64 = init.double().clone()
    seed = 1000 * L
    for j in range(1, max(AHEAD) + 1):       # the rows ahead: their first steps alone
        ahead = [b for b in range(B) if AHEAD[b] >= j]
        inp = _sub(_inputs(kind, B, HK, H, dk, dv, seed), ahead)
        seed += 1
        _step(kind, ref_fn, store, inp, idx[ahead])
        sl = idx[ahead].long()
        S64[sl] = _f64_step(kind, S64[sl], _frontend(kind, inp))
    eager, ref = store.clone(), store.clone()
    mixed = False
    checked64 = set()
    for n in range(3 * L + 1):               # the in-phase rows fold their third window last
        inp = _inputs(kind, N, HK, H, dk, dv, seed + n)
        full0 = store.committed[slots.long()] == L
        mixed |= bool(full0.any()) and not bool(full0.all())
        # today's kernel in the same schedule, from a clone of the same store
        two = store.clone()
        y0 = _verify_one(kind, two, inp, idx)
        # the deferred fold (poisoned outputs)
        out = torch.full((N, H, dv), float("nan"))
        if n == 2 * L:                       # the in-phase rows hold h == L unfolded entries
            assert int((store.committed[slots.long()] == L).sum()) == 2
            rs = store_to_state(store, slots, pair, seed=3, layer=0)
        if n == L:                           # advance=False then fold_advance_pointers
            apart = store.clone()
            with override_replay_launch(launch):
                _step(kind, step_fn, apart, inp, idx, out=out.clone(), design="deferred-fold",
                      advance=False)
            fold_advance_pointers(apart, idx)
        with override_replay_launch(launch):
            y = _step(kind, step_fn, store, inp, idx, out=out, design="deferred-fold")
        assert y is out and torch.isfinite(y).all() and (y[B] == 0).all()
        if n == L:
            for f in ("committed", "start", "n_flush", "arrive"):
                assert torch.equal(getattr(apart, f), getattr(store, f)), f
            assert torch.equal(_bits(apart.anchor.payload), _bits(store.anchor.payload))
        _close("output vs today's kernel (verify T=1)", y[:B], y0[:B], 1e-5)
        if n == 2 * L:
            fe = [t.float() if t is not None else None
                  for t in _frontend(kind, _sub(inp, slice(0, B)))]
            ys = rs.step(*fe[:4], fe[4])
            if kind == "mamba2":
                ys = mamba2_post_ref(ys, inp[0][:B], inp[6], inp[4][:B])
            _close("output vs ReplayState from the store", y[:B], ys, 1e-5)
        for f in ("committed", "start", "n_flush", "arrive"):
            assert torch.equal(getattr(store, f), getattr(two, f)), f
        for f in RING:
            if f in ("ubuf",) and store.ubuf is not None:
                _close("ring u vs today's kernel", store.ubuf, two.ubuf, 1e-5)
            elif getattr(store, f) is not None:
                assert torch.equal(_bits(getattr(store, f)), _bits(getattr(two, f))), f
        _close("anchor vs today's kernel (verify T=1)", store.anchor.payload,
               two.anchor.payload, 1e-6)
        # the torch reference of the schedule, its own chain
        yr = _step(kind, ref_fn, ref, inp, idx)
        _close("output vs torch reference", y[:B], yr[:B], 1e-5)
        for f in ("committed", "start", "n_flush"):
            assert torch.equal(getattr(store, f), getattr(ref, f)), f
        _close("anchor vs torch reference", store.anchor.payload, ref.anchor.payload, 1e-5)
        # today's eager schedule, its own chain
        ye = _step(kind, step_fn, eager, inp, idx)
        _close("output vs today's eager step", y[:B], ye[:B], 1e-5)
        h, he = store.committed[slots.long()], eager.committed[slots.long()]
        full = h == L
        assert torch.equal(torch.where(full, 0, h), he)
        assert torch.equal(store.n_flush[slots.long()] + full.long(),
                           eager.n_flush[slots.long()])
        just = slots.long()[h == 1]
        if n > 0 and len(just):              # both folded the same window: the same anchor
            _close("anchor vs today's eager step", store.anchor.payload[just],
                   eager.anchor.payload[just], 1e-5)
        # float64: a row that has just folded its third window holds the state before this
        # step as its anchor
        for s in slots.long()[(store.n_flush[slots.long()] == 3)
                              & (store.committed[slots.long()] == 1)].tolist():
            if s not in checked64:
                checked64.add(s)
                _close("anchor vs float64 after three windows", store.anchor.payload[s],
                       S64[s], 1e-5)
        S64[slots.long()] = _f64_step(kind, S64[slots.long()],
                                      _frontend(kind, _sub(inp, slice(0, B))))
    assert checked64 == set(slots.long().tolist()), checked64
    assert mixed, "no step folded some rows and not others"
    print({k: f"{v:.2e}" for k, v in MAX_REL.items()})


def test_fold_refuses_what_it_does_not_take():
    """One clear error, before any launch, for what keeps design='eager-flush'."""
    q, k, v, a, b = gdn_step_inputs(2, 1, 2, 16, 16)
    A_log, dtb = gdn_params(2)

    def store(pair="s32_rs", **kw):
        return ReplayStore.from_state(random_state(2, 2, 16, 16),
                                      PrecisionPair.load(pair).with_buffer_len(4), "gdn",
                                      key_heads=1, **{"max_drafts": 1, **kw})

    def run(st, **kw):
        return replay_gdn_step(st, q, k, v, a, b, A_log, dtb, design="deferred-fold", **kw)

    with pytest.raises(ValueError, match=r"anchor fp32 / read fp8 \(separate\); other pairs "
                                         r"keep design='eager-flush'"):
        run(store("tp8_hi32"))
    with pytest.raises(ValueError, match="not anchor fp16 / read fp16; other pairs"):
        run(store("s16_sr"))
    with pytest.raises(ValueError, match="u_dtype float32"):
        run(store(u_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"ring of L \+ 1 = 5 entries"):
        run(store(max_drafts=0))
    with pytest.raises(ValueError, match="path='flush'"):
        run(store(), path="flush")
    with pytest.raises(ValueError, match="design must be one of 'eager-flush', 'deferred-fold'"):
        replay_gdn_step(store(), q, k, v, a, b, A_log, dtb, design="fold")
    st = ReplayStore.from_state(random_state(2, 2, 16, 16), PrecisionPair.load("s32_rs")
                                .with_buffer_len(4), "kda", key_heads=1, max_drafts=1)
    from replayquant.kernels.replay.fold import fold_step
    with pytest.raises(ValueError, match="'gdn' or 'mamba2' store, not 'kda'"):
        fold_step(st, "kda", q, k, v, a, b, None, None, None, None, None, None, None, True)
