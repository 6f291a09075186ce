"""Experiment tracking: `report_to` reaches transformers with run and stage names; TensorBoard logs land in the run."""

from __future__ import annotations

import json

import pytest
from conftest import FAST, run_cli
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipeline.config import load_config
from pipeline.train.tracking import trainer_args


def test_trainer_args_name_the_stage_and_pass_hub_settings_through(tmp_path):
    cfg = load_config(["recipe=tiny", f"output_root={tmp_path}", "run_name=exp1", "report_to=[wandb,trackio]",
                       "push_to_hub=true", "hub_model_id=me/smol"])
    work = tmp_path / "exp1/stages/03-dpo/candidates/beta0.1-lr1e-05/work"
    assert trainer_args(cfg, work) == {"report_to": ["wandb", "trackio"], "run_name": "exp1/03-dpo/beta0.1-lr1e-05",
                                       "push_to_hub": True, "hub_model_id": "me/smol-03-dpo-beta0.1-lr1e-05"}
    assert trainer_args(cfg, tmp_path / "elsewhere" / "work") == {"report_to": "none"}  # not in the run's folder
    assert trainer_args(None, work) == {"report_to": "none"}  # no run (a benchmark's own trainer)


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
