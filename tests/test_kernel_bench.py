"""`replayquant bench kernels` code path on the CPU (Triton interpreter, tiny shapes, wall-clock
timing: a smoke run, never a result): plan, estimate, every section kind, derived speedups,
targets, dispatch table, JSON / markdown / PNG written; bad arguments rejected."""

import json

import pytest

from replayquant.bench import decode as bd

TINY = {"gdn": dict(kind="gdn", H=2, HK=1, dv=16, dk=16),
        "mamba2": dict(kind="mamba2", H=2, HK=1, dv=16, dk=16)}


def test_full_grid_plan():
    sec = bd.plan()
    keys = [k for k, _, _ in sec]
    assert len(keys) == len(set(keys))
    for kind in ("gdn", "mamba2"):
        for B in (1, 8, 32, 128, 256, 512):
            for pair in bd.PAIRS:
                for L in (4, 8, 16, 32):
                    assert f"{kind}/B{B}/{pair}/L{L}" in keys
        for T in (2, 4):
            assert f"spec/{kind}/B512/T{T}" in keys
    # the targets come first: conventional and the main L of every pair before other L values
    assert keys.index("gdn/B512/tp4_hi16_sr/L16") < keys.index("gdn/B1/s32_rs/L4")
    assert keys.index("spec/mamba2/B512/T4") < keys.index("spec/gdn/B512/T2")
    assert "dots/gdn/B256/tp4_hi32/L16" in keys and "dots/mamba2/B256/tp4_hi32/L8" in keys
    assert "dots/gdn/B1/s32_rs/L16" not in keys        # read variants from VARIANT_MIN_B
    assert keys.index("spec/gdn/B512/T4") < keys.index("dots/gdn/B128/s32_rs/L16") \
        < keys.index("peers/mamba2/B512") < keys.index("gdn/B1/s32_rs/L4")
    # by the H200 calibration (stochastic-rounding stores built on the GPU) the full grid takes
    # two 10-minute device calls
    assert 300 < bd.estimate_s(sec) < 2 * 540
    no_sr = bd.plan(pairs=("s32_rs", "tp8_hi32", "tp4_hi32"))
    assert bd.estimate_s(no_sr) < bd.estimate_s(sec)


def test_cpu_smoke_run(tmp_path):
    res = bd.run_kernels_bench(out=str(tmp_path), batches=(1, 3), Ls=(2,),
                               pairs=("s32_rs", "tp4_hi32"), Ts=(2,), spec_batches=(3,),
                               peers=False, checks=False, sweep=False, detail_batches=(3,),
                               device="cpu", shapes=TINY, variant_min_b=1)
    assert bd.SHAPES["gdn"]["H"] == 32                       # restored
    assert not res["errors"], res["errors"]
    js = json.loads((tmp_path / "kernels.json").read_text())
    assert js["provenance"]["smoke_cpu"] is True
    assert set(js["section_s"]) == {k for k, _, _ in bd.plan(
        (1, 3), (2,), ("s32_rs", "tp4_hi32"), (2,), (3,), peers=False, checks=False, sweep=False,
        detail_batches=(3,), shapes=TINY, variant_min_b=1)}
    kernels = {(r["kind"], r["kernel"], r["variant"], r["B"]) for r in js["rows"]}
    for kind in ("gdn", "mamba2"):
        for B in (1, 3):
            assert (kind, "conventional", "fp32", B) in kernels
            for pair in ("s32_rs", "tp4_hi32"):
                assert (kind, "replay-window", pair, B) in kernels
            assert (kind, "replay-forced-flush-layer", "s32_rs", B) in kernels
            assert (kind, "replay-forced-auto", "s32_rs", B) in kernels
            assert (kind, "replay-forced-auto-layer", "s32_rs", B) in kernels
            assert (kind, "conventional-alternated", "fp32", B) in kernels
            assert (kind, "replay-forced-auto-layer-alternated", "s32_rs", B) in kernels
            assert (kind, "replay-forced-flush-fused", "s32_rs", B) in kernels
            assert (kind, "replay-window-fused", "tp4_hi32", B) in kernels
        assert (kind, "replay-read-step", "tp4_hi32", 3) in kernels
        assert (kind, "spec-replay-round", "tp4_hi32", 3) in kernels
        assert (kind, "spec-replay-round-no-flush", "tp4_hi32", 3) in kernels
        assert (kind, "spec-snapshot-round", "fp32", 3) in kernels
    for kind in ("gdn", "mamba2"):
        assert (kind, "replay-window-dots", "tp4_hi32", 3) in kernels
        assert (kind, "replay-window-dots-staggered", "tp4_hi32", 3) in kernels
        assert (kind, "replay-read-step-dots", "tp4_hi32", 3) in kernels
    assert not [r for r in js["rows"] if r.get("error")]
    assert all("speedup_vs_conv_fp32" in r for r in js["rows"] if r["kernel"] == "replay-window")
    assert all("speedup_vs_snapshot_round" in r for r in js["rows"]
               if r["kernel"] == "spec-replay-round")
    assert len(js["targets"]) == 10 and "gdn/L2" in js["dispatch"]
    d = js["dispatch"]["mamba2/launch/tp4_hi32/L2"]
    assert set(d["fused_us"]) == set(d["split_us"]) == {"1", "3"}
    assert all(r["speedup_vs_conv_fp32"] > 0 for r in js["rows"]
               if r["kernel"] == "replay-window-fused")
    alt = [r for r in js["rows"] if r["kernel"].endswith("-alternated")]
    assert all(len(r["us_each"]) == bd.ALTERNATE_REPEATS for r in alt)
    assert all(r["speedup_vs_alternated_conv"] == 1.0 for r in alt
               if r["kernel"] == "conventional-alternated")
    b1 = [t for t in js["targets"] if t["target"].startswith("gdn: batch 1")][0]
    assert any("alternated" in k for k in b1["measured"])
    md = (tmp_path / "kernels.md").read_text()
    assert "## Targets" in md and "replay-window" in md
    assert (tmp_path / "kernels_speedup.png").stat().st_size > 1000


