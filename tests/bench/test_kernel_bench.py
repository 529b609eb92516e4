"""`replayquant bench kernels` code path on the CPU (Triton interpreter, tiny shapes, wall-clock
timing: a smoke run, never a result): plan, estimate, every section kind, derived speedups,
targets, dispatch table, JSON / markdown / PNG written; bad arguments rejected."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from replayquant.bench import authors as au
from replayquant.bench import targets as targets_mod
from replayquant.bench.kernels.checks import conventional_checks
from replayquant.bench.kernels.grid import PAIRS, SHAPES, KernelGrid, kernel_inputs
from replayquant.bench.kernels.merge import merge_kernels, one_commit
from replayquant.bench.kernels.plan import estimate_s, plan
from replayquant.bench.kernels.run import run_kernels_bench
from replayquant.bench.kernels.sweep import launched, pair_config
from replayquant.kernels.conventional.launch import launch_config
from replayquant.kernels.replay.launch import given_launch

TINY = {"gdn": dict(kind="gdn", H=2, HK=1, dv=16, dk=16),
        "mamba2": dict(kind="mamba2", H=2, HK=1, dv=16, dk=16)}
# the command's grid without the staggered windows and the accuracy comparison
BASE = KernelGrid(staggered_batches=(), accuracy=False)


def test_full_grid_plan():
    sec = plan(BASE)
    keys = [k for k, _, _ in sec]
    assert len(keys) == len(set(keys))
    for kind in ("gdn", "mamba2"):
        for B in (1, 8, 32, 128, 256, 512):
            for pair in PAIRS:
                for L in (4, 8, 16, 32):
                    assert f"{kind}/B{B}/{pair}/L{L}" in keys
        for T in (2, 4):
            assert f"spec/{kind}/B512/T{T}" in keys
    # the targets come first: conventional and the main L of every pair before other L values
    assert keys.index("gdn/B512/tp4_hi16_sr/L16") < keys.index("gdn/B1/s32_rs/L4")
    assert keys.index("spec/mamba2/B512/T4") < keys.index("spec/gdn/B512/T2")
    assert keys.index("spec/gdn/B512/T4") < keys.index("peers/mamba2/B512") \
        < keys.index("gdn/B1/s32_rs/L4")
    # by the H200 calibration (stochastic-rounding stores built on the GPU) the full grid takes
    # two 10-minute device calls
    assert 300 < estimate_s(sec) < 2 * 540
    no_sr = plan(replace(BASE, pairs=("s32_rs", "tp8_hi32", "tp4_hi32")))
    assert estimate_s(no_sr) < estimate_s(sec)


def test_every_planned_section_fits_its_runner():
    """Each section's arguments bind to the runner `run_kernels_bench` calls for it, over the
    whole default grid (other L values, staggered rows, peers, sweep) and both presets: a
    section of another arity would fail on the GPU, where the plan first runs whole."""
    import inspect
    from replayquant.bench.kernels.run import _SECTIONS
    from replayquant.bench.targets import PRESETS
    grids = [KernelGrid()] + [KernelGrid(**g) for g in PRESETS.values()]
    for grid in grids:
        for key, _, what in plan(grid):
            inspect.signature(_SECTIONS[what[0]]).bind(None, key, *what[1:])


@pytest.mark.slow
def test_cpu_smoke_run(tmp_path):
    grid = KernelGrid(batches=(3,), Ls=(2,), pairs=("s32_rs", "tp4_hi32"), Ts=(2,),
                      spec_batches=(3,), peers=False, checks=False, sweep=False,
                      detail_batches=(3,), shapes=TINY, staggered_batches=(3,))
    res = run_kernels_bench(out=str(tmp_path), grid=grid, device="cpu")
    assert SHAPES["gdn"]["H"] == 32                       # restored
    assert not res["errors"], res["errors"]
    js = json.loads((tmp_path / "kernels.json").read_text())
    assert js["provenance"]["smoke_cpu"] is True
    assert set(js["section_s"]) == {k for k, _, _ in plan(grid)}
    kernels = {(r["kind"], r["kernel"], r["variant"], r["B"]) for r in js["rows"]}
    for kind in ("gdn", "mamba2"):
        for B in (3,):
            assert (kind, "conventional", "fp32", B) in kernels
            for pair in ("s32_rs", "tp4_hi32"):
                assert (kind, "replay-window", pair, B) in kernels
            assert (kind, "replay-window-staggered", pair, 3) in kernels
        assert (kind, "replay-read-step", "tp4_hi32", 3) in kernels
        assert (kind, "spec-replay-round", "tp4_hi32", 3) in kernels
        assert (kind, "spec-snapshot-round", "fp32", 3) in kernels
        assert set(js["accuracy"][kind]["ours"]) == {"s32_rs", "tp4_hi32"}
    assert not [r for r in js["rows"] if r.get("error")]
    assert all("speedup_vs_conv_fp32" in r for r in js["rows"] if r["kernel"] == "replay-window")
    assert all("speedup_vs_snapshot_round" in r for r in js["rows"]
               if r["kernel"] == "spec-replay-round")
    tg = {t["name"]: t for t in js["targets"]}
    assert tg["gdn/s32_rs-vs-authors-B256"]["met"] is None          # run without --authors
    assert "--authors" in tg["gdn/s32_rs-vs-authors-B256"]["reason"]
    assert tg["mamba2/accuracy"]["met"] is not None
    md = (tmp_path / "kernels.md").read_text()
    assert "## Targets" in md and "replay-window" in md
    assert (tmp_path / "kernels_speedup.png").stat().st_size > 1000


@pytest.mark.slow
def test_merge_parts(tmp_path):
    """Two smoke runs split by layer kind merge into one table; parts of different commits,
    overlapping sections and a single part are refused with one error each."""
    grid = KernelGrid(batches=(1,), Ls=(2,), pairs=("s32_rs",), Ts=(2,), spec_batches=(),
                      peers=False, checks=False, sweep=False, detail_batches=(), shapes=TINY,
                      accuracy=False)
    for kind in ("gdn", "mamba2"):
        run_kernels_bench(out=str(tmp_path), grid=replace(grid, kinds=(kind,)),
                          name=f"part_{kind}", plot=False, device="cpu")
    parts = [str(tmp_path / f"part_{k}.json") for k in ("gdn", "mamba2")]
    res = merge_kernels(parts, out=str(tmp_path), name="merged")
    js = json.loads((tmp_path / "merged.json").read_text())
    assert {r["part"] for r in js["rows"]} == {0, 1}
    assert {r["kind"] for r in js["rows"]} == {"gdn", "mamba2"}
    assert [p["kinds"] for p in js["provenance"]["parts"]] == [["gdn"], ["mamba2"]]
    assert len(res["targets"]) == len(targets_mod.targets({"rows": []}))
    assert all("speedup_vs_conv_fp32" in r for r in js["rows"] if r["kernel"] == "replay-window")
    assert "Merged from 2 runs" in (tmp_path / "merged.md").read_text()
    assert (tmp_path / "merged_speedup.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="section"):
        merge_kernels([parts[0], parts[0]], out=str(tmp_path), name="bad")
    with pytest.raises(ValueError, match="at least two"):
        merge_kernels(parts[:1], out=str(tmp_path), name="bad")
    other = json.loads(open(parts[1]).read())
    other["provenance"]["git_commit"] = "0" * 40
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="git_commit"):
        merge_kernels([parts[0], str(tmp_path / "other.json")], out=str(tmp_path), name="bad")


def test_merge_commit_abbreviated():
    """Parts of one commit named in full and abbreviated merge under the full name; a different
    commit, or a name under 7 characters, is refused."""
    full = "909d56e0f065f9ce4c362c707be77ea326878c7c"
    assert one_commit([full[:7], full, full[:12]]) == full
    assert one_commit([None, None]) is None
    for bad in ([full[:7], "0" * 40], [full[:6], full], [full, None]):
        with pytest.raises(ValueError, match="git_commit"):
            one_commit(bad)


def test_bench_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="pairs"):
        run_kernels_bench(out=str(tmp_path), grid=KernelGrid(pairs=("nope",), shapes=TINY),
                          device="cpu")
    with pytest.raises(ValueError, match="tiny"):
        run_kernels_bench(out=str(tmp_path), device="cpu")


def test_sweep_pick_is_the_launch_of_step_and_verify():
    """The sweep's pick of a pair ('replay/PAIR': the read and the flush launch) serves its steps
    and verifies alike; without one the launch table's."""
    cfg = {"replay/p": {"launch": {"read": (64, 4), "flush": (16, 1)}}}
    assert pair_config(cfg, "p") == {"launch": {"read": (64, 4), "flush": (16, 1)}}
    assert pair_config(cfg, "q") == {}


