"""replayquant: low-precision storage of hybrid-model SSM state (ReplaySSM)."""

__version__ = "0.1.0"

from replayquant.pairs import PrecisionPair  # noqa: E402,F401
