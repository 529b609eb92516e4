"""lm-eval's console handler follows sys.stderr: lm-eval binds it once per process to the
sys.stderr of that moment, and a caller that swapped sys.stderr and closed the stream since (a
test runner, a notebook) would see a logging traceback on every lm-eval log line of a later
run."""

import io
import logging
import sys

import pytest

pytest.importorskip("lm_eval")

from replayquant.gpqa.lm_eval_model import lm_eval_logs_to_stderr  # noqa: E402


def test_lm_eval_handler_follows_stderr(monkeypatch):
    log = logging.getLogger("lm_eval")
    gone = io.StringIO()
    handler = logging.StreamHandler(gone)
    log.addHandler(handler)
    try:
        gone.close()                                   # the stream lm-eval saw first is closed
        now = io.StringIO()
        monkeypatch.setattr(sys, "stderr", now)
        lm_eval_logs_to_stderr()
        assert handler.stream is now
        handler.emit(logging.LogRecord("lm_eval", logging.INFO, __file__, 1, "seen", None, None))
        assert now.getvalue() == "seen\n"
    finally:
        log.removeHandler(handler)
