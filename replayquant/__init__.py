"""replayquant: low-precision storage of hybrid-model SSM state (ReplaySSM)."""

__version__ = "0.1.0"

from replayquant.pairs import PrecisionPair  # noqa: E402,F401

# Hugging Face model integration (replayquant.models), imported on first use so that
# `import replayquant` does not import transformers.
_MODELS_API = ("load_model", "patch", "unpatch")


def __getattr__(name):
    if name in _MODELS_API:
        from replayquant import models
        return getattr(models, name)
    raise AttributeError(f"module 'replayquant' has no attribute {name!r}")
