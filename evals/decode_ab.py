"""A/B of the decode kernels' switches (module settings of replay_decode), on a GPU, in one
call: for each kind and pair at batch B, the 'dots' read step (h = L / 2: no row flushes), the
flush step (h = L - 1: every row flushes), the 'dots' window with every row in phase and
staggered (row b starts at fill b % L), and the verify round (T drafts at batch --verify-batch,
the bench's random accepts) against the snapshot round, once per mode (MODES: a name for a set
of switch values and step options). Session 12 (as evals/flush_list_ab.py, runs 55-56): the
flush kernel over a list of the rows that flush (FLUSH_LIST: 'grid' without it; 'list' variants:
programs per SM, no register cap, 8 value heads per item for SR pairs); then a verify's
preloaded draft inputs (VERIFY_PRELOAD: 'no-preload' without). Session 13: a register cap
on one-warp flush programs ('cap1w-128', 'cap1w-168'), 8-row flush blocks ('f8'); three forms
of GDN's flush fold ran as modes of commits since removed (row pieces 'frw8/16/32' at 0f0679a,
the decay deferred 'defer' at 9ef646b, loads two entries ahead 'pf2' at 9c8b49d); the steps
with the block read (--read-variant block, the default below 128 rows). Session 14: the one
launch per step ('fused', with --read-variant block and --verify-batch 0; the GPU check does
not cover it: the grid's checks compare the two launches) against the split launch; a decode
step's flush blocks per program chosen on the device (FLUSH_DEVICE_BLOCKS: 'dyn-off' the
host's rule, 'dyn-1' every block from one listed item, 'dyn-every' the device's choice at every
batch, both kinds; runs 78-81 set the switch of their commits, FLUSH_ALL_BLOCKS_MIN_ITEMS /
_ROWS, as their files record). Session 15: an NVFP4 read copy beside an FP32 anchor cast after
the flush from the anchor ('nv-whole': cast in the flush, whole matrices). A GPU check first
(--no-check: none): L + 3 staggered steps and a verify in the first two modes from the same
stores, outputs and stores compared bit for bit.

    python evals/decode_ab.py OUT.json [--batch 256] [--verify-batch 512] [--T 4]
        [--read-variant dots]
        [--pairs s32_rs,tp8_hi32,tp4_hi32,tp4_hi16_sr] [--kinds gdn,mamba2]
        [--modes grid,list] [--verify-modes grid,list] [--no-steps] [--no-check] [--L 16]

Times as in the bench (CUDA graph, L2 flushed, state copies rotated for the windows). Writes
OUT.json with provenance and prints a markdown table."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from replayquant.bench import decode as bd
from replayquant.kernels import replay_decode as rd
from replayquant.provenance import provenance


# mode: (replay_decode settings, flush_config of the steps and verifies or None); 'list' is run
# 56's choice but for programs per SM (FLUSH_LIST_WARPS_PER_SM 32 there). 'list-nh8' only for
# pairs with stochastic rounding, 'nt1' (one-warp 16-row flush blocks, one block per work item)
# only for pairs without an NVFP4 role (those flush whole matrices)
MODES = {"grid": ({"FLUSH_LIST": False}, None), "list": ({"FLUSH_LIST_WARPS_PER_SM": 32}, None),
         "list-w16": ({"FLUSH_LIST_WARPS_PER_SM": 16}, None),
         "list-w64": ({"FLUSH_LIST_WARPS_PER_SM": 64}, None),
         "list-nocap": ({"FLUSH_LIST_MAXNREG": None}, None),
         "list-nh8": ({}, (None, None, None, 8)), "nt1": ({}, (16, 1, 1)),
         "nt-all": ({"FLUSH_ALL_BLOCKS_MIN_ROWS": 0, "FLUSH_DEVICE_BLOCKS": {}}, None),
         "default": ({}, None), "no-preload": ({"VERIFY_PRELOAD": False}, None),
         "cap1w-128": ({"FLUSH_LIST_MAXNREG_1W": {"step": 128, "verify": 128}}, None),
         "cap1w-168": ({"FLUSH_LIST_MAXNREG_1W": {"step": 168, "verify": 168}}, None),
         "cap1w-none": ({"FLUSH_LIST_MAXNREG_1W": {"step": None, "verify": None}}, None),
         "f8": ({}, (8, 1)), "fused": ({}, {"launch": "fused"}),
         "dyn-off": ({"FLUSH_DEVICE_BLOCKS": {}}, None),
         "dyn-1": ({"FLUSH_DEVICE_BLOCKS": {"gdn": (256, 1), "mamba2": (256, 1)}}, None),
         "dyn-every": ({"FLUSH_DEVICE_BLOCKS": {"gdn": (10 ** 9, 1024),
                                                "mamba2": (10 ** 9, 1024)}}, None),
         "nv-whole": ({"FLUSH_DEFER_NV": {}}, None)}
DEFAULT = {k: getattr(rd, k) for k in ("FLUSH_LIST", "FLUSH_LIST_WARPS_PER_SM",
                                       "FLUSH_LIST_MAXNREG", "FLUSH_LIST_MAXNREG_1W",
                                       "VERIFY_PRELOAD", "FLUSH_ALL_BLOCKS_MIN_ROWS",
                                       "FLUSH_DEVICE_BLOCKS", "FLUSH_DEFER_NV")}


def _set(mode):
    """Set the module's switches for `mode` (the others at their defaults); the extra step
    options (a flush config, or a dict of step options such as the launch)."""
    settings, fc = MODES[mode]
    for k, v in {**DEFAULT, **settings}.items():
        setattr(rd, k, v)
    if isinstance(fc, dict):
        return dict(fc)
    return {} if fc is None else {"flush_config": fc}


def _applies(mode, pair) -> bool:
    if mode == "list-nh8":
        return bd._sr_pair(pair)
    if mode in ("nt1", "f8"):                           # no NVFP4 role
        from replayquant.pairs import PrecisionPair
        P = PrecisionPair.load(pair)
        return all(r is None or r.format != "nvfp4" for r in (P.anchor, P.read))
    return True


def _reset():
    _set("default")


def _check(kind, pair, B, T, modes, L, device="cuda") -> dict:
    """Largest |difference| of outputs and stores between two modes over L + 3 staggered
    steps and one verify + accept (0.0: bit for bit)."""
    from replayquant.kernels.verify import replay_accept
    S = bd.SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    init = bd.random_state(B, H, dv, dk, seed=7, device=device)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    f = bd._fns(kind)
    outs, stores = {}, {}
    for mode in modes:
        _set(mode)
        st = rd.ReplayStore.from_state(init, bd._pair(pair, L)[0], kind, key_heads=HK,
                                       max_drafts=T)
        st.committed.copy_(idx % L)
        got = []
        for s in range(L + 3):
            kw = bd._kw(kind, S, B, seed=100 + s, device=device)
            got.append(f["step"](st, **kw, state_indices=idx, path="replay",
                                 read_variant="dots").clone())
        kw = bd._kw(kind, S, B, T=T, seed=99, device=device)
        out = torch.empty(B, T, H, dv, device=device)
        f["verify"](st, **kw, state_indices=idx, out=out)
        got.append(out.clone())
        replay_accept(st, (idx % (T + 1)).to(torch.int32), idx, check=False)
        outs[mode], stores[mode] = got, st
    _reset()
    a, b = (stores[m] for m in modes)
    d = dict(out=max(float((x - y).abs().max()) for x, y in zip(*(outs[m] for m in modes))),
             anchor=float((a.anchor.dequantize() - b.anchor.dequantize()).abs().max()),
             read=float((a.read_role.dequantize() - b.read_role.dequantize()).abs().max()),
             pointers=bool(torch.equal(a.committed, b.committed)
                           and torch.equal(a.start, b.start) and torch.equal(a.n_flush, b.n_flush)))
    return d


def _steps(kind, pair, B, cfg, L, rv="dots") -> list:
    """Read step and flush step (one store, pointers held) and the windows of L steps, split
    launch, read variant rv."""
    H, HK, dv, dk, f, idx, kw, out, af, rf, c, R, sts = bd._replay_setup(
        kind, B, pair, L, "cuda", {}, None, "dots" if rv == "dots" else "read")
    st = sts[0]
    rows = []
    cfg = {"launch": "split", **cfg}                   # mode 'fused': the one launch
    for name, h in ((f"replay-read-step-{rv}", L // 2), (f"replay-flush-step-{rv}", L - 1)):
        st.committed.fill_(h)
        ms = bd.time_calls(lambda: f["step"](st, **kw, state_indices=idx, out=out, path="replay",
                                             advance=False, read_variant=rv, **cfg), 8)
        rows.append(bd._row(kind, name, pair, B, ms, None, None, L=L, h=h))
    for stag in (False, True):
        for s_ in sts:
            s_.committed.copy_(idx % L if stag else torch.zeros_like(idx))
        calls = [lambda st=st: f["step"](st, **kw, state_indices=idx, out=out, path="replay",
                                         read_variant=rv, **cfg) for st in sts]
        ms = bd.time_calls(lambda: [g() for g in calls], L) / R
        rows.append(bd._row(kind, f"replay-window-{rv}" + ("-staggered" if stag else ""), pair,
                            B, ms, None, None, L=L, rot=R))
    del sts
    bd._empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--verify-batch", type=int, default=512, help="0: no verify rounds")
    ap.add_argument("--T", type=int, default=4)
    ap.add_argument("--pairs", default=",".join(bd.PAIRS))
    ap.add_argument("--kinds", default="gdn,mamba2")
    ap.add_argument("--modes", default="grid,list",
                    help=f"step modes, of {','.join(MODES)} ('list-nh8' only for SR pairs)")
    ap.add_argument("--verify-modes", default="grid,list")
    ap.add_argument("--no-steps", action="store_true")
    ap.add_argument("--read-variant", default="dots", choices=("dots", "block"),
                    help="the steps' read kernel (block: the default below 128 rows)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--L", type=int, default=None,
                    help=f"buffer length of the steps and checks (default {bd.PAIR_L})")
    a = ap.parse_args(argv)
    pairs, kinds = a.pairs.split(","), a.kinds.split(",")
    modes, vmodes = a.modes.split(","), a.verify_modes.split(",")
    bd._check_names(pairs, kinds)
    Ls = {k: a.L or bd.PAIR_L[k] for k in kinds}
    if min(Ls.values()) < 2:
        raise SystemExit(f"decode_ab: --L {a.L}: a window needs L >= 2")
    if [m for m in modes + vmodes if m not in MODES] or len(modes) < 2 and not a.no_check:
        raise SystemExit(f"decode_ab: modes {modes}, verify modes {vmodes}: choose from "
                         f"{list(MODES)} (two step modes at least, unless --no-check)")
    if bd.no_gpu("decode_ab"):
        return 2
    copy_bw = bd.copy_bandwidth_GBps("cuda")
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    checks, rows = {}, []
    for kind in kinds if not a.no_check else ():
        for pair in pairs:
            checks[f"{kind}/{pair}"] = d = _check(kind, pair, 64, a.T, modes[:2], Ls[kind])
            print(f"check {kind} {pair}: {d}", flush=True)
    for kind in kinds:
        for pair in pairs:
            for mode in modes if not a.no_steps else ():
                if not _applies(mode, pair):
                    continue
                got = _steps(kind, pair, a.batch, _set(mode), Ls[kind], a.read_variant)
                rows += [{**r, "mode": mode} for r in got]
                print(f"{kind} {pair} {mode}: " + ", ".join(
                    f"{r['kernel']} {r['us']:.1f}" for r in got), flush=True)
        for mode in vmodes if a.verify_batch else ():
            opts = _set(mode)
            ps = [p for p in pairs if _applies(mode, p)]
            got = bd.bench_spec(kind, a.verify_batch, a.T, "cuda", copy_bw, pairs=ps,
                                cfg={f"flush/{p}": opts for p in ps})
            rows += [{**r, "mode": mode} for r in got]
            print(f"{kind} verify {mode}: " + ", ".join(
                f"{r['kernel']} {r['variant']} {r['us']:.1f}" for r in got), flush=True)
    _reset()
    res = {"provenance": provenance("cuda", script="evals/decode_ab.py", batch=a.batch,
                                    verify_batch=a.verify_batch, T=a.T, pairs=pairs, kinds=kinds,
                                    read_variant=a.read_variant,
                                    modes={m: MODES[m] for m in modes + vmodes},
                                    steps=not a.no_steps, L=Ls,
                                    shapes=bd.SHAPES),
           "copy_GBps": copy_bw, "checks": checks, "rows": rows}
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(bd.rows_table(rows, ("mode",)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
