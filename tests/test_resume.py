"""Resume by fingerprint (`pipeline.chain.resume.decide`) on hand-built run folders: which stages are reused,
re-scored, resumed or retrained; and the run folder's record and model look-ups. No model is trained."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from pipeline.chain.resume import StageDecision, base_fingerprint, decide
from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.fingerprints import stage_section
from pipeline.runfolder import StageRecord, earlier_stage_model, find_kept, finished, keep

# the smol recipe: three enabled stages (sft, midtrain, dpo), a loaded base model and Hub data, so deciding
# reads no file and builds nothing
STAGES = ["sft", "midtrain", "dpo"]


def _decide(root: Path, *overrides: str) -> list[StageDecision]:
    return decide(load_config(["recipe=smol", f"output_root={root.parent}", *overrides]), root)


def _actions(root: Path, *overrides: str) -> list[str]:
    return [d.action for d in _decide(root, *overrides)]


@cache
def _smol_section(name: str) -> dict:
    return stage_section(load_config(["recipe=smol"]), name)


def _record(d: StageDecision, status: str = "done", model: bool = True, **fields) -> None:
    """Write the stage.json a finished (or interrupted) stage leaves, and a fake model/ when `model`."""
    scored = {"eval_fingerprint": d.eval_fingerprint, "eval": {"metrics": {"m": 0.5}}} if status == "done" else {}
    record = {"stage": d.name, "index": d.index, "fingerprint": d.fingerprint, "upstream": d.upstream,
              "config": _smol_section(d.name), "data": d.data, "status": status, **scored, **fields}
    StageRecord(**record).write(d.dir)
    if model:
        (d.dir / "model").mkdir(parents=True, exist_ok=True)


@pytest.fixture
def done(tmp_path: Path) -> Path:
    """A run folder in which every stage finished and was scored."""
    root = tmp_path / "smol"
    for d in _decide(root):
        _record(d)
    return root


def test_an_empty_run_folder_trains_every_stage_and_fingerprints_chain(tmp_path):
    root = tmp_path / "smol"
    decisions = _decide(root)
    assert [(d.index, d.name, d.action) for d in decisions] == [(1, "sft", "train"), (2, "midtrain", "train"),
                                                                 (3, "dpo", "train")]
    assert [d.dir for d in decisions] == [root / "stages" / f"0{i}-{n}" for i, n in enumerate(STAGES, 1)]
    cfg = load_config(["recipe=smol", f"output_root={tmp_path}"])
    assert [d.upstream for d in decisions] == [base_fingerprint(cfg), decisions[0].fingerprint,
                                               decisions[1].fingerprint]
    assert len({d.fingerprint for d in decisions} | {d.eval_fingerprint for d in decisions}) == 6
    assert [d.fingerprint for d in _decide(root)] == [d.fingerprint for d in decisions]  # the same every time


@pytest.mark.slow
def test_finished_stages_with_the_same_fingerprints_are_reused(done):
    assert _actions(done) == ["reuse", "reuse", "reuse"]


def test_a_changed_finished_stage_is_refused_with_what_changed(done):
    with pytest.raises(ConfigError) as err:
        _decide(done, "midtrain.learning_rate=3e-5")
    message = str(err.value)
    assert "stage 02-midtrain already finished with a different config" in message
    assert "midtrain.learning_rate: 2e-05 -> 3e-05" in message and "redo=[midtrain]" in message


@pytest.mark.slow
def test_a_change_upstream_changes_every_fingerprint_after_it(tmp_path):
    root = tmp_path / "smol"
    before = _decide(root)
    after = _decide(root, "sft.learning_rate=3e-5")
    assert all(a.fingerprint != b.fingerprint for a, b in zip(before, after, strict=True))
    assert [a.upstream == b.upstream for a, b in zip(before, after, strict=True)] == [True, False, False]
    last = _decide(root, "dpo.beta=0.2")  # the last stage: nothing after it to change
    assert [a.fingerprint == b.fingerprint for a, b in zip(before, last, strict=True)] == [True, True, False]
    reseeded = _decide(root, "seed=7")
    assert all(a.fingerprint != b.fingerprint for a, b in zip(before, reseeded, strict=True))


def test_a_change_upstream_of_finished_stages_is_refused_at_the_first_changed_stage(done):
    with pytest.raises(ConfigError, match=r"stage 01-sft already finished .*sft\.learning_rate"):
        _decide(done, "sft.learning_rate=3e-5")


def test_the_refusal_names_changed_data_and_input_model(done):
    sft = _decide(done)[0]
    _record(sft, fingerprint="0" * 16, upstream="1" * 16, data=[{"path": "old.jsonl", "sha256": "x"}])
    with pytest.raises(ConfigError) as err:
        _decide(done)
    assert "(its data; its input model)" in str(err.value)


def test_redo_retrains_the_stage_and_every_stage_after_it(done):
    assert _actions(done, "redo=[midtrain]") == ["reuse", "train", "train"]
    assert _actions(done, "sft.learning_rate=3e-5", "redo=[sft]") == ["train", "train", "train"]


@pytest.mark.slow
def test_an_interrupted_stage_resumes_and_the_stages_after_it_retrain(done):
    _record(_decide(done)[1], status="running", model=False)
    assert _actions(done) == ["reuse", "resume", "train"]


def test_an_interrupted_stage_with_another_fingerprint_is_refused_naming_the_change(tmp_path):
    """Its checkpoints are kept: only redo= retrains it (tests/test_reliability.py: the real run)."""
    root = tmp_path / "smol"
    _record(_decide(root)[0], status="running", model=False)
    with pytest.raises(ConfigError) as err:
        _decide(root, "sft.learning_rate=3e-5")
    assert "stage 01-sft was interrupted (its checkpoints are kept) with a different config" in str(err.value)
    assert "sft.learning_rate: 2e-05 -> 3e-05" in str(err.value) and "redo=[sft]" in str(err.value)
    assert _actions(root, "sft.learning_rate=3e-5", "redo=[sft]")[0] == "train"


RESUMABLE = ["sft.logging_steps=7", "sft.save_steps=15", "sft.nonfinite_limit=3", "sft.gradient_checkpointing=false",
             "sft.logging_first_step=false", "sft.dataloader_num_workers=2"]


@pytest.mark.slow
def test_settings_a_resume_may_change_leave_every_fingerprint_as_it_was(tmp_path):
    root = tmp_path / "smol"
    before = _decide(root)
    batch = load_config(["recipe=smol"]).sft
    traded = [f"sft.per_device_train_batch_size={batch.per_device_train_batch_size * 2}",
              f"sft.gradient_accumulation_steps={batch.gradient_accumulation_steps // 2}"]
    assert batch.gradient_accumulation_steps % 2 == 0
    after = _decide(root, *RESUMABLE, *traded)
    assert [d.fingerprint for d in after] == [d.fingerprint for d in before]
    doubled = _decide(root, f"sft.per_device_train_batch_size={batch.per_device_train_batch_size * 2}")
    assert doubled[0].fingerprint != before[0].fingerprint  # more samples per step: another training


def test_an_interrupted_stage_resumes_after_a_change_of_settings_a_resume_may_change(done):
    _record(_decide(done)[0], status="running", model=False)
    assert _actions(done, *RESUMABLE) == ["resume", "train", "train"]


def test_the_help_marks_the_settings_a_resume_may_change():
    from pipeline.describe import describe

    lines = {line.split("=")[0].strip(): line for line in describe(load_config(["recipe=smol"])).splitlines()}
    assert "[a resume may change it]" in lines["sft.save_steps"]
    assert "[a resume may change it]" not in lines["sft.learning_rate"]


@pytest.mark.slow
def test_a_redo_is_carried_out_once(done):
    """A requeue repeats the command line: the stage the redo retrained resumes (or is reused), not redone."""
    sft = _decide(done)[0]
    _record(sft, status="running", model=False, redone=True)
    assert _actions(done, "redo=[sft]") == ["resume", "train", "train"]
    _record(sft, redone=True)
    assert _actions(done, "redo=[sft]") == ["reuse", "reuse", "reuse"]
    _record(sft)  # a run without the redo forgot it: the same redo= again retrains
    assert _actions(done, "redo=[sft]") == ["train", "train", "train"]
    _record(sft, redone=True)  # redone with other settings than asked now: retrained again
    assert _actions(done, "redo=[sft]", "sft.learning_rate=3e-5") == ["train", "train", "train"]


@pytest.mark.slow
def test_a_stage_after_a_retrained_one_trains_afresh_even_if_interrupted(done):
    """Its checkpoints were trained from the model being replaced: resuming them would mix the two."""
    _record(_decide(done)[1], status="running", model=False)
    assert _actions(done, "redo=[sft]") == ["train", "train", "train"]
    assert _actions(done, "redo=[midtrain]") == ["reuse", "train", "train"]  # asked for: from scratch


@pytest.mark.slow
def test_a_kept_stage_comes_back_where_its_fingerprint_does(done):
    """A finished stage that another fingerprint replaced in its folder (`keep`) is found again by its
    fingerprint, and reused: a reorder undone, a detour ended."""
    third = _decide(done)[2]
    kept = keep(done, third.dir)
    assert kept == done / "kept" / f"03-dpo@{third.fingerprint[:16]}" and not third.dir.exists()
    _record(_decide(done, "dpo.beta=0.3")[2])  # the detour's dpo, in its place
    again = _decide(done)
    assert [d.action for d in again] == ["reuse", "reuse", "reuse"] and again[2].kept == kept
    assert find_kept(done, third.dir, "0" * 64) is None
    assert keep(done, done / "stages" / "04-none") is None  # nothing recorded: nothing to keep
    first = _decide(done)[0]
    (first.dir / "stage.json").write_text("{")  # unreadable: what it holds is not judged, so it is kept
    assert keep(done, first.dir) == done / "kept" / "01-sft@unreadable" and not first.dir.exists()


def test_a_trained_but_unscored_stage_is_scored_without_retraining_what_follows(done):
    _record(_decide(done)[0], status="trained")
    assert _actions(done) == ["evaluate", "reuse", "reuse"]


@pytest.mark.slow
def test_a_finished_stage_without_its_model_folder_retrains_with_every_stage_after_it(done):
    midtrain = _decide(done)[1]
    (midtrain.dir / "model").rmdir()
    for status in ("done", "trained"):
        _record(midtrain, status=status, model=False)
        assert _actions(done) == ["reuse", "train", "train"]


def test_changed_eval_settings_rescore_every_stage_without_retraining(done):
    before, after = _decide(done), _decide(done, "eval.max_gen_toks=256")
    assert [d.action for d in after] == ["evaluate", "evaluate", "evaluate"]
    assert [d.fingerprint for d in after] == [d.fingerprint for d in before]
    assert all(a.eval_fingerprint != b.eval_fingerprint for a, b in zip(before, after, strict=True))


def test_one_stage_s_eval_settings_rescore_that_stage_only(done):
    assert _actions(done, "midtrain.eval.tasks=[gsm8k_local_val]") == ["reuse", "evaluate", "reuse"]


def test_without_eval_tasks_a_stage_has_no_eval_fingerprint_and_is_reused(tmp_path):
    root = tmp_path / "smol"
    decisions = _decide(root, "eval.tasks=[]")
    assert [d.eval_fingerprint for d in decisions] == [None, None, None]
    for d in decisions:
        _record(d)
    assert _actions(root, "eval.tasks=[]") == ["reuse", "reuse", "reuse"]
    assert _actions(root) == ["evaluate", "evaluate", "evaluate"]  # tasks added back: scored, not retrained


def test_finished_needs_a_finished_status_the_fingerprint_and_a_model_folder(tmp_path):
    (tmp_path / "model").mkdir()
    assert finished(StageRecord(status="done", fingerprint="a"), tmp_path)
    assert finished(StageRecord(status="trained", fingerprint="a"), tmp_path, "a")
    assert not finished(StageRecord(status="done", fingerprint="a"), tmp_path, "b")
    assert not finished(StageRecord(status="running", fingerprint="a"), tmp_path, "a")
    assert not finished(StageRecord(), tmp_path)
    assert not finished(StageRecord(status="done", fingerprint="a"), tmp_path / "elsewhere", "a")


def test_earlier_stage_model_is_the_latest_finished_one_of_that_name(tmp_path):
    stages = tmp_path / "stages"
    for name in ("01-sft", "02-midtrain", "03-midtrain", "04-dpo"):
        (stages / name).mkdir(parents=True)
    assert earlier_stage_model(stages / "04-dpo", "midtrain") is None  # no model/ yet
    (stages / "02-midtrain" / "model").mkdir()
    assert earlier_stage_model(stages / "04-dpo", "midtrain") == stages / "02-midtrain" / "model"
    (stages / "03-midtrain" / "model").mkdir()
    assert earlier_stage_model(stages / "04-dpo", "midtrain") == stages / "03-midtrain" / "model"
    assert earlier_stage_model(stages / "03-midtrain", "midtrain") == stages / "02-midtrain" / "model"  # not itself
    assert earlier_stage_model(stages / "04-dpo", "ppo") is None


def test_a_record_keeps_unknown_keys_and_leaves_out_empty_fields(tmp_path):
    from pipeline.files import read_json, write_json

    write_json(tmp_path / "stage.json", {"stage": "sft", "status": "done", "future_field": {"a": [1, 2]}})
    record = StageRecord.read(tmp_path)
    assert record.stage == "sft" and record.extra == {"future_field": {"a": [1, 2]}}
    record.metrics = {"steps": 3}
    record.write(tmp_path)
    assert read_json(tmp_path / "stage.json") == {"stage": "sft", "status": "done", "metrics": {"steps": 3},
                                                  "future_field": {"a": [1, 2]}}
    assert StageRecord.read(tmp_path / "missing") == StageRecord()
