"""Resume by fingerprint: what to do with each stage of a run folder (reuse, evaluate, resume or train).

A stage is reused when its `stage.json` says done with the same fingerprint (its config, its data, and
everything upstream). A finished stage whose fingerprint changed is an error unless the user asks to
redo it; redoing a stage redoes every stage after it, from scratch (an interrupted one's checkpoints came from
the model being replaced). Every rank decides the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.chain.basemodel import base_settings
from pipeline.config import ConfigError, EvalConfig, ModelConfig, fingerprint_view, stage_section
from pipeline.data import mixtures as data
from pipeline.evaluation import lmeval as evaluate
from pipeline.files import fingerprint
from pipeline.runfolder import StageRecord, finished, stage_dir


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


def base_fingerprint(cfg: DictConfig) -> str:
    """The base model's fingerprint: its settings (and a built model's settings)."""
    model = fingerprint_view(OmegaConf.to_container(cfg.model), ModelConfig)
    return fingerprint({"model": model, "built": base_settings(cfg)})


def eval_fingerprint(upstream: str, ev: dict) -> str | None:
    """The fingerprint of scoring the checkpoint `upstream` with eval settings `ev`; None without tasks."""
    return fingerprint({"checkpoint": upstream, "eval": fingerprint_view(ev, EvalConfig)}) if ev["tasks"] else None


def _changes(old: dict, new: dict, prefix: str) -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changes(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def _refuse_changed(decision: StageDecision, record: StageRecord, config: dict) -> ConfigError:
    name = decision.name
    changed = _changes(record.config or {}, config, f"{name}.")
    if record.data != decision.data:
        changed.append("its data")
    if record.upstream != decision.upstream:
        changed.append("its input model")
    return ConfigError(f"stage {decision.dir.name} already finished with a different config ({'; '.join(changed)}); "
                       f"to retrain it and every stage after it add redo=[{name}], or use a new run_name")


def _action(decision: StageDecision, record: StageRecord, redo: bool, forced: bool, config: dict) -> str:
    """`redo`: the user asks to retrain this stage; `forced`: an earlier stage trains in this run."""
    if finished(record, decision.dir) and not (redo or forced):
        if record.fingerprint != decision.fingerprint:
            raise _refuse_changed(decision, record, config)
        done = record.status == "done" and record.eval_fingerprint == decision.eval_fingerprint
        return "reuse" if done else "evaluate"
    resumable = not forced and record.status == "running" and record.fingerprint == decision.fingerprint
    return "resume" if resumable else "train"


def decide(cfg: DictConfig, root: Path) -> list[StageDecision]:
    """Per enabled stage: reuse, re-evaluate, resume or train; refuse changed finished stages."""
    upstream, forced, out = base_fingerprint(cfg), False, []
    for i, name in enumerate([n for n in cfg.stages if cfg[n].enabled], 1):
        sources = [fp for mix in data.stage_mixtures(cfg, name) for fp in data.fingerprints(mix, cfg)]
        config = stage_section(cfg, name)
        fp = fingerprint({"kind": name, "config": config, "data": sources, "upstream": upstream, "seed": cfg.seed})
        decision = StageDecision(i, name, stage_dir(root, i, name), fp, upstream,
                                 eval_fingerprint(fp, evaluate.settings(cfg, name)), "", sources)
        decision.action = _action(decision, StageRecord.read(decision.dir), name in cfg.redo, forced, config)
        forced = forced or decision.action in ("train", "resume")
        out.append(decision)
        upstream = fp
    return out
