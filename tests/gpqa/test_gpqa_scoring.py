"""GPQA scoring: the targets lm-eval scores are the letters of the prompts the model saw, and
`replayquant gpqa` with the exact pair scores as lm-eval's own `hf` model does (CPU, offline).

lm-eval 0.4.13 runs a task's `process_docs` (which shuffles the four answers) on every pass over
the documents: to build the requests, to score them, to count them. The embedded tiny-qwen3.5 and
tests/data/gpqa_tiny.csv (synthetic questions in GPQA's columns) keep each run to seconds.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY_CSV = ROOT / "tests" / "data" / "gpqa_tiny.csv"
TINY_MODEL = ROOT / "replayquant" / "assets" / "tiny-qwen3.5"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
for _k, _v in OFFLINE.items():
    os.environ.setdefault(_k, _v)


def _prompt(sample: dict) -> str:
    """The context of a logged sample's first request: the prompt the model was given."""
    args = sample["arguments"]
    first = args[0] if isinstance(args, list) else next(iter(args.values()))
    return first[0] if isinstance(first, (list, tuple)) else first["arg_0"]


def _letter_in_prompt(prompt: str, answer: str) -> str:
    """The letter "(X)" of the choice line reading `answer` in the question's own choices (the
    last "Choices:" block: n-shot prompts hold other questions before it)."""
    block = prompt[prompt.rindex("Choices:"):]
    letters = [m.group(1) for m in re.finditer(r"^(\([A-D]\)) (.*)$", block, re.M)
               if m.group(2).strip() == answer]
    assert len(letters) == 1, (answer, block)
    return letters[0]


def _check_targets_are_prompt_letters(samples: list[dict]) -> int:
    """Every logged sample's target is the letter its prompt gives the correct answer; returns
    how many questions were checked (a generative task logs one sample per filter)."""
    from lm_eval.tasks.gpqa.zeroshot.utils import preprocess
    for s in samples:
        want = _letter_in_prompt(_prompt(s), preprocess(s["doc"]["Correct Answer"]))
        assert s["target"] == want, (s["doc_id"], s["target"], want, _prompt(s)[-300:])
        assert s["doc"]["answer"] == want
    return len({s["doc_id"] for s in samples})


@pytest.mark.parametrize("caching", [True, False])
def test_every_pass_over_the_documents_has_one_answer_order(tmp_path, monkeypatch, caching):
    """The task files `replayquant gpqa` writes, loaded by lm-eval with `datasets`' cache on (in
    an empty folder) or off: the few-shot pool, the documents built with the task and three
    later passes (as requests, count and scoring make) give every question the same answer."""
    import datasets
    from lm_eval.tasks import TaskManager

    from replayquant.gpqa.tasks import GPQA_TASKS, write_task_dir

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")
    monkeypatch.setattr(datasets.fingerprint, "_CACHING_ENABLED", caching)
    assert datasets.is_caching_enabled() == caching
    manager = TaskManager(include_path=str(write_task_dir(TINY_CSV, tmp_path / "tasks")),
                          include_defaults=False)
    for name in GPQA_TASKS:
        task = manager.load([name])["tasks"][name]
        passes = [task.fewshot_docs(), task.task_docs] + [task.eval_docs for _ in range(3)]
        answers = [[d["answer"] for d in docs] for docs in passes]
        assert all(a == answers[0] for a in answers), (name, caching, answers)


@pytest.mark.slow
def test_gpqa_targets_are_the_letters_of_the_prompts(tmp_path):
    """`replayquant gpqa --log-samples`, two pairs, a multiple-choice task with its own RNG
    (n-shot) and a generative one (chain of thought) on four questions: for every logged sample
    the target is the letter of the correct answer in the logged prompt."""
    from _cli import invoke
    out = tmp_path / "gpqa"
    tasks = ["gpqa_diamond_n_shot", "gpqa_diamond_cot_zeroshot"]
    code, text = invoke(["gpqa", "--model", TINY_MODEL, "--pair", "s32_rs", "--pair", "f4_sr_rs",
                         "--task", ",".join(tasks), "--num-fewshot", "1", "--limit", "4",
                         "--gpqa-csv", TINY_CSV, "--device", "cpu", "--dtype", "float32",
                         "--batch-size", "2", "--max-gen-toks", "4", "--log-samples",
                         "--out", out])
    assert code == 0, text
    for pair in ("s32_rs", "f4_sr_rs"):
        for task in tasks:
            path = out / f"{pair}.samples.{task}.jsonl"
            samples = [json.loads(x) for x in path.read_text().splitlines()]
            assert _check_targets_are_prompt_letters(samples) == 4, (pair, task)


def _per_doc(samples: list[dict], metric: str) -> dict[int, float]:
    return {int(s["doc_id"]): float(s[metric]) for s in samples}


@pytest.mark.slow
def test_gpqa_exact_pair_scores_as_lm_evals_hf_model(tmp_path, monkeypatch):
    """`replayquant gpqa --pair s32_rs` and lm-eval's own `hf` model (the unpatched tiny model,
    lm-eval's zero-shot task reading the same CSV, `datasets`' cache on in an empty folder, as
    a first plain `lm_eval` run has it): the same prompts, targets, per-question correctness and
    accuracy, loglikelihoods within float32 noise."""
    import datasets
    import lm_eval
    import yaml
    from lm_eval.tasks import TaskManager

    from replayquant.gpqa import GPQASettings, run_gpqa
    from replayquant.gpqa.tasks import lm_eval_gpqa_dir

    task = "gpqa_diamond_zeroshot"
    settings = GPQASettings(tasks=[task], gpqa_csv=TINY_CSV, seed=0, dtype="float32",
                            device="cpu", log_samples=True)
    summary = run_gpqa(str(TINY_MODEL), ["s32_rs"], settings, out=tmp_path / "rq")
    ours = [json.loads(x) for x in
            (tmp_path / "rq" / f"s32_rs.samples.{task}.jsonl").read_text().splitlines()]

    # lm-eval's own task file with only the data source replaced, lm-eval's own task class
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / f"{task}.yaml").write_text(yaml.safe_dump({
        "include": str(lm_eval_gpqa_dir() / "zeroshot" / f"{task}.yaml"), "dataset_path": "csv",
        "dataset_name": None, "dataset_kwargs": {"data_files": {"train": str(TINY_CSV)}}}))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")
    assert datasets.is_caching_enabled()
    hf = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={TINY_MODEL},dtype=float32", tasks=[task],
        task_manager=TaskManager(include_path=str(tmp_path / "t"), include_defaults=False),
        device="cpu", batch_size=1,
        random_seed=0, log_samples=True)
    theirs = hf["samples"][task]

    assert len(ours) == len(theirs) == 6
    by_id = {s["doc_id"]: s for s in theirs}
    for s in ours:
        t = by_id[s["doc_id"]]
        assert (_prompt(s), s["target"]) == (_prompt(t), t["target"])
        assert [r[0][0] for r in s["resps"]] == pytest.approx([r[0][0] for r in t["resps"]],
                                                                abs=1e-4)
    assert _check_targets_are_prompt_letters(theirs) == _check_targets_are_prompt_letters(ours) == 6
    for metric in ("acc", "acc_norm"):
        assert _per_doc(ours, metric) == _per_doc(theirs, metric)
        row = next(r for r in summary["rows"] if r["task"] == task and r["metric"] == metric)
        assert row["accuracy"] == hf["results"][task][f"{metric},none"]
