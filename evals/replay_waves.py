"""The wave table of the replay decode's launches (no GPU: Triton's compiler and ptxas for sm_90,
`compile_check`): for the read launch, the flush launch and the one-pass verify's read launch of
GDN (Qwen3.5-4B layer: H = 32, HK = 16, d_v = d_k = 128, L = 16) and Mamba-2 (Nemotron-H: H = 128,
HK = 8, d_v = 64, d_k = 128, L = 8), pairs s32_rs / tp8_hi32 / tp4_hi32, each launch's
registers, spills, shared memory and SASS count, the programs an SM holds (launch.programs_per_sm)
and its waves on 132 SMs (launch.waves) at the bench's batches, at the launch table's config.
Records the tiny launches of `--drive` in the interpreter, then compiles them at the layer
shapes.

    PYTHONPATH=. python evals/replay_waves.py OUT.json [--arch 90]

Writes OUT.json (rows, provenance)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 8, 32, 128, 256, 512)
PAIRS = ("s32_rs", "tp8_hi32", "tp4_hi32")
KINDS = {"gdn": dict(H=32, HK=16, dv=128, dk=128, L=16),
         "mamba2": dict(H=128, HK=8, dv=64, dk=128, L=8)}
T_VERIFY = 4


def drive() -> int:
    """At tiny shapes, one step of each kind and pair as two launches (flush, read) and one
    one-pass verify, so that compile_check records each kernel's specialization."""
    import torch

    from replayquant.kernels.replay.decode import replay_gdn_step, replay_mamba2_step
    from replayquant.kernels.replay.launch import override_replay_launch
    from replayquant.kernels.replay.verify import replay_gdn_verify, replay_mamba2_verify
    from replayquant.pairs import PrecisionPair
    from replayquant.replay.stores import ReplayStore
    from replayquant.testing import (gdn_params, gdn_step_inputs, mamba2_params,
                                     mamba2_step_inputs, random_state)
    B, H, D, L = 1, 2, 32, 4
    for kind in KINDS:
        for pair in PAIRS:
            for T in (None, 2):
                st = ReplayStore.from_state(random_state(B, H, D, D),
                                            PrecisionPair.load(pair).with_buffer_len(L), kind,
                                            key_heads=1, max_drafts=T or 0,
                                            u_dtype=torch.float32 if pair == "s32_rs" else None)
                with override_replay_launch({"fused": False} if T is None else {}):
                    if kind == "gdn":
                        q, k, v, a, b = gdn_step_inputs(B, 1, H, D, D, T=T)
                        f = replay_gdn_step if T is None else replay_gdn_verify
                        f(st, q, k, v, a, b, *gdn_params(H),
                          **({} if T is None else dict(design="onepass")))
                    else:
                        x, dt, Bm, C, z = mamba2_step_inputs(B, 1, H, D, D, T=T)
                        A, Dp, dtb = mamba2_params(H)
                        f = replay_mamba2_step if T is None else replay_mamba2_verify
                        f(st, x, dt, A, Bm, C, D=Dp, z=z, dt_bias=dtb,
                          **({} if T is None else dict(design="onepass")))
    return 0


def _record(path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "replayquant.kernels.compile_check", "record",
                        str(path), "--", str(Path(__file__).resolve()), "--drive"],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stdout + r.stderr)
    return json.loads(Path(path).read_text())


