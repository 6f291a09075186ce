"""Experiment tracking: `report_to` reaches transformers with run and stage names; TensorBoard logs land in the run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import FAST, ROOT, missing, run_cli
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipeline.config import load_config
from pipeline.run import main
from pipeline.stages.sft import sft_args
from pipeline.train.tracking import trainer_args
from pipeline.validate import TRACKERS

TRACKER_DIRS = ("TENSORBOARD_LOGGING_DIR", "TRACKIO_DIR", "WANDB_DIR", "MLFLOW_TRACKING_URI")


@pytest.fixture
def installed(monkeypatch):
    """`installed(*modules, hidden=(...))`: those modules are found as if installed (the trackers' packages need not
    be), the hidden ones not found; the trackers' directory variables are unset; all restored after the test."""
    real = importlib.util.find_spec
    for name in TRACKER_DIRS:
        monkeypatch.setenv(name, "x")  # recorded, so that the test's own value is undone afterwards
        monkeypatch.delenv(name)

    def fake(*modules: str, hidden: tuple[str, ...] = ()) -> None:
        def find_spec(name: str, *args: object) -> object:
            return object() if name in modules else None if name in hidden else real(name, *args)
        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return fake


def test_trainer_args_name_the_stage_and_no_trainer_pushes(tmp_path, installed):
    installed("wandb", "trackio")
    cfg = load_config(["recipe=tiny", f"output_root={tmp_path}", "run_name=exp1", "report_to=[wandb,trackio]",
                       "push_to_hub=me/smol", "stages=[sft,dpo]", "sft.push_to_hub=true"])
    work = tmp_path / "exp1/stages/03-dpo/candidates/beta0.1-lr1e-05/work"
    assert trainer_args(cfg, work) == {"report_to": ["wandb", "trackio"], "run_name": "exp1/03-dpo/beta0.1-lr1e-05"}
    assert trainer_args(cfg, tmp_path / "elsewhere" / "work") == {"report_to": "none"}  # not in the run's folder
    assert trainer_args(None, work) == {"report_to": "none"}  # no run (a benchmark's own trainer)
    # TRL's own push_to_hub in a stage is ignored (a warning says so): the run pushes at its end (report/hub.py)
    assert not sft_args(cfg.sft, work, cfg.seed, "fp32", cfg).push_to_hub


def test_tracker_files_go_into_the_run_folder(tmp_path, installed):
    installed("wandb", "trackio", "mlflow")
    cfg = load_config(["recipe=tiny", f"output_root={tmp_path}", "report_to=[tensorboard,trackio,wandb,mlflow]"])
    run = tmp_path / "tiny"
    assert trainer_args(cfg, run / "stages/02-sft/work")["report_to"] == ["tensorboard", "trackio", "wandb", "mlflow"]
    assert os.environ["TENSORBOARD_LOGGING_DIR"] == str(run.resolve() / "stages/02-sft/logs")
    assert os.environ["TRACKIO_DIR"] == str(run.resolve() / "trackio")  # trackio's database: <run>/trackio/
    assert os.environ["WANDB_DIR"] == str(run.resolve())  # W&B writes <run>/wandb/
    assert os.environ["MLFLOW_TRACKING_URI"] == (run.resolve() / "mlruns").as_uri()  # not ./mlruns


def test_a_tracker_set_elsewhere_keeps_its_folder(tmp_path, installed, monkeypatch):
    installed("trackio")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "shared"))
    cfg = load_config(["recipe=tiny", f"output_root={tmp_path}", "report_to=[trackio]"])
    trainer_args(cfg, tmp_path / "tiny/stages/02-sft/work")
    assert os.environ["TRACKIO_DIR"] == str(tmp_path / "shared") and "TENSORBOARD_LOGGING_DIR" not in os.environ


@pytest.mark.parametrize(("tracker", "package"), [("tensorboard", "tensorboard"), ("wandb", "wandb"),
                                                  ("trackio", "trackio"), ("mlflow", "mlflow"),
                                                  ("comet_ml", "comet-ml"), ("dagshub", "mlflow")])
def test_a_tracker_whose_package_is_missing_exits_2_before_anything_runs(tracker, package, tmp_path, capsys,
                                                                        installed):
    # dagshub installed without mlflow, which it needs too; every other tracker's package missing
    installed("dagshub", hidden=("tensorboard", "tensorboardX", "wandb", "trackio", "mlflow", "comet_ml"))
    assert main([f"output_root={tmp_path}", f"report_to=[{tracker}]"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: report_to lists {tracker}, but the {package} package is "
                                                    f"not installed: pip install {package}"]
    assert not list(tmp_path.iterdir())  # refused before the run folder is made


@pytest.mark.slow
def test_smol_pipeline_refuses_a_missing_tracker_in_one_line(tmp_path):
    """Through the real command (the launcher checks the config before it launches), with a tracker whose package
    this environment really lacks."""
    absent = next((name for name, needs in TRACKERS.items() if not all(
        any(importlib.util.find_spec(m) for m in modules.split("|")) for modules, _ in needs)), None)
    if absent is None:
        missing("every tracker's package is installed")
    proc = subprocess.run([sys.executable, "-m", "pipeline.launch", f"output_root={tmp_path}", f"report_to=[{absent}]"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: report_to lists {absent}, but the ") and "pip install " in line
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_tensorboard_events_are_written_under_the_stage_and_read_back(tmp_path, cache_dir):
    proc = run_cli("recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *FAST, "stages=[sft]",
                   "run_name=tracked", "report_to=[tensorboard]", "sft.max_steps=10", "sft.logging_steps=2",
                   "eval.tasks=[]", "sft.gate.metric=")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stage = tmp_path / "tracked/stages/01-sft"
    assert list((stage / "logs").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(stage / "logs"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    recorded = json.loads((stage / "stage.json").read_text())["metrics"]["losses"]  # the trainer's own history
    assert [s for s, _ in logged] == [s for s, _ in recorded] == [1, 2, 4, 6, 8, 10]
    assert [v for _, v in logged] == pytest.approx([v for _, v in recorded], rel=1e-5)
    (args,) = events.Tensors("args/text_summary")
    assert '"run_name": "tracked/01-sft"' in args.tensor_proto.string_val[0].decode()
