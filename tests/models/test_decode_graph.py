"""A decode step of a patched model as the GPU needs it: no host synchronisation once the layers'
states are the decode kernel's stores, one graph for torch.compile(fullgraph=True), and HF's
compiled static-cache generate giving the tokens of the eager generate; a non-finite input
named at the next boundary with the anchor kept. Embedded models, the Triton kernels in the
interpreter (REPLAYQUANT_BACKEND=triton), backend 'eager' for torch.compile (what is traced is
the point, not Inductor's code)."""

import copy
import json
import warnings
from dataclasses import replace

import pytest
import torch

import replayquant
from replayquant import options
from replayquant.hostsync import HostSyncCounter
from replayquant.kl.lockstep import cache_kwarg
from replayquant.models import decode_store, runtime
from replayquant.replay.stores import ReplayStore

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MODELS = ("tiny-qwen3.5", "tiny-mamba2", "tiny-kimi-linear")
L = 2          # a flush every other decode step: each test crosses several


def _model(name, pair="s32_rs", dtype="float32"):
    """An embedded model, patched; bf16 where the decode kernel is to serve it (its ring holds a
    bf16 model's activations exactly; a float32 model decodes on the torch engine)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return replayquant.load_model(name, pair=pair, dtype=dtype, device_map="cpu",
                                      buffer_len=L)


def _prefill(model, B=2, T=5, seed=0):
    from transformers import DynamicCache
    ids = torch.randint(3, 200, (B, T), generator=torch.Generator().manual_seed(seed))
    cache = DynamicCache(config=model.config)
    kw = {cache_kwarg(model): cache, "use_cache": True}
    logits = model(ids, **kw).logits
    return cache, kw, logits[:, -1:].argmax(-1)



def _step(model, tok, kw):
    out = model(tok, **kw).logits
    return out, out[:, -1:].argmax(-1)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", MODELS)
def test_decode_step_on_the_store_is_one_graph_without_host_sync(name, backend):
    """After the first decode step (the hand-off into the store, which still reads the host for
    its checks), L + 1 decode forwards, a flush among them, read nothing on the host; then
    torch.compile(fullgraph=True) traces a decode forward (the step is one custom operator)
    and gives the eager forward's logits bit for bit through another flush. Both engines: the
    Triton kernel (interpreter) and the torch engine (the CPU path). The prompts run on the
    torch path (the chunk kernel in the interpreter is slow; the hand-off is the same)."""
    model = _model(name, "tp4_hi16_sr", "bfloat16" if backend == "triton" else "float32")
    B = 1 if backend == "triton" else 2          # the interpreter's time grows with the grid
    with torch.no_grad():
        with options.override(backend="torch"):
            ekw, etok = _prefill(model, B)[1:]
        with options.override(backend=backend):
            with HostSyncCounter() as first:
                _, etok = _step(model, etok, ekw)
            with HostSyncCounter(record_where=True) as later:
                for _ in range(L + 1):
                    _, etok = _step(model, etok, ekw)
            assert first.syncs > 0
            assert later.syncs == 0, later.where
            stores = [getattr(lay, runtime.STATE_ATTR) for lay in ekw[cache_kwarg(model)].layers
                      if hasattr(lay, runtime.STATE_ATTR)]
            assert stores and all(isinstance(s, ReplayStore) and s.engine == backend
                                  for s in stores)
            ckw, ctok = copy.deepcopy(ekw), etok.clone()     # the compiled forward's own cache
            torch._dynamo.reset()
            f = torch.compile(lambda t, kw: model(t, **kw).logits, backend="eager", fullgraph=True)
            for _ in range(L):
                e, etok = _step(model, etok, ekw)
                c = f(ctok, ckw)
                ctok = c[:, -1:].argmax(-1)
                assert torch.equal(c, e)


@pytest.mark.parametrize("name,pair", [("tiny-qwen3.5", "tp4_hi16_sr"), ("tiny-mamba2", "s32_rs"),
                                       ("tiny-kimi-linear", "tp8_hi32")])
def test_compiled_static_cache_generate_equals_eager(name, pair):
    """HF's generate with cache_implementation='static' and a compile config (compiled on the
    CPU too through CompileConfig._compile_all_devices): the prefill into the static cache leaves
    the decode stores, the compiled decode steps run on them, and the greedy tokens equal the
    eager generate's. The torch engine (float32 models); the kernel's step under
    torch.compile(fullgraph=True) is the one-graph test's."""
    from transformers import CompileConfig
    model = _model(name, pair)
    ids = torch.randint(3, 200, (2, 4), generator=torch.Generator().manual_seed(3))
    args = dict(max_new_tokens=L + 3, min_new_tokens=L + 3, do_sample=False,
                attention_mask=torch.ones_like(ids))
    cc = CompileConfig(backend="eager", fullgraph=True)
    cc._compile_all_devices = True
    with torch.no_grad(), options.override(backend="torch"):
        eager = model.generate(ids, **args)
        torch._dynamo.reset()
        compiled = model.generate(ids, cache_implementation="static", compile_config=cc, **args)
    assert torch.equal(compiled, eager)


