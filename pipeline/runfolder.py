"""The run folder (see docs/ARCHITECTURE.md): its paths, the typed stage record in `stage.json`, reuse by
fingerprint, and what the orchestrator hands a stage.

    <output_root>/<run_name>/stages/00-base/stage.json           the base model's evaluation
    <output_root>/<run_name>/stages/NN-name/{model/, stage.json}  one folder per enabled stage, NN from 01
    .../stages/NN-name/candidates/<id>/{model/, stage.json}      a sweep's candidates (grid, soup, merge)

`stage.json` is read and written here only (`StageRecord`); a field that is None is left out of the file. Its model
paths inside the run folder are stored relative to it (`stages/01-sft/model`) and resolved when read, so a moved run
folder resumes; a path outside it (the base model) is stored as given.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.files import read_json, write_json

BASE = "00-base"
RECORD = "stage.json"
FINISHED = ("trained", "done")  # trained: its model is saved; done: scored too
MODEL_PATHS = ("input_model", "output_model")  # record fields stored relative to the run folder when inside it


def run_dir(cfg: DictConfig) -> Path:
    """`<output_root>/<run_name>`."""
    return Path(cfg.output_root) / cfg.run_name


def stage_dir(root: Path, index: int, name: str) -> Path:
    """`stages/NN-name` of the run folder `root` (`index` counts enabled stages from 1)."""
    return Path(root) / "stages" / f"{index:02d}-{name}"


def base_dir(root: Path) -> Path:
    """`stages/00-base`: the base model's evaluation."""
    return Path(root) / "stages" / BASE


def candidate_dir(stage: Path, candidate: str) -> Path:
    """`candidates/<id>` of a sweep stage's folder."""
    return Path(stage) / "candidates" / candidate


def run_root(folder: Path) -> Path | None:
    """The run folder holding a stage's or a sweep candidate's `folder` (the parent of its nearest `stages`
    folder), or None outside a run folder."""
    return next((p.parent for p in Path(folder).parents if p.name == "stages"), None)


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
    if root is None or os.path.isabs(value) or Path(value).parts[:1] != ("stages",):
        return value
    return str(Path(root) / value)


def same_path(a: str | None, b: str | None) -> bool:
    """Whether two model paths (resolved, or as recorded by an older version) name the same place."""
    return a is not None and b is not None and os.path.abspath(a) == os.path.abspath(b)


def drop_work(folder: Path) -> None:
    """Remove a stage's or candidate's training checkpoints (`work/`) once its record says it is trained (main
    process; every rank calls this and waits)."""
    from pipeline.train.distributed import main_writes  # imports torch, which the dry run (paths only) does without

    with main_writes() as main:
        if main:
            shutil.rmtree(Path(folder) / "work", ignore_errors=True)


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
    metrics: dict | None = None  # training metrics
    wall_time_s: float | None = None
    eval: dict | None = None  # lm-eval result
    eval_fingerprint: str | None = None  # fingerprint + eval settings of that result
    gate: dict | None = None  # the gate's verdict
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as they were

    @classmethod
    def read(cls, folder: Path) -> StageRecord:
        """The record in `folder/stage.json`, its model paths resolved; an empty record when there is none."""
        raw = read_json(Path(folder) / RECORD) or {}
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
        from pipeline.train.distributed import main_writes  # imports torch, which the dry run (paths only) does without

        with main_writes() as main:
            if main and changed:
                out, root = self.to_dict(), run_root(folder)
                for key in MODEL_PATHS:
                    if out.get(key) is not None:
                        out[key] = stored_path(out[key], root)
                write_json(Path(folder) / RECORD, out)

    def scores(self) -> dict:
        """The evaluation's metrics (empty when not evaluated)."""
        return (self.eval or {}).get("metrics", {})

    @property
    def selected(self) -> str | None:
        """The id of the sweep candidate this stage selected (None: not a sweep)."""
        return (self.metrics or {}).get("selected")


def stage_folders(root: Path) -> list[Path]:
    """Every stage folder of the run `root` in chain order, `00-base` first."""
    return sorted(p for p in (Path(root) / "stages").glob("*") if p.is_dir())


def candidates(stage: Path) -> dict[str, StageRecord]:
    """`{id: record}` of a sweep stage's candidates, in id order (empty for other stages)."""
    return {c.name: StageRecord.read(c) for c in sorted((Path(stage) / "candidates").glob("*")) if c.is_dir()}


def eval_dir(stage: Path) -> Path:
    """Where a stage's scored model kept its samples: `eval/`, or, when a sweep's selection was all the scoring
    (no `eval/` of the stage's own), the selected candidate's `eval/`."""
    selected, own = StageRecord.read(stage).selected, Path(stage) / "eval"
    return candidate_dir(stage, selected) / "eval" if selected and not own.is_dir() else own


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


def finished(record: StageRecord, folder: Path, fingerprint: str | None = None) -> bool:
    """Whether `folder` holds a saved model from a finished record (with this fingerprint, when given)."""
    same = fingerprint is None or record.fingerprint == fingerprint
    return record.status in FINISHED and same and (Path(folder) / "model").is_dir()


def earlier_stage_model(stage: Path, name: str) -> Path | None:
    """The finished `model/` of the stage `name` in the same run (the latest if listed twice), or None."""
    found = sorted(p for p in Path(stage).parent.glob(f"*-{name}") if p != stage and (p / "model").is_dir())
    return found[-1] / "model" if found else None


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
