"""The settings of one GPQA run, as one object: `replayquant gpqa` builds it from its command
line and `run_gpqa` takes it whole, checking it once before any weights load."""

from __future__ import annotations

import dataclasses

__all__ = ["GPQASettings"]


@dataclasses.dataclass
class GPQASettings:
    """What a GPQA run asks and how: lm-eval's tasks (default gpqa_diamond_cot_zeroshot) and
    their options (limit, few-shot count, generation budget as `gen_kwargs`, chat template), the
    questions' source (`gpqa_csv`: a local gpqa_diamond.csv, else the gated hub dataset), the
    pairs' prefill and seed (also lm-eval's python seed: the answer order), where and how the
    model runs (dtype, device, batch_size, more `model_args` of lm-eval's hf model), and whether
    every sample is written."""
    tasks: list[str] | None = None
    gpqa_csv: str | None = None
    limit: int | None = None
    seed: int = 0
    prefill: str = "replay"
    dtype: str = "auto"
    device: str | None = None
    batch_size: int | str = 1
    num_fewshot: int | None = None
    gen_kwargs: dict | None = None
    apply_chat_template: bool = False
    log_samples: bool = False
    model_args: dict | None = None
