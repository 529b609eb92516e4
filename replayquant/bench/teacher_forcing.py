"""GPU check and benchmark of the chunked teacher-forcing kernel (replayquant.kernels.chunk).

    python -m replayquant.bench.teacher_forcing OUT.json [--lengths 8192,32768]

1. Correctness on CUDA: the Triton kernel against the torch reference `chunk_scan_ref` run on
   the CPU (the specification), two segments per case (the second continues a partial window,
   one case with padding), outputs poisoned with NaN before the kernel writes, an exact-prefill
   case, and a second identical run that must give the same bits (a race shows as a change).
2. Timing: one Qwen3.5-4B-shape GDN layer (32 value heads, d_k = d_v = 128, B = 1) over T tokens
   in one segment: the kernel with tp4_hi16_sr and s32_rs, against transformers'
   `torch_chunk_gated_delta_rule` (its torch path: flash-linear-attention is not installed)
   on the same inputs; s32_rs outputs are compared with it (both the FP32 recurrence up to
   reassociation). Medians of `triton.testing.do_bench`; peak memory over the call.
Writes one JSON file with provenance.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F


def _inputs(gen, B, T, H, dk, dv, delta, device):
    q = torch.randn(B, T, H, dk, generator=gen) / dk ** 0.5
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, dv, generator=gen)
    log_a = torch.log(0.85 + 0.15 * torch.rand(B, T, H, generator=gen))
    beta = torch.rand(B, T, H, generator=gen) if delta else None
    return [None if t is None else t.to(device) for t in (q, k, v, log_a, beta)]


def _codes(qt):
    p = qt.payload
    return p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p


def _compare(pair, y, y_ref, s, s_ref):
    y, y_ref = y.cpu(), y_ref.cpu()
    scale = y_ref.abs().max().clamp(min=1e-6)
    out = {"nan_outputs": int(torch.isnan(y).sum()),
           "y_max_rel_err": float((y - y_ref).abs().max() / scale),
           "y_frac_above_1e-5": float(((y - y_ref).abs() > 1e-5 * scale).float().mean()),
           "count_equal": bool(torch.equal(s.count.cpu(), s_ref.count)),
           "flushes_equal": bool(torch.equal(s.flushes.cpu(), s_ref.flushes)),
           "buffer_k_v_equal": bool(torch.equal(s.k.cpu(), s_ref.k) and torch.equal(s.v.cpu(), s_ref.v)),
           "buffer_G_max_err": float((s.G.cpu() - s_ref.G).abs().max())}
    for role, spec in (("anchor", pair.anchor), ("read", pair.read)):
        if spec is None:
            continue
        a, b = getattr(s, role), getattr(s_ref, role)
        fa, fb = spec.fmt.dequantize(a).cpu(), spec.fmt.dequantize(b)
        out[f"{role}_codes_differ_frac"] = float((_codes(a).cpu() != _codes(b)).float().mean())
        out[f"{role}_max_err_rel_to_matrix_max"] = float(
            ((fa - fb).abs() / fb.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=1e-30)).max())
    return out


def check(device="cuda") -> list:
    """Kernel on `device` against chunk_scan_ref on the CPU; returns one dict per case."""
    from replayquant.kernels import chunk
    from replayquant.kernels.chunk_ref import chunk_scan_ref, initial_scan_state
    from replayquant.pairs import PrecisionPair

    real_empty = chunk._empty
    chunk._empty = lambda shape, dtype, dev: torch.full(shape, float("nan"), dtype=dtype, device=dev)
    cases = [  # pair, delta, B, H, d_k, d_v, L, padded second segment, exact
        ("tp4_hi16_sr", True, 2, 4, 128, 128, 16, True, False),
        ("f4_sr_rs", False, 2, 4, 128, 64, 16, False, False),
        ("tp8_hi32", True, 3, 4, 64, 64, 8, False, False),
        ("s32_rs", True, 2, 4, 128, 128, 16, False, True),
    ]
    results = []
    try:
        for name, delta, B, H, dk, dv, L, padded, exact in cases:
            pair = PrecisionPair.load(name).with_buffer_len(L)
            gen = torch.Generator().manual_seed(1234 + len(results))
            T1, T2 = 2 * L + L // 2 + 1, L + L // 2
            q, k, v, la, be = _inputs(gen, B, T1 + T2, H, dk, dv, delta, "cpu")
            S0 = torch.randn(B, H, dv, dk, generator=gen) * 0.5
            valid = torch.ones(B, T1 + T2, dtype=torch.bool)
            if padded:
                valid[1, T1:T1 + 5] = False
            s_ref = initial_scan_state(S0, pair, delta=delta, seed=9, layer=4)
            s_gpu = initial_scan_state(S0.to(device), pair, delta=delta, seed=9, layer=4)
            case = {"pair": name, "kind": "gdn" if delta else "mamba2", "B": B, "H": H, "d_k": dk,
                    "d_v": dv, "L": L, "segments": [T1, T2], "padded": padded, "exact": exact,
                    "segments_result": []}
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
                    _codes(s_new.anchor), _codes(s_again.anchor)))
                case["segments_result"].append(r)
                s_gpu = s_new
            results.append(case)
    finally:
        chunk._empty = real_empty
    return results


def _hf_chunk():
    for mod in ("transformers.models.qwen3_5.modeling_qwen3_5",
                "transformers.models.qwen3_next.modeling_qwen3_next"):
        try:
            m = __import__(mod, fromlist=["torch_chunk_gated_delta_rule"])
            return getattr(m, "torch_chunk_gated_delta_rule"), mod
        except (ImportError, AttributeError):
            continue
    raise ImportError("transformers has no torch_chunk_gated_delta_rule")


def bench(lengths=(8192, 32768), device="cuda") -> list:
    from triton.testing import do_bench

    from replayquant.kernels import chunk
    from replayquant.kernels.chunk_ref import initial_scan_state
    from replayquant.pairs import PrecisionPair

    hf_fn, hf_mod = _hf_chunk()
    H, dk, dv, B = 32, 128, 128, 1
    rows = []
    for T in lengths:
        gen = torch.Generator().manual_seed(T)
        q, k, v, la, be = _inputs(gen, B, T, H, dk, dv, True, device)
        S0 = torch.zeros(B, H, dv, dk, device=device)
        row = {"T": T, "B": B, "H": H, "d_k": dk, "d_v": dv}
        ys = {}
        for name in ("tp4_hi16_sr", "s32_rs"):
            pair = PrecisionPair.load(name)
            ss = initial_scan_state(S0, pair, delta=True, seed=1)
            fn = lambda: chunk.chunk_scan(ss, q, k, v, la, be, pair=pair, seed=1)  # noqa: E731
            ys[name] = fn()[0]
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            row[f"kernel_{name}_peak_extra_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            row[f"kernel_{name}_ms"] = do_bench(fn, warmup=5, rep=300, return_mode="median")
        # HF: q unscaled (it scales by d_k^-1/2 itself), state [B, H, d_k, d_v]
        qh = q * dk ** 0.5
        hf = lambda: hf_fn(qh, k, v, la, be, chunk_size=64, initial_state=None,  # noqa: E731
                           output_final_state=True, use_qk_l2norm_in_kernel=False)
        y_hf = hf()[0]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        hf()
        torch.cuda.synchronize()
        row["hf_torch_chunk_peak_extra_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        row["hf_torch_chunk_ms"] = do_bench(hf, warmup=5, rep=300, return_mode="median")
        row["hf_function"] = f"{hf_mod}.torch_chunk_gated_delta_rule"
        scale = y_hf.abs().max()
        row["s32_rs_vs_hf_max_rel_err"] = float((ys["s32_rs"] - y_hf.float()).abs().max() / scale)
        row["tp4_hi16_sr_vs_hf_max_rel_err"] = float((ys["tp4_hi16_sr"] - y_hf.float()).abs().max() / scale)
        row["ratio_tp4_hi16_sr_over_hf"] = row["kernel_tp4_hi16_sr_ms"] / row["hf_torch_chunk_ms"]
        rows.append(row)
        del q, k, v, la, be, ys, y_hf
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m replayquant.bench.teacher_forcing OUT.json "
                         "[--lengths 8192,32768] [--commit SHA]")
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
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    from replayquant.provenance import provenance
    t0 = time.time()
    prov = provenance("cuda", lengths=list(lengths), source_commit=commit,
                      timing="triton.testing.do_bench median, warmup 5 ms, rep 300 ms, one segment, "
                             "inputs float32 on the GPU, compile excluded")
    result = {"provenance": prov, "check": None, "bench": []}

    def save():
        with open(out, "w") as f:
            json.dump(result, f, indent=1)

    result["check"] = check()
    prov["check_seconds"] = round(time.time() - t0, 1)
    save()
    print(json.dumps(result["check"], indent=1), flush=True)
    for T in lengths:                     # written after each length: a timeout keeps the rest
        result["bench"] += bench((T,))
        save()
    prov["total_seconds"] = round(time.time() - t0, 1)
    save()
    rows = result["bench"]
    for r in rows:
        print(f"T={r['T']}: kernel tp4_hi16_sr {r['kernel_tp4_hi16_sr_ms']:.2f} ms, s32_rs "
              f"{r['kernel_s32_rs_ms']:.2f} ms, HF torch chunk {r['hf_torch_chunk_ms']:.2f} ms; "
              f"s32_rs vs HF rel err {r['s32_rs_vs_hf_max_rel_err']:.1e}")
    return result


if __name__ == "__main__":
    main()