def test_launched_runs_a_block_at_the_configs_the_rows_record():
    """`launched` turns a config as the sweep's rows record it into the kernels' overrides for
    its block: a replay pair's {'launch': ...}, the conventional step's block_v / num_warps, and
    {} the launch tables'; after the block the tables hold again."""
    with launched({"launch": {"read": (64, 4), "flush": (16, 1)}}):
        assert given_launch() == {"read": (64, 4), "flush": (16, 1)}
        assert launch_config("fp32", 8, 32, 16) == (8, 1)         # the conventional table's
    with launched({"block_v": 16, "num_warps": 2}):
        assert launch_config("fp32", 8, 32, 16) == (16, 2) and given_launch() == {}
    with launched({}):
        assert given_launch() == {} and launch_config("fp32", 8, 32, 16) == (8, 1)
    assert given_launch() == {} and launch_config("fp32", 8, 32, 16) == (8, 1)


# ---------------------------------------------------------------------------- the authors' kernels

AUTHORS = Path(__file__).resolve().parents[2] / ".gpu" / "authors"

# the import lines of the authors' files (their own kernels replaced by trivial ones)
_FAKE = {
    au._CONFIG: '''
from vllm.platforms import current_platform
from vllm.triton_utils import triton


def get_replayssm_config(kernel, **shape):
    return (triton.next_power_of_2(3), current_platform.is_device_capability_family(100))
''',
    au._MODS["gdn_decode"]: '''
import torch

from vllm.model_executor.layers.mamba.ops.replayssm_config import (
    get_replayssm_config,
)
from vllm.triton_utils import tl, triton


@triton.jit
def _twice(x_ptr, o_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(o_ptr + o, 2 * tl.load(x_ptr + o))


def fused_recurrent_gated_delta_rule_replayssm(x, out):
    _twice[(1,)](x, out, N=x.numel())
    return get_replayssm_config("gdn_decode")
''',
    au._MODS["gdn_verify"]: '''
from vllm.model_executor.layers.mamba.ops.replayssm_config import get_replayssm_config
from vllm.triton_utils import tl, triton


def gdn_replayssm_spec_decode(*a, **k):
    return "verify"


def commit_gdn_replayssm_spec(*a, **k):
    return "commit"
''',
    au._MODS["mamba2_verify"]: '''
import torch

from vllm.model_executor.layers.mamba.ops.mamba_ssm import softplus
from vllm.model_executor.layers.mamba.ops.replayssm_config import get_replayssm_config
from vllm.triton_utils import tl, triton
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID


def selective_state_update_replayssm_spec(*a, **k):
    return "mamba2 verify"


def commit_replayssm_spec(*a, **k):
    return "mamba2 commit"
''',
    au._MODS["mamba2_decode"]: '''
import torch

from vllm.model_executor.layers.mamba.ops.mamba_ssm import softplus
from vllm.model_executor.layers.mamba.ops.replayssm_config import get_replayssm_config
from vllm.triton_utils import tl, triton
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID


@triton.jit
def _soft(x_ptr, o_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(o_ptr + o, softplus(tl.load(x_ptr + o)))


def selective_state_update_replayssm_output_only(x, out):
    _soft[(1,)](x, out, N=x.numel())
    return NULL_BLOCK_ID
''',
}


