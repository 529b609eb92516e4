"""Per-token divergence between a reference and a test model, and the statistics of the KL report.

The statistics follow llama.cpp's KL report (`llama-perplexity --kl-divergence`,
tools/perplexity/perplexity.cpp) so numbers compare across tools: mean KLD with the standard error
of the mean, maximum, minimum and percentiles 99.9 ... 0.1 by linear interpolation between order
statistics, the same-top-token rate with its binomial uncertainty, PPL of both models, the
correlation of their per-token ln-probabilities (Pearson), ln(PPL(test)/PPL(ref)), PPL(test)/PPL(ref)
and PPL(test) - PPL(ref) with uncertainties that account for that correlation, and delta-p
(p_test - p_ref of the observed next token): mean, RMS, maximum, minimum and percentiles. One
difference: llama.cpp reports an uncertainty of 0 below 11 tokens, this module from 2 tokens on;
and llama.cpp keeps the base model's log-probabilities in 16 bits (its KL sums the tokens whose
base log-probability is above -16) and replaces the first token of each window by BOS where the
vocabulary asks for one; this module keeps them in float32 over the whole vocabulary and runs the
tokens the tokenizer gave (`add_special_tokens=True`).
`llama_report` prints the same text block as llama.cpp. Two additions for long context:
KL by log-spaced position bucket, and per-document values (with a document-level uncertainty,
because tokens of one document are not independent and the token-level uncertainty understates
the spread between documents).

Which positions are scored (`SCORINGS`, `scored_range`): "all" (the default) scores every position
of a document, 0 ... T-2 (position t predicts token t+1); "llama" scores as llama.cpp does, the
second half of each context window only: positions n/2 ... n-2 of a window of n tokens (llama.cpp's
`first = n_ctx/2`, `n_ctx - 1 - first` tokens a chunk), so the statistics are those of tokens that
see at least half a window of context. A document of `--context` tokens is one window.

Everything per token is computed in float32 over the full vocabulary and kept in float32 (the
per-token values the percentiles and medians are taken from, as llama.cpp keeps them); sums are
accumulated in float64.
"""

from __future__ import annotations

import math

import numpy as np
import torch

PERCENTILES = (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1)
DP_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1)

# Sums kept per document (and per position bucket) from which every mean and uncertainty is
# rebuilt exactly, whatever the split of documents between runs or processes.
SUM_KEYS = ("n", "kl", "kl2", "top", "nll_ref", "nll_ref2", "nll_test", "nll_test2", "nll_cross",
            "dnll", "dnll2", "dp", "dp2", "dp4")
BUCKET_KEYS = ("n", "kl", "kl2", "top", "dnll", "dnll2")

SCORINGS = ("all", "llama")


