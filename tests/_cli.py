"""The command line as the tests drive it (pytest puts tests/ on sys.path): one invocation's exit
code and text, and the shape of one clear error."""

from typer.testing import CliRunner

from replayquant.cli import app


def invoke(args):
    """(exit code, stdout + stderr, and the exception of a traceback if one escaped) of one run."""
    res = CliRunner().invoke(app, [str(a) for a in args])
    text = (res.stdout or "") + (getattr(res, "stderr", "") or "")
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        text += f"\n{type(res.exception).__name__}: {res.exception}"
    return res.exit_code, text


def one_clear_error(code, text, *needles):
    """Exit 2, no traceback, and every needle in the message."""
    assert code == 2, text
    assert "Traceback" not in text, text
    for n in needles:
        assert n in text, (n, text)
