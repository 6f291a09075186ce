"""Scores reused across runs: a checkpoint's evaluation kept in the cache, keyed by what decides it.

The key (`pipeline.keys`' rule) hashes the checkpoint's files by their paths inside it and their bytes (weights,
config, tokenizer; not its model card), the contents of the task files the run wrote (`<run>/eval_tasks/`) and of
`eval.include_path`, with the data files they name, the eval settings, the model loader's settings and the versions
of lm-eval, torch, transformers, tokenizers (and vLLM for its backend). Where the model lies (a Hub snapshot, a
folder under `.cache`) is in no key. Any run or sweep candidate that scores the same weights on the same tasks the
same way gets the kept result and per-problem samples instead of a new evaluation (the base model's, every rerun of
a candidate, two recipes that share a stage), which the run's log says. An entry holds the digest of the model it
scored, compared before it is used: a mismatch, or an entry that cannot be read, is scored anew, with a warning. A
Hub model is keyed by the files of its cached snapshot; one that is not in the local Hub cache is scored without
reuse. Entries live in `<cache_dir>/scores/<key>/`; delete that folder to score everything anew.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline import keys
from pipeline.evaluation import lmeval, stats
from pipeline.files import publish_dir, temp_name, write_text
from pipeline.runfolder import cache_dir, remember, samples_file

RESULT = "result.json"
log = logging.getLogger("pipeline")


def _model_folder(model: str | Path) -> Path | None:
    """The local folder of `model`: itself, or the cached snapshot of a Hub id; None when neither is on disk."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, not a repo id: no reuse, the scoring itself says what is wrong
        return None


def score_key(model: str | Path, ev: dict, tasks_dir: Path, model_cfg: Any) -> tuple[str, str] | None:
    """The cache key of scoring `model` with `ev` on the task files of `tasks_dir`, and the model's digest
    (`keys.tree_digest` of its folder); None without local files."""
    folder = _model_folder(model)
    if folder is None:
        return None
    digest = keys.tree_digest(folder)
    loader = OmegaConf.to_container(model_cfg) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    loader = {k: v for k, v in loader.items() if k not in ("name_or_path", "tokenizer", "chat_template", "revision")}
    return keys.key({"model": digest, "loader": loader, **lmeval.scoring_inputs(ev, tasks_dir)}), digest


def _load(entry: Path, digest: str) -> tuple[dict | None, str | None]:
    """(the result kept in `entry` with its samples' texts, None) when it is there, readable and of the model with
    `digest`; else (None, why it cannot be used; None when there is no entry)."""
    if not (entry / RESULT).is_file():
        return None, None
    try:
        result = json.loads((entry / RESULT).read_text())
        texts = {task: samples_file(entry, task).read_text() for task in result["samples"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"cannot be read ({err})"
    if result.get("model_digest") != digest:
        return None, f"are of another model (digest {result.get('model_digest')}, this one's {digest})"
    return {**result, "texts": texts}, None


def _kept(entry: Path, digest: str) -> dict | None:
    """The result kept in `entry` (`_load`); a bad or mismatched entry is logged: the model is scored anew."""
    kept, why = _load(entry, digest)
    if why:
        log.warning("kept scores %s %s: scoring anew", entry, why)
    return kept


def run_eval(model: str | Path, ev: dict, tasks_dir: Path, out_dir: Path, cfg: DictConfig) -> dict:
    """`lmeval.run_eval` of `model`, or the result kept for the same key and model digest (its samples written
    into `out_dir`; the result's `reused` names the cache entry)."""
    found = score_key(model, ev, tasks_dir, cfg.model)
    entry, digest = (cache_dir(cfg) / "scores" / found[0], found[1]) if found else (None, None)
    kept = _kept(entry, digest) if entry is not None else None
    if kept is not None:
        for task, text in kept.pop("texts").items():
            write_text(samples_file(out_dir, task), text)
            remember(samples_file(out_dir, task), stats.problem_scores(text))
        return {**kept, "reused": str(entry)}
    result = {**lmeval.run_eval(model, ev, tasks_dir, out_dir, cfg.model), "model_digest": digest}
    if entry is not None:
        _keep(entry, result, out_dir)
    return result


def _keep(entry: Path, result: dict, out_dir: Path) -> None:
    """Store `result` and its samples under `entry`, whole or not at all (built aside, synced, then renamed,
    `files.publish_dir`); an unreadable entry of the same key is replaced."""
    aside = temp_name(entry)
    aside.mkdir(parents=True)
    for task in result["samples"]:
        shutil.copyfile(samples_file(out_dir, task), samples_file(aside, task))
    write_text(aside / RESULT, json.dumps(result, default=str))
    if entry.is_dir() and _load(entry, result["model_digest"])[0] is None:
        shutil.rmtree(entry, ignore_errors=True)  # unreadable or another model's: what this process scored replaces it
    publish_dir(aside, entry)  # another process that kept the same scores first wins