def _fake_checkout(root, commit="c0ffee" * 6 + "c0ff"):
    for rel, text in _FAKE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    if commit:
        (root / "COMMIT").write_text(commit + "\n")
    return root


def test_authors_shim_fake_checkout(tmp_path):
    """The shim imports files with the authors' import lines through its stand-ins, runs their
    Triton code, reads the commit beside them and leaves no vllm module behind; a folder missing
    a file, or with no commit to tell, is one error each."""
    import sys
    before = {n for n in sys.modules if n.startswith("vllm")}
    A = au.load(_fake_checkout(tmp_path / "fork"))
    assert A.commit.startswith("c0ffee") and A.provenance()["repo"] == au.FORK
    assert {n for n in sys.modules if n.startswith("vllm")} == before
    x = torch.tensor([0.5, -1.0, 2.0, 30.0])
    out = torch.full_like(x, float("nan"))
    assert A.gdn_step(x, out) == (4, False)
    assert torch.equal(out, 2 * x)
    assert A.mamba2_step(x, out) == 0
    torch.testing.assert_close(out, torch.nn.functional.softplus(x))
    assert (A.gdn_verify(), A.gdn_commit()) == ("verify", "commit")
    assert (A.mamba2_verify(), A.mamba2_commit()) == ("mamba2 verify", "mamba2 commit")
    assert au.load(tmp_path / "fork", commit="abc1234").commit == "abc1234"
    _fake_checkout(tmp_path / "nocommit", commit=None)
    with pytest.raises(ValueError, match="--authors-commit"):
        au.load(tmp_path / "nocommit")
    (tmp_path / "fork" / au._MODS["mamba2_decode"]).unlink()
    with pytest.raises(ValueError, match="not a checkout of the ReplaySSM fork.*output_only"):
        au.load(tmp_path / "fork")


