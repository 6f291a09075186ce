"""The run folder (see docs/ARCHITECTURE.md): its paths, the typed stage record in `stage.json`, reuse by
fingerprint, and what the orchestrator hands a stage.

    <output_root>/<run_name>/stages/00-base/stage.json           the base model's evaluation
    <output_root>/<run_name>/stages/NN-name/{model/, stage.json}  one folder per enabled stage, NN from 01
    .../stages/NN-name/candidates/<id>/{model/, stage.json}      a sweep's candidates (grid, soup, merge)
    <output_root>/<run_name>/kept/NN-name@<fingerprint>/          a finished stage another config replaced

This is the one module that names a file or folder inside the run folder (`tests/test_runfolder_paths.py`): the
run's own files (`RunPaths`), a stage's or candidate's folder (`model_dir`, `work_dir`, `samples_dir`, ...) and
what a stage prepares in it (`StageContext`'s paths). The files inside a checkpoint (`model/`) are its format's.

While the chain runs it holds a `RunState`: the records, manifest and per-problem scores it writes are kept in
memory as read back they would be, so that the gates, the sweep's statistics and the reports it builds after every
stage read no file of its own from disk again (`recall`; the disk stays the record for a resume and other processes).

`stage.json` is read and written here only (`StageRecord`); a field that is None is left out of the file. Its model
paths inside the run folder are stored relative to it (`stages/01-sft/model`) and resolved when read, so a moved run
folder resumes; a path outside it (the base model) is stored as given.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from pipeline import keys
from pipeline.errors import ConfigError
from pipeline.files import RunLock, atomic_dir, fence, fingerprint, move_dir, write_json, write_text

BASE = "00-base"
RECORD = "stage.json"
STAGES = "stages"  # the run folder's folder of stage folders
FINISHED = ("trained", "done")  # trained: its model is saved; done: scored too
MODEL_PATHS = ("input_model", "output_model")  # record fields stored relative to the run folder when inside it
CUTS = ("max_length", "max_prompt_length", "max_completion_length", "truncation_mode")  # how pairs are cut


T = TypeVar("T")


class RunState:
    """What the chain holds in memory of the files it writes into its run folder while it runs (`held`): each
    `stage.json` record, the manifest, each eval folder's per-problem scores, as parsed back they would be; the
    records, reports and statistics it builds after every stage parse none of them again. An entry stands for its
    file only while the file's bytes are the ones this process wrote (their sha256): every recall reads the file, so
    a file rewritten by another process or host, or removed, is never answered from memory (no inode, size or
    modification time is trusted: a network filesystem can answer those from an old cache)."""

    def __init__(self) -> None:
        self.files: dict[Path, tuple[str, Any]] = {}  # path -> (sha256 of the bytes written, their parsed content)

    @contextmanager
    def held(self) -> Iterator[RunState]:
        """Make this the state that records and scores are read through and written into, for the block."""
        _held.append(self)
        try:
            yield self
        finally:
            _held.remove(self)


_held: list[RunState] = []  # the held states, innermost last


def _read(path: Path) -> tuple[str, bytes] | None:
    """The sha256 and bytes of the file now at `path`; None when there is none."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    return hashlib.sha256(data).hexdigest(), data


def remember(path: Path, value: Any) -> None:
    """Right after this process wrote the file `path`: keep `value`, what parsing it back would give, in the held
    `RunState` (if any), with the digest of the bytes written."""
    found = _read(path) if _held else None
    if found is not None:
        _held[-1].files[Path(path)] = (found[0], value)


def recall(path: Path, parse: Callable[[str], T]) -> T | None:
    """`parse` of the text of the file `path`: what the held `RunState` keeps while the file's bytes are still the
    ones this process wrote, else parsed from them; None when it is absent or unreadable (`parse` raising
    ValueError)."""
    found = _read(path)
    if found is None:
        return None
    kept = _held[-1].files.get(Path(path)) if _held else None
    if kept is not None and kept[0] == found[0]:
        return kept[1]
    try:
        return parse(found[1].decode("utf-8"))
    except ValueError:  # UnicodeDecodeError included
        return None


def copy_kept(source: Path, dest: Path) -> None:
    """Copy the file `source` to `dest` (atomically); what the held `RunState` keeps of `source` while it is this
    process's file, it keeps of the copy too."""
    found = _read(source)
    if found is None:
        raise FileNotFoundError(source)
    kept = _held[-1].files.get(Path(source)) if _held else None
    write_text(dest, found[1].decode("utf-8"))
    if kept is not None and kept[0] == found[0]:
        remember(dest, kept[1])