def test_static_generates_reuse_one_store_unless_its_cache_is_held():
    """Successive static-cache generates (HF makes a new cache each call) step the same store
    tensors, so that CUDA graphs keep their addresses, and a generate after another prompt gives
    the tokens it gave alone; a cache still held keeps its own store."""
    model = _model("tiny-qwen3.5", "tp4_hi16_sr")
    g = torch.Generator().manual_seed(5)
    p1, p2 = (torch.randint(3, 200, (2, 4), generator=g) for _ in range(2))
    args = dict(max_new_tokens=L + 2, min_new_tokens=L + 2, do_sample=False,
                cache_implementation="static")
    rt = next(m._replayquant for m in model.modules() if hasattr(m, "_replayquant"))

    def ptrs():
        return [t.data_ptr() for t in decode_store.tensors(rt._spare[1])]

    with torch.no_grad(), options.override(backend="torch"):    # the runtime's, either engine
        first = model.generate(p1, **args)
        where = ptrs()
        model.generate(p2, **args)
        again = model.generate(p1, **args)
        assert ptrs() == where
        assert torch.equal(again, first)
        held = model.generate(p1, return_dict_in_generate=True, **args).past_key_values
        model.generate(p2, **args)
        assert ptrs() != where
        mine = getattr(held.layers[rt.layer_idx], runtime.STATE_ATTR)
        assert [t.data_ptr() for t in decode_store.tensors(mine)] == where


def test_nonfinite_decode_input_is_named_and_the_anchor_kept():
    """A NaN in one row's beta logits at a decode step on the store: no host read at that step;
    the flush after it keeps that row's anchor as it was; the next multi-token forward raises
    one ValueError naming the layer, the input, the row and the step."""
    model = _model("tiny-qwen3.5")
    lay_mod = next(m for _, m, _ in replayquant.models.recurrent_layers(model))
    poison = {"on": False}

    def hook(mod, args, out):
        if poison["on"]:
            out = out.clone()
            out[1] = float("nan")
        return out

    with torch.no_grad(), options.override(backend="torch"):
        cache, kw, tok = _prefill(model)
    with torch.no_grad(), options.override(backend="triton"):
        _, tok = _step(model, tok, kw)
        st = getattr(cache.layers[lay_mod.layer_idx], runtime.STATE_ATTR)
        before = st.anchor.payload[1].clone()
        handle = lay_mod.in_proj_b.register_forward_hook(hook)
        poison["on"] = True
        with HostSyncCounter() as c:
            _, tok = _step(model, tok, kw)
        poison["on"] = False
        assert c.syncs == 0
        for _ in range(L):
            _, tok = _step(model, tok, kw)
        handle.remove()
        assert int(st.n_flush[1]) >= 1
        assert torch.equal(st.anchor.payload[1], before)
        with pytest.raises(ValueError, match=rf"layer {lay_mod.layer_idx} \(gdn\): input b held "
                                             rf"NaN or infinity at decode step 2 .*batch row 1"):
            model(torch.ones(2, 3, dtype=torch.long), **kw)


