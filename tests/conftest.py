import os

# Triton kernels run on the CPU through the interpreter; this must be set before `import triton`.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


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