def write_kept(path: Path, obj: Any) -> None:
    """Write `obj` as JSON to `path` (`files.write_json`) and keep it, as read back, in the held `RunState`."""
    write_json(path, obj)
    remember(path, json.loads(json.dumps(obj, default=str)))


def cache_dir(cfg: DictConfig) -> Path:
    """Where tokenised data and extensions' data and models are cached for this config."""
    return Path(cfg.cache_dir or Path(cfg.output_root) / ".cache")


def run_dir(cfg: DictConfig) -> Path:
    """`<output_root>/<run_name>`."""
    return Path(cfg.output_root) / cfg.run_name


@dataclass(frozen=True)
class RunPaths:
    """The files and folders at the top of the run folder `root` (`<output_root>/<run_name>`)."""

    root: Path

    @classmethod
    def of(cls, cfg: DictConfig) -> RunPaths:
        """The paths of the run folder of the config `cfg`."""
        return cls(run_dir(cfg))

    @property
    def stages(self) -> Path:
        """`stages/`: one folder per stage, `00-base` first; a folder without it is no run folder."""
        return Path(self.root) / STAGES

    @property
    def kept(self) -> Path:
        """`kept/`: finished (or interrupted) stages and candidates that a stage of another fingerprint replaced
        in `stages/` (`keep`), each restored where its fingerprint comes back (`restore`)."""
        return Path(self.root) / "kept"

    @property
    def log(self) -> Path:
        """`pipeline.log`: the pipeline's lines and the libraries' records."""
        return Path(self.root) / "pipeline.log"

    @property
    def resolved_config(self) -> Path:
        """`resolved.yaml`: the run's config as loaded, secrets redacted."""
        return Path(self.root) / "resolved.yaml"

    @property
    def manifest(self) -> Path:
        """`manifest.json`: the invocation, code version, hardware and data (`chain/manifest.py`)."""
        return Path(self.root) / "manifest.json"

    @property
    def eval_tasks(self) -> Path:
        """`eval_tasks/`: the lm-eval task files written for this run."""
        return Path(self.root) / "eval_tasks"

    @property
    def write_probe(self) -> Path:
        """`.write-test`: the file the start writes (under a temporary name) to check the folder is writable."""
        return Path(self.root) / ".write-test"

    @property
    def trackio(self) -> Path:
        """`trackio/`: trackio's database, unless `TRACKIO_DIR` says otherwise."""
        return Path(self.root) / "trackio"

    @property
    def mlruns(self) -> Path:
        """`mlruns/`: MLflow's file store, unless `MLFLOW_TRACKING_URI` says otherwise."""
        return Path(self.root) / "mlruns"

    @property
    def hub_revisions(self) -> Path:
        """`hub_revisions.json`: the commit each Hub branch or tag the run reads was pinned to (chain/revisions.py)."""
        return Path(self.root) / "hub_revisions.json"

    @property
    def hub_pushes(self) -> Path:
        """`hub_pushes.json`: what the run pushed to the Hub, per repository and revision (`report/hub.py`)."""
        return Path(self.root) / "hub_pushes.json"

    def outcome(self, candidate: tuple[str, int] | None = None) -> Path:
        """`outcome.json`, or `outcome-<stage>-candidate-<i>.json` for one sweep candidate (`chain/outcome.py`)."""
        name = "outcome.json" if candidate is None else f"outcome-{candidate[0]}-candidate-{candidate[1]}.json"
        return Path(self.root) / name

    def lock(self, candidate: tuple[str, int] | None = None) -> RunLock:
        """The run's lock (`RunLock`'s own file), or for one sweep candidate (`(stage, index)`: a Slurm array task
        sharing the folder) a lock of its own."""
        if candidate is None:
            return RunLock(self.root)
        return RunLock(self.root, f".lock-{candidate[0]}-candidate-{candidate[1]}")


def leaderboard_file(folder: Path, fmt: str) -> Path:
    """`leaderboard.<fmt>` (csv, json, md, html) in `folder`: the run folder, or the leaderboard command's `--out`."""
    return Path(folder) / f"leaderboard.{fmt}"


def stage_dir(root: Path, index: int, name: str) -> Path:
    """`stages/NN-name` of the run folder `root` (`index` counts enabled stages from 1)."""
    return Path(root) / STAGES / f"{index:02d}-{name}"


