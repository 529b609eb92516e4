"""Kimi Delta Attention replay decode (a gate per key channel, the kernel's VEC specialization)
in the interpreter: step and verify against their torch references, against
ReplayState(vector_gate=True), and the anchor against a float64 per-channel recurrence."""

import pytest
import torch

from replayquant.testing import kda_step_inputs, random_state
from replayquant.kernels.conventional.reference import kda_frontend_ref
from replayquant.kernels.replay.decode import replay_kda_step
from replayquant.replay.stores import ReplayStore
from replayquant.kernels.replay import reference as rr
from replayquant.kernels.replay import verify as vf
from replayquant.pairs import PrecisionPair
from replayquant.replay import ReplayState
from _helpers import assert_states_close
from test_kernel_replay import assert_outputs_close, assert_same_store, poison_buffers

N, HK, H, DK, DV = 3, 1, 2, 16, 16


def _store(pair, seed, max_drafts=0):
    init = random_state(N, H, DV, DK, seed=seed)
    st = ReplayStore.from_state(init, pair, "kda", key_heads=HK, seed=seed, u_dtype=torch.float32,
                                max_drafts=max_drafts)
    poison_buffers(st)
    return init, st


def _nan(*shape):
    return torch.full(shape, float("nan"))


@pytest.mark.parametrize("pair", ["s32_rs", "tp4_hi32"])
def test_kda_step_matches_reference_and_replay_state(pair):
    P = PrecisionPair.load(pair).with_buffer_len(3)
    init, store = _store(P, 11)
    ref = store.clone()
    rs = ReplayState(init, P, delta=True, seed=11, vector_gate=True)
    idx = torch.tensor([2, -1, 0, 1])
    live = idx >= 0
    perm = torch.empty(N, dtype=torch.long)
    perm[idx[live]] = live.nonzero().flatten()
    for step in range(7):
        q, k, v, g, beta = kda_step_inputs(4, HK, H, DK, DV, seed=300 + step)
        y = replay_kda_step(store, q, k, v, g, beta, state_indices=idx, out=_nan(4, H, DV),
                            path="replay")
        y2 = rr.replay_kda_step_ref(ref, q, k, v, g, beta, state_indices=idx, path="replay")
        assert torch.isfinite(y).all() and not y[~live].any()
        assert_outputs_close(y, y2, P)
        fe = kda_frontend_ref(q, k, v, g, beta)
        yr = rs.step(*[t[perm] for t in fe])
        assert_outputs_close(y[perm], yr, P)
    assert store.committed.tolist() == ref.committed.tolist() == rs.committed.tolist()
    assert store.n_flush.tolist() == rs.n_flush.tolist() == [2] * N
    assert_states_close(store.anchor.dequantize(), rs.anchor())
    assert_states_close(store.read_role.dequantize(), rs.read_copy())
    assert_states_close(store.anchor.dequantize(), ref.anchor.dequantize())


def test_kda_anchor_against_float64_recurrence():
    P = PrecisionPair.load("s32_rs").with_buffer_len(3)
    init, store = _store(P, 12)
    S = init.double()
    for step in range(6):
        q, k, v, g, beta = kda_step_inputs(N, HK, H, DK, DV, seed=400 + step)
        replay_kda_step(store, q, k, v, g, beta, out=_nan(N, H, DV))
        _, kf, vf_, la, bf = (t.double() for t in kda_frontend_ref(q, k, v, g, beta))
        S = S * la.exp()[:, :, None, :]
        u = bf[..., None] * (vf_ - (S * kf[:, :, None, :]).sum(-1))
        S = S + u[..., None] * kf[:, :, None, :]
    assert store.committed.tolist() == [0] * N
    err = (store.anchor.dequantize().double() - S).norm() / S.norm()
    assert err < 1e-5, err.item()


def test_kda_verify_accept_round():
    P = PrecisionPair.load("tp4_hi32").with_buffer_len(4)
    _, store = _store(P, 13, max_drafts=2)
    ref = store.clone()
    idx = torch.tensor([1, 0, 2])
    for step in range(2):
        inp = kda_step_inputs(3, HK, H, DK, DV, seed=500 + step)
        replay_kda_step(store, *inp, state_indices=idx, out=_nan(3, H, DV))
        rr.replay_kda_step_ref(ref, *inp, state_indices=idx)
    for rnd in range(2):
        inp = kda_step_inputs(3, HK, H, DK, DV, T=2, seed=600 + rnd)
        y = vf.replay_kda_verify(store, *inp, state_indices=idx, out=_nan(3, 2, H, DV))
        y2 = rr.replay_kda_verify_ref(ref, *inp, state_indices=idx)
        assert_outputs_close(y, y2, P)
        n = torch.tensor([2, 1, 0])
        vf.replay_accept(store, n, idx)
        rr.replay_accept_ref(ref, n, idx)
        assert store.committed.tolist() == ref.committed.tolist()
    assert_states_close(store.anchor.dequantize(), ref.anchor.dequantize())


def test_kda_bad_inputs():
    P = PrecisionPair.load("s32_rs").with_buffer_len(3)
    _, store = _store(P, 14)
    q, k, v, g, beta = kda_step_inputs(N, HK, H, DK, DV, seed=1)
    with pytest.raises(ValueError, match="g has shape"):
        replay_kda_step(store, q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError, match="built with kind='gdn'"):
        vf.replay_gdn_verify(store, q[:, None], k[:, None], v[:, None], beta[:, None],
                             beta[:, None], beta[0])
