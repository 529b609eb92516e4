"""GPQA-Diamond through lm-evaluation-harness with any precision pair.

    from replayquant.gpqa import GPQASettings, run_gpqa, render_table, load_summary
    summary = run_gpqa("Qwen3.5-4B", ["s32_rs", "f4_sr_rs", "tp4_hi16_sr"],
                       GPQASettings(tasks=["gpqa_diamond_cot_zeroshot"], limit=None, seed=0))
    print(render_table([load_summary("build/gpqa/Qwen3.5-4B")]))

The lm-eval model itself is `replayquant.gpqa.lm_eval_model.ReplayQuantLM` (name "replayquant").
"""

from replayquant.gpqa.settings import GPQASettings
from replayquant.gpqa.summary import (SUMMARY_KIND, build_summary, is_gpqa_summary, load_summary,
                                      render_table)
from replayquant.gpqa.tasks import (DEFAULT_TASK, GPQA_TASKS, REQUIRED_COLUMNS, check_csv, check_hub_access,
                                    write_task_dir)


def run_gpqa(*args, **kwargs):
    """See replayquant.gpqa.run.run_gpqa (imported lazily: it pulls in lm-eval and torch)."""
    # lm-eval / datasets: loaded by the commands that use them
    from replayquant.gpqa.run import run_gpqa as _run
    return _run(*args, **kwargs)


__all__ = ["GPQASettings", "run_gpqa", "render_table", "load_summary", "build_summary",
           "is_gpqa_summary", "SUMMARY_KIND", "write_task_dir", "check_csv", "check_hub_access",
           "GPQA_TASKS", "DEFAULT_TASK", "REQUIRED_COLUMNS"]
