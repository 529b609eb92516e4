"""Long-context KL harness: KL(reference || pair) at every position of long documents.

`run_kl` (library), `kl_command` (what `replayquant kl` runs), `render_table` (`replayquant table`).
"""

from .data import Document, DocumentSet, load_documents
from .report import load_results, print_summary, render_table
from .runner import Variant, patch_variant, reference_variant, run_kl, score_document
from .stats import summarize, token_metrics

__all__ = ["Document", "DocumentSet", "Variant", "load_documents", "load_results", "patch_variant",
           "print_summary", "reference_variant", "render_table", "run_kl", "score_document",
           "summarize", "token_metrics"]