def test_bench_kernels_cli_bad_authors_path(tmp_path):
    """`bench kernels --authors PATH` with a PATH that is not a checkout of the fork: one error,
    exit code 2, nothing measured or written."""
    from typer.testing import CliRunner

    from replayquant.cli import app
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["bench", "kernels", "--authors", str(tmp_path), "--out", str(out),
                                 "--preset", "probe"])
    assert r.exit_code == 2
    assert "not a checkout of the ReplaySSM fork" in r.output and "Traceback" not in r.output
    assert not out.exists()
    r = CliRunner().invoke(app, ["bench", "kernels", "--preset", "nope", "--estimate-only"])
    assert r.exit_code == 2 and "Invalid value for '--preset'" in r.output and "'targets'" in r.output


@pytest.fixture
def interpreter_bf16(monkeypatch):
    """Two gaps of the Triton interpreter that the authors' kernels meet and the GPU compiler
    does not have: tl.dot of bf16 operands multiplies their raw uint16 codes, and a mask built
    as `tensor & (scalar < constexpr)` arrives as int32. Patched for the test only."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as I
    B = I.InterpreterBuilder
    dot, st, ld = B.create_dot, B.create_masked_store, B.create_masked_load

    def f32(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return I.TensorHandle(I._convert_float(h.data, tl.bfloat16, tl.float32, None)
                              .view(np.float32), tl.float32)

    def boolean(m):
        return I.TensorHandle(m.data.astype(bool), tl.int1)
    monkeypatch.setattr(B, "create_dot", lambda s, a, b, d, *r: dot(s, f32(a), f32(b), d, *r))
    monkeypatch.setattr(B, "create_masked_store",
                        lambda s, p, v, m, *r: st(s, p, v, boolean(m), *r))
    monkeypatch.setattr(B, "create_masked_load",
                        lambda s, p, m, *r: ld(s, p, boolean(m), *r))


GDN_T = dict(kind="gdn", H=2, HK=1, dv=16, dk=32)          # their GDN kernel: d_k >= 32
MAMBA_T = dict(kind="mamba2", H=2, HK=1, dv=16, dk=16)


@pytest.mark.skipif(not all((AUTHORS / f).is_file() for f in au.FILES),
                    reason="no .gpu/authors here (the authors' files, extracted for the device)")
@pytest.mark.slow
def test_authors_kernels_in_interpreter(interpreter_bf16, monkeypatch):
    """The authors' real kernels through the shim at tiny shapes, on the bench's inputs, against
    a float64 recurrence over three windows: with float32 activations their state and outputs
    are exact to FP32 rounding and match ours; with their bf16 caches the state drifts, ours
    (s32_rs) stays at FP32 rounding; their speculative round's outputs match the recurrence."""
    A = au.load(AUTHORS)
    for kind, S in (("gdn", GDN_T), ("mamba2", MAMBA_T)):
        acc = au.accuracy(kind, S, 2, 4, "cpu", A, pairs=("s32_rs",))
        assert acc["ours"]["s32_rs"]["anchor"] < 1e-5
        assert acc["ours"]["s32_rs"]["outputs"] < 2 ** -8
        assert acc["authors"]["fp32"]["state"] < 1e-5 and acc["authors"]["fp32"]["outputs"] < 1e-5
        assert 1e-4 < acc["authors"]["bf16"]["state"] < 3e-2
        assert acc["ours_vs_authors"]["s32_rs / fp32"]["outputs"] < 2 ** -8
    from replayquant.testing import random_state
    init = random_state(2, 2, 16, 32, seed=5)
    kw = kernel_inputs("gdn", GDN_T, 2, T=2, seed=6, device="cpu")
    sr = au.GdnSpecRunner(A, init, kw, 4, 1, 2)
    y = sr.round(torch.tensor([2, 1], dtype=torch.int32)).float().reshape(2, 2, 2, 16)
    steps = [{**kw, **{k: kw[k][:, t] for k in ("q", "k", "v", "a", "b")}} for t in range(2)]
    Y, _ = au._reference("gdn", init, steps)
    assert au._rel_fro(y, Y) < 1e-2
    assert sr.write_pos[1:].tolist() == [2, 1]
    import contextlib
    # their Mamba-2 verify enters torch.cuda.device(index), which needs CUDA
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    init = random_state(2, 2, 16, 16, seed=7)
    kw = kernel_inputs("mamba2", MAMBA_T, 2, T=2, seed=8, device="cpu")
    sr = au.Mamba2SpecRunner(A, init, kw, 4, 1, 2)
    y = sr.round(torch.tensor([2, 1], dtype=torch.int32)).float().reshape(2, 2, 2, 16)
    steps = [{**kw, **{k: kw[k][:, t] for k in ("x", "dt", "B", "C", "z")}} for t in range(2)]
    Y, _ = au._reference("mamba2", init, steps)
    assert au._rel_fro(y, Y) < 1e-2
    assert sr.write_pos[1:].tolist() == [2, 1]


