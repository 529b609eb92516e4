"""GPQA through lm-eval with precision pairs (CPU, offline).

A tiny random Qwen3.5 text model and a tiny byte-level BPE tokenizer are built and saved in a temp
folder; tests/data/gpqa_tiny.csv is a synthetic GPQA-format CSV (GPQA's column names, invented
questions). Nothing here touches the hub or real GPQA data.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY_CSV = ROOT / "tests" / "data" / "gpqa_tiny.csv"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}

for _k, _v in OFFLINE.items():
    os.environ.setdefault(_k, _v)


def _patch_available() -> bool:
    try:
        from replayquant.models import patch, unpatch  # noqa: F401
    except ImportError:
        return False
    return True


needs_patch = pytest.mark.skipif(not _patch_available(),
                                 reason="replayquant.patch (model integration) not available")


# ---------------------------------------------------------------------------------------------
# fixtures

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A 4-layer Qwen3.5 text model (three Gated DeltaNet layers, then one attention layer, the
    real models' ratio) with random weights and a 320-token byte-level BPE tokenizer, saved with
    save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    folder = tmp_path_factory.mktemp("tiny_qwen35")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = TINY_CSV.read_text() + "What is the correct answer to this question: Choices Answer: " \
        "Let's think step by step: The answer is (A) (B) (C) (D)"
    tok.train_from_iterator([text] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    cfg = Qwen3_5TextConfig(
        vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
        layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=1024,
        initializer_range=0.2, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return str(folder)


def _write_csv(path: Path, header: list[str], rows: list[list[str]]):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


# ---------------------------------------------------------------------------------------------
# data sources and bad input (no model needed)

def test_tiny_csv_is_gpqa_format_and_marked_synthetic():
    from replayquant.gpqa.tasks import REQUIRED_COLUMNS, check_csv
    assert check_csv(TINY_CSV) == 6
    with open(TINY_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    assert set(REQUIRED_COLUMNS) <= set(rows[0])
    assert all(r["Question"].startswith("[SYNTHETIC TEST ITEM, NOT FROM GPQA]") for r in rows)


def test_task_dir_includes_lm_eval_tasks_and_overrides_only_the_data(tmp_path):
    """The written task files include lm-eval's, replace the data source (a CSV) or keep it (the
    hub) and name the task class that shuffles the answers once per task."""
    import lm_eval
    import yaml
    from lm_eval.tasks._yaml_loader import load_yaml

    from replayquant.gpqa.tasks import GPQA_TASKS, TASK_CLASS, templates_dir, write_task_dir

    d = write_task_dir(TINY_CSV, tmp_path / "tasks")
    hub = write_task_dir(None, tmp_path / "hub")
    lm_tasks = Path(lm_eval.__file__).parent / "tasks" / "gpqa"
    for task, sub in GPQA_TASKS.items():
        cfg = load_yaml(d / f"{task}.yaml", resolve_func=False, recursive=False)
        assert set(cfg) == {"include", "dataset_path", "dataset_name", "dataset_kwargs", "class"}
        assert Path(cfg["include"]) == lm_tasks / sub / f"{task}.yaml"
        assert cfg["dataset_path"] == "csv" and cfg["dataset_name"] is None
        assert cfg["dataset_kwargs"] == {"data_files": {"train": str(TINY_CSV.resolve())}}
        assert Path(cfg["class"]).name == TASK_CLASS     # unresolved: the folder / the name
        hub_cfg = load_yaml(hub / f"{task}.yaml", resolve_func=False, recursive=False)
        assert {k: Path(v).name for k, v in hub_cfg.items()} == {
            "include": f"{task}.yaml", "class": TASK_CLASS}
        # the shipped template differs from the written file only in the two paths
        tpl = yaml.safe_load((templates_dir() / f"{task}.yaml").read_text())
        assert tpl["include"] == f"lm_eval_gpqa/{sub}/{task}.yaml"

    # lm-eval itself resolves the task: its own prompt and metrics, our CSV, our task class
    from lm_eval.tasks import TaskManager

    from replayquant.gpqa.lm_task import GPQATask
    tm = TaskManager(include_path=str(d), include_defaults=False)
    task = tm.load(["gpqa_diamond_zeroshot"])["tasks"]["gpqa_diamond_zeroshot"]
    assert type(task) is GPQATask and task.config.task == "gpqa_diamond_zeroshot"
    assert task.config.dataset_path == "csv"
    assert task.config.doc_to_choice == ["(A)", "(B)", "(C)", "(D)"]
    docs = list(task.validation_docs())
    assert len(docs) == 6 and docs[0]["Question"].startswith("[SYNTHETIC")


def test_csv_missing_columns_one_clear_error(tmp_path):
    from replayquant.gpqa.tasks import check_csv
    bad = tmp_path / "bad.csv"
    _write_csv(bad, ["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2"],
               [["q?", "a", "b", "c"]])
    with pytest.raises(ValueError, match=r"missing GPQA column\(s\) \['Incorrect Answer 3'\]"):
        check_csv(bad)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        check_csv(empty)
    header_only = tmp_path / "header.csv"
    _write_csv(header_only, ["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
                             "Incorrect Answer 3"], [])
    with pytest.raises(ValueError, match="no questions"):
        check_csv(header_only)
    with pytest.raises(ValueError, match="no such file"):
        check_csv(tmp_path / "nope.csv")


def _cli(args, env_extra=None):
    from typer.testing import CliRunner

    from replayquant.cli import app
    return CliRunner().invoke(app, args)


def test_cli_bad_csv_unknown_pair_unknown_task(tmp_path):
    bad = tmp_path / "bad.csv"
    _write_csv(bad, ["Question", "Answer"], [["q?", "a"]])
    r = _cli(["gpqa", "--model", "org/unused", "--pair", "s32_rs", "--gpqa-csv", str(bad)])
    assert r.exit_code == 2 and "missing GPQA column(s)" in r.output, r.output
    r = _cli(["gpqa", "--model", "org/unused", "--pair", "s32_rs", "--pair", "no_such_pair",
              "--gpqa-csv", str(TINY_CSV)])
    assert r.exit_code == 2 and "unknown precision pair 'no_such_pair'" in r.output, r.output
    r = _cli(["gpqa", "--model", "org/unused", "--pair", "s32_rs", "--task", "gpqa_main_zeroshot",
              "--gpqa-csv", str(TINY_CSV)])
    assert r.exit_code == 2 and "unknown GPQA task" in r.output, r.output
    # nothing was written for the failed runs
    assert not (Path("build") / "gpqa" / "unused").exists()


@pytest.mark.slow
def test_no_dataset_access_and_no_csv_one_clear_error(tmp_path):
    """Offline, empty HF cache, no --gpqa-csv: fails before loading any model."""
    env = {**os.environ, **OFFLINE, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": ""}
    env.pop("HF_TOKEN")
    p = subprocess.run([sys.executable, "-m", "replayquant", "gpqa", "--model", "not/loaded",
                        "--pair", "s32_rs", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "cannot load GPQA-Diamond (Idavidrein/gpqa, gpqa_diamond)" in p.stderr
    assert "--gpqa-csv" in p.stderr and "huggingface.co/datasets/Idavidrein/gpqa" in p.stderr
    assert not (tmp_path / "out").exists()


def test_lm_eval_passthrough_rejects_two_task_sources():
    from replayquant.gpqa.lm_eval_model import lm_eval_main
    with pytest.raises(ValueError, match="either --gpqa-csv or --include_path"):
        lm_eval_main(["--model", "replayquant", "--gpqa-csv", str(TINY_CSV), "--include_path", "x"])


def test_model_registered_with_lm_eval():
    import lm_eval.api.registry as reg

    from replayquant.gpqa.lm_eval_model import ReplayQuantLM
    assert reg.get_model("replayquant") is ReplayQuantLM
    from lm_eval.models.huggingface import HFLM
    assert issubclass(ReplayQuantLM, HFLM)


def test_unknown_pair_and_prefill_fail_before_loading():
    from replayquant.gpqa.lm_eval_model import ReplayQuantLM
    with pytest.raises(ValueError, match="unknown precision pair 'bogus'"):
        ReplayQuantLM(pretrained="never/loaded", pair="bogus")
    with pytest.raises(ValueError, match="prefill='fast'"):
        ReplayQuantLM(pretrained="never/loaded", pair="s32_rs", prefill="fast")
    with pytest.raises(ValueError, match="compile_generate='maybe'"):
        ReplayQuantLM(pretrained="never/loaded", compile_generate="maybe")


# ---------------------------------------------------------------------------------------------
# summary and table (from lm-eval-shaped results; no model)

def _fake_results(label, accs, stderr, per_doc, digest="d"):
    return {"label": label, "file": f"{label}.json", "results": {
        "results": {"gpqa_diamond_zeroshot": {"alias": "gpqa_diamond_zeroshot", "acc,none": accs[0],
                                              "acc_stderr,none": stderr, "acc_norm,none": accs[1],
                                              "acc_norm_stderr,none": stderr}},
        "n-samples": {"gpqa_diamond_zeroshot": {"original": 6, "effective": len(per_doc)}},
        "replayquant": {"pair": {"name": label}, "questions_digest": {"gpqa_diamond_zeroshot": digest},
                        "per_doc": {"gpqa_diamond_zeroshot": {
                            "acc,none": {str(i): v for i, v in enumerate(per_doc)},
                            "acc_norm,none": {str(i): v for i, v in enumerate(per_doc)}}}}}}


def test_summary_paired_stderr_and_tables():
    from replayquant.gpqa.summary import build_summary, render_table
    a = [1, 0, 1, 1, 0, 1]
    b = [1, 0, 0, 1, 1, 0]
    per_pair = [_fake_results("s32_rs", (4 / 6, 0.5), 0.2, a),
                _fake_results("f4_sr_rs", (3 / 6, 0.5), 0.22, b, digest="other")]
    s = build_summary(per_pair, model="tiny", tasks=["gpqa_diamond_zeroshot"], limit=6, seed=0,
                      prefill="replay", data={"source": "csv"}, provenance={"git_commit": "x"})
    rows = {(r["pair"], r["metric"]): r for r in s["rows"]}
    r = rows[("f4_sr_rs", "acc")]
    d = [x - y for x, y in zip(b, a)]
    m = sum(d) / len(d)
    se = math.sqrt(sum((v - m) ** 2 for v in d) / (len(d) - 1) / len(d))
    assert r["delta"] == pytest.approx(3 / 6 - 4 / 6) and r["delta_stderr"] == pytest.approx(se)
    assert r["primary"] and not rows[("f4_sr_rs", "acc_norm")]["primary"]
    assert rows[("s32_rs", "acc")]["delta"] == 0 and rows[("s32_rs", "acc")]["questions_match_first"]
    assert r["questions_match_first"] is False
    md = render_table([s])
    assert "| s32_rs | 66.7 \u00b1 20.0 | +0.0 |" in md
    assert "| f4_sr_rs | 50.0 \u00b1 22.0 | \u221216.7 \u00b1 " in md and "questions differ" in md
    # two models: a mean-difference column
    s2 = dict(s, model="tiny2")
    md2 = render_table([s, s2])
    assert "mean \u0394" in md2 and "| f4_sr_rs |" in md2
    lines = list(csv.DictReader(render_table([s, s2], fmt="csv").splitlines()))
    assert len(lines) == 4 and {ln["model"] for ln in lines} == {"tiny", "tiny2"}
    with pytest.raises(ValueError, match="--format"):
        render_table([s], fmt="html")


def test_table_command_reads_summaries(tmp_path):
    from replayquant.gpqa.summary import build_summary
    s = build_summary([_fake_results("s32_rs", (0.5, 0.5), 0.2, [1, 0])], model="tiny",
                      tasks=["gpqa_diamond_zeroshot"], limit=2, seed=0, prefill="replay",
                      data={"source": "csv"}, provenance={})
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "SUMMARY.json").write_text(json.dumps(s))
    r = _cli(["table", str(tmp_path / "m")])
    assert r.exit_code == 0 and "| s32_rs | 50.0" in r.output, r.output
    r = _cli(["table", str(tmp_path / "m" / "SUMMARY.json"), "--format", "csv"])
    assert r.exit_code == 0 and r.output.startswith("model,task,metric"), r.output


# ---------------------------------------------------------------------------------------------
# the model class on both scoring paths (needs the model-integration API)

@pytest.mark.slow
@needs_patch
def test_both_scoring_paths_see_the_pair(tiny_model):
    """loglikelihood (teacher forcing) and generate_until (replay decode), batched: an FP32 pair and
    f4_sr_rs give different loglikelihoods and different greedy continuations; prefill="exact"
    scores as prefill + decode; switching back to the FP32 pair reproduces the first numbers
    exactly."""
    from lm_eval.api.instance import Instance

    from replayquant.gpqa.lm_eval_model import ReplayQuantLM, cache_kwarg, output_cache

    lm = ReplayQuantLM(pretrained=tiny_model, pair="s32_rs", device="cpu", dtype="float32", batch_size=4)
    with open(TINY_CSV, newline="") as f:
        ctx = [f"Question: {r['Question']}\nChoices:\n(A) {r['Correct Answer']}\n(B) {r['Incorrect Answer 1']}"
               "\nLet's think step by step: " for r in list(csv.DictReader(f))[:4]]
    ll_req = [Instance("loglikelihood", {}, (c, " The answer is (A)"), i) for i, c in enumerate(ctx)]
    gen_req = [Instance("generate_until", {}, (c, {"until": ["<|im_end|>"], "max_gen_toks": 32,
                                                   "do_sample": False}), i) for i, c in enumerate(ctx)]

    def score():
        return [x[0] for x in lm.loglikelihood(ll_req, disable_tqdm=True)], \
            lm.generate_until(gen_req, disable_tqdm=True)

    ll32, gen32 = score()
    lm.set_pair("f4_sr_rs")
    ll4, gen4 = score()
    assert all(math.isfinite(x) for x in ll32 + ll4)
    assert all(a != b for a, b in zip(ll32, ll4)), (ll32, ll4)
    assert gen32 != gen4, (gen32, gen4)
    # prefill="exact": the context is prefilled (FP32, one cast) and the continuation decoded token
    # by token, as a server would score it; the pair is still on the path
    lm.set_pair("f4_sr_rs", prefill="exact")
    ll4x = [x[0] for x in lm.loglikelihood(ll_req, disable_tqdm=True)]
    assert all(a != b for a, b in zip(ll32, ll4x)) and ll4x != ll4
    kw = cache_kwarg(lm.model)
    for (c, cont), got in zip([r.args for r in ll_req], ll4x):
        ctx_ids, cont_ids = lm._encode_pair(c, cont)
        with torch.no_grad():
            o = lm.model(torch.tensor([ctx_ids]), use_cache=True)
            logp, cache = 0.0, output_cache(o)
            for t, tok in enumerate(cont_ids):
                logp += float(torch.log_softmax(o.logits[0, -1].float(), -1)[tok])
                if t + 1 < len(cont_ids):
                    o = lm.model(torch.tensor([[tok]]), use_cache=True, **{kw: cache})
                    cache = output_cache(o)
        assert got == pytest.approx(logp, abs=1e-4)
    lm.set_pair("s32_rs", prefill="replay")
    assert score() == (ll32, gen32)
    info = lm.get_model_info()["replayquant"]
    assert info["pair"]["name"] == "s32_rs" and info["prefill"] == "replay"


@pytest.mark.slow
@needs_patch
def test_compiled_generate_until_compiles_once_per_batch_size(tiny_model):
    """compile_generate through lm-eval's generate_until: five prompts of five lengths in batches
    of two (longest first, as lm-eval orders them): the second batch, shorter, reuses the first
    batch's compiled decode step (transformers keeps the first static cache length), only the last
    batch of one row compiles again, and the continuations equal the eager decode steps'.
    Compiled on the CPU through CompileConfig._compile_all_devices with backend 'eager'."""
    from lm_eval.api.instance import Instance
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    from replayquant.gpqa.lm_eval_model import ReplayQuantLM

    class Compiled(ReplayQuantLM):
        compiled = True
        graphs: list = []

        def _compile_config(self):
            if not self.compiled:
                return None
            cc = CompileConfig(backend="eager", fullgraph=True)
            cc._compile_all_devices = True
            return cc

        def _model_generate(self, *args, **kwargs):
            out = super()._model_generate(*args, **kwargs)
            self.graphs.append(counters["stats"]["unique_graphs"])
            return out

    lm = Compiled(pretrained=tiny_model, pair="tp4_hi16_sr", device="cpu", dtype="float32",
                  batch_size=2)
    words = "the answer is one of four choices and a short reason comes first".split()
    req = [Instance("generate_until", {}, (" ".join(words[:3 + 2 * i]),
                                           {"until": ["<|im_end|>"], "max_gen_toks": 6, "do_sample": False}), i)
           for i in range(5)]
    torch._dynamo.reset()
    counters.clear()
    compiled = lm.generate_until(req, disable_tqdm=True)
    assert len(lm.graphs) == 3 and lm.graphs[0] > 0, lm.graphs
    assert lm.graphs[1] == lm.graphs[0] and lm.graphs[2] > lm.graphs[1], lm.graphs
    lm.compiled = False
    assert lm.generate_until(req, disable_tqdm=True) == compiled
    with pytest.raises(ValueError, match="compile_generate=true compiles the decode step for CUDA"):
        ReplayQuantLM(pretrained=tiny_model, device="cpu", dtype="float32", compile_generate="true")


@pytest.mark.slow
@needs_patch
def test_lm_eval_command_end_to_end(tiny_model, tmp_path):
    """lm-eval's own command line with --model replayquant, a loglikelihood task and a generative
    task, on the synthetic CSV with --limit."""
    from replayquant.gpqa.lm_eval_model import lm_eval_main
    out = tmp_path / "lm_eval_out"
    lm_eval_main(["--model", "replayquant", "--model_args",
                  f"pretrained={tiny_model},pair=tp4_hi16_sr,dtype=float32,prefill=replay",
                  "--device", "cpu", "--batch_size", "2",
                  "--tasks", "gpqa_diamond_zeroshot,gpqa_diamond_cot_zeroshot",
                  "--gen_kwargs", "max_gen_toks=16", "--limit", "2",
                  "--gpqa-csv", str(TINY_CSV), "--output_path", str(out), "--log_samples"])
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())
    assert res["results"]["gpqa_diamond_zeroshot"]["sample_len"] == 2
    assert "exact_match,flexible-extract" in res["results"]["gpqa_diamond_cot_zeroshot"]
    assert res["config"]["replayquant"]["pair"]["name"] == "tp4_hi16_sr"
    assert res["configs"]["gpqa_diamond_zeroshot"]["dataset_path"] == "csv"
    samples = list(out.rglob("samples_gpqa_diamond_zeroshot_*.jsonl"))
    assert samples and "SYNTHETIC" in samples[0].read_text()


@pytest.mark.slow
@needs_patch
def test_gpqa_command_two_pairs_summary_and_table(tiny_model, tmp_path):
    out = tmp_path / "gpqa"
    r = _cli(["gpqa", "--model", tiny_model, "--pair", "s32_rs", "--pair", "f4_sr_rs",
              "--task", "gpqa_diamond_n_shot", "--task", "gpqa_diamond_cot_zeroshot", "--num-fewshot", "1",
              "--gpqa-csv", str(TINY_CSV), "--limit", "3", "--seed", "0", "--device", "cpu",
              "--dtype", "float32", "--batch-size", "2", "--max-gen-toks", "12", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert {p.name for p in out.glob("*.json")} == {"s32_rs.json", "f4_sr_rs.json", "SUMMARY.json"}
    s = json.loads((out / "SUMMARY.json").read_text())
    assert s["kind"] == "replayquant/gpqa-summary" and s["reference_pair"] == "s32_rs"
    assert s["data"]["source"] == "csv" and len(s["data"]["sha256"]) == 64
    for key in ("git_commit", "versions", "device", "date"):
        assert key in s["provenance"]
    assert s["provenance"]["model"] == tiny_model
    rows = [r for r in s["rows"] if r["primary"]]
    assert {(r["pair"], r["task"]) for r in rows} == {(p, t) for p in ("s32_rs", "f4_sr_rs") for t in
                                                      ("gpqa_diamond_n_shot", "gpqa_diamond_cot_zeroshot")}
    assert all(r["n"] == 3 and r["questions_match_first"] for r in rows)
    for pair in ("s32_rs", "f4_sr_rs"):
        res = json.loads((out / f"{pair}.json").read_text())
        assert res["replayquant"]["pair"]["name"] == pair
        assert res["replayquant"]["provenance"]["pair"]["name"] == pair
        assert set(res["replayquant"]["per_doc"]["gpqa_diamond_n_shot"]["acc,none"]) == {"0", "1", "2"}
        assert res["n-shot"]["gpqa_diamond_n_shot"] == 1
    # same questions, same answer order, same few-shot context for both pairs (n_shot's answer
    # shuffle uses a module-level RNG that the runner resets for every pair)
    r32 = json.loads((out / "s32_rs.json").read_text())
    r4 = json.loads((out / "f4_sr_rs.json").read_text())
    assert r32["replayquant"]["questions_digest"] == r4["replayquant"]["questions_digest"]
    assert r32["task_hashes"] == r4["task_hashes"]
    t = _cli(["table", str(out), "--format", "md"])
    assert t.exit_code == 0 and "| f4_sr_rs |" in t.output and "gpqa_diamond_cot_zeroshot" in t.output
    t = _cli(["table", str(out / "SUMMARY.json"), "--format", "csv"])
    assert t.exit_code == 0 and len(t.output.strip().splitlines()) == 5
