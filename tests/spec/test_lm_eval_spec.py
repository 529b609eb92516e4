"""Speculative options through lm-eval's gen_kwargs on the `replayquant` lm-eval model: a tiny
generate-until task of local documents (a verse said three times, so that prompt lookup finds
its drafts) on the embedded tiny-qwen3.5 with the FP32 pair s32_rs.

With `prompt_lookup_num_tokens` in gen_kwargs HF's prompt lookup runs (its candidate generator
is called) and the answers equal plain decode's; at batch size 2 it is one error before any
request runs, and so are an assistant model given as text and more drafts than the pair's L.
The model argument `assistant` drafts every request with a loaded assistant model.
"""

import json
import os

import pytest

from _cli import invoke, one_clear_error

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow       # lm-eval and the model load: 13 s before the first test
for _k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_k, "1")

VERSE = "And God said, Let there be light: and there was light. "
DOCS = [{"text": VERSE * 3 + "And God said,", "target": " Let there be light"},
        {"text": "In the beginning God created the heaven and the earth. " * 3 + "In the",
         "target": " beginning"}]
GEN = {"until": ["\n"], "max_gen_toks": 20, "do_sample": False}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """lm-eval's include path holding task `tiny_spec`: generate-until over DOCS (a JSON lines
    file read through `datasets`' json builder), exact match against each target."""
    import yaml
    d = tmp_path_factory.mktemp("tasks")
    (d / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in DOCS))
    (d / "tiny_spec.yaml").write_text(yaml.safe_dump({
        "task": "tiny_spec", "dataset_path": "json", "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(d / "docs.jsonl")}},
        "output_type": "generate_until", "doc_to_text": "{{text}}",
        "doc_to_target": "{{target}}", "generation_kwargs": GEN,
        "metric_list": [{"metric": "exact_match"}]}))
    return d


@pytest.fixture(scope="module")
def lm():
    from replayquant.gpqa.lm_eval_model import ReplayQuantLM
    return ReplayQuantLM(pretrained="tiny-qwen3.5", pair="s32_rs", device="cpu", dtype="float32",
                         batch_size=1)


@pytest.fixture
def lookups(monkeypatch):
    """Calls of HF's prompt-lookup candidate generator."""
    from transformers.generation import candidate_generator as cg
    calls = []
    get = cg.PromptLookupCandidateGenerator.get_candidates

    def spy(self, *a, **kw):
        calls.append(1)
        return get(self, *a, **kw)

    monkeypatch.setattr(cg.PromptLookupCandidateGenerator, "get_candidates", spy)
    return calls


def _requests(**extra):
    from lm_eval.api.instance import Instance
    return [Instance("generate_until", {}, (d["text"], {**GEN, **extra}), i)
            for i, d in enumerate(DOCS)]


def test_prompt_lookup_answers_equal_plain_decode(lm, lookups):
    plain = lm.generate_until(_requests(), disable_tqdm=True)
    assert not lookups
    assert lm.generate_until(_requests(prompt_lookup_num_tokens=4), disable_tqdm=True) == plain
    assert lookups
    sampled = lm.generate_until(_requests(prompt_lookup_num_tokens=4, do_sample=True,
                                          temperature=0.7), disable_tqdm=True)
    assert len(sampled) == 2 and all(isinstance(s, str) for s in sampled)


def test_what_cannot_run_is_one_error_before_any_request(lm, monkeypatch):
    from lm_eval.models.huggingface import HFLM
    monkeypatch.setattr(HFLM, "_model_generate", lambda *a, **k: pytest.fail("a request ran"))
    with pytest.raises(ValueError, match="assistant_model='tiny-kimi-linear'.*assistant=MODEL"):
        lm.generate_until(_requests(assistant_model="tiny-kimi-linear"), disable_tqdm=True)
    with pytest.raises(ValueError, match=r"prompt_lookup_num_tokens=20 drafts.*L = 16"):
        lm.generate_until(_requests(prompt_lookup_num_tokens=20), disable_tqdm=True)
    monkeypatch.setattr(lm, "_rq_compile_asked", True)        # compile_generate=true
    with pytest.raises(ValueError, match="compile_generate=true: HF's assisted generation runs"):
        lm.generate_until(_requests(prompt_lookup_num_tokens=4), disable_tqdm=True)
    monkeypatch.setattr(lm, "_rq_compile_asked", None)
    monkeypatch.setattr(lm, "batch_size_per_gpu", 2)
    with pytest.raises(ValueError, match="batch_size is 2; run with --batch_size 1"):
        lm.generate_until(_requests(prompt_lookup_num_tokens=4), disable_tqdm=True)