def compiled(ln: dict, arch: int) -> dict:
    """Registers, spilled bytes (stores + loads), shared memory and SASS count of one launch."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from replayquant.kernels.compile_check import (_compile_inputs, assemble, count_sass,
                                                   ptxas_report)
    fn, sig, consts, attrs = _compile_inputs(ln)
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": ln["num_warps"],
                                **({"maxnreg": ln["maxnreg"]} if ln.get("maxnreg") else {})})
    rc, err, dis = assemble(k.asm["ptx"], arch, verbose=True, sass=True)
    rep = ptxas_report(err)
    regs = int(re.search(r"Used (\d+) registers", rep).group(1))
    spill = sum(int(x) for x in re.findall(r"(\d+) bytes spill", rep))
    return dict(regs=regs, spill_bytes=spill, smem=int(k.metadata.shared),
                sass=count_sass(dis) if dis else None, ptxas=rep)


def configs(kind: str, pair: str, B: int):
    """{launch: (constexpr updates, num_warps, maxnreg, grid programs)} of the table's configs
    for one batch B."""
    from replayquant.kernels.replay.decode import flush_grid_on
    from replayquant.kernels.replay.launch import (SM90, onepass_launch_config, _max_regs,
                                                   _table, replay_launch_config)
    from replayquant.pairs import PrecisionPair
    from replayquant.replay.stores import ReplayStore
    from replayquant.testing import random_state
    S = KINDS[kind]
    st = ReplayStore.from_state(random_state(1, S["H"], S["dv"], S["dk"]),
                                PrecisionPair.load(pair).with_buffer_len(S["L"]), kind,
                                key_heads=S["HK"])
    shape = dict(HK=S["HK"], HV=S["H"], DK=S["dk"], DV=S["dv"], BUFFER_LEN=S["L"],
                 BUFFER_TILE=max(16, S["L"]))
    out = {}
    for which in ("flush", "read"):
        BV, nw = replay_launch_config(st, which)
        tiles = B * S["H"] * (S["dv"] // BV)
        c = dict(shape, BV=BV, CAPACITY=S["L"], PCK=_table(st, "read")[3])
        if which == "flush":
            c["TPP"], (tiles,) = flush_grid_on(tiles, SM90["sms"])
        out[which] = (c, nw, _max_regs(st, which, 1), tiles)
    BV, nw, CK, stages = onepass_launch_config(st)
    out["onepass"] = (dict(shape, BV=BV, CK=CK, STAGES=stages, T=T_VERIFY, TP=T_VERIFY,
                           CAPACITY=S["L"] + T_VERIFY, NCOL=16), nw, None,
                      B * S["H"] * (S["dv"] // BV))
    return out


def main(argv) -> int:
    if "--drive" in argv:
        return drive()
    os.environ.pop("TRITON_INTERPRET", None)
    from replayquant.kernels.replay.launch import programs_per_sm, waves
    from replayquant.outputs import write_json
    from replayquant.provenance import provenance
    out = next((a for a in argv if a.endswith(".json")), None)
    arch = int(argv[argv.index("--arch") + 1]) if "--arch" in argv else 90
    with tempfile.TemporaryDirectory() as d:
        recorded = _record(Path(d) / "launches.json")
    base = {}                  # (kernel, DELTA, RFMT, FLUSHES) -> a recorded launch
    for ln in recorded:
        c = ln["constexprs"]
        if ln["kernel"] == "_replay_kernel" and (c["FUSED"] or not c["STEP"]):
            continue
        base.setdefault((ln["kernel"], c["DELTA"], c["RFMT"], c.get("FLUSHES")), ln)
    res = dict(provenance("cpu", arch=arch, batches=BATCHES, pairs=PAIRS, sms=132), rows=[])
    cache = {}
    for kind in KINDS:
        for pair in PAIRS:
            for B in BATCHES:
                    for which, (c, nw, regs, programs) in configs(kind, pair, B).items():
                        kern = "_onepass_kernel" if which == "onepass" else "_replay_kernel"
                        rf = _rfmt(pair)
                        ln = base[(kern, kind == "gdn", rf,
                                   None if which == "onepass" else which == "flush")]
                        ln = json.loads(json.dumps(ln))
                        ln["constexprs"].update(c)
                        ln["num_warps"] = nw
                        ln.pop("maxnreg", None)
                        if regs:
                            ln["maxnreg"] = regs
                        key = json.dumps(ln, sort_keys=True)
                        if key not in cache:
                            cache[key] = compiled(ln, arch)
                        r = cache[key]
                        row = dict(kind=kind, pair=pair, launch=which, B=B,
                                   BV=c["BV"], warps=nw, maxnreg=regs, programs=programs,
                                   per_sm=programs_per_sm(nw, r["regs"], r["smem"]),
                                   waves=waves(programs, nw, r["regs"], r["smem"]), **r)
                        res["rows"].append(row)
                        print(f"{kind:6s} {pair:8s} {which:7s} "
                              f"B={B:3d} {c['BV']}x{nw} cap={regs} regs={r['regs']} "
                              f"spill={r['spill_bytes']} smem={r['smem']} sass={r['sass']} "
                              f"programs={programs} per_sm={row['per_sm']} "
                              f"waves={row['waves']:.2f}", flush=True)
                        if out:
                            write_json(out, res)
    return 0


def _rfmt(pair: str) -> int:
    """The read copy's format id (roles.FORMAT ids: FP32 0, FP8 3, NVFP4 4) of a bench pair."""
    return {"s32_rs": 0, "tp8_hi32": 3, "tp4_hi32": 4}[pair]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
