"""The parts of replayquant that an extra of the package installs (pyproject.toml's
optional-dependencies), and the one error that names the extra where such a part is used
without it.

| extra | installs | what needs it |
| --- | --- | --- |
| lm-eval | lm-eval (and its datasets, scikit-learn, ...) | `replayquant gpqa`, `replayquant lm-eval`, `replayquant.gpqa.lm_eval_model` |
| triton | Triton (Linux) | the Triton kernels with a CPU build of torch (REPLAYQUANT_BACKEND=triton, TRITON_INTERPRET=1: the test suite); CUDA builds of torch on Linux install Triton themselves |
| dev | both, and pytest | `make test` |
"""

from __future__ import annotations

import importlib

__all__ = ["EXTRAS", "MissingExtra", "require"]

# module -> (the extra that installs it, what uses it)
EXTRAS = {
    "lm_eval": ("lm-eval", "GPQA and lm-eval with a patched model (replayquant gpqa, replayquant "
                           "lm-eval, replayquant.gpqa.lm_eval_model)"),
    "triton": ("triton", "the Triton kernels (REPLAYQUANT_BACKEND=triton; CUDA tensors)"),
}


class MissingExtra(ImportError, ValueError):
    """An optional part used without the extra that installs it: an ImportError to Python code,
    and, as a ValueError, one line and exit code 2 on the command line
    (`cli.common.user_errors`)."""


def require(module: str):
    """Import `module` (a key of EXTRAS) and return it, or raise one MissingExtra naming the extra
    to install."""
    extra, what = EXTRAS[module]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(f"{module} is not installed ({e}); {what} need it: pip install "
                           f"'replayquant[{extra}]'", name=module) from None
