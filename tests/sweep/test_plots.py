"""The plots as a reader meets them, checked through their matplotlib objects: every series its own
colour and marker, axes named with their units, labels that do not overlap, zero drawn as zero,
and the budget a plot was made for drawn on it."""

from __future__ import annotations

import importlib.util
import json
import sys
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt
    plt.close("all")


def _series(ax):
    """The labelled lines of an axes (legend entries), by label."""
    return {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}


def _extent(t):
    """The window extent of a text or label, without a label's leader line."""
    from matplotlib.text import Text
    return Text.get_window_extent(t)


def _no_overlap(fig, texts) -> None:
    fig.canvas.draw()
    boxes = [(t.get_text(), _extent(t)) for t in texts]
    for (a, ba), (b, bb) in combinations(boxes, 2):
        assert not ba.overlaps(bb), f"labels {a!r} and {b!r} overlap"


# ---------------------------------------------------------------- sweep

@pytest.mark.parametrize("model", ["tiny-qwen3.5", "tiny-kimi-linear"])
def test_sweep_plot_names_every_variant_in_kib_and_nats(model):
    from matplotlib.colors import to_hex

    from replayquant.sweep.plot import sweep_figure
    sw = json.loads((ROOT / f"results/demo/{model}_sweep.json").read_text())
    fig, drawn = sweep_figure(sw)
    ax = fig.axes[0]
    series = {label.split(" ")[0]: ln for label, ln in _series(ax).items()}
    names = [v["name"] for v in sw["variants"]]
    assert set(names) <= set(series), sorted(set(names) - set(series))
    styles = {n: (to_hex(series[n].get_color()), series[n].get_marker()) for n in names}
    assert len({c for c, _ in styles.values()}) == len(names)          # a colour per variant
    for v in sw["variants"]:                       # L8 and L16 of a pair: other marker too
        for w in sw["variants"]:
            if v["base"] == w["base"] and v["buffer_len"] != w["buffer_len"]:
                assert styles[v["name"]][1] != styles[w["name"]][1]
    # x in KiB, as every table says; y with its unit
    assert "KiB" in ax.get_xlabel() and "nats" in ax.get_ylabel()
    for v in sw["variants"]:
        kib = v["bytes_per_step"]["state"] / 1024
        assert series[v["name"]].get_xdata()[0] == pytest.approx(kib)
    assert len(drawn) == len(names)
    # every front variant labelled beside its point, inside the axes, no two labels overlapping
    labels = [t for t in ax.texts if t.get_text().split(" ")[0] in names]
    assert {t.get_text().split(" ")[0] for t in labels} == set(sw["front"])
    _no_overlap(fig, ax.texts)
    box = ax.get_window_extent()
    for t in ax.texts:
        bb = _extent(t)
        assert box.x0 <= bb.x0 and bb.x1 <= box.x1 and box.y0 <= bb.y0 and bb.y1 <= box.y1, t
    assert "/" not in ax.get_title().split(":")[0]


# ---------------------------------------------------------------- KL by position

