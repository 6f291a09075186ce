"""Experiment tracking and Hub pushes: the run's `report_to` / `push_to_hub` settings as trainer arguments.

`report_to` goes to transformers as is (tensorboard, wandb, trackio, mlflow, ... or "all"); each
trainer is named `<run_name>/<NN-stage>[/<candidate>]`. TensorBoard writes its event files under
the stage folder, `<stage>/[candidates/<id>/]logs/` (transformers' `TENSORBOARD_LOGGING_DIR`; the
trainer's own output folder is removed after training). The settings are read from the run's
`resolved.yaml`, the config of record, found above the trainer's output folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf


def run_root(work_dir: Path) -> Path | None:
    """The run folder holding `work_dir` (`<run>/stages/...`): the nearest parent with `resolved.yaml`."""
    return next((p for p in Path(work_dir).resolve().parents if (p / "resolved.yaml").is_file()), None)


def trainer_args(work_dir: Path) -> dict:
    """TrainingArguments fields for tracking and Hub pushes of the trainer writing to `work_dir`
    (`<run>/stages/<NN-stage>/[candidates/<id>/]work`); no tracking outside a run folder."""
    root = run_root(work_dir)
    if root is None:
        return {"report_to": "none"}
    cfg = OmegaConf.load(root / "resolved.yaml")
    out = Path(work_dir).resolve().parent  # the stage (or candidate) folder
    label = "/".join(p for p in out.relative_to(root / "stages").parts if p != "candidates")
    if "tensorboard" in cfg.report_to or "all" in cfg.report_to:
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(out / "logs")  # read when the trainer builds its callbacks
    args = {"report_to": list(cfg.report_to) or "none", "run_name": f"{cfg.run_name}/{label}"}
    if cfg.push_to_hub:
        repo = f"{cfg.hub_model_id}-{label.replace('/', '-')}" if cfg.hub_model_id else None
        args.update(push_to_hub=True, hub_model_id=repo)
    return args
