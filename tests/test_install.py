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
out = []
for name in sys.argv[1:]:
    try:
        kind, source = resolve_source(name)
        out.append([t for _, t in iter_texts(kind, source, "test")])
    except ValueError as e:
        out.append({"error": str(e)})
print(json.dumps(out))
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

    out = subprocess.run([sys.executable, "-c", _READ_OFFLINE, "someone/downloaded",
                          "someone/prepared", "someone/elsewhere"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    downloaded, prepared, elsewhere = json.loads(out.stdout.strip().splitlines()[-1])
    assert downloaded == ["first book", "second book"]
    assert prepared == ["third book"]
    err = elsewhere["error"]
    assert "HF_HUB_OFFLINE=1 is set" in err and "in neither local cache" in err
    assert "hf download --repo-type dataset someone/elsewhere" in err and "--dataset heldout" in err


# ---------------------------------------------------------------- the wheel and the sdist

DOCS = ("usage.md", "DESIGN.md", "kernels.md", "gpqa.md")


def _tree_copy(dst: Path) -> Path:
    """The files git tracks or would track, as a fresh clone has them (links kept as links)."""
    import shutil
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, files):
        if os.path.lexists(ROOT / rel):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel, follow_symlinks=False)
    return dst


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A wheel and an sdist built from a copy of the tree with the venv's setuptools."""
    src = _tree_copy(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("dist")
    code = ("import sys; from setuptools import build_meta as b; out = sys.argv[1]; "
            "b.build_sdist(out); b.build_wheel(out)")        # build_meta rewrites sys.argv
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, check=True,
                   capture_output=True, text=True)
    (sdist,) = out.glob("replayquant-*.tar.gz")
    (wheel,) = out.glob("replayquant-*.whl")
    return sdist, wheel


@pytest.mark.slow
def test_wheel_ships_the_docs_the_kernels_table_and_says_what_each_extra_installs(built):
    import zipfile
    _, wheel = built
    z = zipfile.ZipFile(wheel)
    names = set(z.namelist())
    for d in DOCS:
        assert f"replayquant/docs/{d}" in names, d
    assert "replayquant/data/kernels_h200.json" in names
    meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Project-URL: " in meta
    requires = [ln[len("Requires-Dist: "):] for ln in meta.splitlines()
                if ln.startswith("Requires-Dist: ")]
    core = [r for r in requires if "extra ==" not in r]
    assert not [r for r in core if r.startswith(("triton", "lm-eval", "lm_eval"))], core
    for extra, dist in (("triton", "triton"), ("lm-eval", "lm-eval")):
        assert f"Provides-Extra: {extra}" in meta
        assert [r for r in requires if r.startswith(dist) and f'extra == "{extra}"' in r], extra
    assert "Provides-Extra: dev" in meta