def base_dir(root: Path) -> Path:
    """`stages/00-base`: the base model's evaluation."""
    return Path(root) / STAGES / BASE


def candidate_dir(stage: Path, candidate: str) -> Path:
    """`candidates/<id>` of a sweep stage's folder."""
    return Path(stage) / "candidates" / candidate


def candidate_folders(stage: Path) -> list[Path]:
    """The folders of a sweep stage's candidates, in id order (empty for other stages)."""
    return sorted(c for c in (Path(stage) / "candidates").glob("*") if c.is_dir())


def model_dir(folder: Path) -> Path:
    """`model/` of a stage's or candidate's folder: its trained (or selected) checkpoint."""
    return Path(folder) / "model"


def work_dir(folder: Path) -> Path:
    """`work/` of a stage's or candidate's folder: the trainer's checkpoints, removed once the record says trained."""
    return Path(folder) / "work"


def checkpoint_dir(work: Path, step: int) -> Path:
    """`checkpoint-N` of a `work/` folder: the trainer's checkpoint at optimizer step `step`."""
    return Path(work) / f"checkpoint-{step}"


def checkpoints(work: Path) -> list[tuple[int, Path]]:
    """(step, folder) of each trainer checkpoint in a `work/` folder, oldest first."""
    return sorted((int(p.name.split("-")[1]), p) for p in Path(work).glob("checkpoint-*") if p.name[11:].isdigit())


def checkpointed(folder: Path) -> bool:
    """Whether the trainer saved a checkpoint in `folder`'s `work/`: what a resume of it would continue from."""
    return bool(checkpoints(work_dir(folder)))


def samples_dir(folder: Path) -> Path:
    """`eval/` of a stage's or candidate's folder: where scoring its model keeps the per-problem samples."""
    return Path(folder) / "eval"


def samples_file(scored: Path, task: str) -> Path:
    """`samples_<task>.jsonl` in the eval folder `scored` (`samples_dir`): lm-eval's per-problem rows of `task`."""
    return Path(scored) / f"samples_{task}.jsonl"


def logs_dir(folder: Path) -> Path:
    """`logs/` of a stage's or candidate's folder: TensorBoard's event files (they outlive `work/`)."""
    return Path(folder) / "logs"


def stale_children(folder: Path, keep_prepared: bool) -> list[Path]:
    """What a stage's folder holds that training it from scratch removes: all but its model, its candidates and
    its record; the data it prepared (pairs, samples) stays when `keep_prepared` (prepared for the same inputs)."""
    kept, redone = {"model", "candidates", RECORD}, {"work", "eval"}
    return sorted(c for c in Path(folder).iterdir() if c.name not in kept and (not keep_prepared or c.name in redone))


KEPT = (*FINISHED, "running")  # what `keep` moves aside rather than removing: a model, or checkpoints to resume


def kept_dir(root: Path, folder: Path, fingerprint: str) -> Path:
    """Where `keep` puts the stage or candidate `folder` of the run `root` that holds a record of `fingerprint`:
    `kept/NN-name@<fp>`, `kept/NN-name/candidates/<id>@<fp>` (its path under `stages/`)."""
    rel = Path(folder).relative_to(Path(root) / STAGES)
    return RunPaths(root).kept / rel.parent / f"{rel.name}@{fingerprint[:16]}"


def keep(root: Path, folder: Path) -> Path | None:
    """Move the stage or candidate `folder` of the run `root` to `kept/` (`kept_dir`) when its record is finished
    or interrupted (`KEPT`), so that another fingerprint can take its place and it can come back (`restore`), or
    when its record cannot be read (`@unreadable`: what it holds is not judged); return where it went, or None
    (nothing worth keeping: no record, or a stale one). Main process."""
    try:
        record = StageRecord.read(folder, strict=True)
    except ConfigError:
        name = "unreadable"
    else:
        if not (record.fingerprint and record.status in KEPT):
            return None
        name = record.fingerprint
    target = kept_dir(root, folder, name)
    while target.exists():  # the same fingerprint kept before: keep both
        target = target.with_name(f"{target.name}+")
    move_dir(folder, target)
    return target


