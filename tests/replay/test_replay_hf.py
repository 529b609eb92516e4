"""ReplayState against transformers' own recurrences (the upstream code, not our reference):
GDN (s32_rs) vs `torch_recurrent_gated_delta_rule` (models/qwen3_5) and Mamba-2 vs the torch
decode path `mamba2_selective_state_update` (models/mamba2), hundreds of steps, several shapes."""

import pytest
import torch

from replayquant.replay import ReplayState, gdn_inputs, mamba2_inputs

qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("B,Hk,Hv,dk,dv,T", [(2, 2, 4, 32, 16, 300), (1, 3, 3, 16, 24, 257)])
def test_gdn_s32_matches_transformers_recurrent(B, Hk, Hv, dk, dv, T):
    g = torch.Generator().manual_seed(100 + dk)
    q = torch.randn(B, T, Hk, dk, generator=g)
    k = torch.randn(B, T, Hk, dk, generator=g)
    v = torch.randn(B, T, Hv, dv, generator=g)
    a = torch.randn(B, T, Hv, generator=g)
    b = torch.randn(B, T, Hv, generator=g)
    A_log = torch.log(torch.rand(Hv, generator=g) * 0.5 + 0.01)
    dt_bias = torch.randn(Hv, generator=g) - 2
    gate = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)      # as Qwen3_5GatedDeltaNet
    beta = b.sigmoid()
    S0 = torch.randn(B, Hv, dk, dv, generator=g) * 0.1                 # HF layout [.., d_k, d_v]
    y_hf, S_hf = qwen.torch_recurrent_gated_delta_rule(
        q, k, v, g=gate, beta=beta, initial_state=S0.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True)

    qq, kk, vv, la, bb = gdn_inputs(q, k, v, gate, b)
    st = ReplayState(S0.transpose(-1, -2), "s32_rs", delta=True)     # ours: [.., d_v, d_k]
    ys = []
    t = 0
    while t < T:                                   # plain steps, with a verify/accept now and then
        if t % 37 == 5 and t + 3 <= T:
            Y = st.verify(qq[:, t:t + 3], kk[:, t:t + 3], vv[:, t:t + 3], la[:, t:t + 3], bb[:, t:t + 3])
            st.accept(3)
            ys.append(Y)
            t += 3
        else:
            ys.append(st.step(qq[:, t], kk[:, t], vv[:, t], la[:, t], bb[:, t]).unsqueeze(1))
            t += 1
    Y = torch.cat(ys, dim=1)
    assert rel(Y, y_hf) < 1e-5
    assert rel(st.current_state().transpose(-1, -2), S_hf) < 1e-5


@pytest.mark.parametrize("B,H,P,N,G,T", [(2, 4, 16, 32, 2, 300), (1, 3, 8, 16, 1, 256),
                                         (3, 4, 8, 16, 4, 200)])
def test_mamba2_s32_matches_transformers_decode(B, H, P, N, G, T):
    g = torch.Generator().manual_seed(200 + N + G)
    A = -torch.exp(torch.rand(H, generator=g) * 2)                    # A = -exp(A_log)
    dt_bias = torch.randn(H, generator=g) - 3
    D = torch.randn(H, generator=g)
    S0 = torch.randn(B, H, P, N, generator=g) * 0.1                  # HF layout = ours [.., P, N]
    state = S0.clone()
    st = ReplayState(S0, "s32_rs", delta=False)
    for t in range(T):
        x = torch.randn(B, H, P, generator=g)
        dt = torch.randn(B, H, generator=g)
        Bm = torch.randn(B, G, N, generator=g)
        Cm = torch.randn(B, G, N, generator=g)
        y_hf = mamba2.mamba2_selective_state_update(
            state, x, dt[..., None].expand(B, H, P), A[:, None, None].expand(H, P, N), Bm, Cm,
            D[:, None].expand(H, P), dt_bias=dt_bias[:, None].expand(H, P), dt_softplus=True)
        q, k, v, la = mamba2_inputs(x, dt, A, Bm, Cm, dt_bias, ngroups=G)
        y = st.step(q, k, v, la) + D[:, None] * x
        assert rel(y, y_hf) < 1e-5, t
    assert rel(st.current_state(), state) < 1e-5
