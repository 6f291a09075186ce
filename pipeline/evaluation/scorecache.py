"""Scores reused across runs: a checkpoint's evaluation kept in the cache, keyed by what decides it.

The key hashes the checkpoint's files (weights, config, tokenizer; not its model card), the task files the run
wrote (`<run>/eval_tasks/`), the eval settings, the model loader's settings and lm-eval's version. Any run or
sweep candidate that scores the same weights on the same tasks the same way gets the kept result and
per-problem samples instead of a new evaluation (the base model's, every rerun of a candidate, two recipes
that share a stage), which the run's log says. A Hub model is keyed by the files of its cached snapshot;
one that is not in the local Hub cache is scored without reuse. Entries live in `<cache_dir>/scores/<key>/`;
delete that folder to score everything anew.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.config import cache_dir
from pipeline.evaluation import lmeval, stats
from pipeline.files import fingerprint, temp_name, write_text
from pipeline.runfolder import remember, samples_file

RESULT = "result.json"
NOT_WEIGHTS = {"README.md"}  # the model card changes with the run, not the model


def _digest(files: list[Path], root: Path) -> str:
    """sha256 of the names (relative to `root`) and contents of `files`."""
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def _model_folder(model: str | Path) -> Path | None:
    """The local folder of `model`: itself, or the cached snapshot of a Hub id; None when neither is on disk."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, not a repo id: no reuse, the scoring itself says what is wrong
        return None


def score_key(model: str | Path, ev: dict, tasks_dir: Path, model_cfg: Any) -> str | None:
    """The cache key of scoring `model` with `ev` on the task files of `tasks_dir`; None without local files."""
    folder = _model_folder(model)
    if folder is None:
        return None
    weights = [p for p in folder.rglob("*") if p.is_file() and p.name not in NOT_WEIGHTS and ".cache" not in p.parts]
    tasks = [p for p in Path(tasks_dir).rglob("*") if p.is_file()]
    loader = OmegaConf.to_container(model_cfg) if isinstance(model_cfg, DictConfig) else model_cfg
    return fingerprint({"model": _digest(weights, folder), "tasks": _digest(tasks, Path(tasks_dir)), "eval": ev,
                        "loader": loader, "lm_eval": metadata.version("lm_eval")})


def run_eval(model: str | Path, ev: dict, tasks_dir: Path, out_dir: Path, cfg: DictConfig) -> dict:
    """`lmeval.run_eval` of `model`, or the result kept for the same key (its samples written into `out_dir`; the
    result's `reused` names the cache entry)."""
    key = score_key(model, ev, tasks_dir, cfg.model)
    entry = cache_dir(cfg) / "scores" / key if key else None
    if entry is not None and (entry / RESULT).is_file():
        result = json.loads((entry / RESULT).read_text())
        for task in result["samples"]:
            text = samples_file(entry, task).read_text()
            write_text(samples_file(out_dir, task), text)
            remember(samples_file(out_dir, task), stats.problem_scores(text))
        return {**result, "reused": str(entry)}
    result = lmeval.run_eval(model, ev, tasks_dir, out_dir, cfg.model)
    if entry is not None:
        _keep(entry, result, out_dir)
    return result


def _keep(entry: Path, result: dict, out_dir: Path) -> None:
    """Store `result` and its samples under `entry`, whole or not at all (built aside, then renamed)."""
    aside = temp_name(entry)
    aside.mkdir(parents=True)
    for task in result["samples"]:
        shutil.copyfile(samples_file(out_dir, task), samples_file(aside, task))
    (aside / RESULT).write_text(json.dumps(result, default=str))
    try:
        os.rename(aside, entry)
    except OSError:  # another process kept the same scores first
        shutil.rmtree(aside, ignore_errors=True)