def _trow(kernel, variant, B, us, kind="gdn", **kw):
    return dict(kind=kind, kernel=kernel, variant=variant, B=B, us=us,
                L=kw.pop("L", au_L[kind]), **kw)


au_L = {"gdn": 16, "mamba2": 8}


def test_targets_met_not_met_not_measured():
    """The targets read the rows of one run: met, not met, measured in part (met None, the
    missing rows named) and not measured (met None with the reason), byte floors at the run's
    copy bandwidth (hand-made rows, not a measurement)."""
    rows = [_trow("authors", "fp32", 256, 160.0), _trow("authors-staggered", "fp32", 256, 165.0),
            _trow("replay-window", "s32_rs", 256, 150.0),
            _trow("replay-window-staggered", "s32_rs", 256, 150.0),
            _trow("authors", "fp32", 32, 26.0), _trow("replay-window", "s32_rs", 32, 30.0),
            _trow("replay-window", "tp4_hi32", 256, 79.0),
            _trow("replay-window", "tp8_hi32", 256, 120.0),
            _trow("conventional", "fp32", 128, 100.0, L=None),
            _trow("peer:fla", "float32", 128, 101.0, L=None),
            _trow("spec-authors-round", "fp32", 512, 440.0, T=4, L=16),
            *[_trow("spec-replay-round", p, 512, 400.0, T=4) for p in ("s32_rs", "tp8_hi32")],
            _trow("spec-replay-round", "tp4_hi32", 512, 450.0, T=4)]
    res = {"rows": rows, "copy_GBps": 4218.0, "provenance": {"shapes": SHAPES,
                                                             "authors": {"commit": "x"}},
           "accuracy": {"gdn": {"B": 8, "windows": 3,
                                "ours": {"s32_rs": {"anchor": 9e-7, "outputs": 1e-3},
                                         "tp4_hi32": {"anchor": 2e-5, "outputs": 0.1}}}}}
    tg = {t["name"]: t for t in targets_mod.targets(res)}
    t = tg["gdn/s32_rs-vs-authors-B256"]
    assert t["met"] is True and t["measured"] == round(160 / 150, 3) and t["unit"] == "x"
    assert abs(t["floor_us"] - 148.3) < 0.2     # the byte model at 4218 GB/s (FP32 u, shared)
    assert tg["gdn/s32_rs-vs-authors-other-B"]["met"] is False      # 26 / 30 at B = 32
    assert tg["gdn/s32_rs-vs-authors-other-B"]["detail"]["not_measured"] == \
        ["B=1", "B=8", "B=128", "B=512"]
    assert tg["gdn/tp4_hi32-window-B256"]["met"] is True
    assert tg["gdn/tp8_hi32-window-B256"]["met"] is False
    assert tg["gdn/conventional-vs-peer"]["met"] is None            # met where measured ...
    assert "B=256" in tg["gdn/conventional-vs-peer"]["reason"]       # ... the rest named
    assert tg["gdn/spec-vs-authors-T4-B512"]["met"] is False         # tp4_hi32 slower
    assert tg["gdn/accuracy"]["met"] is False and tg["gdn/accuracy"]["measured"] == 2e-5
    m = tg["mamba2/s32_rs-vs-authors-B256"]
    assert m["met"] is None and m["measured"] is None and m["reason"]
    assert tg["mamba2/spec-vs-authors-T4-B512"]["met"] is None
    assert tg["mamba2/accuracy"]["reason"] == "the accuracy section did not run"
    lines = tg["kernel-lines"]
    counted = {k: v for k, v in lines["detail"].items() if "not counted" not in k}
    assert lines["unit"] == "lines" and lines["measured"] == sum(counted.values()) > 0
    assert set(counted) == set(targets_mod.COUNTED)
    assert lines["detail"]["stores.py (not counted)"] > 0
    res["provenance"].pop("authors")
    t = {t["name"]: t for t in targets_mod.targets(res)}["mamba2/s32_rs-vs-authors-B256"]
    assert "--authors" in t["reason"]