def _kl_run(names, T=512, docs=3, seed=0):
    """Results and per-token KL arrays of a made-up run: every pair exact at the first 8
    positions (as before a pair's first flush), then a pair's own KL level; `exact` pairs are
    float noise of either sign throughout, one bin of it summing to a positive 1e-24."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for d in range(docs):
        a = np.zeros((len(names), T))
        for j, n in enumerate(names):
            if n.startswith("exact"):
                noise = rng.normal(0, 1e-7, T - 8)     # of both signs at every position
                a[j, 8:] = (np.abs(noise), -np.abs(noise), noise)[d % 3]
                a[j, 8] = (1e-7, -1e-7, 1e-24)[d % 3]       # position 9: mean 3.3e-25
            else:
                a[j, 8:] = 10.0 ** (-2 - 0.3 * j) * rng.uniform(0.5, 1.5, T - 8)
        arrays[d] = a
    model = {"id": "/somewhere/on/a/machine/tiny-x", "local_hash": "sha256:ab"}
    results = {"config": {"model": model, "context": T, "prefill": "replay"},
               "documents_done": docs,
               "results": {n: {"kl_mean": float(np.mean([arrays[d][j] for d in arrays]))}
                           for j, n in enumerate(names)}}
    return results, arrays


def test_kl_plot_of_sixteen_series_keeps_them_apart_and_draws_no_floor_wall():
    from matplotlib.colors import to_hex

    from replayquant.kl.plot import kl_figure
    names = [f"{p}@L{L}" for p in ("exact", "b1", "b2", "b3", "b4", "b5", "b6", "b7")
             for L in (8, 16)]
    res, arrays = _kl_run(names)
    fig = kl_figure(res, arrays, names)
    ax = fig.axes[0]
    curves = list(_series(ax).values())
    assert len(curves) == 16
    colours = [to_hex(ln.get_color()) for ln in curves]
    assert len(set(colours)) == 16, colours
    markers = {ln.get_label().split(":")[0]: ln.get_marker() for ln in curves}
    for p in ("exact", "b1", "b7"):
        assert markers[f"{p}@L8"] != markers[f"{p}@L16"]
    # zero (and float noise around it) is not drawn as a row of markers on a log axis: it is a
    # gap in the curve, counted in the legend
    assert not [ln for ln in ax.get_lines() if ln.get_marker() == "v"]
    exact = next(ln for ln in curves if ln.get_label().startswith("exact@L8"))
    assert np.isnan(exact.get_ydata()).all()
    assert "~0" in exact.get_label()
    b1 = next(ln for ln in curves if ln.get_label().startswith("b1@L8"))
    assert "~0" in b1.get_label() and np.isfinite(b1.get_ydata()).sum() > 5
    # the noise bin at 1e-24 does not stretch the axis: a decade under the smallest KL drawn
    smallest = min(np.nanmin(ln.get_ydata()) for ln in curves if np.isfinite(ln.get_ydata()).any())
    assert ax.get_ylim()[0] >= smallest / 100
    assert any("~0" in t.get_text() for t in fig.texts)
    assert "/somewhere" not in ax.get_title()


def test_kl_plot_draws_the_budget_it_was_made_for():
    from replayquant.kl.plot import kl_figure
    names = ["b1", "b2"]
    res, arrays = _kl_run(names)
    fig = kl_figure(res, arrays, names, budget=1e-3)
    ax = fig.axes[0]
    (line,) = [ln for ln in ax.get_lines() if "budget" in ln.get_label()]
    assert set(line.get_ydata()) == {1e-3} and "0.001" in line.get_label()
    assert ax.get_ylim()[0] < 1e-3 < ax.get_ylim()[1]
    assert not [ln for ln in kl_figure(res, arrays, names).axes[0].get_lines()
                if "budget" in ln.get_label()]


def test_a_results_file_is_plotted_again_with_its_budget(tmp_path, monkeypatch):
    """`plot_results_file` draws a KL run's plot from NAME.json and its per-token files, as
    `recommend --per-layer` does with the budget its policy was built for."""
    import replayquant.kl.plot as P
    from replayquant.kl import KLSettings
    from replayquant.kl.command import kl_command
    out = tmp_path / "run.json"
    settings = KLSettings(dataset="heldout", context=48, docs=1, segment=48, dtype="float32",
                          device_map="cpu", progress=False)
    kl_command("tiny-mamba2", ["s32_rs", "tp4_hi32"], settings, out=str(out))
    seen = []
    monkeypatch.setattr(P, "save_figure", lambda fig, png, **kw: seen.append((fig, png)))
    assert P.plot_results_file(out, budget=2e-3) == out.with_suffix(".png")
    ((fig, png),) = seen
    assert png == out.with_suffix(".png")
    ax = fig.axes[0]
    assert [ln.get_label() for ln in ax.get_lines() if "budget" in ln.get_label()]
    assert {ln.get_label().split(":")[0] for ln in _series(ax).values()} >= {"s32_rs", "tp4_hi32"}


# ---------------------------------------------------------------- kernels

def test_kernels_plot_says_which_way_is_faster_and_names_the_peers():
    from replayquant.bench.kernels.render import kernels_figure
    res = json.loads((ROOT / "results/bench/kernels.json").read_text())
    fig = kernels_figure(res)
    words = " ".join([fig._suptitle.get_text() if fig._suptitle else ""]
                     + [t.get_text() for t in fig.texts]
                     + [ax.get_ylabel() for ax in fig.axes])
    assert "faster" in words and "> 1" in words
    legends = " ".join(t.get_text() for ax in fig.axes if ax.get_legend()
                       for t in ax.get_legend().get_texts())
    legends += " ".join(t.get_text() for lg in fig.legends for t in lg.get_texts())
    assert "fla" in legends and "mamba_ssm" in legends and "authors" in legends
    assert "peer FP32" not in legends


# ---------------------------------------------------------------- tiny models' training

def _train_tiny():
    if "train_tiny" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_tiny",
                                                      ROOT / "evals" / "train_tiny.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["train_tiny"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["train_tiny"]


def test_loss_curves_mark_the_shipped_checkpoint():
    tt = _train_tiny()
    logs = tt.log_models([ROOT / "results/train_tiny/train_log.json",
                          ROOT / "results/train_tiny/train_log_tiny-kimi-linear.json"])
    fig = tt.loss_figure(logs)
    ax = fig.axes[0]
    shipped = [ln for ln in ax.get_lines() if "shipped" in ln.get_label()]
    assert shipped
    steps = {lg["best_val"]["step"] for lg in logs}
    xs = {float(x) for ln in shipped for x in ln.get_xdata()}
    assert xs == {float(s) for s in steps}
    assert any("lowest validation loss" in ln.get_label() for ln in shipped)