def scored_range(context: int, scoring: str = "all") -> tuple[int, int]:
    """The positions scored in a document of `context` tokens, as (first, stop): positions
    first ... stop - 1, position t predicting token t + 1. "all": (0, context - 1); "llama":
    (context // 2, context - 1), llama.cpp's `--kl-divergence` window."""
    if scoring not in SCORINGS:
        raise ValueError(f"--scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    return (0 if scoring == "all" else context // 2), context - 1


def token_metrics(ref_logits: torch.Tensor, test_logits: torch.Tensor, targets: torch.Tensor,
                  ref_logp: torch.Tensor | None = None) -> dict:
    """Per-position metrics of one chunk of positions.

    ref_logits, test_logits: [n, V] (any float dtype; promoted to float32); targets: [n] int64, the
    next token at each position. `ref_logp` may be passed instead of recomputing
    log_softmax(ref_logits) (the reference is shared by several pairs).
    Returns float32 tensors [n]: kl = sum_v p_ref (log p_ref - log p_test), nll_ref, nll_test,
    dp = p_test(target) - p_ref(target), and bool same_top (argmax equal).
    Identical logits give kl exactly 0.
    """
    if ref_logp is None:
        ref_logp = torch.log_softmax(ref_logits.float(), dim=-1)
    test_logp = torch.log_softmax(test_logits.float(), dim=-1)
    t = targets.view(-1, 1)
    lp_ref = ref_logp.gather(1, t).squeeze(1)
    lp_test = test_logp.gather(1, t).squeeze(1)
    same_top = ref_logp.argmax(dim=-1) == test_logp.argmax(dim=-1)
    # kl = sum p_ref * (logp_ref - logp_test), in place on test_logp to keep one [n, V] temporary.
    diff = test_logp.neg_().add_(ref_logp)
    kl = diff.mul_(ref_logp.exp()).sum(dim=-1)
    return {"kl": kl, "nll_ref": -lp_ref, "nll_test": -lp_test,
            "dp": lp_test.exp() - lp_ref.exp(), "same_top": same_top}


def bucket_edges(n_positions: int, base: int = 1024) -> list[int]:
    """Log-spaced position buckets: [0, base), [base, 2 base), [2 base, 4 base), ... up to n_positions."""
    if base < 1:
        raise ValueError(f"bucket base must be >= 1, got {base}")
    edges = [0]
    e = base
    while e < n_positions:
        edges.append(e)
        e *= 2
    edges.append(n_positions)
    return edges


def bucket_label(lo: int, hi: int, base: int = 1024) -> str:
    """Nominal name of the bucket that holds position `lo`: "<1K" for [0, base), "1K-2K", ...,
    "64K-128K" (the last bucket ends at the document's last scored position, e.g. 131071, and a
    bucket cut by the first scored position, e.g. [500, 1024) under llama scoring, keep their
    nominal names)."""
    def k(x):
        return f"{x // 1024}K" if x % 1024 == 0 and x > 0 else str(x)
    if lo < base:
        return f"<{k(base)}"
    start = base
    while start * 2 <= lo:
        start *= 2
    return f"{k(start)}-{k(2 * start)}"


def document_sums(m: dict, bucket_base: int = 1024, first: int = 0) -> dict:
    """Reduce the per-token metrics of one document (tensors [n] on any device, the positions
    first ... first + n - 1) to float64 sums.

    Returns {"sums": {SUM_KEYS...}, "kl_max", "kl_min", "buckets": [{"lo", "hi", BUCKET_KEYS...}]};
    buckets are by absolute position (`bucket_edges` from 0), those with no scored position left
    out.
    """
    kl = m["kl"].double().cpu()
    nr = m["nll_ref"].double().cpu()
    nt = m["nll_test"].double().cpu()
    dp = m["dp"].double().cpu()
    top = m["same_top"].cpu()
    d = nt - nr
    s = {
        "n": int(kl.numel()),
        "kl": kl.sum().item(), "kl2": (kl * kl).sum().item(),
        "top": int(top.sum().item()),
        "nll_ref": nr.sum().item(), "nll_ref2": (nr * nr).sum().item(),
        "nll_test": nt.sum().item(), "nll_test2": (nt * nt).sum().item(),
        "nll_cross": (nr * nt).sum().item(),
        "dnll": d.sum().item(), "dnll2": (d * d).sum().item(),
        "dp": dp.sum().item(), "dp2": (dp * dp).sum().item(), "dp4": (dp ** 4).sum().item(),
    }
    edges = bucket_edges(first + kl.numel(), bucket_base)
    buckets = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        lo = max(lo, first)
        if hi <= lo:
            continue
        kb, db = kl[lo - first:hi - first], d[lo - first:hi - first]
        buckets.append({"lo": lo, "hi": hi, "n": hi - lo, "kl": kb.sum().item(),
                        "kl2": (kb * kb).sum().item(), "top": int(top[lo - first:hi - first].sum().item()),
                        "dnll": db.sum().item(), "dnll2": (db * db).sum().item()})
    return {"sums": s, "kl_max": float(m["kl"].max().item()), "kl_min": float(m["kl"].min().item()),
            "dp_max": float(m["dp"].max().item()), "dp_min": float(m["dp"].min().item()),
            "buckets": buckets}


def mean_and_uncertainty(total: float, total2: float, n: int) -> tuple[float, float]:
    """Mean and standard error of the mean from a sum and a sum of squares (as llama.cpp)."""
    if n < 1:
        return float("nan"), float("nan")
    f = total / n
    var = total2 / n - f * f
    unc = math.sqrt(var / (n - 1)) if var > 0 and n > 1 else 0.0
    return f, unc


# How many standard errors a mean KL may lie from zero and still be zero (`kl_vs_zero`).
KL_ZERO_SE = 3.0


def kl_vs_zero(mean: float, unc: float) -> int:
    """Where a mean KL stands against zero, given its standard error `unc` (the uncertainty the
    statistics carry: `mean_and_uncertainty`'s, or `sweep.common.kl_bound`'s larger of the token-
    and document-level ones): 0 when it is compatible with zero, |mean| <= KL_ZERO_SE * unc (a
    KL of float noise, to be read as 0); 1 when it lies above; -1 when it lies below zero beyond
    its uncertainty, which no KL can: an error.

    Why three standard errors: the per-token KL of a pair whose logits equal the reference's up
    to float32 rounding is rounding noise of either sign (per-token values from -4.3e-7 to
    +4.9e-7 in the committed s32_rs runs), and its mean scatters around zero by its standard
    error: the ten committed s32_rs means (tiny models, 4K to 49K tokens) lie between -0.8 and
    +2.4 standard errors, their 24 position buckets between -1.5 and +2.1. Refusing a mean whose
    upper bound (mean + one standard error) is below zero refuses one exact run in six
    (one-sided 16%; a tiny-qwen3.5 s32_rs run at -7e-9 +- 5.7e-9 was); three standard errors
    refuse one in 740 (0.13%), while a KL made negative by a defect (logits swapped, a broken
    reference) lies many standard errors below. A mean above zero within the same band is the
    same noise, and reads as 0 too."""
    if mean > KL_ZERO_SE * unc:
        return 1
    return 0 if mean >= -KL_ZERO_SE * unc else -1


def kl_text(mean: float, unc: float, fmt: str = "{:.3g}") -> str:
    """A mean KL as tables show it by position: "~0" when it is compatible with zero
    (`kl_vs_zero`), the value when above, and the value marked "(<0)" when below zero beyond its
    uncertainty (a defect to look into, not a measurement)."""
    side = kl_vs_zero(mean, unc)
    return "~0" if side == 0 else fmt.format(mean) + (" (<0)" if side < 0 else "")


def binomial(k: int, n: int) -> tuple[float, float]:
    if n < 1:
        return float("nan"), float("nan")
    p = k / n
    return p, (math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0)


def add_sums(records: list[dict], keys=SUM_KEYS) -> dict:
    out = {k: 0 for k in keys}
    for r in records:
        for k in keys:
            out[k] += r[k]
    return out


def percentile(sorted_values: np.ndarray, q: float) -> float:
    """Linear interpolation between order statistics (numpy's default; llama.cpp's formula)."""
    return float(np.percentile(sorted_values, q)) if sorted_values.size else float("nan")


def summarize(doc_records: list[dict], kl_values: np.ndarray | None, bucket_base: int = 1024,
              dp_values: np.ndarray | None = None) -> dict:
    """Statistics of one pair over documents.

    doc_records: per document, the output of `document_sums` (plus "id"); kl_values: every per-token
    KL of those documents (float32 as stored; float16 in files of earlier versions), for the
    percentiles and the median;
    dp_values: every per-token delta-p, for its percentiles and median (None: not reported).
    """
    s = add_sums([r["sums"] for r in doc_records])
    n = s["n"]
    kl_mean, kl_unc = mean_and_uncertainty(s["kl"], s["kl2"], n)
    top, top_unc = binomial(s["top"], n)
    lr, lr_unc = mean_and_uncertainty(s["nll_ref"], s["nll_ref2"], n)
    lt, lt_unc = mean_and_uncertainty(s["nll_test"], s["nll_test2"], n)
    # ln(PPL_test / PPL_ref) = mean of (nll_test - nll_ref); its uncertainty is that of a mean of
    # differences, identical to llama.cpp's sqrt(u_t^2 + u_r^2 - 2 cov).
    dl, dl_unc = mean_and_uncertainty(s["dnll"], s["dnll2"], n)
    # covariance of the two mean ln-probabilities, and the Pearson correlation of the per-token
    # ln-probabilities (llama.cpp's Cor(ln(PPL(Q)), ln(PPL(base))) = cov / (u_t u_r))
    c = s["nll_cross"] / n - lr * lt if n else float("nan")
    cov = c / (n - 1) if n > 1 else float("nan")
    var_r, var_t = s["nll_ref2"] / n - lr * lr, s["nll_test2"] / n - lt * lt
    cor = c / math.sqrt(var_r * var_t) if n > 1 and var_r > 0 and var_t > 0 else float("nan")
    dp_mean, dp_unc = mean_and_uncertainty(s["dp"], s["dp2"], n)
    msq, msq_unc = mean_and_uncertainty(s["dp2"], s["dp4"], n)
    rms = math.sqrt(msq) if msq >= 0 else float("nan")
    rms_unc = 0.5 / rms * msq_unc if rms > 0 else 0.0
    ppl_ref, ppl_test = math.exp(lr), math.exp(lt)
    ppl_ref_unc, ppl_test_unc = ppl_ref * lr_unc, ppl_test * lt_unc
    diff_var = ppl_test_unc ** 2 + ppl_ref_unc ** 2 - 2 * ppl_test * ppl_ref * (cov if n > 1 else 0.0)

    out = {
        "n_tokens": n,
        "n_documents": len(doc_records),
        "kl_mean": kl_mean, "kl_mean_unc": kl_unc,
        "kl_max": max(r["kl_max"] for r in doc_records),
        "kl_min": min(r["kl_min"] for r in doc_records),
    }
    doc_means = [r["sums"]["kl"] / r["sums"]["n"] for r in doc_records]
    out["kl_mean_unc_docs"] = (float(np.std(doc_means, ddof=1) / math.sqrt(len(doc_means)))
                               if len(doc_means) > 1 else None)
    if kl_values is not None and kl_values.size:
        v = np.sort(kl_values.astype(np.float64, copy=False))
        out["kl_median"] = percentile(v, 50.0)
        out["kl_percentiles_from"] = f"{kl_values.dtype} per-token values"
        out["kl_percentiles"] = {f"{q:g}": percentile(v, q) for q in PERCENTILES}
    out.update({
        "same_top": top, "same_top_unc": top_unc,
        "ppl_ref": ppl_ref, "ppl_ref_unc": ppl_ref_unc,
        "ppl_test": ppl_test, "ppl_test_unc": ppl_test_unc,
        "ln_ppl_ratio": dl, "ln_ppl_ratio_unc": dl_unc,
        "ppl_ratio": math.exp(dl), "ppl_ratio_unc": math.exp(dl) * dl_unc,
        "ppl_diff": ppl_test - ppl_ref, "ppl_diff_unc": math.sqrt(max(diff_var, 0.0)),
        "ln_ppl_cov": cov, "ln_ppl_cor": cor,
        "dp_mean": dp_mean, "dp_mean_unc": dp_unc,
        "dp_rms": rms, "dp_rms_unc": rms_unc,
        "dp_max": (max(r["dp_max"] for r in doc_records)
                   if all("dp_max" in r for r in doc_records) else None),
        "dp_min": (min(r["dp_min"] for r in doc_records)
                   if all("dp_min" in r for r in doc_records) else None),
    })
    if dp_values is not None and dp_values.size:
        v = np.sort(dp_values.astype(np.float64, copy=False))
        out["dp_median"] = percentile(v, 50.0)
        out["dp_percentiles_from"] = f"{dp_values.dtype} per-token values"
        out["dp_percentiles"] = {f"{q:g}": percentile(v, q) for q in DP_PERCENTILES}
    out["by_position"] = bucket_summary(doc_records, bucket_base)
    out["per_document"] = [document_summary(r) for r in doc_records]
    return out


def bucket_summary(doc_records: list[dict], base: int = 1024) -> list[dict]:
    """Buckets are matched by (lo, hi); documents of one run share the context, hence the buckets."""
    acc: dict[tuple, dict] = {}
    for r in doc_records:
        for b in r["buckets"]:
            key = (b["lo"], b["hi"])
            a = acc.setdefault(key, {k: 0 for k in BUCKET_KEYS})
            for k in BUCKET_KEYS:
                a[k] += b[k]
    rows = []
    for (lo, hi), a in sorted(acc.items()):
        m, u = mean_and_uncertainty(a["kl"], a["kl2"], a["n"])
        t, tu = binomial(a["top"], a["n"])
        d, du = mean_and_uncertainty(a["dnll"], a["dnll2"], a["n"])
        rows.append({"bucket": bucket_label(lo, hi, base), "lo": lo, "hi": hi, "n_tokens": a["n"],
                     "kl_mean": m, "kl_mean_unc": u, "same_top": t, "same_top_unc": tu,
                     "ln_ppl_ratio": d, "ln_ppl_ratio_unc": du})
    return rows


def document_summary(r: dict) -> dict:
    s = r["sums"]
    n = s["n"]
    kl, kl_unc = mean_and_uncertainty(s["kl"], s["kl2"], n)
    return {"id": r.get("id"), "index": r.get("index"), "n_tokens": n, "kl_mean": kl,
            "kl_mean_unc": kl_unc, "kl_max": r["kl_max"], "same_top": s["top"] / n,
            "ppl_ref": math.exp(s["nll_ref"] / n), "ppl_test": math.exp(s["nll_test"] / n),
            "ln_ppl_ratio": s["dnll"] / n,
            "kl_last_bucket": (r["buckets"][-1]["kl"] / r["buckets"][-1]["n"]) if r["buckets"] else None}
