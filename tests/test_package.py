"""The installed package, not the checkout: a wheel carries its data and runs from any folder.

A wheel is built from this tree (no build isolation: the venv's setuptools, no network), its
contents are checked, and it is installed with `pip install --target` into an empty folder, which is
then the only place replayquant can be imported from (the checkout is not on the path and the
command runs from another folder). That is the install a `--user`, `--target` or PYTHONPATH user
has: data files outside the package would not be seen there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built from a copy of the files git tracks or would track (setuptools' build/lib in
    the checkout could hold modules deleted since, which would then ship in the wheel)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, files):
        if not os.path.lexists(ROOT / rel):          # deleted in the work tree, not yet committed
            continue
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel, follow_symlinks=False)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True)
    (whl,) = out.glob("replayquant-*.whl")
    return whl


@pytest.mark.slow
def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    pairs = sorted(p.stem for p in (ROOT / "configs" / "pairs").glob("*.yaml"))
    assert pairs, "configs/pairs/ holds no pair"
    for p in pairs:
        assert f"replayquant/configs/pairs/{p}.yaml" in names
    for t in (ROOT / "replayquant" / "gpqa" / "templates").glob("*.yaml"):
        assert f"replayquant/gpqa/templates/{t.name}" in names
    from replayquant.data import TINY_MODELS
    assert len(TINY_MODELS) == 3
    for model in TINY_MODELS:
        for f in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
            assert f"replayquant/assets/{model}/{f}" in names
    assert "replayquant/data/kjv_heldout.jsonl.gz" in names
    # nothing of the checkout but the package: no tests, evals or results in the wheel
    assert not [n for n in names if n.split("/")[0] in ("tests", "evals", "results", "configs")]


@pytest.mark.slow
def test_wheel_runs_from_another_folder(wheel, tmp_path):
    target, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True, capture_output=True, text=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REPLAYQUANT_GIT_COMMIT")}
    env["PYTHONPATH"] = str(target)

    def run(*code):
        return subprocess.run([sys.executable, "-c", "\n".join(code)], cwd=work, env=env,
                              capture_output=True, text=True, check=True).stdout

    out = json.loads(run(
        "import json, replayquant, replayquant.pairs as P, replayquant.gpqa.tasks as T",
        "from replayquant.provenance import git_commit",
        "print(json.dumps({'file': replayquant.__file__, 'pairs': P.list_pairs(),",
        "  'pair': P.PrecisionPair.load('tp4_hi16_sr').name,",
        "  'templates': sorted(t.name for t in T.templates_dir().iterdir()),",
        "  'commit': git_commit()}))"))
    assert out["file"].startswith(str(target))
    assert out["pairs"] == sorted(p.stem for p in (ROOT / "configs" / "pairs").glob("*.yaml"))
    assert out["pair"] == "tp4_hi16_sr"
    assert "gpqa_diamond_cot_zeroshot.yaml" in out["templates"]
    import replayquant
    assert out["commit"] == f"replayquant=={replayquant.__version__}"  # no checkout: the version

    table = subprocess.run([sys.executable, "-m", "replayquant", "pairs"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert "tp4_hi16_sr" in table and "s32_rs" in table


def test_git_commit_only_from_own_checkout(tmp_path):
    """A package copy inside another git repository records that repository's HEAD nowhere."""
    other = tmp_path / "other"
    site = other / ".venv" / "lib" / "site-packages"   # a project venv inside another repository
    (site / "replayquant").mkdir(parents=True)
    (other / "pyproject.toml").write_text("[project]\nname = 'other'\n")
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    subprocess.run(["git", "-C", str(other), "-c", "user.email=a@b", "-c", "user.name=a", "commit",
                    "-q", "--allow-empty", "-m", "x"], check=True)
    src = (ROOT / "replayquant" / "provenance.py").read_text()
    (site / "replayquant" / "__init__.py").write_text("__version__ = '9.9'\n")
    (site / "replayquant" / "provenance.py").write_text(src)
    code = "import sys; sys.path.insert(0, sys.argv[1]); from replayquant.provenance import git_commit; print(git_commit())"
    env = {k: v for k, v in os.environ.items() if k != "REPLAYQUANT_GIT_COMMIT"}
    got = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True,
                         check=True, env=env, cwd=tmp_path).stdout.strip()
    assert got == "replayquant==9.9"
    env["REPLAYQUANT_GIT_COMMIT"] = "abc123"
    got = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True,
                         check=True, env=env, cwd=tmp_path).stdout.strip()
    assert got == "abc123"


def test_git_commit_named_by_the_sender_wins_over_the_checkout(monkeypatch):
    """A tree copied to a GPU machine may carry git metadata older than its files: the commit its
    sender names (REPLAYQUANT_GIT_COMMIT) is the one recorded, also inside a checkout."""
    from replayquant.provenance import git_commit
    monkeypatch.setenv("REPLAYQUANT_GIT_COMMIT", "feedbeef")
    assert git_commit() == "feedbeef"
    monkeypatch.delenv("REPLAYQUANT_GIT_COMMIT")
    assert git_commit() != "feedbeef"
