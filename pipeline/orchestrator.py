"""The stage chain: plan (resume by fingerprint), run each stage, hand its checkpoint to the next.

Run folder (see DESIGN.md): `resolved.yaml`, `manifest.json`, `pipeline.log` and
`stages/NN-name/{model/, stage.json}`. A stage is reused when its `stage.json` says done with the
same fingerprint (its config, its data, and everything upstream). A finished stage whose
fingerprint changed is an error unless the user asks to redo it; redoing a stage redoes every
stage after it. Every rank plans the same way; only the main process writes run files.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline import data, manifest
from pipeline.config import ConfigError, cache_dir, stage_section
from pipeline.files import fingerprint, read_json, write_json, write_text

log = logging.getLogger("pipeline")


@dataclass
class PlannedStage:
    index: int
    name: str
    dir: Path
    fingerprint: str
    action: str  # reuse | train | resume
    data: list[dict]


def run_dir(cfg: DictConfig) -> Path:
    """`<output_root>/<run_name>`."""
    return Path(cfg.output_root) / cfg.run_name


def setup_logging(path: Path | None, main: bool) -> None:
    """Log to stderr (main process: info, others: warnings) and, on the main process, to `path`."""
    log.handlers.clear()
    log.setLevel(logging.INFO if main else logging.WARNING)
    log.propagate = False
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if path is not None:
        handlers.append(logging.FileHandler(path, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(fmt)
        log.addHandler(handler)


def _base_fingerprint(cfg: DictConfig) -> str:
    model = OmegaConf.to_container(cfg.model)
    tiny = OmegaConf.to_container(cfg.tiny) if cfg.model.name_or_path == "tiny" else None
    return fingerprint({"model": model, "tiny": tiny})


def _changes(old: dict, new: dict, prefix: str) -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changes(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def plan(cfg: DictConfig, root: Path) -> list[PlannedStage]:
    """Decide per stage whether to reuse, resume or train; refuse changed finished stages."""
    upstream, forced, out = _base_fingerprint(cfg), False, []
    for i, name in enumerate(cfg.stages, 1):
        stage_dir = root / "stages" / f"{i:02d}-{name}"
        sources = data.fingerprints(cfg[name].mixture, cfg)
        config = stage_section(cfg, name)
        fp = fingerprint({"kind": name, "config": config, "data": sources, "upstream": upstream, "seed": cfg.seed})
        prev = read_json(stage_dir / "stage.json") or {}
        done = prev.get("status") == "done" and (stage_dir / "model").is_dir()
        redo = forced or name in cfg.redo
        if done and prev.get("fingerprint") == fp and not redo:
            action = "reuse"
        elif done and not redo:
            changed = _changes(prev.get("config", {}), config, f"{name}.")
            if prev.get("data") != sources:
                changed.append("its data")
            if prev.get("upstream") != upstream:
                changed.append("its input model")
            raise ConfigError(
                f"stage {stage_dir.name} already finished with a different config ({'; '.join(changed)}); "
                f"to retrain it and every stage after it add redo=[{name}], or use a new run_name")
        else:
            action = "resume" if prev.get("status") == "running" and prev.get("fingerprint") == fp else "train"
            forced = True
        out.append(PlannedStage(i, name, stage_dir, fp, action, sources))
        upstream = fp
    return out


def _base_model(cfg: DictConfig) -> str | Path:
    if cfg.model.name_or_path != "tiny":
        return cfg.model.name_or_path
    from pipeline import tiny

    return tiny.ensure_base_model(cache_dir(cfg), cfg.tiny, cfg.model, cfg.seed)


def run_pipeline(cfg: DictConfig, argv: list[str]) -> int:
    """Run the configured chain; return the exit code (0 when every stage finished)."""
    import torch
    from accelerate import PartialState

    from pipeline.stage import StageContext
    from pipeline.stages import STAGES

    if not torch.cuda.is_available():  # accelerate launch pins CPU runs to 1 thread; share the cores instead
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    state = PartialState(cpu=not torch.cuda.is_available())
    root = run_dir(cfg)
    main = state.is_main_process
    if main:
        root.mkdir(parents=True, exist_ok=True)
    state.wait_for_everyone()
    setup_logging(root / "pipeline.log" if main else None, main)
    started = time.time()
    stages = plan(cfg, root)
    if main:
        write_text(root / "resolved.yaml", OmegaConf.to_yaml(cfg))
        write_json(root / "manifest.json", manifest.build(cfg, argv, {s.name: s.data for s in stages}, root))
    log.info("run %s: recipe %s, %d stage(s), world size %d", root, cfg.recipe, len(stages), state.num_processes)
    model: str | Path | None = None  # the base model is resolved only if a stage trains
    upstream = _base_fingerprint(cfg)
    for s in stages:
        label = f"stage {s.index}/{len(stages)} {s.name}"
        if s.action == "reuse":
            log.info("%s: reusing finished stage %s (fingerprint %s)", label, s.dir, s.fingerprint)
        else:
            model = model or _base_model(cfg)
            log.info("%s: %s from %s", label, "resuming" if s.action == "resume" else "training", model)
            t0 = time.time()
            record = {"stage": s.name, "index": s.index, "fingerprint": s.fingerprint, "upstream": upstream,
                      "config": stage_section(cfg, s.name), "data": s.data, "input_model": str(model),
                      "world_size": state.num_processes}
            if main:
                if s.action == "train":
                    shutil.rmtree(s.dir, ignore_errors=True)
                write_json(s.dir / "stage.json", {**record, "status": "running"})
            state.wait_for_everyone()
            metrics = STAGES[s.name](StageContext(cfg, s.name, model, s.dir))
            record.update(status="done", output_model=str(s.dir / "model"), metrics=metrics,
                          wall_time_s=round(time.time() - t0, 2))
            if main:
                write_json(s.dir / "stage.json", record)
            state.wait_for_everyone()
            log.info("%s: done in %.1f s, loss %.4f -> %.4f over %d steps", label, time.time() - t0,
                     metrics["loss_first"] or float("nan"), metrics["loss_last"] or float("nan"), metrics["steps"])
        model, upstream = s.dir / "model", s.fingerprint
    log.info("run finished in %.1f s; final model: %s", time.time() - started, model)
    return 0