def test_bench_generate_targets_and_its_error_without_a_gpu(tmp_path):
    """bench generate forms each target as a ratio within its run (patched static against HF
    static, wall against the way's own GPU busy time, patched eager against HF eager, launches,
    host syncs, the compiled tokens against the eager ones), and refuses at once without CUDA."""
    from _cli import invoke, one_clear_error

    from replayquant.bench.generate import _targets
    rows = {"hf_eager@B32": {"ms_per_step": 100.0, "launches_per_step": 2000},
            "hf_static@B32": {"ms_per_step": 10.0, "gpu_busy_ms_per_step": 8.0,
                              "tokens_equal_eager": False,
                              "logits_max_abs_diff_first_steps": [0.0, 0.25]},
            "patched_eager:s32_rs@B32": {"ms_per_step": 70.0, "launches_per_step": 2400,
                                         "host_syncs_per_step": 0},
            "patched_static:s32_rs@B32": {"ms_per_step": 12.0, "gpu_busy_ms_per_step": 10.0,
                                          "tokens_equal_eager": True,
                                          "logits_max_abs_diff_first_steps": [0.0, 0.375]}}
    got = {t["name"]: (round(t["measured"], 6), t["met"]) for t in _targets(rows, ["s32_rs"], [32])}
    logits = ("s32_rs static+compile logits of the first compiled step against patched eager, "
              "largest difference, B = 32 (<= 2x HF's own)")
    assert got == {
        logits: (0.375, True),
        "s32_rs static+compile vs HF static+compile, B = 32 (<= 1.1x)": (1.2, False),
        "s32_rs static+compile wall / its GPU busy time, B = 32 (<= 1.3x)": (1.2, True),
        "s32_rs eager vs HF eager, B = 32 (<= 0.8x)": (0.7, True),
        "s32_rs eager launches vs HF eager's, B = 32 (<= 1.15x)": (1.2, False),
        "s32_rs host syncs in a decode forward, B = 32 (0)": (0, True)}
    # HF's own measure of the same quantity, where it has one
    assert {t["name"].split(",")[0]: t.get("unpatched") for t in _targets(
        rows, ["s32_rs"], [32]) if "unpatched" in t} == {
        logits.split(",")[0]: 0.25,
        "s32_rs static+compile wall / its GPU busy time": 1.25}
    rows["patched_static:s32_rs@B32"]["logits_max_abs_diff_first_steps"] = [0.0, 0.625]
    assert [t["met"] for t in _targets(rows, ["s32_rs"], [32]) if t["name"] == logits] == [False]
    if not torch.cuda.is_available():
        code, text = invoke(["bench", "generate", "--out", tmp_path / "g.json"])
        one_clear_error(code, text, "needs a CUDA GPU")


def test_bench_generate_times_each_decode_step_and_stops_nothing():
    """bench generate's step time is the median of the intervals between decode steps, read
    where HF's generate asks its stopping criteria (the prompt and the first decode step left
    out): 5 new tokens give 3 intervals a generate, and neither the clock nor the logits record
    changes a token; a way against itself differs in no logit."""
    import replayquant.bench.generate as bg
    from replayquant.bench.kl import build_model
    model = build_model("tiny", torch.float32, "cpu")
    ids = torch.randint(1, model.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(3))
    row = bg._measure(model, ids, False, None, 2, 5, eager_syncs=False, repeats=2)
    assert row["intervals_timed"] == 2 * 3
    lo, hi = row["ms_per_step_p10_p90"]
    assert 0 < lo <= row["ms_per_step"] <= hi and row["ms_per_step_mean"] > 0
    assert torch.equal(row["tokens"], bg._generate(model, ids, 5, False, None)[:, 4:])
    seen = row["seen"]
    assert len(seen.margins) == 5 and len(seen.first) == 2
    assert seen.first[0].shape == (2, model.config.vocab_size)
    assert (torch.stack(seen.margins) >= 0).all()
    same = bg._against_eager(row["tokens"], seen, row["tokens"], seen)
    assert same["tokens_equal_eager"] and same["logits_max_abs_diff_first_steps"] == [0.0, 0.0]
    assert "eager_top2_margin_at_first_difference" not in same


