"""What an installed user meets outside the checkout: a hub dataset downloaded beforehand and read
offline (HF's "download where the hub can be reached, run offline" convention)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- hub datasets offline

_READ_OFFLINE = """
import json, sys
from replayquant.kl.data import iter_texts, resolve_source
try:
    kind, source = resolve_source(sys.argv[1])
    print(json.dumps([t for _, t in iter_texts(kind, source, "test")]))
except ValueError as e:
    print(json.dumps({"error": str(e)}))
"""


def _parquet(path: Path, texts: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path)


def _hub_snapshot(hub: Path, repo: str, texts: list[str]) -> None:
    """The hub cache layout `hf download --repo-type dataset REPO` writes (refs/main naming the
    snapshot that holds the repository's files)."""
    top = hub / f"datasets--{repo.replace('/', '--')}"
    (top / "refs").mkdir(parents=True)
    (top / "refs" / "main").write_text("0" * 40)
    _parquet(top / "snapshots" / ("0" * 40) / "data" / "test-00000-of-00001.parquet", texts)


def _datasets_cache(cache: Path, repo: str, texts: list[str], tmp: Path) -> None:
    """The `datasets` cache layout that `datasets.load_dataset(REPO)` writes where the hub can be
    reached: NAMESPACE___NAME/CONFIG/VERSION/HASH/NAME-SPLIT.arrow beside dataset_info.json.
    Written here by preparing a local parquet file and naming its files as a hub dataset's."""
    import shutil

    import datasets
    _parquet(tmp / "src.parquet", texts)
    ds = datasets.load_dataset("parquet", data_files={"test": str(tmp / "src.parquet")},
                               cache_dir=str(tmp / "prep"), split="test")
    prepared = Path(ds.cache_files[0]["filename"]).parent
    namespace, name = repo.split("/")
    dst = cache / f"{namespace}___{name}" / "default" / "0.0.0" / ("1" * 40)
    shutil.copytree(prepared, dst)
    (dst / "parquet-test.arrow").rename(dst / f"{name}-test.arrow")
    info = json.loads((dst / "dataset_info.json").read_text())
    info.update(config_name="default", dataset_name=name)
    info["splits"]["test"]["dataset_name"] = name
    (dst / "dataset_info.json").write_text(json.dumps(info))


def test_a_cached_hub_dataset_is_read_offline(tmp_path):
    """With HF_HUB_OFFLINE=1 a hub dataset found in the hub cache (`hf download`) or in the
    `datasets` cache (`datasets.load_dataset` run where the hub could be reached) is read from
    there; one that is in neither is one error saying how to download it."""
    hub, cache = tmp_path / "hub", tmp_path / "datasets"
    _hub_snapshot(hub, "someone/downloaded", ["first book", "second book"])
    _datasets_cache(cache, "someone/prepared", ["third book"], tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HTTP", "http"))}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub), HF_DATASETS_CACHE=str(cache),
               HF_HOME=str(tmp_path / "home"))

    def read(name):
        out = subprocess.run([sys.executable, "-c", _READ_OFFLINE, name], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert read("someone/downloaded") == ["first book", "second book"]
    assert read("someone/prepared") == ["third book"]
    err = read("someone/elsewhere")["error"]
    assert "HF_HUB_OFFLINE=1 is set" in err and "in neither local cache" in err
    assert "hf download --repo-type dataset someone/elsewhere" in err and "--dataset heldout" in err