def test_presets_fit_one_device_call():
    """The 'targets' preset plans every row the targets read within one ~8-minute call by the
    bench's estimate (the fit to H200 grids), beside the authors; 'probe' within ~5 minutes."""
    for name, limit in (("targets", 400), ("probe", 300)):
        sec = plan(KernelGrid(**targets_mod.PRESETS[name]), authors=True)
        keys = [k for k, _, _ in sec]
        assert estimate_s(sec) < limit, (name, estimate_s(sec))
        assert not [k for k in keys if k.endswith(("/L4", "/L32"))]
    keys = [k for k, _, _ in plan(KernelGrid(**targets_mod.PRESETS["targets"]), authors=True)]
    for kind, L in (("gdn", 16), ("mamba2", 8)):
        for B in (1, 8, 32, 128, 256, 512):
            assert f"authors/{kind}/B{B}" in keys and f"{kind}/B{B}/conventional" in keys
            for p in ("s32_rs", "tp8_hi32", "tp4_hi32"):
                assert f"{kind}/B{B}/{p}/L{L}" in keys
        assert f"staggered/{kind}/B256/s32_rs" in keys and f"peers/{kind}/B128" in keys
        assert f"spec/{kind}/B512/T4" in keys and f"accuracy/{kind}" in keys
    assert "spec-authors/gdn/B512/T4" in keys and "spec-authors/mamba2/B512/T4" in keys
    assert "checks" in keys


@pytest.mark.slow
def test_kda_rows(tmp_path):
    """A KDA run (CPU smoke, tiny shape): conventional FP32 and BF16 rows and replay windows
    whose bytes are the byte model's, and the conventional KDA kernel against its reference as
    the GPU checks run it; the full grid plans KDA's conventional, replay and peer sections, and
    no speculative, authors' or accuracy section (no conventional KDA verify, no authors' KDA)."""
    from replayquant.statebytes import (LayerShape, layer_conventional_bytes,
                                        replay_window_bytes)
    S = dict(kind="kda", H=2, HK=2, dv=16, dk=16)
    grid = KernelGrid(batches=(1, 3), Ls=(2,), pairs=("s32_rs",), Ts=(2,), spec_batches=(),
                      peers=False, checks=False, sweep=False, detail_batches=(),
                      shapes={"kda": S}, accuracy=False)
    res = run_kernels_bench(out=str(tmp_path), grid=grid, device="cpu")
    assert not res["errors"], res["errors"]
    rows = {(r["kernel"], r["variant"], r["B"]): r for r in res["rows"]}
    assert {("conventional", f, B) for f in ("fp32", "bf16") for B in (1, 3)} <= set(rows)
    sh = LayerShape("kda", S["H"], S["HK"], S["dv"], S["dk"])
    for B in (1, 3):
        for fmt in ("fp32", "bf16"):
            assert rows[("conventional", fmt, B)]["bytes"] == \
                layer_conventional_bytes(sh, fmt).total * B
        w = rows[("replay-window", "s32_rs", B)]
        assert w["bytes"] == replay_window_bytes("kda", "fp32", None, 2, B, 2, 2, 16, 16)
        assert w["GBps"] > 0
    idx = torch.tensor([2, -1, 0, 1], dtype=torch.int32)
    chk = conventional_checks("kda", S, idx, "cpu", N=3, steps=2)
    for key in ("kda/conventional/fp32-nearest", "kda/conventional/fp16-stochastic"):
        assert chk[key]["max_rel_y"] < 1e-5 and chk[key]["state"]["max_rel"] < 1e-5, chk
        assert chk[key]["n_casts_equal"]
    keys = [k for k, _, _ in plan(BASE)]
    assert "kda/B512/conventional" in keys and "peers/kda/B1" in keys
    assert "kda/B256/tp4_hi32/L16" in keys
    assert not [k for k in keys if "kda" in k and k.startswith(("spec", "authors", "accuracy",
                                                                  "staggered"))]
