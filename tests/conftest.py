import os

# Triton kernels run on the CPU through the interpreter; this must be set before `import triton`.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# The folders whose every test is slow (the Triton kernels in the interpreter and their sm_90
# compiles; whole tiny models generating and decoding); elsewhere a module says
# `pytestmark = pytest.mark.slow` itself, or a test (the built wheel and sdist). `make test-fast` runs `-m "not slow"`.
SLOW_FOLDERS = {"kernels", "models"}
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(HERE).parts
        if len(parts) > 1 and parts[0] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    """The tests run tiny ops: one intra-op thread is far faster than two contending ones on a
    2-core CI machine (measured 5-80x on the model and scan tests)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def no_model(monkeypatch):
    """Fails a test that loads the model (tokenizer, config or weights) through `replayquant kl`'s
    loaders: the bad input must be refused before."""
    from replayquant.kl import command as C

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")
    monkeypatch.setattr(C, "load_tokenizer_and_config", boom)
    monkeypatch.setattr(C, "load_weights", boom)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """A folder of two .txt documents from the shipped held-out text."""
    from replayquant.data import heldout_documents
    d = tmp_path_factory.mktemp("texts")
    for i, b in enumerate(heldout_documents()[:2]):
        (d / f"doc_{i}.txt").write_text(b["text"][:2000])
    return d
