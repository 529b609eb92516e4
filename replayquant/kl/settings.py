"""The settings of one KL run, as one object: `replayquant kl` builds it from its command line,
`sweep`, `sensitivity` and `recommend --per-layer` pass it on whole, and `run_kl` takes it.
`check` says what is wrong with one before any work; a run checks its settings once."""

from __future__ import annotations

import dataclasses

from replayquant.choices import DTYPE_NAMES, PREFILLS, REFERENCES
from replayquant.streams import check_seed

__all__ = ["KLSettings", "check_dtype"]


def check_dtype(dtype) -> None:
    """One ValueError naming the --dtype values when `dtype` is none of them."""
    if not (dtype == "auto" or (isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES)):
        raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")


@dataclasses.dataclass
class KLSettings:
    """What a KL run measures and how: the documents (dataset ... docs, pack), the forward
    (segment, dtype, device_map), the pairs' prefill and seed, and the reference. A sweep or
    sensitivity file records these fields as its settings, in this order."""
    dataset: str = "pg19"
    split: str = "test"
    dataset_config: str | None = None
    data_files: list[str] | None = None
    text_field: str = "text"
    context: int = 131072
    docs: int = 10
    segment: int = 8192
    prefill: str = "replay"
    dtype: str = "auto"
    device_map: str | None = None
    seed: int = 0
    pack: bool = False
    revision: str | None = None
    reference: str = "exact"
    progress: bool = True

    def __post_init__(self):
        self.data_files = self.data_files or None        # none given: None, as load_documents takes it

    def check(self) -> None:
        """One ValueError for a setting no run can use (named by its command-line option)."""
        for name, v, choices in (("--prefill", self.prefill, PREFILLS),
                                 ("--reference", self.reference, REFERENCES)):
            if v not in choices:
                raise ValueError(f"{name} must be {' or '.join(map(repr, choices))}, got {v!r}")
        for name, v, lo in (("--context", self.context, 2), ("--docs", self.docs, 1),
                            ("--segment", self.segment, 1)):
            if v < lo:
                raise ValueError(f"{name} must be >= {lo}, got {v}")
        check_dtype(self.dtype)
        check_seed(self.seed, "--seed")
