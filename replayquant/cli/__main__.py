"""`python -m replayquant.cli` (and `accelerate launch -m replayquant.cli ...`): the command line."""

from replayquant.cli import app

app()
