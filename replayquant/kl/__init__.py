"""Long-context KL harness: KL(reference || pair) at every position of long documents.

Command line::

    replayquant kl --model Qwen3.5-4B --pair f4_sr_rs --pair tp4_hi32 [--pair my_pair.yaml] \\
        [--dataset pg19 | heldout | texts/ | book.txt | docs.jsonl | data.parquet | saved/ | owner/name] \\
        [--split test] [--dataset-config C] [--data-files F] [--text-column text] [--context 131072] [--docs 10] [--segment 8192] [--prefill replay|exact] \\
        [--reference exact|hf] [--scoring all|llama] [--dtype auto] [--device auto] [--seed 0] [--pack] \\
        [--out build/kl/NAME.json]
    replayquant table build/kl/*.json [--format md|csv|llama] [--by pair|model] [--scoring llama]
    accelerate launch -m replayquant kl ...      # documents split across processes, one results file

What is compared: the reference is the model with exact FP32 recurrent state (default
`--reference exact`: the model patched with the shared FP32 pair s32_rs and prefill="exact";
`--reference hf`: the model as loaded). Each pair is the same weights patched with the pair
(`replayquant.patch`). The reference and every pair run in lockstep over each document, segment
by segment (`--segment` tokens per forward), each with its own cache, and the LM head is applied to
about 2^28 / vocab positions at a time, so full-vocabulary logits never exist for a whole segment.
KL(ref || test) = sum_v p_ref log(p_ref / p_test) in float32 over the full vocabulary at every
position 0 .. context-2 (position t predicts token t+1); `--scoring llama` scores only positions
context/2 .. context-2, as llama.cpp's `--kl-divergence` scores each window (`stats.scored_range`).

Data: see `replayquant.kl.data` (`heldout`: the books shipped with replayquant; PG-19 and any other hub dataset, local .parquet / .arrow /
.json(l) / .csv files, hub-layout and save_to_disk folders, all through `datasets`; a folder of
.txt or a .txt file; the first `--docs` documents with at least `--context` tokens, in fixed order; `--pack`
concatenates documents instead).

Statistics (per pair; `replayquant.kl.stats`): as llama.cpp's KL report, mean KL +- uncertainty,
median, percentiles 99.9/99/95/90/10/5/1/0.1, max; same-top-token rate +- uncertainty; PPL of the
reference and the pair, their difference and ln(PPL ratio) +- uncertainty, the correlation of
ln-probabilities; delta-p mean, RMS, max, min and percentiles (`replayquant table --format llama`
prints llama-perplexity's block); plus KL by
log-spaced position bucket (<1K, 1K-2K, ..., 64K-128K) and per-document values. The token-level
uncertainties treat tokens as independent (as llama.cpp does); `kl_mean_unc_docs` is the
standard error over documents, the more honest one for long correlated documents.

Outputs of `--out build/kl/NAME.json`: NAME.json (results, config, provenance), NAME.kl/
(per-token KL per document as float32 .npy [n_pairs, scored positions], per-token delta-p,
NLL and top-token agreement as .dp.npy, .nll.npy and .top.npy, and the append-only progress
logs), NAME.png (KL against position, log x, one line per pair). Re-running the same command
resumes: finished documents are skipped, a larger `--docs` adds documents, an interrupted run
loses at most the document in flight, and says how many documents it found done and kept; a
different configuration into the same file is refused (so is a file of another kind, or a second
run while one holds NAME.lock), and a document whose tokens changed since it was scored is
recomputed (its record keeps a token fingerprint).

Python: `run_kl(model, tokenizer, pairs, KLSettings(dataset=..., context=...), out=...)` does the
same on a model you hold; `KLSettings` holds the options of one run, as `replayquant kl` takes them.
"""

from .data import Document, DocumentSet, load_documents
from .report import load_results, print_summary, render_table
from .run import RunParts, run_kl
from .settings import KLSettings
from .lockstep import Variant, patch_variant, reference_variant, score_document
from .stats import summarize, token_metrics

__all__ = ["Document", "DocumentSet", "KLSettings", "RunParts", "Variant", "load_documents",
           "load_results", "patch_variant", "print_summary", "reference_variant", "render_table",
           "run_kl", "score_document", "summarize", "token_metrics"]
