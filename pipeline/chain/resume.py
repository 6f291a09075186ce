"""Resume by fingerprint: what to do with each stage of a run folder (reuse, evaluate, resume or train).

A stage's fingerprint hashes what it trains (`fingerprints.training_view`: its settings without those a resume may
change, such as logging and saving cadence), its data, its seed and everything upstream. A finished stage with
the same fingerprint is reused, an interrupted one resumed from its last checkpoint. A finished or interrupted
stage whose fingerprint changed is refused, naming the changed settings, unless the user asks to redo it or a
stage before it, whatever changed it: an edit, or a stage inserted or moved before it (a stage that trains in
this run gives every stage after it a new input); nothing finished is discarded without that. Redoing a stage
redoes every stage after it, from scratch (an interrupted one's checkpoints came from the model being replaced).
A redo is carried out once: the stage's record remembers it (`redone`), so a requeue of the same command resumes
the redone stage instead of starting it again; a run without the redo forgets it. A finished or interrupted stage
that another fingerprint replaces is kept (`runfolder.keep`), and found again by its fingerprint when the chain comes
back to it (a reorder undone, a detour ended). Every rank decides the same way.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline import keys
from pipeline.chain.basemodel import base_settings
from pipeline.data import mixtures as data
from pipeline.data.chat import template_text
from pipeline.errors import ConfigError
from pipeline.evaluation import lmeval as evaluate
from pipeline.fingerprints import fingerprint_view, stage_section, training_view
from pipeline.grid import grid, sweeps, swept
from pipeline.runfolder import FINISHED, RunPaths, StageRecord, checkpointed, find_kept, finished, stage_dir
from pipeline.settings import EvalConfig, ModelConfig, enabled_stages

# settings that choose among a sweep's candidates (and the swept settings themselves): the data a stage prepares
# for every candidate (pairs, reference log-probs) does not depend on them
PER_CANDIDATE = ("sweep", "soup", "merge")


@dataclass
class StageDecision:
    """One enabled stage and what this run does with it."""

    index: int
    name: str
    dir: Path
    fingerprint: str  # training: config, data, everything upstream
    upstream: str  # the previous stage's fingerprint (or the base model's)
    eval_fingerprint: str | None  # training fingerprint + eval settings; None: not evaluated
    action: str  # reuse | evaluate | train | resume
    data: list[dict]
    inputs: str = ""  # what the stage starts from (kind, data, seed, upstream): sweep candidates key on it
    redo: bool = False  # this run retrains the stage because the user asked (redo=), once
    prepared: str = ""  # the key of the data the stage prepares in its folder (pairs, samples, reference log-probs)
    grid: list[dict] = field(default_factory=list)  # its sweep's candidates (`grid.grid`); empty: no sweep
    kept: Path | None = None  # a kept folder of this fingerprint (`runfolder.find_kept`) that goes back to `dir`


def _checkpoint(name: str, revision: str | None) -> dict:
    """A model or tokenizer `model.*` names, by what decides it: a local folder's contents, a Hub id's commit."""
    path = Path(name).expanduser()
    if path.is_dir():
        return {"local": keys.tree_digest(path)}
    return {"hub": name, "revision": keys.resolved(name, revision, "model")}  # the commit the run pinned


def base_fingerprint(cfg: DictConfig) -> str:
    """The base model's fingerprint: its loader settings, what it is (a local checkpoint's and tokenizer's
    contents, a Hub model's id and `model.revision`; a built model's settings) and its chat template's text; never
    a path."""
    model = fingerprint_view(OmegaConf.to_container(cfg.model), ModelConfig)
    built = base_settings(cfg)
    what = {k: v for k, v in model.items() if k not in ("name_or_path", "tokenizer", "chat_template")}
    if built is None:
        what["checkpoint"] = _checkpoint(cfg.model.name_or_path, cfg.model.revision)
    else:
        what["built"] = {"extension": cfg.model.name_or_path, "settings": built}
    if cfg.model.tokenizer:
        what["tokenizer"] = _checkpoint(cfg.model.tokenizer, None)
    if cfg.model.chat_template:
        what["chat_template"] = hashlib.sha256(template_text(cfg.model.chat_template).encode()).hexdigest()
    return keys.key({"base": what})


def eval_fingerprint(upstream: str, ev: dict, tasks_dir: Path) -> str | None:
    """The fingerprint of scoring the checkpoint `upstream` with eval settings `ev` on the tasks of `tasks_dir`
    (their contents, `eval.include_path`'s and the data they name, and the scoring libraries' versions:
    `lmeval.scoring_inputs`); None without tasks."""
    if not ev["tasks"]:
        return None
    inputs = evaluate.scoring_inputs(ev, tasks_dir)
    return keys.key({"checkpoint": upstream, **inputs, "eval": fingerprint_view(inputs["eval"], EvalConfig)})


def _changes(old: dict, new: dict, prefix: str) -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changes(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def _refuse_changed(decision: StageDecision, record: StageRecord, config: dict, schema: type) -> ConfigError:
    name = decision.name
    changed = _changes(training_view(record.config or {}, schema), training_view(config, schema), f"{name}.")
    if record.data != decision.data:
        changed.append("its data")
    if record.upstream != decision.upstream:
        changed.append("its input model")
    what = "; ".join(changed) or "its fingerprint was recorded by another version of the pipeline"
    state = "already finished" if record.status in FINISHED else "was interrupted (its checkpoints are kept)"
    return ConfigError(f"stage {decision.dir.name} {state} with a different config ({what}); settings a resume may "
                       f"change are marked in help=true; to retrain it and every stage after it add redo=[{name}] "
                       "(what they hold is kept in the run's kept/, and comes back when the chain does), or use a "
                       "new run_name")


def refuse_other_world(where: str, name: str, record: StageRecord, world_size: int | None, stage: Any) -> None:
    """Refuse (ConfigError) resuming the interrupted attempt `record` of `where` (stage `name`'s settings `stage`)
    on `world_size` ranks when it trained on another number: its global batch would change under it."""
    if world_size is None or record.world_size in (None, world_size):
        return
    rows = stage.per_device_train_batch_size * stage.gradient_accumulation_steps
    raise ConfigError(f"{where} was interrupted at world size {record.world_size} and this run has {world_size}: "
                      f"resuming it would change its global batch from {rows * record.world_size} to "
                      f"{rows * world_size} rows a step; run it again on {record.world_size} process(es), or add "
                      f"redo=[{name}] to train it anew on {world_size}")


def _action(decision: StageDecision, record: StageRecord, forced: bool, redone: bool, config: dict,
            schema: type) -> str:
    """`decision.redo`: the user asks to retrain this stage; `forced`: an earlier stage trains in this run;
    `redone`: an earlier stage is one the user asked to redo (which retrains every stage after it)."""
    if decision.redo:
        return "train"
    if finished(record, decision.kept or decision.dir) or record.status == "running":
        if record.fingerprint != decision.fingerprint and not (forced and redone):
            raise _refuse_changed(decision, record, config, schema)  # an edit, a reorder or an inserted stage
        if forced:
            return "train"  # its input is trained anew in this run (redone, or its model was missing)
        if record.status == "running":
            return "resume"
        done = record.status == "done" and record.eval_fingerprint == decision.eval_fingerprint
        return "reuse" if done else "evaluate"
    return "train"


def decide(cfg: DictConfig, root: Path, world_size: int | None = None) -> list[StageDecision]:
    """Per enabled stage: reuse, re-evaluate, resume or train; refuse changed finished stages, and a resume on
    another `world_size` than the interrupted attempt's (when given)."""
    upstream, forced, redone, out = base_fingerprint(cfg), False, False, []  # redone: an earlier stage redone now
    tasks_dir = RunPaths(root).eval_tasks
    for i, name in enumerate(enabled_stages(cfg), 1):
        sources = [fp for mix in data.stage_mixtures(cfg, name) for fp in data.fingerprints(mix, cfg)]
        config, schema = stage_section(cfg, name), OmegaConf.get_type(cfg[name])
        inputs = keys.key({"kind": name, "data": sources, "upstream": upstream, "seed": cfg.seed})
        trains = keys.by_contents(training_view(config, schema))  # a path setting: what it names
        fp = keys.key({"inputs": inputs, "config": trains})
        shared = {k: v for k, v in trains.items() if k not in (*PER_CANDIDATE, *swept(cfg[name]))}
        prepared = keys.key({"inputs": inputs, "config": shared})
        folder = stage_dir(root, i, name)
        record = StageRecord.read(folder, strict=not (redone or name in cfg.redo))  # else retrained
        kept = find_kept(root, folder, fp) if record.fingerprint != fp and name not in cfg.redo else None
        record = StageRecord.read(kept, strict=True) if kept else record
        redo = name in cfg.redo and not (record.redone and record.fingerprint == fp)  # a redo is carried out once
        decision = StageDecision(i, name, folder, fp, upstream,
                                 eval_fingerprint(fp, evaluate.settings(cfg, name), tasks_dir), "", sources, inputs,
                                 redo, prepared, grid(cfg[name]) if sweeps(cfg[name]) else [], kept)
        decision.action = _action(decision, record, forced, redone, config, schema)
        if decision.action == "resume" and not sweeps(cfg[name]) and checkpointed(kept or folder):
            refuse_other_world(f"stage {decision.dir.name}", name, record, world_size, cfg[name])
        forced = forced or decision.action in ("train", "resume")
        redone = redone or (name in cfg.redo and decision.action in ("train", "resume"))  # not once carried out
        out.append(decision)
        upstream = fp
    return out
