"""Publishing a run on the Hub (`push_to_hub=ORG/NAME`), once its chain has passed: the final model goes to the
repository's main branch, each stage's model to a branch named after the stage (`01-sft`, `02-dpo`, ..., as
SmolLM3 publishes its stages), and with `push_candidates=true` each sweep candidate's to `<NN-stage>-<id>`; each
with its model card (`report/modelcard.py`) as README.md.

`plan` lists these uploads as plain data (no network). `push` makes those the run folder has not pushed yet
(`hub_pushes.json`, by a key over the repository, branch, model and card; `push_again=true` pushes all again) through
`upload`, the one function that calls the Hub. Stages save full checkpoints (a LoRA adapter merged in,
`train.trainer.save_trained`), so each pushed model loads with `from_pretrained` alone. The Hub login is
huggingface_hub's own (HF_TOKEN or `hf auth login`): no token is passed or written here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from pipeline import preempt
from pipeline.files import fingerprint, read_json, write_json
from pipeline.report import modelcard
from pipeline.runfolder import RunPaths, StageRecord, candidate_folders, model_dir, stage_label, stored_path

log = logging.getLogger("pipeline")
CARD = "README.md"  # where a model repository keeps its card


@dataclass(frozen=True)
class Upload:
    """One commit: the files `files` (paths relative to the checkpoint folder `folder`) and the model card `card`
    as README.md, to branch `revision` of the model repository `repo`; `key` changes when any of it does."""

    repo: str
    revision: str
    folder: Path
    files: list[str]
    card: str
    message: str
    key: str

    @property
    def size(self) -> int:
        """The bytes it sends: its files and its card."""
        return sum((self.folder / f).stat().st_size for f in self.files) + len(self.card.encode())

    @property
    def target(self) -> str:
        """`repo@revision`: where it goes."""
        return f"{self.repo}@{self.revision}"


def _upload(cfg: DictConfig, folder: Path, revision: str, card: str, message: str) -> Upload:
    """The upload of the checkpoint of `folder` (a stage's or a candidate's) with the card `card`."""
    model = model_dir(folder)
    files = sorted(p.relative_to(model).as_posix() for p in model.rglob("*") if p.is_file())
    files = [f for f in files if f != CARD]  # the card goes as written for this branch
    key = fingerprint({"repo": cfg.push_to_hub, "revision": revision, "model": StageRecord.read(folder).fingerprint,
                       "files": {f: (model / f).stat().st_size for f in files}, "card": card})
    return Upload(cfg.push_to_hub, revision, model, files, card, message, key)


def plan(cfg: DictConfig, root: Path, stages: list[Path]) -> list[Upload]:
    """The uploads of the finished run `cfg` in `root` whose chain is `stages` (its stage folders, in order): per
    stage its sweep candidates' models (`push_candidates`) and its model, each to its branch; then the final
    model to main."""
    root = Path(root)
    folders = [f for s in stages for f in ([c for c in candidate_folders(s) if model_dir(c).is_dir()]
                                           if cfg.push_candidates else []) + [Path(s)]]
    out = []
    for folder in folders:
        label = stage_label(folder.resolve(), root.resolve())
        out.append(_upload(cfg, folder, modelcard.revision(label), modelcard.card(cfg, root, folder).content,
                           f"{cfg.run_name}: {label} (smol-pipeline, recipe {cfg.recipe})"))
    final = Path(stages[-1])
    out.append(_upload(cfg, final, "main", modelcard.card(cfg, root, final, main=True).content,
                       f"{cfg.run_name}: the final model, {final.name} (smol-pipeline, recipe {cfg.recipe})"))
    return out


def pending(uploads: list[Upload], pushed: dict, again: bool = False) -> list[Upload]:
    """The uploads of `uploads` that `pushed` (the run's `hub_pushes.json`) does not hold with the same key; all of
    them when `again`."""
    return [u for u in uploads if again or (pushed.get(u.target) or {}).get("key") != u.key]


def push(cfg: DictConfig, root: Path, stages: list[Path]) -> None:
    """Push what the run made (`plan`) and has not pushed yet, recording each commit in `hub_pushes.json` as it
    lands (main process; a rerun pushes only what is missing)."""
    record = RunPaths(root).hub_pushes
    pushed = read_json(record) or {}
    todo = pending(plan(cfg, root, stages), pushed, cfg.push_again)
    if not todo:
        log.info("%s: the run's models are on the Hub already (%s; push_again=true pushes them again)",
                 cfg.push_to_hub, record)
    push_uploads(todo, pushed, record, root)


def push_uploads(todo: list[Upload], pushed: dict, record: Path, root: Path) -> None:
    """Upload each of `todo`, recording it in `pushed` and its file `record` as it lands, with its size and time.
    Under a Slurm time limit (`preempt.job_time_left`), an upload that would not end before it at the slowest rate
    of this run's pushes so far is not started: the run stops as on a signal (exit 75), and the requeued job pushes
    what is left."""
    for item in todo:
        size = item.size
        left, need = preempt.job_time_left(), upload_seconds(size, pushed)
        if left is not None and need is not None and left < need:
            preempt.stop(f"the job's time limit is nearer than a push ({max(left, 0):.0f} s left, {item.target} "
                         f"would take about {need:.0f} s)")
            preempt.check(f"before pushing {item.target}")
        log.info("pushing %s to %s, revision %s", stored_path(item.folder, root), item.repo, item.revision)
        t0 = time.monotonic()
        commit = upload(item)
        pushed[item.target] = {"key": item.key, "model": stored_path(item.folder, root), "commit": commit,
                               "bytes": size, "seconds": round(time.monotonic() - t0, 3)}
        write_json(record, pushed)
        log.info("pushed: %s", commit)


def upload_seconds(size: int, pushed: dict) -> float | None:
    """About how long sending `size` bytes takes at the slowest rate of the pushes in `pushed` (`hub_pushes.json`);
    None before any was timed."""
    rates = [p["bytes"] / p["seconds"] for p in pushed.values() if p.get("bytes") and p.get("seconds")]
    return size / min(rates) if rates else None


def upload(item: Upload) -> str:
    """Commit `item` to the Hub: the repository and the branch are made when missing (a new branch starts from
    main), the files the branch holds that the model does not are deleted; return the commit's URL. The one
    function that reaches the network (not tested here: huggingface_hub has no local stand-in of the Hub)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    api = HfApi()
    api.create_repo(item.repo, exist_ok=True)
    if item.revision != "main":
        api.create_branch(item.repo, branch=item.revision, exist_ok=True)
    keep = {*item.files, CARD, ".gitattributes"}
    stale = [f for f in api.list_repo_files(item.repo, revision=item.revision) if f not in keep]
    operations = [*(CommitOperationAdd(f, item.folder / f) for f in item.files),
                  CommitOperationAdd(CARD, item.card.encode()), *(CommitOperationDelete(f) for f in stale)]
    return api.create_commit(item.repo, operations, commit_message=item.message, revision=item.revision).commit_url
