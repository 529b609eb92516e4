"""save_pretrained of a patched model: Hugging Face's checkpoint holds the weights and config, not
the pair (it lives in the patched forwards), so the patched model warns that the folder loads
unpatched; the model still pickles, and an unpatched model saves without a word."""

import pickle
import warnings

import pytest

from replayquant.models import load_model, unpatch


def test_patched_save_pretrained_warns_and_unpatched_does_not(tmp_path):
    model = load_model("tiny-mamba2", "tp4_hi16_sr", dtype="float32")
    with pytest.warns(UserWarning, match="without replayquant's pair tp4_hi16_sr"):
        model.save_pretrained(tmp_path / "patched")
    assert (tmp_path / "patched" / "config.json").is_file()
    pickle.dumps(model)
    unpatch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.save_pretrained(tmp_path / "plain")