def test_bench_generate_compares_logits_where_the_tokens_read_are_equal():
    """A compiled way's logits are compared with the eager way's only over the rows whose tokens
    before the step are equal; where the greedy tokens differ the row says the first step and the
    eager margin between the two largest logits there (the widest such margin over the rows)."""
    from replayquant.bench.generate import _against_eager, _LogitsSeen

    def seen_of(steps):
        s = _LogitsSeen()
        for x in steps:
            s(None, torch.tensor(x, dtype=torch.float32))
        return s
    e_steps = [[[5, 1, 0, 0, 0, 0], [0, 4, 3, 0, 0, 0]],            # tokens 0 | 1
               [[0, 2, 1.5, 0, 0, 0], [0, 0, 0, 9, 1, 0]],          # tokens 1 | 3
               [[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1]]]
    c_steps = [[[5, 1, 0, 0, 0, 0], [0, 3, 3.5, 0, 0, 0]],          # row 1 flips at step 0
               [[0, 1.5, 1.75, 0, 0, 0], [0, 0, 0, 0, 0, 7]],       # row 0 flips at step 1
               [[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1]]]
    etoks = torch.tensor([[0, 1, 5], [1, 3, 5]])
    ctoks = torch.tensor([[0, 2, 5], [2, 5, 5]])
    got = _against_eager(ctoks, seen_of(c_steps), etoks, seen_of(e_steps))
    assert got["tokens_equal_eager"] is False and got["first_token_differing"] == 0
    # step 0: both rows read the prompt alone; step 1: only row 0 read equal tokens
    assert got["logits_max_abs_diff_first_steps"] == [1.0, 0.5]
    # row 0 first differs at step 1 (eager margin 0.5), row 1 at step 0 (margin 1.0)
    assert got["eager_top2_margin_at_first_difference"] == 1.0
    assert got["eager_top2_margin_median"] == 1.0


def _fake_measures(monkeypatch, bg, fail=None, order=None):
    """bench generate's measuring parts replaced by instant ones: a step of 1 ms (2 ms compiled),
    tokens all 0 and the same logits for every way; `fail` (pair or None for HF) fails its eager
    timed generate; `order` gathers the pairs of the timed eager generates as they run."""
    now = {"pair": None}                 # the pair the model is patched with (None: unpatched)
    monkeypatch.setattr(bg, "patch", lambda model, pair: now.update(pair=pair))
    monkeypatch.setattr(bg, "unpatch", lambda model: now.update(pair=None))

    def seen(ids):
        s = bg._LogitsSeen()
        for _ in range(2):
            s(None, torch.arange(4.0).repeat(ids.shape[0], 1))
        return s

    def timed(model, ids, static, cc, n2):
        if order is not None:
            order.append(now["pair"])
        if fail is not None and now["pair"] == fail:
            raise RuntimeError("made to fail")
        return [0.001, 0.001]

    untimed = {"tokens": None, "seen": None}
    monkeypatch.setattr(bg, "copy_bandwidth_gbps", lambda: 1.0)
    monkeypatch.setattr(bg, "_warm", lambda *a: None)
    monkeypatch.setattr(bg, "_timed", timed)
    monkeypatch.setattr(bg, "_untimed", lambda model, ids, *a, **k: untimed | {
        "tokens": torch.zeros(ids.shape[0], 2, dtype=torch.long), "seen": seen(ids)})
    monkeypatch.setattr(bg, "_measure", lambda model, ids, static, *a, **k: {
        "tokens": torch.zeros(ids.shape[0], 2, dtype=torch.long), "seen": seen(ids),
        "ms_per_step": 2.0})


def test_bench_generate_times_the_eager_ways_in_turns(monkeypatch, tmp_path):
    """The eager ways of a batch are timed in turns (HF, pair 1, pair 2, HF, ...), so that the
    host's drift falls on each alike; a way whose generate fails leaves the turns with its error
    in its row and the other ways are still measured and compared."""
    import replayquant.bench.generate as bg
    order = []
    _fake_measures(monkeypatch, bg, fail="tp4_hi16_sr", order=order)
    settings = bg.GenerateSettings(shape="tiny", device="cpu", batches=(1,),
                                   pairs=("s32_rs", "tp4_hi16_sr"))
    res = bg.run_generate_bench(tmp_path / "g.json", settings, progress=lambda m: None)
    assert order == [None, "s32_rs", "tp4_hi16_sr"] + [None, "s32_rs"] * 4
    rows = res["rows"]
    assert rows["patched_eager:tp4_hi16_sr@B1"]["error"] == "RuntimeError: made to fail"
    assert rows["patched_eager:s32_rs@B1"]["ms_per_step"] == 1.0
    assert rows["patched_eager:s32_rs@B1"]["intervals_timed"] == 10
    assert "tokens_equal_eager" not in rows["patched_static:tp4_hi16_sr@B1"]
    assert rows["patched_static:s32_rs@B1"]["logits_max_abs_diff_first_steps"] == [0.0, 0.0]
    assert all("seen" not in r and "tokens" not in r for r in rows.values())


