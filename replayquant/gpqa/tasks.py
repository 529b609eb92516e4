"""GPQA-Diamond task sources for lm-eval: the gated hub dataset, or a local CSV copy.

lm-eval ships the tasks (`lm_eval/tasks/gpqa/`); we never change their prompts or metrics. The
templates in `replayquant/gpqa/templates/*.yaml` `include:` lm-eval's own task files and override
the data source; `write_task_dir` copies them into a run folder with the paths made absolute (for
the hub dataset it keeps lm-eval's data source) and names the task class
`replayquant.gpqa.lm_task.GPQATask`, which shuffles the answers once per task so that the scored
targets are the letters of the prompts. That folder is passed to lm-eval as `include_path` (a task
found there replaces lm-eval's task of the same name, so results keep lm-eval's task names).
"""

from __future__ import annotations

import csv
import hashlib
import os
from importlib.resources import files
from pathlib import Path

import yaml

from replayquant.outputs import write_text

__all__ = [
    "GPQA_TASKS", "HUB_DATASET", "HUB_CONFIG", "REQUIRED_COLUMNS", "DEFAULT_TASK",
    "check_csv", "check_hub_access", "check_tasks", "check_task_dir", "write_task_dir",
    "templates_dir", "file_sha256",
]

# The lm-eval tasks this project supports, with their folder under lm_eval/tasks/gpqa/.
GPQA_TASKS = {
    "gpqa_diamond_zeroshot": "zeroshot",
    "gpqa_diamond_n_shot": "n_shot",
    "gpqa_diamond_cot_zeroshot": "cot_zeroshot",
    "gpqa_diamond_generative_n_shot": "generative",
}
DEFAULT_TASK = "gpqa_diamond_cot_zeroshot"
HUB_DATASET, HUB_CONFIG = "Idavidrein/gpqa", "gpqa_diamond"
REQUIRED_COLUMNS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
                    "Incorrect Answer 3")
_TEMPLATE_PREFIX = "lm_eval_gpqa/"
TASK_CLASS = "replayquant.gpqa.lm_task.GPQATask"    # the `class:` of every task file written
_DATA_KEYS = ("dataset_path", "dataset_name", "dataset_kwargs")
_HEAD = "# Written by replayquant from "      # the first line of every task file written

ACCESS_HELP = (
    "GPQA is gated on the Hugging Face Hub: accept its terms at "
    "https://huggingface.co/datasets/Idavidrein/gpqa with your account, then log in "
    "(`hf auth login`, or export HF_TOKEN=<a read token>); or pass --gpqa-csv path/to/gpqa_diamond.csv "
    "(the file from the GPQA release, see README)."
)


def templates_dir():
    """The task templates shipped inside the package (replayquant/gpqa/templates/)."""
    return files("replayquant.gpqa") / "templates"


def lm_eval_gpqa_dir() -> Path:
    import lm_eval   # lm-eval / datasets: loaded by the commands that use them
    return Path(lm_eval.__file__).resolve().parent / "tasks" / "gpqa"


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_tasks(tasks) -> list[str]:
    """The task names, each one of GPQA_TASKS."""
    tasks = list(tasks) if tasks else [DEFAULT_TASK]
    unknown = [t for t in tasks if t not in GPQA_TASKS]
    if unknown:
        raise ValueError(f"unknown GPQA task(s) {unknown}: use one of {sorted(GPQA_TASKS)} "
                         "(lm-eval's own GPQA-Diamond tasks)")
    return tasks


