"""lm-eval's GPQA task with its answer shuffle computed once per task: the targets scored are
the letters of the prompts the model saw.

lm-eval 0.4.13 calls a task's `process_docs` on every pass over its documents: the few-shot pool
and the task's own documents when the task is built, the requests, the count of documents, the
scoring (five passes for the zero-shot task in one `simple_evaluate`). GPQA's `process_docs`
shuffles the four answers with Python's RNG. With `datasets`' cache on, a pass whose function
hashes as the first's reads the first's result from disk; otherwise each pass shuffles anew, and
the scored targets belong to another shuffle than the prompts: with the cache off, 4 of 6
zero-shot, 2 of 6 n-shot and 6 of 6 CoT targets on tests/data/gpqa_tiny.csv (tiny-qwen3.5); with it
on, the n-shot task's module-level RNG is part of the function's hash, so every pass misses the
cache and n-shot has the same fault (2 of 6 with lm-eval's `hf` model). `GPQATask` runs
`process_docs` once per dataset split and hands every later pass the same documents, whatever the
cache holds or whether it is on.

The task files `replayquant.gpqa.tasks.write_task_dir` writes name this class (`class:`); lm-eval
builds the task from lm-eval's own configuration (prompt, filters, metrics, `process_docs`).
"""

from __future__ import annotations

import functools

from lm_eval.api.task import ConfigurableTask

__all__ = ["GPQATask", "once_per_dataset"]


def once_per_dataset(process_docs):
    """`process_docs` run once per dataset object; later calls with it return the first result.
    lm-eval passes the same object on every pass (the task's split), so the documents of all
    passes are the first pass's. Wrapped with functools.wraps: lm-eval's results file shows the
    source of lm-eval's own function."""
    done: dict[int, tuple] = {}

    @functools.wraps(process_docs)
    def once(dataset):
        if id(dataset) not in done:      # the dataset is kept, so its id is not reused
            done[id(dataset)] = (dataset, process_docs(dataset))
        return done[id(dataset)][1]
    return once


class GPQATask(ConfigurableTask):
    """lm-eval's ConfigurableTask with `process_docs` run once per split (`once_per_dataset`);
    each task lm-eval builds has its own, so a new `simple_evaluate` shuffles afresh from its
    seed."""

    def __init__(self, config: dict, **kwargs):
        config = {k: v for k, v in config.items() if k != "class"}    # lm-eval's route key
        if config.get("process_docs") is None:
            raise ValueError(f"task {config.get('task')!r} has no process_docs: GPQATask is for "
                             "lm-eval's GPQA tasks, whose process_docs shuffles the answers")
        config["process_docs"] = once_per_dataset(config["process_docs"])
        super().__init__(config=config, **kwargs)
