"""replayquant: low-precision storage of hybrid-model SSM state (ReplaySSM)."""

__version__ = "0.1.0"
