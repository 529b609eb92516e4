"""replayquant command line: a thin layer over the library (each command calls one function).

`common` holds the Typer apps, the choices, the options the KL family declares once and the
error handler; one module per family of commands registers its commands on import (in the order
`--help` lists them). Each command imports the library inside its body, not at the top of its
module: `replayquant --help` and the parsing of a command's options then load only typer and the
package root, never transformers, lm-eval or the kernels a command runs.
"""

from replayquant.cli.common import app

# each import registers its commands; `--help` lists them in this order
from replayquant.cli import formats, kl, spec, bench, gpqa, sweep  # noqa: E402,F401,I001  # isort: skip

__all__ = ["app"]