def find_kept(root: Path, folder: Path, fingerprint: str) -> Path | None:
    """The kept folder (`keep`) whose record has `fingerprint` and would go back to `folder`: the stage or
    candidate `folder` itself kept, or, for a candidate, kept with its stage; None when there is none."""
    stage = Path(folder).relative_to(Path(root) / STAGES).parts
    kept = RunPaths(root).kept
    found = sorted(kept_dir(root, folder, fingerprint).parent.glob(f"{stage[-1]}@{fingerprint[:16]}*"))
    if len(stage) == 3:  # a candidate: NN-name/candidates/<id>, also kept inside its stage's folder
        found += sorted(kept.glob(f"{stage[0]}@*/candidates/{stage[2]}"))
    return next((f for f in found if StageRecord.read(f).fingerprint == fingerprint), None)


def restore(root: Path, folder: Path, kept: Path) -> None:
    """Put the kept folder `kept` (`find_kept`) back at `folder`, keeping what `folder` holds (`keep`); a stale
    or unrecorded `folder` is removed. A candidate kept inside its kept stage is copied out by hard links (its
    stage keeps it: files here are replaced, never written in place). Main process."""
    if folder.exists() and keep(root, folder) is None:
        shutil.rmtree(folder)
    where = Path(kept).relative_to(RunPaths(root).kept).parts
    if len(where) == 1 or "@" not in where[0]:  # not inside a kept stage
        move_dir(kept, folder)
        return
    with atomic_dir(folder) as tmp:
        shutil.copytree(kept, tmp, copy_function=os.link, dirs_exist_ok=True)


def run_root(folder: Path) -> Path | None:
    """The run folder holding a stage's or a sweep candidate's `folder` (the parent of its nearest `stages`
    folder), or None outside a run folder."""
    return next((p.parent for p in Path(folder).parents if p.name == STAGES), None)


def stage_label(folder: Path, root: Path) -> str | None:
    """`NN-stage` or `NN-stage/<candidate>` of a stage's or candidate's `folder` in the run folder `root` (both
    resolved); None when `folder` is not in its `stages/`."""
    stages = Path(root) / STAGES
    if not Path(folder).is_relative_to(stages):
        return None
    return "/".join(p for p in Path(folder).relative_to(stages).parts if p != "candidates")


def stored_path(path: str | Path, root: Path | None) -> str:
    """`path` as a record stores it: relative to the run folder `root` when inside it (`stages/01-sft/model`),
    else as given (a base model's own path or Hub id)."""
    if root is not None:
        full, top = os.path.abspath(path), os.path.abspath(root)
        if full.startswith(top + os.sep):
            return Path(os.path.relpath(full, top)).as_posix()
    return str(path)


def resolved_path(value: str, root: Path | None) -> str:
    """A stored model path as a usable one: a path relative to the run folder (`stages/...`) joined to `root`;
    anything else (an absolute path, a Hub id) as it is."""
    if root is None or os.path.isabs(value) or Path(value).parts[:1] != (STAGES,):
        return value
    return str(Path(root) / value)


def same_path(a: str | None, b: str | None) -> bool:
    """Whether two model paths (resolved, or as recorded by an older version) name the same place."""
    return a is not None and b is not None and os.path.abspath(a) == os.path.abspath(b)


def drop_work(folder: Path) -> None:
    """Remove a stage's or candidate's training checkpoints (`work/`) once its record says it is trained (main
    process; every rank calls this and waits)."""
    from pipeline.distributed import main_writes  # imports torch, which the dry run (paths only) does without

    with main_writes() as main:
        if main:
            shutil.rmtree(work_dir(folder), ignore_errors=True)


