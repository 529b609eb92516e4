"""Bad inputs of the command line and the library: each one clear error (what is wrong, what to
do), a non-zero exit, raised before any expensive work, and nothing already computed lost.

The KL runs use the embedded tiny Qwen3.5 model on two short documents cut from the shipped
held-out text (64 tokens each), so every run takes about a second."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from replayquant.kl import command as C
from replayquant.kl import run as R
from replayquant.kl.resume import same_code
from replayquant.models.names import resolve_model_name
from _cli import invoke as _invoke, one_clear_error as _one_clear_error

TINY = "tiny-qwen3.5"
CTX = 64


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """A folder of two .txt documents from the shipped held-out text (each >= CTX tokens)."""
    from replayquant.data import heldout_documents
    d = tmp_path_factory.mktemp("texts")
    books = heldout_documents()
    for i, b in enumerate(books[:2]):
        (d / f"doc_{i}.txt").write_text(b["text"][:2000])
    return d


def _kl(texts, out, *extra, docs=1):
    return ["kl", "--model", TINY, "--pair", "s32_rs", "--dataset", texts, "--context", CTX,
            "--docs", docs, "--segment", 32, "--dtype", "float32", "--reference", "hf",
            "--no-progress", "--out", out, *extra]


# ------------------------------------------------------------------ kl --out


def test_kl_out_checked_before_the_model_loads(texts, tmp_path, no_model):
    folder = tmp_path / "o"
    folder.mkdir()
    a_file = tmp_path / "plain_file"
    a_file.write_text("x")
    cases = [
        (tmp_path / "res.png", "must end in .json"),
        (tmp_path / "res.kl", "must end in .json"),
        (tmp_path / "res", "must end in .json"),
        (folder, "is a folder"),
        (a_file / "res.json", "is a file, not a folder"),
        (Path("/proc/replayquant_no/res.json"), "cannot write in /proc"),
    ]
    for out, msg in cases:
        code, text = _invoke(_kl(texts, out))
        _one_clear_error(code, text, msg)
    (tmp_path / "r.kl").write_text("not a folder")
    code, text = _invoke(_kl(texts, tmp_path / "r.json"))
    _one_clear_error(code, text, "r.kl", "not a folder")
    assert not (tmp_path / "res.png").exists() and a_file.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o", "plain_file", "r.kl"]


# ------------------------------------------------------------------ resume never mixes stale results


def _count_scored(monkeypatch):
    calls = []
    orig = R.score_document
    monkeypatch.setattr(R, "score_document", lambda *a, **k: calls.append(a[1].index) or orig(*a, **k))
    return calls


def test_resume_recomputes_changed_documents_and_refuses_other_code(texts, tmp_path, monkeypatch):
    data = tmp_path / "texts"
    data.mkdir()
    for f in sorted(texts.iterdir()):
        (data / f.name).write_text(f.read_text())
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.json"
    code, text = _invoke(_kl("texts", out, docs=2))               # relative path
    assert code == 0, text
    first = json.loads(out.read_text())["results"]["s32_rs"]["per_document"]
    calls = _count_scored(monkeypatch)
    # the same folder by its absolute path (and the model by a relative path): one configuration
    model_rel = os.path.relpath(resolve_model_name(TINY), tmp_path)
    code, text = _invoke([a if a != TINY else model_rel for a in _kl(data, out, docs=2)])
    assert code == 0, text
    assert calls == []
    # new text in a document: that document is recomputed, and the run says so
    (data / "doc_0.txt").write_text((texts / "doc_1.txt").read_text()[::-1])
    code, text = _invoke(_kl(data, out, docs=2))
    assert code == 0, text
    assert calls == [0]
    assert "document 0 ('doc_0.txt'): its tokens differ" in text and "recomputing it" in text
    res = json.loads(out.read_text())
    now = res["results"]["s32_rs"]["per_document"]
    assert res["complete"] and len(now) == 2 and now[1] == first[1]
    assert now[0] != first[0]
    calls.clear()
    code, text = _invoke(_kl(data, out, docs=2))                   # and only once
    assert code == 0 and calls == [] and "recomputing" not in text
    # results of another code version are refused, nothing is changed
    before = {p.name: p.read_bytes() for p in (tmp_path / "r.kl").iterdir()}
    monkeypatch.setattr(R, "code_version", lambda: {"replayquant": "9.9", "git_commit": "abc"})
    code, text = _invoke(_kl(data, out, docs=2))
    _one_clear_error(code, text, "two code versions", "replayquant 9.9 at commit abc", "delete")
    assert calls == []
    assert before == {p.name: p.read_bytes() for p in (tmp_path / "r.kl").iterdir()}


def test_same_code_compares_commits_of_clean_checkouts_only():
    v = {"replayquant": "0.1.0"}
    assert same_code({**v, "git_commit": "a"}, {**v, "git_commit": "a"})
    assert not same_code({**v, "git_commit": "a"}, {**v, "git_commit": "b"})
    assert same_code({**v, "git_commit": "a+dirty"}, {**v, "git_commit": "b"})
    assert same_code({**v, "git_commit": "unknown"}, {**v, "git_commit": "b"})
    assert not same_code({"replayquant": "0.2.0", "git_commit": "a"}, {**v, "git_commit": "a"})
    assert not same_code(None, {**v, "git_commit": "a"})


# ------------------------------------------------------------------ per-document files


def test_damaged_document_file_named_with_what_to_do_and_writes_are_durable(texts, tmp_path,
                                                                            monkeypatch):
    out = tmp_path / "d.json"
    log = []
    fsync, replace = os.fsync, os.replace

    def logged_fsync(fd):
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def logged_replace(a, b):
        log.append(("replace", str(a), str(b)))
        return replace(a, b)
    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(os, "replace", logged_replace)
    code, text = _invoke(_kl(texts, out, docs=2))
    assert code == 0, text
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    npy = tmp_path / "d.kl" / "doc00001.npy"
    for target in (npy, out):                                   # a per-document file, the results
        i, (_, tmp, _) = next((i, e) for i, e in enumerate(log) if e[0] == "replace" and e[2] == str(target))
        tmp = Path(tmp)                # a temporary file of its own in the same folder, then gone
        assert tmp.parent == target.parent and tmp.name.startswith(f".{target.name}.") \
            and tmp.suffix == ".tmp" and not tmp.exists()
        assert log.index(("fsync", str(tmp))) < i
        assert ("fsync", str(target.parent)) in log[i:]

    calls = _count_scored(monkeypatch)
    good = npy.read_bytes()
    for damage, msg in ((b"", "is damaged"), (b"\x93NUMPY garbage", "is damaged"),
                        (None, "holds float64 [3]")):
        if damage is None:
            np.save(npy, np.zeros(3))
        else:
            npy.write_bytes(damage)
        code, text = _invoke(_kl(texts, out, docs=2))
        _one_clear_error(code, text, str(npy), msg, "delete it", "recompute document 1")
    assert calls == []
    npy.unlink()                                                 # what the message says to do
    code, text = _invoke(_kl(texts, out, docs=2))
    assert code == 0 and calls == [1], text
    assert npy.read_bytes() == good and json.loads(out.read_text())["complete"]
    out.write_text("{ torn")                                     # a damaged results file
    code, text = _invoke(_kl(texts, out, docs=2))
    _one_clear_error(code, text, "invalid JSON", "nothing computed is lost")


# ------------------------------------------------------------------ devices


def test_devices_cuda_when_present_else_cpu_and_a_missing_one_is_one_error(texts, tmp_path,
                                                                           monkeypatch):
    import replayquant.gpqa.run as gpqa_run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)      # a machine without CUDA
    with monkeypatch.context() as mp:
        mp.setattr(C, "load_tokenizer_and_config", lambda *a, **k: 1 / 0)
        for dm, msg in (("cuda:0", "no CUDA device"), ("cuda", "no CUDA device"),
                        ("gpu", "not a device"), ("mps", "no mps device")):
            code, text = _invoke(_kl(texts, tmp_path / "x.json", "--device", dm))
            _one_clear_error(code, text, f"--device {dm}", msg)
    code, text = _invoke(_kl(texts, tmp_path / "x.json"))
    assert code == 0 and "device: cpu" in text, text

    csv = Path(__file__).parents[1] / "data" / "gpqa_tiny.csv"
    seen = {}

    class Stop(Exception):
        pass

    def fake_lm(**kw):
        seen.update(kw)
        raise Stop
    monkeypatch.setattr(gpqa_run, "ReplayQuantLM", fake_lm)
    gpqa = ["gpqa", "--model", TINY, "--pair", "s32_rs", "--gpqa-csv", csv, "--limit", 1,
            "--out", tmp_path / "g"]
    code, text = _invoke(gpqa)
    assert "Stop" in text and seen["device"] == "cpu" and f"{TINY} on cpu" in text, text
    seen.clear()
    for dev, msg in (("cuda", "no CUDA device"), ("cuda:3", "no CUDA device"),
                     ("tpu0", "not a device")):
        code, text = _invoke([*gpqa, "--device", dev])
        _one_clear_error(code, text, f"--device {dev}", msg)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out, msg in ((a_file, "is a file; gpqa writes"), ("/proc/replayquant_no", "cannot write in")):
        code, text = _invoke([*gpqa[:-1], out])
        _one_clear_error(code, text, msg)
    assert seen == {}
    code, text = _invoke(["gpqa", "--model", tmp_path / "no_model", "--pair", "s32_rs",
                          "--gpqa-csv", csv])
    _one_clear_error(code, text, "folder not found")


def test_model_folder_not_found_is_said_so(texts, tmp_path):
    for model in (tmp_path / "no_model_here", "./no_such_folder", "~/no_such_folder/", "a/b/c"):
        code, text = _invoke(["kl", "--model", model, "--pair", "s32_rs", "--dataset", texts,
                              "--context", CTX, "--out", tmp_path / "m.json"])
        _one_clear_error(code, text, "folder not found", "config.json")
        assert "Repo id" not in text
    code, text = _invoke(["kl", "--model", texts / "doc_0.txt", "--pair", "s32_rs", "--dataset",
                          texts, "--out", tmp_path / "m.json"])
    _one_clear_error(code, text, "is a file, not a model folder")
    from replayquant.models import load_model
    with pytest.raises(ValueError, match="folder not found"):
        load_model(tmp_path / "nothing")


# ------------------------------------------------------------------ shapes, pair names, drift --out


def test_zero_dimensions_are_one_error_each(tmp_path):
    drift = ["drift", "--kind", "gdn", "--pair", "s32_rs", "--steps", 32, "--seeds", "1",
             "--out", tmp_path / "drift"]
    cases = [
        ([*drift, "--d-k", 0], "--d-k must be an integer >= 1, got 0"),
        ([*drift, "--d-v", 0], "--d-v must be an integer >= 1, got 0"),
        ([*drift, "--batch", 0], "--batch must be an integer >= 1, got 0"),
        ([*drift, "--heads", 0], "--heads must be an integer >= 1, got 0"),
        ([*drift, "--pair", "tp4_hi32", "--d-k", 40], "tp4_hi32 stores NVFP4: --d-k must be a multiple of 16"),
        ([*drift, "--pair", "s32_rs"], "s32_rs given more than once"),
        (["formats", "--d", 0], "--d must be an integer >= 1, got 0"),
        (["formats", "--d", 8], "--d must be a multiple of 16"),
        (["formats", "--heads", 0], "--heads must be an integer >= 1, got 0"),
        (["pairs", "--d-k", 0], "--d-k must be an integer >= 1, got 0"),
        (["pairs", "--d-v", 0], "--d-v must be an integer >= 1, got 0"),
        (["pairs", "--d-k", 40], "--d-k must be a multiple of 16"),
    ]
    for args, msg in cases:
        code, text = _invoke(args)
        _one_clear_error(code, text, msg)
    assert not (tmp_path / "drift").exists()


def test_drift_out_checked_before_computing(tmp_path, monkeypatch):
    import replayquant.drift as D
    monkeypatch.setattr(D, "run_one", lambda *a, **k: pytest.fail("computed before --out was checked"))
    a_file = tmp_path / "existing"
    a_file.write_text("keep me")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "gdn_32steps.json").mkdir()
    drift = ["drift", "--kind", "gdn", "--pair", "s32_rs", "--steps", 32, "--seeds", "1"]
    for out, msg in ((a_file, "is a file"), (a_file / "sub", "is a file, not a folder"),
                     ("/proc/replayquant_no", "cannot write in /proc"),
                     (tmp_path / "o", "gdn_32steps.json is a folder")):
        code, text = _invoke([*drift, "--out", out])
        _one_clear_error(code, text, msg)
    assert a_file.read_text() == "keep me"


def test_kl_duplicate_pair_names_and_reference_refused_before_the_model_loads(texts, tmp_path,
                                                                               no_model):
    ref = tmp_path / "reference.yaml"
    ref.write_text("anchor: {format: fp32}\n")
    twin = tmp_path / "twin.yaml"
    twin.write_text("name: s32_rs\nanchor: {format: fp32}\nbuffer_len: 4\n")
    base = ["kl", "--model", TINY, "--dataset", texts, "--context", CTX, "--out", tmp_path / "p.json"]
    for pairs, msg in ((["s32_rs", "s32_rs"], "s32_rs given more than once"),
                       (["s32_rs", twin], "s32_rs given more than once"),
                       ([ref], "named 'reference'")):
        code, text = _invoke([*base, *[x for p in pairs for x in ("--pair", p)]])
        _one_clear_error(code, text, msg)


# ------------------------------------------------------------------ non-finite step inputs, overflow


def _step_inputs(gen, B, H, dk, dv, T=None):
    lead = (B,) if T is None else (B, T)
    return {"q": torch.randn(*lead, H, dk, generator=gen) / dk ** 0.5,
            "k": torch.nn.functional.normalize(torch.randn(*lead, H, dk, generator=gen), dim=-1),
            "v": torch.randn(*lead, H, dv, generator=gen),
            "log_a": torch.log(0.9 + 0.1 * torch.rand(*lead, H, generator=gen)),
            "beta": torch.rand(*lead, H, generator=gen)}


def test_nonfinite_step_inputs_named_where_they_enter_and_nothing_changes():
    from replayquant.replay import ConventionalState, ReplayState
    gen = torch.Generator().manual_seed(0)
    B, H, dk, dv = 2, 2, 16, 16
    for cls, pair in ((ReplayState, "tp4_hi16_sr"), (ConventionalState, "s16_sr")):
        st = cls(torch.zeros(B, H, dv, dk), pair, delta=True)
        for _ in range(3):
            st.step(**_step_inputs(gen, B, H, dk, dv))
        before = (st.committed, st.n_flush, st.anchor(), st.read_copy())
        for name in ("q", "k", "v", "log_a", "beta"):
            for bad in (float("nan"), float("inf")):
                x = _step_inputs(gen, B, H, dk, dv)
                x[name].view(B, -1)[1, -1] = bad
                with pytest.raises(ValueError, match=f"step 4 of this state: input {name} holds "
                                                     f"NaN or infinity .* batch row 1"):
                    st.step(**x)
        after = (st.committed, st.n_flush, st.anchor(), st.read_copy())
        assert all(torch.equal(a, b) for a, b in zip(before, after)), cls
        x = _step_inputs(gen, B, H, dk, dv, T=3)
        x["v"][0, 2, 1, 0] = float("nan")
        with pytest.raises(ValueError, match="verify 4 of this state, draft index 2: input v .* row 0"):
            st.verify(**x)
        st.step(**_step_inputs(gen, B, H, dk, dv))             # a finite step still runs
    # Mamba-2 (no beta): a gate that is -inf (a = 0) is as much an error as NaN
    st = ReplayState(torch.zeros(B, H, dv, dk), "f4_sr_rs", delta=False)
    x = _step_inputs(gen, B, H, dk, dv)
    x.pop("beta")
    x["log_a"][0, 1] = -float("inf")
    with pytest.raises(ValueError, match="step 1 of this state: input log_a"):
        st.step(**x)


def test_fp16_state_that_overflows_is_refused_at_construction():
    from replayquant.replay import ConventionalState, ReplayState
    big = torch.zeros(1, 2, 16, 16)
    big[0, 1, 3, 4] = 7.0e4
    for cls, pair, role in ((ReplayState, "tp4_hi16_sr", "anchor"), (ReplayState, "s16_sr", "anchor"),
                            (ConventionalState, "s16_sr", "state")):
        with pytest.raises(ValueError, match=f"initial_state overflows the {role} format fp16 of "
                                             f"pair {pair}: its largest magnitude is 70000"):
            cls(big, pair, delta=True)
    ReplayState(big, "tp4_hi32", delta=True)                      # fp32 anchor, nvfp4 read: fine
    ReplayState(big * 0.9, "tp4_hi16_sr", delta=True)              # in range


def test_model_layer_names_the_nonfinite_input_and_token_before_any_kernel(monkeypatch):
    from replayquant.models import load_model, recurrent_layers
    from replayquant.models import decode_store as DS
    model = load_model(TINY, "tp4_hi16_sr", dtype="float32")
    name, layer, _ = recurrent_layers(model)[0]       # the first: no clean layer runs before it
    poison = {}

    def pre_hook(mod, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        if "t" in poison:
            h = h.clone()
            h[0, poison["t"], 5] = float("nan")
        return ((h,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})
    layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    ids = torch.arange(3, 19).view(1, 16)
    poison["t"] = 7
    with pytest.raises(ValueError, match=f"layer {layer.layer_idx} \\(gdn\\): input q holds NaN or "
                                         f"infinity at token 7 of a 16-token forward, batch row 0"):
        model(ids)
    poison.clear()
    import inspect
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(ids, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")          # the decode kernel's path
    monkeypatch.setattr(DS, "from_scan",
                        lambda *a, **k: pytest.fail("the kernel path started before the check"))
    poison["t"] = 0
    with pytest.raises(ValueError, match="input q holds NaN or infinity at the decode step"):
        model(ids[:, :1], use_cache=True, **{cache_kw: cache})