@pytest.mark.slow
def test_sdist_ships_the_docs_and_builds_the_same_wheel_data(built, tmp_path):
    import tarfile
    sdist, _ = built
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
        tf.extractall(tmp_path, filter="data")
    for d in DOCS:
        assert f"docs/{d}" in names, d
    assert "results/bench/kernels.json" in names and "configs/pairs/tp4_hi16_sr.yaml" in names
    assert "MANIFEST.in" in names and "README.md" in names and "LICENSE" in names
    (top,) = tmp_path.iterdir()
    out = tmp_path / "w"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(top)], check=True, capture_output=True, text=True)
    import zipfile
    (wheel,) = out.glob("replayquant-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"replayquant/docs/{d}" for d in DOCS} <= names
    assert "replayquant/data/kernels_h200.json" in names


@pytest.mark.slow
def test_installed_package_finds_its_docs_and_kernels_table(built, tmp_path):
    _, wheel = built
    target, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, text=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    docs = subprocess.run([sys.executable, "-m", "replayquant", "docs"], cwd=work, env=env,
                          capture_output=True, text=True, check=True).stdout.strip()
    assert Path(docs).is_dir() and Path(docs).is_relative_to(target)
    assert {p.name for p in Path(docs).glob("*.md")} >= set(DOCS)
    code = ("from replayquant.sweep.measured import load_kernels; "
            "print(load_kernels('h200')['provenance']['device'])")
    device = subprocess.run([sys.executable, "-c", code], cwd=work, env=env,
                            capture_output=True, text=True, check=True).stdout.strip()
    assert device == json.loads((ROOT / "results/bench/kernels.json").read_text())[
        "provenance"]["device"]


# ---------------------------------------------------------------- optional parts

def test_an_optional_part_without_its_extra_is_one_error_naming_the_extra(monkeypatch):
    from replayquant.cli import app
    from typer.testing import CliRunner
    monkeypatch.setitem(sys.modules, "lm_eval", None)          # lm-eval not installed
    for args in (["gpqa", "--model", "tiny-qwen3.5", "--pair", "s32_rs"],
                 ["gpqa", "--model", "m", "--pair", "s32_rs", "--model-args", "a=1"],
                 ["lm-eval", "--tasks", "x"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        assert "pip install 'replayquant[lm-eval]'" in r.output and "Traceback" not in r.output
    monkeypatch.delitem(sys.modules, "replayquant.gpqa.lm_eval_model", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'replayquant\[lm-eval\]'"):
        import replayquant.gpqa.lm_eval_model  # noqa: F401
    # the Triton kernels on a CPU: REPLAYQUANT_BACKEND=triton without triton installed
    import torch

    from replayquant.formats import use_triton
    from replayquant.options import check_backend
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for call in (check_backend, lambda: use_triton(torch.zeros(1))):
        with pytest.raises(ImportError, match=r"pip install 'replayquant\[triton\]'"):
            call()
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "auto")
    assert use_triton(torch.zeros(1)) is False          # the CPU's torch path needs no triton


def test_the_readme_demo_of_an_installed_package_is_make_demo():
    """The sweep and recommend lines the README gives an installed user run the Makefile's demo
    (model, pairs, buffer lengths, context, documents, budget), with the shipped kernel table."""
    import re
    import shlex
    make = (ROOT / "Makefile").read_text()

    def var(name):
        return re.search(rf"^{name}\s*:=\s*(.+)$", make, re.M).group(1).strip()
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("replayquant sweep --model"):]
    block = block[:block.index("```")].replace("\\\n", " ")
    sweep, recommend = (shlex.split(line) for line in block.strip().splitlines())
    assert " ".join(sweep[sweep.index("--model"):sweep.index("--buffer-len")]) == \
        f"--model {var('DEMO_MODEL')} {var('DEMO_PAIRS')}"
    i = sweep.index("--buffer-len")
    opts = dict(zip(sweep[i::2], sweep[i + 1::2]))
    assert opts["--buffer-len"] == var("DEMO_BUFFER_LEN") and opts["--kernels"] == "h200"
    assert (opts["--context"], opts["--docs"]) == (var("DEMO_CONTEXT"), var("DEMO_DOCS"))
    assert recommend[2] == opts["--out"] and recommend[-1] == var("DEMO_KL_BUDGET")


@pytest.mark.slow
def test_the_package_without_its_extras_runs_a_sweep(tmp_path):
    """Neither lm-eval nor Triton importable (the package installed alone, on a CPU build of
    torch): a sweep with the shipped kernel table and its recommendation run."""
    code = ("import sys; sys.modules['lm_eval'] = sys.modules['triton'] = None; "
            "from replayquant.cli import app; a = sys.argv[1:]; i = a.index('--then'); "
            "app(a[:i], standalone_mode=False); app(a[i + 1:], standalone_mode=False)")
    out = tmp_path / "s.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("REPLAYQUANT_BACKEND", None)
    args = ["sweep", "--model", "tiny-mamba2", "--pair", "tp4_hi32", "--buffer-len", "8",
            "--dataset", "heldout", "--context", "48", "--docs", "1", "--dtype", "float32",
            "--device-map", "cpu", "--kernels", "h200", "--no-progress", "--out", str(out),
            "--then", "recommend", str(out), "--kl-budget", "1"]
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "recommended" in r.stdout.lower(), r.stdout + r.stderr[-3000:]
    sw = json.loads(out.read_text())
    assert sw["complete"] and sw["variants"][0]["kernel"]["us_per_step"] > 0
