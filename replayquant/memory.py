"""Memory a run would need, checked against what the machine has before any work.

A size that cannot fit (a buffer length of a million steps, a drift of 10^8 steps, a test
tensor of 10^12 elements) is refused with one ValueError naming the memory it would need and
the memory there is, instead of an allocator error after the model has loaded. The estimates
are upper estimates from the shapes the command knows; what is available is the free memory of
the GPUs the run would use, or the host's available memory (psutil) for a CPU run.
"""

from __future__ import annotations

import torch

__all__ = ["available_bytes", "check_fits", "replay_cache_bytes", "kl_cache_bytes",
           "check_kl_sizes"]


def _gib(b: float) -> str:
    return f"{b / 2 ** 30:.3g} GiB"


def available_bytes(device: str | None = None) -> tuple[float, str]:
    """(bytes free, where) for a run on `device`: a CUDA device or map (None / "auto" on a
    machine with CUDA: every visible GPU together), else the host's available memory."""
    dev = "auto" if device is None else str(device).strip()
    if torch.cuda.is_available() and not dev.startswith(("cpu", "meta", "mps")):
        if dev.startswith("cuda:"):
            idx = [int(dev.split(":", 1)[1])]
        else:
            idx = list(range(torch.cuda.device_count()))
        free = sum(torch.cuda.mem_get_info(i)[0] for i in idx)
        return float(free), ("GPU " + ", ".join(map(str, idx)) if len(idx) > 1 else f"cuda:{idx[0]}")
    import psutil   # psutil: optional, not a dependency
    return float(psutil.virtual_memory().available), "the host"


def check_fits(needed: float, what: str, fix: str, device: str | None = None) -> None:
    """One ValueError when `needed` bytes are more than the memory available for `device`:
    '{what} would need N GiB of memory, more than the M GiB free on WHERE; {fix}'."""
    free, where = available_bytes(device)
    if needed > free:
        raise ValueError(f"{what} would need {_gib(needed)} of memory, more than the "
                         f"{_gib(free)} free on {where}; {fix}")


def replay_cache_bytes(shape, pair) -> float:
    """Bytes of one sequence's `ReplayState` for one layer (the KL harness's cache): the anchor
    and read copy dequantized (FP32, an upper estimate of their stored formats) and the FP32
    buffer of L entries (k, v, the gate: d_k channels for KDA, one for GDN / Mamba-2; beta and u
    for the delta rule)."""
    s = shape
    per_entry = s.dk + s.dv + (s.dk if s.kind == "kda" else 1) + (0 if s.kind == "mamba2" else 1 + s.dv)
    return 4.0 * s.H * (pair.buffer_len * per_entry + 2 * s.dv * s.dk)


def kl_cache_bytes(layer_pairs) -> float:
    """Bytes of the caches of a KL run, one sequence a variant: `layer_pairs` holds, for each
    variant, the (layer shape, pair) of every layer it quantizes (`policy.quantized_layers`)."""
    return sum(replay_cache_bytes(s, p) for layers in layer_pairs for s, p in layers)


def check_kl_sizes(labels, layer_pairs, n_layers: int, context: int, prefill: str,
                   device: str | None) -> None:
    """Before a KL run loads weights: the caches of the variants (named by `labels`, their layers
    as `kl_cache_bytes` takes them) must fit in memory, and with prefill "replay" every pair's
    buffer length L must be below context - 1. A document's first flush is its token L - 1
    (0-based; that token's output comes from the unrounded state), token L is the first to read
    the flushed anchor and read copy, and the last scored token is context - 2 under either
    scoring (`kl.stats.scored_range`): with L >= context - 1 no scored token reads a flushed
    role, and the KL would measure no anchor at all."""
    Ls = [[p.buffer_len for _, p in layers] for layers in layer_pairs]
    longest = max((L for lens in Ls for L in lens), default=0)
    check_fits(kl_cache_bytes(layer_pairs),
               f"the caches of {len(labels)} variant(s) over {n_layers} recurrent layers "
               f"(buffer lengths up to {longest})",
               "give shorter buffer lengths or fewer pairs per run", device)
    if prefill == "replay":
        last = context - 2                      # the last scored token
        for label, lens in zip(labels, Ls, strict=True):
            long = [L for L in lens if L > last]
            if long:
                L = max(long)
                raise ValueError(f"{label}: buffer length {L} is not below --context {context} "
                                 f"- 1: the first flush is token {L - 1} of a document and the "
                                 f"last scored token is {last}, so no flush would reach a scored "
                                 f"token and the KL would not measure the anchor at all; give a "
                                 f"buffer length below {context - 1} (--buffer-len of sweep / "
                                 f"sensitivity, buffer_len: of the pair YAML) or a longer "
                                 f"--context")