@dataclass
class StageRecord:
    """One `stage.json`: a stage, the base model's evaluation, or a sweep candidate."""

    stage: str | None = None  # stage kind (`base` for 00-base)
    index: int | None = None  # position among the enabled stages (0: base)
    candidate: str | None = None  # a sweep candidate's id
    fingerprint: str | None = None  # training fingerprint: config, data, everything upstream
    upstream: str | None = None  # the previous stage's fingerprint
    config: dict | None = None
    data: list | None = None  # data fingerprints
    input_model: str | None = None
    world_size: int | None = None
    status: str | None = None  # running | trained | done | stale (an earlier stage was retrained after it)
    redone: bool | None = None  # trained by a redo= request of the user (a requeue of it resumes, not redoes)
    prepared: str | None = None  # the key of the data the stage prepared in its folder (pairs, samples)
    output_model: str | None = None
    model_digest: str | None = None  # `keys.tree_digest` of its model/ when it was saved: checked before reuse
    metrics: dict | None = None  # training metrics
    wall_time_s: float | None = None
    eval: dict | None = None  # lm-eval result
    eval_fingerprint: str | None = None  # fingerprint + eval settings of that result
    gate: dict | None = None  # the gate's verdict
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as they were

    @classmethod
    def read(cls, folder: Path, strict: bool = False) -> StageRecord:
        """The record in `folder/stage.json`, its model paths resolved; an empty record when there is none. `strict`
        (where an empty record would mean training anew, over what is there): a file that cannot be read as a
        record is a ConfigError naming it and the ways out, never an empty record."""
        path = Path(folder) / RECORD
        raw = copy.deepcopy(recall(path, json.loads))
        if strict and path.exists() and not isinstance(raw, dict):
            raise ConfigError(f"{path} cannot be read as a stage record (not a JSON object); nothing was retrained "
                              "or deleted: restore it from a backup, or move it away to train that model again "
                              "(for a stage, redo=[<stage>] also retrains it and every stage after it)")
        raw = raw if isinstance(raw, dict) else {}
        known = {f.name for f in fields(cls)} - {"extra"}
        root = run_root(folder)
        for key in MODEL_PATHS:
            if isinstance(raw.get(key), str):
                raw[key] = resolved_path(raw[key], root)
        return cls(**{k: v for k, v in raw.items() if k in known}, extra={k: v for k, v in raw.items()
                                                                         if k not in known})

    def to_dict(self) -> dict:
        """The record as written to `stage.json` (None fields left out)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**{k: v for k, v in out.items() if v is not None}, **self.extra}

    def write(self, folder: Path, changed: bool = True) -> None:
        """Write `folder/stage.json` on the main process (atomically) when `changed` is true there; every rank
        calls this and waits."""
        from pipeline.distributed import main_writes  # imports torch, which the dry run (paths only) does without

        with main_writes() as main:
            if main and changed:
                fence(folder)  # a process that lost the run's lock writes no record
                out, root = self.to_dict(), run_root(folder)
                for key in MODEL_PATHS:
                    if out.get(key) is not None:
                        out[key] = stored_path(out[key], root)
                write_kept(Path(folder) / RECORD, out)

    def scores(self) -> dict:
        """The evaluation's metrics (empty when not evaluated)."""
        return (self.eval or {}).get("metrics", {})

    @property
    def kind(self) -> str | None:
        """The stage kind that trained it: its config's `kind` (a section such as `sft_long`), else its section's
        name (`stage`), which is the kind's own."""
        return (self.config or {}).get("kind") or self.stage

    @property
    def selected(self) -> str | None:
        """The id of the sweep candidate this stage selected (None: not a sweep)."""
        return (self.metrics or {}).get("selected")


def stage_folders(root: Path) -> list[Path]:
    """Every stage folder of the run `root` in chain order, `00-base` first."""
    return sorted(p for p in (Path(root) / STAGES).glob("*") if p.is_dir())


def candidates(stage: Path) -> dict[str, StageRecord]:
    """`{id: record}` of a sweep stage's candidates, in id order (empty for other stages)."""
    return {c.name: StageRecord.read(c) for c in candidate_folders(stage)}


def eval_dir(stage: Path) -> Path:
    """Where a stage's scored model kept its samples: `eval/`, or, when a sweep's selection was all the scoring
    (no `eval/` of the stage's own), the selected candidate's `eval/`."""
    selected, own = StageRecord.read(stage).selected, samples_dir(stage)
    return samples_dir(candidate_dir(stage, selected)) if selected and not own.is_dir() else own


def input_stage(stage: Path) -> Path | None:
    """The stage folder (in the same run, `00-base` included) whose output model is this stage's input."""
    stage = Path(stage)
    wanted = StageRecord.read(stage).input_model
    others = [p for p in stage_folders(stage.parent.parent) if p != stage]
    return next((p for p in others if same_path(wanted, StageRecord.read(p).output_model)), None)


@dataclass
class Trained:
    """What training a stage gives its record: the training metrics and, when the stage already scored its
    model (a sweep's selection), that evaluation and the settings the selected model was trained with."""

    metrics: dict
    eval: dict | None = None
    config: dict | None = None


