"""GPU check and benchmarks of chunked teacher forcing (replayquant.kernels.chunk.kernel).

    python -m replayquant.bench.teacher_forcing OUT.json [--lengths 8192,32768]   (parts 1, 2)
    python -m replayquant.bench.teacher_forcing --ptxas      (registers / spills, no GPU)
    replayquant bench teacher-forcing [--part layer|model|all] [--context 131072] ...

1. Correctness on CUDA: the Triton kernel against the torch reference `chunk_scan_ref` run on
   the CPU (the specification), two segments per case (the second continues a partial window,
   one case with padding), outputs poisoned with NaN before the kernel writes, an exact-prefill
   case, and a second identical run that must give the same bits (a race shows as a change).
2. Per-layer timing: one Qwen3.5-4B-shape GDN layer (32 value heads, d_k = d_v = 128, B = 1)
   over T tokens in one segment: the kernel with tp4_hi16_sr and s32_rs (float32 inputs, as the
   patched model passes them), against the chunk function HF's Qwen3.5 layer calls
   (`torch_chunk_gated_delta_rule`: flash-linear-attention's kernel when fla is importable, else
   HF's torch path; bf16 inputs, as the model gives it). Medians of `triton.testing.do_bench`;
   peak memory over the call.
3. Whole model: the Qwen3.5-4B-shape random-weight model of `replayquant bench kl`
   over one document of `context` tokens in segments with its cache: the unpatched HF forward
   (fla's kernels when installed) and the same after `replayquant.patch(model, pair,
   prefill=...)`; wall times, their ratio (target <= 2), peak memory (target <= 40 GiB) and the
   time inside the replay calls (CUDA events around chunk.teacher_force / chunk.chunk_scan and
   around HF's GDN chunk function) to say what dominates.
Writes one JSON file with provenance; each part replaces its own section and keeps the others.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from replayquant import options
from replayquant.bench import check_model_bench
from replayquant.bench.timing import (HF_TARGETS, REPLAY_TARGETS, KernelClock, fla_version,
                                      hf_chunk_function)
from replayquant.formats import as_bits
from replayquant.kernels.chunk import kernel as chunk
from replayquant.kernels.chunk import launch as chunk_launch
from replayquant.kernels.chunk.reference import chunk_scan_ref, initial_scan_state
from replayquant.kernels.compile_check import assemble, compile_ptx, ptxas_report
from replayquant.replay.roles import FMT_IDS
from replayquant.bench.kl import (SHAPES, _chunk_dot, build_model, plain_forward, random_document,
                                  timed)
from replayquant.models.patching import DTYPES
from replayquant.models import patch, teacher_force_path, unpatch
from replayquant.outputs import check_owned, output_lock, write_json
from replayquant.pairs import PrecisionPair
from replayquant.provenance import provenance


def _inputs(gen, B, T, H, dk, dv, delta, device):
    q = torch.randn(B, T, H, dk, generator=gen) / dk ** 0.5
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, dv, generator=gen)
    log_a = torch.log(0.85 + 0.15 * torch.rand(B, T, H, generator=gen))
    beta = torch.rand(B, T, H, generator=gen) if delta else None
    return [None if t is None else t.to(device) for t in (q, k, v, log_a, beta)]


def _compare(pair, y, y_ref, s, s_ref):
    y, y_ref = y.cpu(), y_ref.cpu()
    scale = y_ref.abs().max().clamp(min=1e-6)
    out = {"nan_outputs": int(torch.isnan(y).sum()),
           "y_max_rel_err": float((y - y_ref).abs().max() / scale),
           "y_frac_above_1e-5": float(((y - y_ref).abs() > 1e-5 * scale).float().mean()),
           "count_equal": bool(torch.equal(s.committed.cpu(), s_ref.committed)),
           "flushes_equal": bool(torch.equal(s.n_flush.cpu(), s_ref.n_flush)),
           "buffer_k_v_equal": bool(torch.equal(s.k.cpu(), s_ref.k) and torch.equal(s.v.cpu(), s_ref.v)),
           "buffer_G_max_err": float((s.G.cpu() - s_ref.G).abs().max())}
    for role, spec in (("anchor", pair.anchor), ("read", pair.read)):
        if spec is None:
            continue
        a, b = getattr(s, role), getattr(s_ref, role)
        fa, fb = spec.fmt.dequantize(a).cpu(), spec.fmt.dequantize(b)
        differ = as_bits(a.payload).cpu() != as_bits(b.payload)
        out[f"{role}_codes_differ_frac"] = float(differ.float().mean())
        out[f"{role}_max_err_rel_to_matrix_max"] = float(
            ((fa - fb).abs() / fb.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=1e-30)).max())
    return out


def check(device="cuda") -> list:
    """Kernel on `device` against chunk_scan_ref on the CPU; returns one dict per case."""
    real_empty = chunk._empty
    chunk._empty = lambda shape, dtype, dev: torch.full(shape, float("nan"), dtype=dtype, device=dev)
    cases = [  # pair, delta, B, H, d_k, d_v, L, padded second segment, exact
        ("tp4_hi16_sr", True, 2, 4, 128, 128, 16, True, False),
        ("f4_sr_rs", False, 2, 4, 128, 64, 16, False, False),
        ("f4_sr_rs", True, 2, 16, 128, 128, 16, True, False),   # Qwen3.5-4B heads: split chain
        ("tp8_hi32", True, 3, 4, 64, 64, 8, False, False),
        ("s32_rs", True, 2, 4, 128, 128, 16, False, True),
    ]
    results = []
    try:
        for (i, (name, delta, B, H, dk, dv, L, padded, exact)), dots in itertools.product(
                enumerate(cases), ("ieee", "tf32x3")):
            with options.override(chunk_dot=dots):
                pair = PrecisionPair.load(name).with_buffer_len(L)
                gen = torch.Generator().manual_seed(1234 + i)       # the same inputs for both dots
                T1, T2 = 2 * L + L // 2 + 1, L + L // 2
                q, k, v, la, be = _inputs(gen, B, T1 + T2, H, dk, dv, delta, "cpu")
                S0 = torch.randn(B, H, dv, dk, generator=gen) * 0.5
                valid = torch.ones(B, T1 + T2, dtype=torch.bool)
                if padded:
                    valid[1, T1:T1 + 5] = False
                s_ref = initial_scan_state(S0, pair, delta=delta, seed=9, layer=4)
                s_gpu = initial_scan_state(S0.to(device), pair, delta=delta, seed=9, layer=4)
                case = {"pair": name, "dots": dots, "kind": "gdn" if delta else "mamba2", "B": B,
                        "H": H, "d_k": dk,
                        "d_v": dv, "L": L, "segments": [T1, T2], "padded": padded, "exact": exact,
                        "segments_result": []}
                if pair.anchor.format == "nvfp4" and str(device).startswith("cuda"):
                    case["nvfp4_chain_programs_per_matrix"] = chunk_launch.nvfp4_chain_programs(
                        B * H, dv, chunk_launch.device_sms(device))
                for a, b in ((0, T1), (T1, T1 + T2)):
                    sl = [None if t is None else t[:, a:b] for t in (q, k, v, la, be)]
                    vm = valid[:, a:b] if padded else None
                    y_ref, s_ref = chunk_scan_ref(s_ref, *sl, pair=pair, seed=9, layer=4, valid=vm,
                                                  exact=exact and a > 0)
                    gsl = [None if t is None else t.to(device) for t in sl]
                    gvm = None if vm is None else vm.to(device)
                    y, s_new = chunk.chunk_scan(s_gpu, *gsl, pair=pair, seed=9, layer=4, valid=gvm,
                                                exact=exact and a > 0)
                    y2, s_again = chunk.chunk_scan(s_gpu, *gsl, pair=pair, seed=9, layer=4, valid=gvm,
                                                   exact=exact and a > 0)
                    if str(device).startswith("cuda"):
                        torch.cuda.synchronize()
                    r = _compare(pair, y, y_ref, s_new, s_ref)
                    r["rerun_bit_identical"] = bool(torch.equal(y, y2) and torch.equal(
                        as_bits(s_new.anchor.payload), as_bits(s_again.anchor.payload)))
                    case["segments_result"].append(r)
                    s_gpu = s_new
                results.append(case)
    finally:
        chunk._empty = real_empty
    return results


def bench(lengths=(8192, 32768), device="cuda") -> list:
    hf_fn, hf_label = hf_chunk_function()
    H, dk, dv, B = 32, 128, 128, 1
    rows = []
    for T in lengths:
        gen = torch.Generator().manual_seed(T)
        q, k, v, la, be = _inputs(gen, B, T, H, dk, dv, True, device)
        S0 = torch.zeros(B, H, dv, dk, device=device)
        row = {"T": T, "B": B, "H": H, "d_k": dk, "d_v": dv}
        ys = {}

        def measure(name, fn):
            out = fn()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            row[f"{name}_peak_extra_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            row[f"{name}_ms"] = do_bench(fn, warmup=5, rep=100, return_mode="median")
            return out

        for name in ("tp4_hi16_sr", "s32_rs", "f4_sr_rs", "tp4_hi32"):
            pair = PrecisionPair.load(name)
            ss = initial_scan_state(S0, pair, delta=True, seed=1)
            fn = lambda: chunk.chunk_scan(ss, q, k, v, la, be, pair=pair, seed=1)  # noqa: E731
            ys[name] = measure(f"kernel_{name}", fn)[0]
            with KernelClock(device, {}) as clock:       # one more call: time per pass
                fn()
            row[f"kernel_{name}_passes_ms"] = {k: v["seconds"] * 1e3 for k, v in
                                               clock.seconds().get("chunk_passes", {}).items()}
            if pair.anchor.format == "nvfp4":             # A/B: split chain or two-pass
                row[f"kernel_{name}_chain_programs_per_matrix"] = \
                    chunk_launch.nvfp4_chain_programs(H, dv, chunk_launch.device_sms(device))
                with options.override(nvfp4_chain_split=0):
                    y2 = measure(f"kernel_{name}_chain_two_pass", fn)[0]
                row[f"kernel_{name}_split_vs_two_pass_max_rel_diff"] = float(
                    (y2 - ys[name]).abs().max() / ys[name].abs().max())
            if pair.anchor.rounding == "stochastic":      # A/B: where the SR bits are drawn
                measure(f"kernel_{name}_precomputed_sr_bits",
                        lambda: chunk.chunk_scan(ss, q, k, v, la, be, pair=pair, seed=1,
                                                 precompute_sr_bits=True))
            if name == "tp4_hi16_sr":                    # A/B: the other dot precision
                prec = options.get().chunk_dot
                other = "ieee" if prec == "tf32x3" else "tf32x3"
                row["dot_precision"] = prec
                try:
                    with options.override(chunk_dot=other):
                        y3 = measure(f"kernel_{name}_{other}", fn)[0]
                    row[f"kernel_{name}_{other}_max_rel_diff"] = float(
                        (y3 - ys[name]).abs().max() / ys[name].abs().max())
                except Exception as e:                    # record, keep timing the rest
                    row[f"kernel_{name}_{other}_error"] = f"{type(e).__name__}: {e}"[:500]
        # HF: q unscaled (it scales by d_k^-1/2 itself), bf16 inputs as in the model, state
        # [B, H, d_k, d_v]
        bf = torch.bfloat16
        qh, kh, vh, bh = (q * dk ** 0.5).to(bf), k.to(bf), v.to(bf), be.to(bf)
        hf = lambda: hf_fn(qh, kh, vh, g=la, beta=bh, initial_state=None,  # noqa: E731
                           output_final_state=True, use_qk_l2norm_in_kernel=False)
        y_hf = measure("hf_chunk", hf)[0]
        row["hf_function"] = hf_label
        scale = y_hf.float().abs().max()
        for name in ("s32_rs", "tp4_hi16_sr"):
            row[f"{name}_vs_hf_max_rel_err"] = float((ys[name] - y_hf.float()).abs().max() / scale)
            row[f"ratio_{name}_over_hf"] = row[f"kernel_{name}_ms"] / row["hf_chunk_ms"]
        rows.append(row)
        del q, k, v, la, be, ys, y_hf, qh, kh, vh, bh
        torch.cuda.empty_cache()
    return rows


# ============================================================================ whole model

def whole_model(shape: str = "qwen3.5-4b", context: int = 131072, segment: int = 8192,
                pair: str = "tp4_hi16_sr", prefill: str = "replay", dtype: str = "bfloat16",
                device: str | None = None, warmup_tokens: int | None = None) -> dict:
    """The model of `replayquant bench kl` over one random document in segments with
    its cache, unpatched (HF; fla's kernels when installed) and patched with `pair`; returns the
    section for the results file. Warm-up (compilation, autotuning) on a prefix of two
    segments before each timed run."""
    check_model_bench("bench teacher-forcing", shape, device)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(shape, DTYPES[dtype], device)
    cfg = SHAPES[shape]
    ids = random_document(model.config.vocab_size, context).to(device)
    warm = min(warmup_tokens or 2 * segment, context)
    gib = lambda b: None if b is None else b / 2 ** 30  # noqa: E731

    plain_forward(model, ids[:warm], min(segment, warm))
    with KernelClock(device, HF_TARGETS, passes=False) as hf_clock:
        t_hf, peak_hf = timed(lambda: plain_forward(model, ids, segment), device)

    patch(model, pair, prefill=prefill)
    probe = torch.empty(0, device=device)
    path = teacher_force_path(probe, cfg["linear_key_head_dim"], cfg["linear_value_head_dim"])
    plain_forward(model, ids[:warm], min(segment, warm))
    with KernelClock(device, REPLAY_TARGETS) as rq_clock:
        t_rq, peak_rq = timed(lambda: plain_forward(model, ids, segment), device)
    unpatch(model)

    inside = rq_clock.seconds()
    hf_inside = hf_clock.seconds()
    tf = inside["replay_teacher_force"]["seconds"]
    ratio = t_rq / t_hf
    return {
        "kind": "replayquant.bench.teacher_forcing.whole_model",
        "shape": shape, "model_config": cfg, "dtype": dtype, "context": context,
        "segment": segment, "pair": pair, "prefill": prefill, "teacher_force_path": path,
        "flash_linear_attention": fla_version(), "hf_gdn_function": hf_chunk_function()[1],
        "chunk_dot_precision": _chunk_dot(),
        "hf_forward_s": t_hf, "patched_forward_s": t_rq, "ratio_patched_over_hf": ratio,
        "peak_gpu_gib_hf": gib(peak_hf), "peak_gpu_gib_patched": gib(peak_rq),
        "target": "patched_forward_s <= 2 * hf_forward_s; peak GPU (patched) <= 40 GiB",
        "meets_time_target": ratio <= 2.0,
        "meets_memory_target": None if peak_rq is None else peak_rq <= 40 * 2 ** 30,
        "inside_patched_s": inside, "inside_hf_s": hf_inside, "inside_note": KernelClock.NOTE,
        "patched_outside_replay_s": t_rq - tf,
        "hf_outside_gdn_chunk_s": t_hf - hf_inside["hf_gdn_chunk"]["seconds"],
        "provenance": provenance(device=device, bench="teacher-forcing whole model", shape=shape,
                                 context=context, segment=segment, pair=pair, prefill=prefill,
                                 dtype=dtype, warmup_tokens=warm,
                                 timing="wall time of the segmented forward, synchronized, "
                                        "after a warm-up on the first two segments"),
    }


# ============================================================================ resource report

def resource_report(pairs=("tp4_hi16_sr", "s32_rs", "f4_sr_rs", "tp4_hi32"), H: int = 32,
                    d: int = 128, L: int = 16, arch: int = 90) -> list:
    """Registers and spills of the chunk kernel's passes for sm_<arch>a, compiled by Triton
    here and assembled with the ptxas Triton ships (the newest one that reads its PTX), no GPU
    needed: [{pair, kernel, line}], line = ptxas -v's report. The launch parameters are those
    chunk_scan uses for B = 1, H heads, d_k = d_v = d (GDN, prefill="replay")."""
    ptr = {"fp32": ("*fp32", "*fp32", "*fp32"), "fp16": ("*i16", "*i16", "*i16"),
           "bf16": ("*i16", "*i16", "*i16"), "fp8": ("*u8", "*fp32", "*u8"),
           "nvfp4": ("*u8", "*u8", "*fp32")}
    ints = {"T": "i32", "WIDTH": "i32", "w0": "i32", "NWS": "i32", "key_lo": "i64",
            "key_hi": "i64", "tok_ptr": "*i32", "h0_ptr": "*i32", "nfull_ptr": "*i32",
            "nwin_ptr": "*i32", "nf_ptr": "*i64", "seq_ptr": "*i64", "Rb": "*i32",
            "Cn": "*i32", "err": "*i32", "spin_limit": "i32"}

    def build(fn, types, consts, warps):
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                sig[name] = "constexpr"
            else:
                sig[name] = types.get(name, "*fp32")
                if sig[name].startswith("*"):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        r = assemble(compile_ptx(fn, sig, consts, warps, arch, attrs), arch, verbose=True)
        if r is None:
            return "ptxas failed: Triton ships no ptxas"
        if r[0] == 0:
            return ptxas_report(r[1])
        return "ptxas failed: " + (r[1].strip().splitlines() or ["?"])[-1]

    rows = []
    for name in pairs:
        pair = PrecisionPair.load(name).with_buffer_len(L)
        cfg = chunk_launch.chunk_launch_config(pair, 1, H, d, d, L, sms=132)    # as on an H200
        a, r = pair.anchor.format, pair.read_spec.format
        shared = pair.read is None
        asr = pair.anchor.rounding == "stochastic"
        t = dict(ints, A_pay=ptr[a][0], A_sc=ptr[a][1], A_gs=ptr[a][2],
                 R_pay=ptr[r][0], R_sc=ptr[r][1], R_gs=ptr[r][2])
        base = dict(H=H, DK=d, DV=d, BUFFER_LEN=L, BUFFER_TILE=cfg["buffer_tile"], EXACT=False,
                    PREC=options.get().chunk_dot)
        kernels = [
            ("terms", chunk._terms_kernel,
             dict(base, BV=cfg["terms_bv"], DELTA=True, PRE=False, VEC=False),
             cfg["terms_warps"]),
            ("chain", chunk._chain_kernel,
             dict(base, BV=cfg["chain_bv"], NRB=cfg["chain_rows"] // cfg["chain_bv"],
                  AFMT=FMT_IDS[a], ASR=asr, SHARED=shared, DELTA=True, PRE=False,
                  SPLIT=bool(cfg["chain_split"]), VEC=False),
             cfg["chain_warps"]),
            ("output", chunk._output_kernel, dict(base, BV=cfg["out_bv"]), cfg["out_warps"])]
        if not shared:
            kernels.insert(2, ("cast", chunk._cast_kernel,
                               dict(H=H, DK=d, DV=d, BV=cfg["cast_bv"], AFMT=FMT_IDS[a], ASR=asr,
                                    RFMT=FMT_IDS[r], RSR=pair.read_spec.rounding == "stochastic",
                                    SHARED=False, EXACT=False), cfg["cast_warps"]))
        for kname, fn, consts, warps in kernels:
            try:
                line = build(fn, t, consts, warps)
            except Exception as e:                 # another Triton version's API
                line = f"not compiled: {type(e).__name__}: {e}"
            rows.append({"pair": name, "kernel": kname, "warps": warps, "ptxas": line})
    return rows


TF_KIND = "replayquant.bench.teacher_forcing"   # the "kind" of the results file


def _is_teacher_forcing(old: dict) -> bool:
    """A results file written before they carried a "kind"."""
    return bool(old) and set(old) <= {"provenance", "check", "bench", "whole_model", "merged_note"}


def check_out(out) -> None:
    """Refuse, before any work, an `out` holding anything but this benchmark's results (its
    parts are merged into the file: `replayquant.outputs.check_owned`)."""
    check_owned(out, TF_KIND, "replayquant bench teacher-forcing", unkinded=_is_teacher_forcing)


@contextlib.contextmanager
def _holding(out):
    """`out` checked, then locked (and checked again) for the `with` block."""
    check_out(out)
    with output_lock(out):
        check_out(out)
        yield


def _merge(out, **sections) -> dict:
    """Write `sections` into the JSON file `out`, keeping its other sections."""
    path = Path(out)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(sections, kind=TF_KIND)
    write_json(path, data)
    return data


def run_layer(out, lengths=(8192, 32768), commit=None) -> dict:
    """Parts 1 and 2 (check, per-layer timing) into `out`; each length is written as it ends,
    so a timeout keeps the rest."""
    with _holding(out):
        return _run_layer(out, lengths, commit)


def _run_layer(out, lengths, commit) -> dict:
    if not torch.cuda.is_available():
        raise ValueError("bench teacher-forcing --part layer: the kernel check and per-layer "
                         "timing need a CUDA GPU, and this machine has none; run it on a machine "
                         "with one (--part model --shape tiny is the CPU smoke test)")
    t0 = time.time()
    prov = provenance("cuda", lengths=list(lengths), source_commit=commit,
                      timing="triton.testing.do_bench median, warmup 5 ms, rep 100 ms, one segment, "
                             "kernel inputs float32 on the GPU, HF inputs bf16, compile excluded")
    section = {"provenance": prov, "check": None, "bench": []}
    _merge(out, **section)
    section["check"] = check()
    prov["check_seconds"] = round(time.time() - t0, 1)
    _merge(out, **section)
    print(json.dumps(section["check"], indent=1), flush=True)
    for T in lengths:
        section["bench"] += bench((T,))
        _merge(out, **section)
        r = section["bench"][-1]
        print(f"T={T}: " + ", ".join(f"{k[:-3]} {v:.2f} ms" for k, v in r.items()
                                     if k.endswith("_ms") and isinstance(v, float)), flush=True)
    prov["total_seconds"] = round(time.time() - t0, 1)
    return _merge(out, **section)


def run_model(out, **kw) -> dict:
    """Part 3 (whole model) into `out` under "whole_model"."""
    with _holding(out):
        r = whole_model(**kw)
        _merge(out, whole_model=r)
    return r


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m replayquant.bench.teacher_forcing OUT.json "
                         "[--lengths 8192,32768] [--commit SHA]  |  --ptxas (registers and "
                         "spills of the chunk kernel for sm_90a, no GPU)")
    if argv[0] == "--ptxas":
        for r in resource_report():
            print(f"{r['pair']:12s} {r['kernel']:7s} {r['warps']} warps  {r['ptxas']}")
        return None
    out = argv.pop(0)
    lengths, commit = (8192, 32768), None
    while argv:
        flag = argv.pop(0)
        if flag == "--lengths":
            lengths = tuple(int(x) for x in argv.pop(0).split(","))
        elif flag == "--commit":
            commit = argv.pop(0)
        else:
            raise SystemExit(f"unknown argument {flag!r}")
    return run_layer(out, lengths, commit)


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:               # bad input or no GPU: one line, as the CLI prints it
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
