"""The manifest's code version: a git commit only where the package is its checkout's own, else the version."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from pathlib import Path

from conftest import missing

from pipeline.chain import manifest


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_a_commit_is_named_only_for_the_packages_own_checkout(tmp_path, monkeypatch):
    if shutil.which("git") is None:
        missing("git is not installed")
    repo = tmp_path / "project"
    installed = repo / ".venv/lib/python3/site-packages/pipeline"  # a virtual environment inside a project's repo
    installed.mkdir(parents=True)
    _git(repo, "init", "-q")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "start")
    version = importlib.metadata.version("smol-pipeline")

    monkeypatch.setattr(manifest, "PACKAGE", installed)
    assert manifest.code_version() == {"version": version, "path": str(installed), "git_commit": None,
                                       "git_dirty": None}  # not the project's commit

    monkeypatch.setattr(manifest, "PACKAGE", repo / "pipeline")
    (repo / "pipeline").mkdir()
    (repo / "pipeline/run.py").write_text("")  # uncommitted
    assert manifest.code_version() == {"version": version, "path": str(repo / "pipeline"),
                                       "git_commit": _git(repo, "rev-parse", "HEAD"), "git_dirty": True}
