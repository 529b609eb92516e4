"""The settings of one `replayquant spec` run, as one object: the command line builds it and
`spec_command` takes it whole, checking it once (`check`) before any weights load."""

from __future__ import annotations

import dataclasses
import math

from replayquant.choices import PREFILLS
from replayquant.kl.settings import check_dtype
from replayquant.policy import resolve_pair
from replayquant.streams import check_seed

__all__ = ["SpecSettings", "REFERENCE_PAIR"]

REFERENCE_PAIR = "s32_rs"       # the reference's pair: exact FP32 state (`kl.lockstep`)


@dataclasses.dataclass
class SpecSettings:
    """What one `replayquant spec` run measures: the speculation (lookup, assistant,
    draft_tokens), the documents (dataset ... docs, pack), the generation (new_tokens; greedy at
    temperature 0, else sampled with temperature, top_p, top_k) and the model's run (prefill,
    dtype, device, seed: stochastic rounding's and sampling's, revision, buffer_len: L of every
    pair)."""
    assistant: str | None = None
    lookup: bool = True
    draft_tokens: int = 4
    dataset: str = "heldout"
    split: str = "test"
    dataset_config: str | None = None
    data_files: list[str] | None = None
    text_field: str = "text"
    context: int = 256
    new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    docs: int = 4
    pack: bool = False
    prefill: str = "replay"
    dtype: str = "auto"
    device: str | None = None
    seed: int = 0
    revision: str | None = None
    buffer_len: int | None = None
    progress: bool = True

    @property
    def sampling(self) -> dict | None:
        """HF's sampling options, or None for greedy decoding (temperature 0)."""
        if not self.temperature:
            return None
        return {"temperature": float(self.temperature), "top_p": float(self.top_p),
                "top_k": self.top_k}

    @property
    def methods(self) -> list[str]:
        return [m for m, on in (("lookup", self.lookup), ("assistant", self.assistant is not None))
                if on]

    def check(self, pairs) -> list:
        """The resolved pairs, after every check that needs no file: one ValueError for bad
        input."""
        for name, v, lo in (("--context", self.context, 1), ("--new-tokens", self.new_tokens, 1),
                            ("--docs", self.docs, 1), ("--draft-tokens", self.draft_tokens, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        self._check_sampling()
        if not self.methods:
            raise ValueError("--no-lookup without --assistant measures nothing: give --assistant "
                             "MODEL, or leave prompt lookup on")
        if self.prefill not in PREFILLS:
            raise ValueError(f"--prefill must be {' or '.join(map(repr, PREFILLS))}, got "
                             f"{self.prefill!r}")
        check_dtype(self.dtype)
        check_seed(self.seed, "--seed")
        if not pairs:
            raise ValueError("give at least one --pair (the reference, s32_rs, runs beside them)")
        resolved = [resolve_pair(p, self.buffer_len, policy=False) for p in pairs]
        names = [p.label() for p in resolved]
        for n in names:
            if names.count(n) > 1 or n == "reference":
                raise ValueError(f"pair {n} is given more than once or named 'reference' (the "
                                 f"reference's name): results are kept by pair name")
        n = self.draft_tokens
        for p in [resolve_pair(REFERENCE_PAIR), *resolved]:
            if p.buffer_len < n:
                raise ValueError(f"--draft-tokens {n} is more than pair {p.label()}'s "
                                 f"buffer length L = {p.buffer_len}: speculation keeps the drafts "
                                 f"uncommitted in the replay buffer; give --draft-tokens <= "
                                 f"{p.buffer_len} or --buffer-len >= {n}")
        return resolved


    def _check_sampling(self) -> None:
        t, p, k = self.temperature, self.top_p, self.top_k
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                or t < 0:
            raise ValueError(f"--temperature must be a number >= 0 (0: greedy), got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"--top-p must be a number in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"--top-k must be an integer >= 0 (0: every token), got {k!r}")
        given = [f"--top-p {p}"] * (p != 1) + [f"--top-k {k}"] * (k != 0)
        if not t and given:
            raise ValueError(f"{' and '.join(given)} shape sampling, which runs only at "
                             f"--temperature above 0 (0 is greedy); give --temperature T")
