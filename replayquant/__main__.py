"""`python -m replayquant` (and `accelerate launch -m replayquant ...`): the command line."""

from replayquant.cli import app

app()
