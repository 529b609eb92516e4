"""`replayquant bench kl` (GPU, not in CI): wall time and peak memory of one long KL document.

A Qwen3.5-4B-shape text model with random weights (no download) reads one document of random
tokens (`context` tokens, default 131072) in segments; the KL harness runs the reference and the
pairs in lockstep over it. The baseline is the plain (unpatched) Hugging Face forward over the
same tokens and segments with its cache, logits for every position, as a user computing
perplexity would run it (with flash-linear-attention installed, HF uses its kernels).
Targets: KL wall time <= 1.5 x (1 + number of pairs) baseline forwards; peak GPU
memory <= 60 GiB. The KL values of a random model mean nothing and are not reported as results.

The shape: hidden 2560, 32 layers with every 4th full attention (16 query / 4 KV heads of 256),
Gated DeltaNet with 16 key / 32 value heads of 128, MLP 9216, vocabulary 248320, tied
embeddings: about 4.2 B parameters. Hidden size, layers, attention heads and vocabulary follow
the published model card; the MLP width is an assumption (it does not change the recurrent
state, only the time of the MLPs).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from replayquant import options
from replayquant.outputs import check_owned, output_lock, write_json
from replayquant.provenance import provenance

from replayquant.kl.data import Document, DocumentSet
from replayquant.kl.lockstep import cache_kwarg, output_cache
from replayquant.kl.run import RunParts, run_kl
from replayquant.kl.settings import KLSettings

BENCH_KL_KIND = "replayquant.bench.kl"     # the "kind" of the results file

SHAPES = {
    "qwen3.5-4b": dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, vocab_size=248320, max_position_embeddings=262144,
                       tie_word_embeddings=True),
    # for tests on CPU
    "tiny": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=512,
                 max_position_embeddings=4096, tie_word_embeddings=True),
}


def build_model(shape: str, dtype: torch.dtype, device, **config) -> torch.nn.Module:
    """The random-weight model of `shape` (seed 0); `config` overrides its config's fields."""
    # transformers: loaded when a model is built
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = Qwen3_5TextConfig(**{**SHAPES[shape], **config})
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3_5ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _chunk_dot() -> str:
    """The chunk kernel's dot precision (the option chunk_dot, replayquant.options)."""
    return options.get().chunk_dot


def random_document(vocab: int, context: int) -> torch.Tensor:
    """The benchmarks' document: `context` random token ids (generator seed 1), on the CPU."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (context,), generator=g)


def timed(fn, device) -> tuple[float, int | None]:
    """(wall seconds, peak GPU bytes allocated during fn or None off CUDA) of fn(), synchronized."""
    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0, (torch.cuda.max_memory_allocated() if cuda else None)


def plain_forward(model, ids: torch.Tensor, segment: int) -> None:
    """The baseline: the unpatched model over `ids` in segments with its cache, all logits."""
    kw = cache_kwarg(model)
    cache = None
    with torch.inference_mode():
        for s in range(0, ids.numel(), segment):
            out = model(input_ids=ids[s:s + segment].unsqueeze(0), use_cache=True, **{kw: cache})
            cache = output_cache(out)
            del out


def bench_kl(out: str | Path = "build/bench/kl_128k.json", **kw) -> dict:
    """`_bench_kl` (its options in `kw`) into `out`, which holds nothing but this benchmark's
    results (`replayquant.outputs.check_owned`, before any work) and is locked from the checks
    to the write."""
    check_owned(out, BENCH_KL_KIND, "replayquant bench kl")
    with output_lock(out):
        check_owned(out, BENCH_KL_KIND, "replayquant bench kl")
        return _bench_kl(out=out, **kw)


def _bench_kl(shape: str = "qwen3.5-4b", context: int = 131072, segment: int = 8192,
              pairs=("f4_sr_rs", "tp4_hi32"), prefill: str = "replay", reference: str = "exact",
              dtype: str = "bfloat16", device: str | None = None,
              out: str | Path = "build/bench/kl_128k.json", warmup_tokens: int | None = None) -> dict:
    # Triton (Linux only): loaded where a kernel runs
    from replayquant.bench.timing import REPLAY_TARGETS, KernelClock, fla_version, hf_chunk_function

    from replayquant.bench import check_model_bench
    from replayquant.models.patching import DTYPES   # transformers: loaded where a model is
    check_model_bench("bench kl", shape, device)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(shape, DTYPES[dtype], device)
    ids = random_document(model.config.vocab_size, context)
    dev_ids = ids.to(device)

    def kl_run(doc_ids, tmp):
        docs = DocumentSet([Document(0, "random-tokens", doc_ids)], source="random tokens",
                           kind="synthetic", split=None)
        settings = KLSettings(dataset="synthetic", context=doc_ids.numel(), docs=1,
                              segment=min(segment, doc_ids.numel()), prefill=prefill,
                              reference=reference, progress=False)
        return run_kl(model, None, list(pairs), settings, out=Path(tmp) / "kl.json",
                      documents=docs, parts=RunParts(plot=False))

    with tempfile.TemporaryDirectory() as tmp:
        # warm-up (kernel compilation and autotuning, allocator) on a prefix, not timed: two
        # segments by default, so that every kernel variant of the timed run (first segment /
        # continuing a cache, first / later window group of the chunk kernel) has compiled
        w = min(warmup_tokens or 2 * segment, context)
        plain_forward(model, dev_ids[:w], min(segment, w))
        kl_run(ids[:w], Path(tmp) / "warm")
        _sync(device)

        t_hf, peak_hf = timed(lambda: plain_forward(model, dev_ids, segment), device)
        box = {}
        with KernelClock(device, REPLAY_TARGETS) as clock:
            t_kl, _ = timed(lambda: box.setdefault("res", kl_run(ids, Path(tmp) / "run")), device)
        res = box["res"]

    prov = res["provenance"]
    peak_kl = prov.get("peak_gpu_bytes")
    n = len(pairs)
    result = {
        "kind": BENCH_KL_KIND,
        "shape": shape, "model_config": SHAPES[shape], "dtype": dtype,
        "context": context, "segment": segment, "pairs": list(pairs), "prefill": prefill,
        "reference": reference,
        "kl_wall_time_s": t_kl,
        "hf_forward_s": t_hf,
        "slowdown_vs_plain_forwards": t_kl / ((1 + n) * t_hf),   # target <= 1.5
        "target": "kl_wall_time_s <= 1.5 * (1 + n_pairs) * hf_forward_s; peak GPU <= 60 GiB",
        "meets_time_target": t_kl <= 1.5 * (1 + n) * t_hf,
        "peak_gpu_gib_kl": None if peak_kl is None else peak_kl / 2**30,
        "peak_gpu_gib_hf_forward": None if peak_hf is None else peak_hf / 2**30,
        "meets_memory_target": None if peak_kl is None else peak_kl <= 60 * 2**30,
        "tokens_per_s_kl": context / t_kl,
        "flash_linear_attention": fla_version(), "hf_gdn_function": hf_chunk_function()[1],
        "chunk_dot_precision": _chunk_dot(),
        "inside_replay_s": clock.seconds(),
        "inside_replay_note": KernelClock.NOTE,
        "provenance": provenance(device=device, bench="kl", shape=shape, context=context,
                                 segment=segment, pairs=list(pairs), prefill=prefill,
                                 reference=reference, dtype=dtype),
    }
    write_json(out, result)
    return result
