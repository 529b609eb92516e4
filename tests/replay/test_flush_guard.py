"""The "no flush inside the measurement" guards count the steps that are measured: a KL run needs
a scored token after the first flush (`memory.check_kl_sizes`), a drift an output step after it
(`drift`), else the anchor and read copy are never read by anything measured and the error reads
near zero. No model weights load; each case takes about a second."""

import pytest
import torch

from replayquant.drift import run_drift
from replayquant.kl.stats import SCORINGS, scored_range
from replayquant.memory import check_kl_sizes
from replayquant.pairs import PrecisionPair
from replayquant.replay import ReplayState
from replayquant.statebytes import LayerShape

SHAPE = LayerShape("gdn", H=1, HK=1, dv=8, dk=8)


def _check(L, context):
    pair = PrecisionPair.load("tp4_hi16_sr").with_buffer_len(L)
    check_kl_sizes([f"tp4_hi16_sr@L{L}"], [[(SHAPE, pair)]], 1, context, "replay", "cpu")


@pytest.mark.parametrize("context", [3, 256])
def test_kl_needs_a_scored_token_after_the_first_flush(context):
    """Flush at token L - 1 (0-based); token L is the first to read the flushed roles, and the
    last scored token is context - 2 under either scoring."""
    for scoring in SCORINGS:
        assert scored_range(context, scoring)[1] - 1 == context - 2
    _check(context - 2, context)
    for L in (context - 1, context):
        with pytest.raises(ValueError, match=f"buffer length {L} is not below --context "
                                             f"{context} - 1.*no flush"):
            _check(L, context)


def test_replay_outputs_read_the_flushed_roles_from_step_L_on():
    """What the guards rest on (ReplayState, FP16 anchor, NVFP4 read copy): outputs up to the
    flush step (L - 1) equal the same steps with an FP32 pair; step L is the first to differ."""
    g = torch.Generator().manual_seed(0)
    L, T = 4, 6
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, 1, 16, generator=g), dim=-1)
            for _ in range(2))
    v = torch.randn(1, T, 1, 16, generator=g)
    la = -torch.rand(1, T, 1, generator=g) * 0.1
    beta = torch.rand(1, T, 1, generator=g)
    ys = {}
    for name in ("tp4_hi16_sr", "s32_rs"):
        st = ReplayState(torch.zeros(1, 1, 16, 16), PrecisionPair.load(name).with_buffer_len(L),
                         delta=True)
        ys[name] = torch.stack([st.step(q[:, t], k[:, t], v[:, t], la[:, t], beta[:, t])
                                for t in range(T)], 1)
    diff = (ys["tp4_hi16_sr"] - ys["s32_rs"]).abs().amax(dim=(0, 2, 3))
    assert float(diff[:L].max()) < 1e-6 and float(diff[L]) > 1e-3, diff


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_drift_needs_an_output_step_after_the_first_flush(kind):
    with pytest.raises(ValueError, match="steps=16.*tp4_hi16_sr.*buffer_len 16.*give --steps 17"):
        run_drift(kind, ["tp4_hi16_sr"], steps=16, seeds=[1], batch=1, heads=1, d_k=16, d_v=8,
                  conventional=False)
    res = run_drift(kind, ["tp4_hi16_sr"], steps=17, seeds=[1], batch=1, heads=1, d_k=16, d_v=8)
    assert res["rows"][0]["output_rel_rmse"]["mean"] > 1e-4