def check_csv(path) -> int:
    """Validate a local GPQA CSV; return its number of questions. One ValueError per problem."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--gpqa-csv {path}: no such file (give the gpqa_diamond.csv of the GPQA release)")
    with open(p, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise ValueError(f"--gpqa-csv {path}: the file is empty; expected a CSV with GPQA's columns "
                             f"{list(REQUIRED_COLUMNS)}")
        missing = [c for c in REQUIRED_COLUMNS if c not in header]
        if missing:
            raise ValueError(f"--gpqa-csv {path}: missing GPQA column(s) {missing}; the file has {header[:12]}"
                             f"{' ...' if len(header) > 12 else ''}. Use the gpqa_diamond.csv of the GPQA "
                             f"release (columns {list(REQUIRED_COLUMNS)} and others).")
        idx = [header.index(c) for c in REQUIRED_COLUMNS]
        n = 0
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue
            n += 1
            if len(row) <= max(idx) or not row[idx[0]].strip() or not row[idx[1]].strip():
                raise ValueError(f"--gpqa-csv {path}: question {n} (line {reader.line_num}) has no "
                                 "Question or Correct Answer")
    if n == 0:
        raise ValueError(f"--gpqa-csv {path}: the file has GPQA's columns but no questions")
    # lm-eval loads the file with `datasets`, which infers column types like pandas: a column of
    # numbers only would arrive as numbers and break lm-eval's answer preprocessing.
    import pandas as pd
    frame = pd.read_csv(p)
    numeric = [c for c in REQUIRED_COLUMNS if pd.api.types.is_numeric_dtype(frame[c])]
    if numeric:
        raise ValueError(f"--gpqa-csv {path}: column(s) {numeric} hold only numbers, so they would be read "
                         "as numbers, not text; GPQA's answer columns are text")
    return n


def _written_here(path: Path) -> bool:
    """Whether `path` is a task file `write_task_dir` wrote: a regular file named after a GPQA
    task whose first line is the header it writes."""
    if path.is_symlink() or not path.is_file() or path.suffix != ".yaml" \
            or path.stem not in GPQA_TASKS:
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith(_HEAD)
    except (OSError, UnicodeDecodeError):
        return False


def check_task_dir(folder) -> None:
    """One ValueError, before any work, unless `folder` (where `write_task_dir` writes) is
    missing or holds nothing but task files it wrote: a file there is replaced, and lm-eval
    reads every YAML there as a task, so a file of anyone else would be lost or read."""
    folder = Path(folder)
    if not folder.exists() and not folder.is_symlink():
        return
    what = ("the folder where `replayquant gpqa` writes lm-eval's task files (lm-eval reads "
            "every YAML in it)")
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder, and {folder.name}/ is {what}: move it away "
                         f"or give another --out")
    for p in sorted(folder.iterdir()):
        if not _written_here(p):
            raise ValueError(f"{p} is not a task file `replayquant gpqa` wrote, and {folder}/ is "
                             f"{what}: refusing to replace or read it; move it away or give "
                             f"another --out")


def write_task_dir(csv_path, out_dir, tasks=None) -> Path:
    """Write the task files of `tasks` (default: all four) into `out_dir`: the shipped template
    with the `include` pointing at the installed lm-eval's task file, `class` naming `GPQATask`
    (the answers shuffled once per task), and the data read from the CSV at `csv_path` (absolute)
    or, with csv_path None, from lm-eval's own source (the hub). Returns out_dir, ready for
    lm-eval's `--include_path`."""
    if csv_path is not None:
        check_csv(csv_path)
    out = Path(out_dir)
    check_task_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    src, lm_dir = templates_dir(), lm_eval_gpqa_dir()
    for task in (tasks or list(GPQA_TASKS)):
        tpl = src / f"{task}.yaml"
        if not tpl.is_file():
            raise ValueError(f"no template {tpl} for task {task}")
        cfg = yaml.safe_load(tpl.read_text())
        inc = cfg.get("include", "")
        if not inc.startswith(_TEMPLATE_PREFIX):
            raise ValueError(f"{tpl}: `include` must start with {_TEMPLATE_PREFIX!r}")
        target = lm_dir / inc[len(_TEMPLATE_PREFIX):]
        if not target.is_file():
            raise ValueError(f"{tpl}: the installed lm-eval has no {target}; this lm-eval version does not "
                             f"ship task {task}")
        cfg["include"] = str(target)
        if csv_path is None:
            source = "its own data source"
            for key in _DATA_KEYS:
                cfg.pop(key)
        else:
            source = str(Path(csv_path).resolve())
            cfg["dataset_kwargs"]["data_files"]["train"] = source
        head = f"{_HEAD}{tpl.name}: lm-eval's {task} reading {source}\n"
        # the `!function` tag is lm-eval's YAML, which yaml.safe_dump does not write
        write_text(out / f"{task}.yaml", head + yaml.safe_dump(cfg, sort_keys=False)
                   + f"class: !function {TASK_CLASS}\n")
    return out


def check_hub_access() -> None:
    """Load the gated GPQA-Diamond from the hub (or the local `datasets` cache) once, so that a
    missing token fails before any model is loaded, with one clear error."""
    import datasets   # lm-eval / datasets: loaded by the commands that use them
    try:
        datasets.load_dataset(HUB_DATASET, HUB_CONFIG, split="train")
    except Exception as e:  # gated, offline, not logged in: datasets raises several kinds
        offline = any(os.environ.get(v, "0") not in ("0", "", "false", "False")
                      for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        why = "offline mode is set and the dataset is not in the local cache" if offline else \
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise ValueError(f"cannot load GPQA-Diamond ({HUB_DATASET}, {HUB_CONFIG}) from the Hugging Face Hub "
                         f"({why}). {ACCESS_HELP}") from e
