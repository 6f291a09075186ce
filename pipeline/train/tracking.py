"""Experiment tracking: the run's `report_to` setting as trainer arguments.

`report_to` goes to transformers as is (tensorboard, wandb, trackio, mlflow, ... or "all"; the config loader
checks each one's package is installed); each trainer is named `<run_name>/<NN-stage>[/<candidate>]`. The
trackers' local files stay in the run folder: TensorBoard's event files under the stage folder,
`<stage>/[candidates/<id>/]logs/` (transformers' `TENSORBOARD_LOGGING_DIR`; the trainer's own output folder is
removed after training), trackio's database in `<run>/trackio/`, W&B's offline files in `<run>/wandb/` and
MLflow's file store in `<run>/mlruns/`, unless `TRACKIO_DIR` / `WANDB_DIR` / `MLFLOW_TRACKING_URI` say otherwise.
No trainer pushes to the Hub: the run pushes its models when it ends (`pipeline.report.hub`).
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig

from pipeline.runfolder import RunPaths, logs_dir, run_dir, stage_label


def trainer_args(cfg: DictConfig | None, work_dir: Path) -> dict:
    """TrainingArguments fields for tracking of the run `cfg`'s trainer writing to `work_dir`
    (`<run>/stages/<NN-stage>/[candidates/<id>/]work`); no tracking without a run or outside its folder."""
    root = run_dir(cfg).resolve() if cfg is not None else None
    out = Path(work_dir).resolve().parent  # the stage (or candidate) folder
    label = stage_label(out, root) if root is not None else None
    if label is None:
        return {"report_to": "none"}
    _local_dirs(list(cfg.report_to), root, out)
    return {"report_to": list(cfg.report_to) or "none", "run_name": f"{cfg.run_name}/{label}"}


def _local_dirs(trackers: list[str], root: Path, stage: Path) -> None:
    """Point the trackers' local files into the run folder `root` (TensorBoard's under `stage`), through the
    variables they read when the trainer builds its callbacks (trackio's when it is first imported)."""
    every = "all" in trackers
    if every or "tensorboard" in trackers:
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(logs_dir(stage))
    if every or "trackio" in trackers:
        os.environ.setdefault("TRACKIO_DIR", str(RunPaths(root).trackio))
    if every or "wandb" in trackers:
        os.environ.setdefault("WANDB_DIR", str(root))  # W&B writes <WANDB_DIR>/wandb/
    if every or "mlflow" in trackers:
        os.environ.setdefault("MLFLOW_TRACKING_URI", RunPaths(root).mlruns.as_uri())  # not ./mlruns where it started
