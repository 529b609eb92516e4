"""A KL within its uncertainty of zero is zero (float noise around an exact pair), a KL below zero
beyond its uncertainty is an error: one rule (`kl.stats.kl_vs_zero`) for recommend, the sweep's
front and the KL report's position table. No model; each case takes well under a second."""

import copy
import io
import json
from pathlib import Path

import pytest

from replayquant.kl import stats as S
from replayquant.sweep import recommend as R
from replayquant.sweep.common import front_kl, kl_problem, pareto_front

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "results/demo/tiny-qwen3.5_sweep.json"

# the shared FP32 pair's float-noise KL of a tiny-qwen3.5 run: 1.2 standard errors below zero
NOISE = {"kl_mean": -7e-9, "kl_unc": 5.7e-9, "kl_upper": -7e-9 + 5.7e-9}


@pytest.mark.parametrize("mean, unc, want", [
    (-7e-9, 5.7e-9, 0), (7e-9, 5.7e-9, 0), (0.0, 0.0, 0), (-1.7e-8, 5.7e-9, 0),
    (-1.8e-8, 5.7e-9, -1), (-0.5, 0.01, -1), (1e-3, 1e-5, 1), (-1e-12, 0.0, -1)])
def test_kl_vs_zero(mean, unc, want):
    assert S.kl_vs_zero(mean, unc) == want


def test_noise_below_zero_is_zero_on_the_front_and_fits():
    assert kl_problem(NOISE) is None
    assert front_kl(NOISE["kl_mean"], NOISE["kl_unc"]) == 0.0
    assert pareto_front([("exact", 4, NOISE["kl_mean"], NOISE["kl_unc"]),
                         ("lossy", 1, 1e-3, 1e-5)]) == ["lossy", "exact"]
    bad = {"kl_mean": -1e-7, "kl_unc": 5.7e-9, "kl_upper": -1e-7 + 5.7e-9}
    assert "below zero" in kl_problem(bad)
    assert pareto_front([("bad", 1, -1e-7, 5.7e-9), ("ok", 2, 1e-3, 1e-5)]) == ["ok"]


def test_exact_pair_alone_is_recommended():
    """A sweep of the shared FP32 pair alone, whose KL is float noise below zero, recommends it."""
    sw = json.loads(SWEEP.read_text())
    v = next(v for v in sw["variants"] if v["name"] == "s32_rs@L8")
    v["kl"].update(NOISE)
    sw["variants"] = [v]
    rec = R.recommend(sw, 1e-3)
    assert rec["recommended"]["name"] == "s32_rs@L8" and not rec["kl_not_valid"]
    v["kl"].update(kl_mean=-1e-7, kl_upper=-1e-7 + 5.7e-9)
    with pytest.raises(R.NoFit, match="below zero"):
        R.recommend(sw, 1e-3)


def test_position_table_shows_noise_as_zero():
    from rich.console import Console

    from replayquant.kl.report import print_summary
    res = {"config": {"model": {"id": "m"}, "context": 2048, "prefill": "replay",
                      "pairs": [{"name": "s32_rs"}, {"name": "bad"}]},
           "documents_done": 1, "documents_planned": 1, "complete": True, "results": {}}
    for name, mean in (("s32_rs", -2.49e-9), ("bad", -4.2e-7)):
        st = {"kl_mean": mean, "kl_mean_unc": 2.08e-9, "kl_max": 1e-7, "same_top": 1.0,
              "same_top_unc": 0.0, "ln_ppl_ratio": 0.0, "ln_ppl_ratio_unc": 0.0, "dp_rms": 0.0,
              "dp_rms_unc": 0.0,
              "by_position": [{"bucket": b, "kl_mean": mean, "kl_mean_unc": 2.08e-9}
                              for b in ("<1K", "1K-2K")]}
        res["results"][name] = copy.deepcopy(st)
    buf = io.StringIO()
    print_summary(res, Console(file=buf, width=120, force_terminal=False))
    out = buf.getvalue()
    table = out[out.index("by token position"):out.index("~0: ")]      # the table, not its notes
    assert "-2.49e-09" not in table and table.count("~0") == 2, out
    assert table.count("-4.2e-07 (<0)") == 2, out