def test_bench_generate_adds_batches_to_a_file_of_the_same_run_only(tmp_path, monkeypatch):
    """`add=True` keeps the batches an earlier call of the same run measured and records each
    call; a file of another run is refused before any work; without `add` the file is replaced."""
    import replayquant.bench.generate as bg
    _fake_measures(monkeypatch, bg)
    out = tmp_path / "g.json"
    one = bg.GenerateSettings(shape="tiny", device="cpu", pairs=("s32_rs",))

    def run(out, batches, add=False, **kw):
        return bg.run_generate_bench(out, replace(one, batches=batches, **kw), add=add,
                                     progress=lambda m: None)
    run(out, (1,))
    res = run(out, (2,), add=True)
    assert res["batches"] == [1, 2] and [c["batches"] for c in res["calls"]] == [[1], [2]]
    assert set(res["rows"]) == {f"{w}@B{b}" for b in (1, 2) for w in
                                ("hf_eager", "hf_static", "patched_eager:s32_rs",
                                 "patched_static:s32_rs")}
    assert all(r["tokens_equal_eager"] for k, r in res["rows"].items() if "static" in k)
    before = out.read_bytes()
    with pytest.raises(ValueError, match="different configuration"):
        run(out, (4,), add=True, pairs=("tp4_hi16_sr",))
    assert out.read_bytes() == before
    res = run(out, (4,))
    assert res["batches"] == [4] and len(res["calls"]) == 1
    # `bench merge` of calls that each wrote a file of their own: one file of their batches,
    # rows as measured; overlapping batches or another run are refused before anything is written
    from _cli import invoke, one_clear_error
    other = tmp_path / "g1.json"
    run(other, (1,))
    code, text = invoke(["bench", "merge", str(out), str(other), "--out", tmp_path / "m"])
    assert code == 0, text
    merged = json.loads((tmp_path / "m" / "generate.json").read_text())
    assert merged["batches"] == [1, 4] and len(merged["calls"]) == 2
    assert merged["rows"] == json.loads(other.read_text())["rows"] | res["rows"]
    assert len(merged["targets"]) == 2 * len(res["targets"])
    code, text = invoke(["bench", "merge", str(out), str(out), "--out", tmp_path / "m2"])
    one_clear_error(code, text, "batch 4 is in")
    monkeypatch.setenv("REPLAYQUANT_GIT_COMMIT", "0" * 7)
    run(other, (1,))
    code, text = invoke(["bench", "merge", str(out), str(other), "--out", tmp_path / "m2"])
    one_clear_error(code, text, "different run")
    assert not (tmp_path / "m2").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("name", MODELS)
def test_recorded_decode_steps_equal_eager_steps_on_cuda(name):
    # decode_graph: the third decode step on a store records the layer's step as a CUDA graph and
    # replays it; the logits of 3L steps equal those of the same steps launched one kernel at a
    # time, bit for bit (the same kernels on the same addresses), across flushes: the test that
    # admits a layer kind into decode_graph.GRAPHED_KINDS
    from transformers import DynamicCache

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = replayquant.load_model(name, pair="tp4_hi16_sr", dtype="bfloat16",
                                       device_map="cuda", buffer_len=L)
    ids = torch.randint(3, 200, (3, 6), generator=torch.Generator().manual_seed(1)).cuda()
    runs = {}
    for graphs in ("off", "on"):
        with options.override(decode_graphs=graphs), torch.no_grad():
            cache = DynamicCache(config=model.config)
            kw = {cache_kwarg(model): cache, "use_cache": True}
            tok = model(ids, **kw).logits[:, -1:].argmax(-1)
            logits = []
            for _ in range(3 * L):
                out, tok = _step(model, tok, kw)
                logits.append(out)
            runs[graphs] = torch.cat(logits, 1)
    layers = [m._replayquant for m in model.modules() if hasattr(m, "_replayquant")]
    assert all(rt.graph.graph is not None and rt.graph.failed is None for rt in layers)
    assert torch.equal(runs["on"], runs["off"])
