"""Speculative decoding on patched hybrid models, measured per precision pair.

`replayquant spec` (`command.spec_command`) runs HF's assisted generation (prompt lookup,
`generate(..., prompt_lookup_num_tokens=N)`, and optionally a draft model, `assistant_model=`),
greedy or sampled (--temperature), on a model patched with each pair beside the FP32 reference,
over documents of any dataset `replayquant kl` reads, and reports per pair: accepted drafts per
verify round, tokens per target forward, acceptance rate by draft position, agreement with the
reference's tokens, and tokens per second against plain decode of the same pair (`report`). HF's
loop runs as it is; `measure` counts its rounds by wrapping the candidate generator it builds.

Outputs of `--out build/spec/NAME.json`: NAME.json (config, provenance, statistics per pair and
method, per-document records with every verify round) and NAME.png (acceptance rate by draft
position, one line per pair).
"""

from .command import SPEC_KIND, SpecSettings, spec_command
from .measure import (Generation, agreement, counted_generate, counted_rounds,
                      replayed_drafts)
from .report import method_summary, render_table, summarize

__all__ = ["SPEC_KIND", "SpecSettings", "spec_command", "Generation", "agreement",
           "counted_generate", "counted_rounds", "replayed_drafts", "method_summary",
           "render_table", "summarize"]