def test_compiled_generate_leaves_speculative_requests_eager(lm, monkeypatch):
    """Where generate_until compiles (compile_generate=auto on CUDA), a request with a
    speculative option gets no static cache; one without gets it."""
    from lm_eval.models.huggingface import HFLM
    seen = []
    monkeypatch.setattr(HFLM, "_model_generate", lambda self, *a, **kw: seen.append(kw))
    monkeypatch.setattr(lm, "_compile_config", lambda: "a compile config")
    lm._model_generate(None, 8, [], prompt_lookup_num_tokens=4)
    lm._model_generate(None, 8, [])
    assert "cache_implementation" not in seen[0] and "compile_config" not in seen[0]
    assert seen[1]["cache_implementation"] == "static"


@pytest.mark.slow
def test_lm_eval_command_with_gen_kwargs(task_dir, tmp_path, lookups):
    """`replayquant lm-eval ... --gen_kwargs prompt_lookup_num_tokens=4 --batch_size 1` runs the
    task through prompt lookup; at --batch_size 2 it is one error and writes nothing."""
    args = ["lm-eval", "--model", "replayquant", "--model_args",
            "pretrained=tiny-qwen3.5,pair=s32_rs,dtype=float32", "--device", "cpu",
            "--tasks", "tiny_spec", "--include_path", task_dir,
            "--gen_kwargs", "prompt_lookup_num_tokens=4"]
    code, text = invoke(args + ["--batch_size", 2, "--output_path", tmp_path / "b2"])
    one_clear_error(code, text, "batch_size is 2; run with --batch_size 1")
    assert not (tmp_path / "b2").exists() and not lookups
    code, text = invoke(args + ["--batch_size", 1, "--output_path", tmp_path / "b1",
                                "--log_samples"])
    assert code == 0, text
    assert lookups
    res = json.loads(next((tmp_path / "b1").rglob("results_*.json")).read_text())
    assert res["config"]["gen_kwargs"] == {"prompt_lookup_num_tokens": 4}
    samples = [json.loads(x) for x in
               next((tmp_path / "b1").rglob("samples_tiny_spec_*.jsonl")).read_text().splitlines()]
    assert len(samples) == 2 and all(s["resps"][0][0] for s in samples)


def test_assistant_model_argument(lm, lookups, monkeypatch):
    """model_args assistant=tiny-kimi-linear,assistant_tokens=3: every generate-until request
    drafts with the loaded assistant (patched with s32_rs, 3 drafts a round), the answers equal
    plain decode's, the results record it, and batch size 2 is one error naming it; a bad
    assistant_tokens, and compile_generate=true beside it, are one error before any weights
    load."""
    from transformers.generation import candidate_generator as cg

    from replayquant.gpqa.lm_eval_model import ReplayQuantLM
    rounds = []
    get = cg.AssistedCandidateGenerator.get_candidates

    def spy(self, input_ids, *a, **kw):
        out = get(self, input_ids, *a, **kw)
        rounds.append(out[0].shape[1] - input_ids.shape[1])
        return out

    monkeypatch.setattr(cg.AssistedCandidateGenerator, "get_candidates", spy)
    plain = lm.generate_until(_requests(), disable_tqdm=True)
    helped = ReplayQuantLM(pretrained="tiny-qwen3.5", pair="s32_rs", device="cpu",
                           dtype="float32", batch_size=1, assistant="tiny-kimi-linear",
                           assistant_tokens=3)
    assert helped.generate_until(_requests(), disable_tqdm=True) == plain
    assert rounds and max(rounds) == 3 and not lookups
    assert helped.get_model_info()["replayquant"]["assistant"] == {
        "model": "tiny-kimi-linear", "tokens": 3}
    monkeypatch.setattr(helped, "batch_size_per_gpu", 2)
    with pytest.raises(ValueError, match="model_args assistant=tiny-kimi-linear: HF's"):
        helped.generate_until(_requests(), disable_tqdm=True)
    with pytest.raises(ValueError, match="assistant_tokens='x': give an integer >= 1"):
        ReplayQuantLM(pretrained="/nonexistent", assistant="tiny-kimi-linear",
                      assistant_tokens="x")
    with pytest.raises(ValueError, match="assistant=tiny-kimi-linear with compile_generate=true"):
        ReplayQuantLM(pretrained="/nonexistent", assistant="tiny-kimi-linear",
                      compile_generate="true")