def test_merge_parts(tmp_path):
    """Two smoke runs split by layer kind merge into one table; parts of different commits,
    overlapping sections and a single part are refused with one error each."""
    kw = dict(batches=(1,), Ls=(2,), pairs=("s32_rs",), Ts=(2,), spec_batches=(), peers=False,
              checks=False, sweep=False, detail_batches=(), device="cpu", shapes=TINY)
    for kind in ("gdn", "mamba2"):
        bd.run_kernels_bench(out=str(tmp_path), kinds=(kind,), name=f"part_{kind}", plot=False,
                             **kw)
    parts = [str(tmp_path / f"part_{k}.json") for k in ("gdn", "mamba2")]
    res = bd.merge_kernels(parts, out=str(tmp_path), name="merged")
    js = json.loads((tmp_path / "merged.json").read_text())
    assert {r["part"] for r in js["rows"]} == {0, 1}
    assert {r["kind"] for r in js["rows"]} == {"gdn", "mamba2"}
    assert [p["kinds"] for p in js["provenance"]["parts"]] == [["gdn"], ["mamba2"]]
    assert len(res["targets"]) == 10
    assert all("speedup_vs_conv_fp32" in r for r in js["rows"] if r["kernel"] == "replay-window")
    assert "Merged from 2 runs" in (tmp_path / "merged.md").read_text()
    assert (tmp_path / "merged_speedup.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="section"):
        bd.merge_kernels([parts[0], parts[0]], out=str(tmp_path), name="bad")
    with pytest.raises(ValueError, match="at least two"):
        bd.merge_kernels(parts[:1], out=str(tmp_path), name="bad")
    other = json.loads(open(parts[1]).read())
    other["provenance"]["git_commit"] = "0" * 40
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="git_commit"):
        bd.merge_kernels([parts[0], str(tmp_path / "other.json")], out=str(tmp_path), name="bad")


def test_merge_commit_abbreviated():
    """Parts of one commit named in full and abbreviated merge under the full name; a different
    commit, or a name under 7 characters, is refused."""
    full = "909d56e0f065f9ce4c362c707be77ea326878c7c"
    assert bd._one_commit([full[:7], full, full[:12]]) == full
    assert bd._one_commit([None, None]) is None
    for bad in ([full[:7], "0" * 40], [full[:6], full], [full, None]):
        with pytest.raises(ValueError, match="git_commit"):
            bd._one_commit(bad)


def test_targets_byte_ceiling():
    """The two bandwidth targets carry their ceiling: the byte ratio and the measured baseline
    over the replay side's bytes at the copy bandwidth (hand-made rows, not a measurement)."""
    row = lambda kernel, variant, us, nbytes, **kw: dict(kind="gdn", kernel=kernel,  # noqa: E731
                                                        variant=variant, B=256, us=us,
                                                        bytes=nbytes, **kw)
    rows = [row("conventional", "fp32", 300.0, 1.2e9, pct_copy=100.0),
            row("replay-window", "s32_rs", 250.0, 0.6e9, L=16, speedup_vs_conv_fp32=1.2),
            row("replay-read-step", "s32_rs", 200.0, 0.5e9, L=16),
            row("replay-read-step", "tp4_hi32", 100.0, 0.1e9, L=16)]
    tg = {t["target"].split(" ")[1]: t for t in bd.targets({"rows": rows, "copy_GBps": 4000.0})
          if t["target"].startswith("gdn")}
    rep = tg["replay"]["ceiling"]["L=16"]
    assert rep == dict(byte_ratio=2.0, at_copy_bw=2.0)         # 0.6 GB at 4000 GB/s: 150 us
    rd = tg["non-flush"]["ceiling"]["L=16"]
    assert rd == dict(byte_ratio=5.0, at_copy_bw=8.0)          # 0.1 GB: 25 us; 200 / 25
    assert tg["non-flush"]["measured"]["L=16"] == 2.0 and tg["non-flush"]["met"] is False
    assert "ceiling" not in tg["conventional"]


def test_bench_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="pairs"):
        bd.run_kernels_bench(out=str(tmp_path), pairs=("nope",), device="cpu", shapes=TINY)
    with pytest.raises(ValueError, match="tiny"):
        bd.run_kernels_bench(out=str(tmp_path), device="cpu")


def test_sweep_picks_stay_with_the_block_read():
    """The bench's sweep picks the block read's config of a step (cfg['read/PAIR']); a verify and
    the 'dots' read keep their own defaults (VERIFY_BLOCK, DOTS_BLOCK) unless given theirs, and
    all take the flush pick."""
    cfg = {"read/p": {"block_v": 32, "num_warps": 2}, "flush/p": {"flush_config": (16, 1)},
           "verify/q": {"block_v": 16}}
    assert bd._cfg(cfg, "p") == {"block_v": 32, "num_warps": 2, "flush_config": (16, 1)}
    assert bd._cfg(cfg, "p", "verify") == bd._cfg(cfg, "p", "dots") == {"flush_config": (16, 1)}
    assert bd._cfg(cfg, "q", "verify") == {"block_v": 16}