def model_changed(record: StageRecord, folder: Path) -> str | None:
    """What is wrong when `folder`'s model/ is not the model its record says was saved there (its digest,
    `model_digest`, differs); None when it is the same, or the record holds no digest."""
    if not record.model_digest or not model_dir(folder).is_dir():
        return None
    now = keys.tree_digest(model_dir(folder))
    if now == record.model_digest:
        return None
    return (f"{model_dir(folder)} is not the model saved there (its files digest to {now[:16]}, the record says "
            f"{record.model_digest[:16]})")


def finished(record: StageRecord, folder: Path, fingerprint: str | None = None) -> bool:
    """Whether `folder` holds a saved model from a finished record (with this fingerprint, when given)."""
    same = fingerprint is None or record.fingerprint == fingerprint
    return record.status in FINISHED and same and model_dir(folder).is_dir()


def earlier_stage_model(stage: Path, name: str) -> Path | None:
    """The finished `model/` of the stage `name` in the same run (the latest if listed twice), or None."""
    found = sorted(p for p in Path(stage).parent.glob(f"*-{name}") if p != stage and model_dir(p).is_dir())
    return model_dir(found[-1]) if found else None


@dataclass
class StageContext:
    """What the orchestrator hands a stage: it trains `input_model` into `out_dir/model`."""

    cfg: DictConfig  # the whole run config
    name: str  # stage kind, also its config section
    input_model: Path  # checkpoint handed over by the previous stage (or the base model)
    stage_dir: Path  # stages/NN-name/: the stage's folder (caches shared by its candidates live here)
    out_dir: Path | None = None  # where model/ (and work/ for checkpoints) go; None: stage_dir
    overrides: dict[str, Any] = field(default_factory=dict)  # a sweep candidate's settings over the stage's

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir or self.stage_dir)

    def for_candidate(self, candidate: dict) -> StageContext:
        """The context of a sweep candidate (`{"id": ..., setting: value, ...}`): its own folder and settings."""
        return replace(self, out_dir=candidate_dir(self.stage_dir, candidate["id"]),
                       overrides={k: v for k, v in candidate.items() if k != "id"})

    @property
    def stage(self) -> DictConfig:
        """This stage's config section (with a candidate's overrides)."""
        section = self.cfg[self.name]
        return OmegaConf.merge(section, self.overrides) if self.overrides else section

    @property
    def model_dir(self) -> Path:
        """`model/` of `out_dir`: where the stage (or candidate) saves the model it trains."""
        return model_dir(self.out_dir)

    @property
    def work_dir(self) -> Path:
        """`work/` of `out_dir`: the trainer's checkpoints, removed once the record says trained."""
        return work_dir(self.out_dir)

    @property
    def pairs_dir(self) -> Path:
        """`pairs/` of the stage: its preference pairs as a dataset (prepared once for every candidate)."""
        return Path(self.stage_dir) / "pairs"

    @property
    def ref_pairs_dir(self) -> Path:
        """`pairs_ref/` of the stage: the pairs tokenised and cut with the reference model's log-probs; a candidate
        that sweeps how pairs are cut (`CUTS`) has its own, `pairs_ref-<key of its cut>/`."""
        cut = {k: v for k, v in self.overrides.items() if k in CUTS}
        return Path(self.stage_dir) / (f"pairs_ref-{fingerprint(cut)}" if cut else "pairs_ref")

    @property
    def reference_dir(self) -> Path:
        """`reference/` of the stage: the output folder of the trainer that computes the reference log-probs
        (it trains and keeps nothing; removed afterwards)."""
        return Path(self.stage_dir) / "reference"

    @property
    def on_policy_pairs(self) -> Path:
        """`on_policy_pairs.jsonl` of the stage: pairs sampled from the input model, one JSON object a line."""
        return Path(self.stage_dir) / "on_policy_pairs.jsonl"

    @property
    def on_policy_stats(self) -> Path:
        """`on_policy_stats.json` of the stage: what sampling the on-policy pairs found."""
        return Path(self.stage_dir) / "on_policy_stats.json"

    @property
    def value_model_dir(self) -> Path:
        """`value_model/` of `out_dir`: PPO's trained value model."""
        return Path(self.out_dir) / "value_model"

    @property
    def history_file(self) -> Path:
        """`history.json` of `out_dir`: PPO's per-update history."""
        return Path(self.out_dir) / "history.json"

    def updates_log(self, rank: int) -> Path:
        """`updates-rank<i>.jsonl` of `out_dir`: the PPO updates process `rank` logged."""
        return Path(self.out_dir) / f"updates-rank{rank}.jsonl"
