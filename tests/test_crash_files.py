"""Crash-consistent run files: Trainer checkpoints count only with their completion marker (a broken newest one
falls back to the one before), `work/` goes only after the record says trained, records hold paths relative to
the run folder (a moved folder resumes), killed writers' leftovers are removed at start, and a run refused by
the lock writes nothing. Stand-in checkpoints and the stand-in chain of tests/test_orchestrator.py: no training."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_orchestrator import Chain, _record, chain  # noqa: F401 - `chain` is a fixture

from pipeline.chain import orchestrator
from pipeline.errors import LockLost
from pipeline.files import RunLock, pid_space
from pipeline.runfolder import StageRecord, input_stage
from pipeline.train.trainer import COMPLETE, CheckpointMarker, last_complete_checkpoint, mark_checkpoint

SCORES = {"sft": 0.5, "midtrain": 0.75}


def _checkpoint(work: Path, step: int, marked: bool = True) -> Path:
    """A stand-in Trainer checkpoint: weights, optimizer, trainer state; marked complete when `marked`."""
    folder = work / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * (100 + step))
    (folder / "optimizer.pt").write_bytes(b"o" * 50)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if marked:
        mark_checkpoint(folder, step)
    return folder


def test_an_unmarked_newest_checkpoint_is_set_aside_for_the_marked_one_before(tmp_path, caplog):
    work = tmp_path / "work"
    _checkpoint(work, 10)
    _checkpoint(work, 20, marked=False)  # killed after its trainer_state.json, before the marker
    with caplog.at_level(logging.WARNING, "pipeline"):
        assert last_complete_checkpoint(work) == str(work / "checkpoint-10")
    assert sorted(p.name for p in work.iterdir()) == ["checkpoint-10", "incomplete-checkpoint-20"]  # kept, aside
    assert "setting aside checkpoint" in caplog.text and "no completion marker, and model.safetensors cannot be " \
        "read" in caplog.text and "as incomplete-checkpoint-20; resuming from the one before" in caplog.text
    marker = json.loads((work / "checkpoint-10" / COMPLETE).read_text())
    assert marker == {"step": 10, "files": {"model.safetensors": 110, "optimizer.pt": 50,
                                            "trainer_state.json": len(json.dumps({"global_step": 10}))}}


def test_a_marked_checkpoint_with_a_missing_or_cut_weight_file_falls_back_with_a_warning(tmp_path, caplog):
    work = tmp_path / "work"
    _checkpoint(work, 5)
    (_checkpoint(work, 10) / "model.safetensors").write_bytes(b"w" * 7)  # cut short after it was marked
    (_checkpoint(work, 15) / "model.safetensors").unlink()  # half deleted
    with caplog.at_level(logging.WARNING, "pipeline"):
        assert last_complete_checkpoint(work) == str(work / "checkpoint-5")
    assert "model.safetensors is missing" in caplog.text and "model.safetensors has 7 bytes, 110" in caplog.text
    assert sorted(p.name for p in work.iterdir()) == ["checkpoint-5", "incomplete-checkpoint-10",
                                                      "incomplete-checkpoint-15"]
    (work / "checkpoint-5" / COMPLETE).unlink()  # and its files are no checkpoint when read: set aside too
    assert last_complete_checkpoint(work) is None and last_complete_checkpoint(tmp_path / "none") is None
    _checkpoint(work, 15)  # a third attempt at step 15 that failed again: a second copy aside
    (work / "checkpoint-15" / COMPLETE).write_text("{")  # its marker damaged, and its files not whole
    assert last_complete_checkpoint(work) is None and (work / "incomplete-checkpoint-15-2").is_dir()


def _real_checkpoint(work: Path, step: int) -> Path:
    """A checkpoint as a Trainer of a version without markers saved it: real safetensors and torch files."""
    import torch
    from safetensors.torch import save_file

    folder = work / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    save_file({"w": torch.ones(4, 4)}, str(folder / "model.safetensors"))
    torch.save({"state": {0: {"exp_avg": torch.zeros(4)}}}, folder / "optimizer.pt")
    torch.save({"last_epoch": step}, folder / "scheduler.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder


def test_a_checkpoint_saved_before_markers_is_resumed_when_its_files_read_whole(tmp_path, caplog):
    work = tmp_path / "work"
    _real_checkpoint(work, 10)
    assert last_complete_checkpoint(work) == str(work / "checkpoint-10")  # an upgrade resumes, not step 0
    cut = _real_checkpoint(work, 20) / "optimizer.pt"
    cut.write_bytes(cut.read_bytes()[:-30])
    (_real_checkpoint(work, 30) / "scheduler.pt").unlink()
    (_real_checkpoint(work, 40) / "trainer_state.json").write_text(json.dumps({"global_step": 39}))
    with caplog.at_level(logging.WARNING, "pipeline"):
        assert last_complete_checkpoint(work) == str(work / "checkpoint-10")
    assert "no trainer_state.json of step 40: cut short" in caplog.text
    assert "scheduler.pt is missing beside optimizer.pt" in caplog.text
    assert "optimizer.pt cannot be read (File is not a zip file)" in caplog.text
    assert sorted(p.name for p in work.iterdir()) == ["checkpoint-10", "incomplete-checkpoint-20",
                                                      "incomplete-checkpoint-30", "incomplete-checkpoint-40"]


def test_the_marker_callback_marks_each_save_and_rotates_only_after_marking(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path / "work"), save_total_limit=2)
    marker = CheckpointMarker(args)
    assert args.save_total_limit is None  # the Trainer's own rotation, which runs before on_save, is off
    for step in (10, 20, 30):
        _checkpoint(tmp_path / "work", step, marked=False)
        marker.on_save(args, SimpleNamespace(global_step=step), SimpleNamespace())
        assert (tmp_path / "work" / f"checkpoint-{step}" / COMPLETE).is_file()
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["checkpoint-20", "checkpoint-30"]
    _checkpoint(tmp_path / "work", 40, marked=False)  # a save killed before its marker: nothing was rotated
    assert last_complete_checkpoint(tmp_path / "work") == str(tmp_path / "work/checkpoint-30")


def test_records_store_run_paths_relative_and_resolve_them_where_the_folder_is(tmp_path):
    run, base = tmp_path / "runs/exp", tmp_path / "models/base"
    StageRecord(stage="base", index=0, status="done", output_model=str(base)).write(run / "stages/00-base")
    StageRecord(stage="sft", index=1, status="done", input_model=str(base),
                output_model=str(run / "stages/01-sft/model")).write(run / "stages/01-sft")
    StageRecord(stage="dpo", index=2, status="done", input_model=str(run / "stages/01-sft/model"),
                output_model=str(run / "stages/02-dpo/model")).write(run / "stages/02-dpo")
    StageRecord(stage="dpo", candidate="c0", output_model=str(run / "stages/02-dpo/candidates/c0/model")).write(
        run / "stages/02-dpo/candidates/c0")
    raw = json.loads((run / "stages/02-dpo/stage.json").read_text())
    assert (raw["input_model"], raw["output_model"]) == ("stages/01-sft/model", "stages/02-dpo/model")
    assert json.loads((run / "stages/01-sft/stage.json").read_text())["input_model"] == str(base)  # outside: as is
    assert json.loads((run / "stages/02-dpo/candidates/c0/stage.json").read_text())["output_model"] == \
        "stages/02-dpo/candidates/c0/model"
    moved = tmp_path / "elsewhere/exp"
    shutil.move(run, moved)
    record = StageRecord.read(moved / "stages/02-dpo")
    assert (record.input_model, record.output_model) == (str(moved / "stages/01-sft/model"),
                                                        str(moved / "stages/02-dpo/model"))
    assert StageRecord.read(moved / "stages/02-dpo/candidates/c0").output_model == \
        str(moved / "stages/02-dpo/candidates/c0/model")
    assert input_stage(moved / "stages/02-dpo") == moved / "stages/01-sft"
    assert input_stage(moved / "stages/01-sft") == moved / "stages/00-base"
    hub = StageRecord(stage="base", index=0, output_model="HuggingFaceTB/SmolLM2-135M")  # a Hub id: never a path
    hub.write(moved / "stages/00-base")
    assert StageRecord.read(moved / "stages/00-base").output_model == "HuggingFaceTB/SmolLM2-135M"


def test_an_older_record_with_absolute_paths_still_works_in_place(tmp_path):
    run = tmp_path / "exp"
    for index, name, source in ((1, "sft", "/models/base"), (2, "dpo", str(run / "stages/01-sft/model"))):
        folder = run / "stages" / f"0{index}-{name}"
        folder.mkdir(parents=True)
        (folder / "stage.json").write_text(json.dumps({"stage": name, "index": index, "status": "done",
                                                       "input_model": source,
                                                       "output_model": str(folder / "model")}))
    assert StageRecord.read(run / "stages/02-dpo").output_model == str(run / "stages/02-dpo/model")
    assert input_stage(run / "stages/02-dpo") == run / "stages/01-sft"


@pytest.mark.slow
def test_a_moved_run_folder_resumes_and_reuses_every_stage(chain, tmp_path):  # noqa: F811
    code, run, _ = chain(SCORES)
    assert code == 0
    assert _record(run, "02-midtrain")["input_model"] == "stages/01-sft/model"
    moved = tmp_path / "moved"
    shutil.move(run.parent, moved)
    code, _, again = chain(SCORES, f"output_root={moved}")
    assert code == 0 and again.trained == [] and again.scored == []
    assert input_stage(moved / "tiny/stages/02-midtrain") == moved / "tiny/stages/01-sft"
    record = StageRecord.read(moved / "tiny/stages/02-midtrain")
    assert (record.input_model, record.output_model) == (str(moved / "tiny/stages/01-sft/model"),
                                                        str(moved / "tiny/stages/02-midtrain/model"))


@pytest.mark.slow
def test_work_goes_only_after_the_record_says_trained(chain, monkeypatch):  # noqa: F811
    seen, real_drop, real_train = [], orchestrator.drop_work, Chain.train

    def drop(folder: Path) -> None:
        seen.append((folder.name, StageRecord.read(folder).status, (folder / "work/checkpoint-3").is_dir()))
        real_drop(folder)

    def train(self, ctx) -> dict:  # a stage that leaves checkpoints in work/, as the Trainer does
        (ctx.out_dir / "work/checkpoint-3").mkdir(parents=True)
        return real_train(self, ctx)

    monkeypatch.setattr(orchestrator, "drop_work", drop)
    monkeypatch.setattr(Chain, "train", train)
    code, run, _ = chain(SCORES)
    assert code == 0
    assert seen == [("01-sft", "trained", True), ("02-midtrain", "trained", True)]
    assert not (run / "stages/01-sft/work").exists() and not (run / "stages/02-midtrain/work").exists()


@pytest.mark.slow
def test_leftovers_of_killed_writers_and_finished_work_are_removed_at_start(chain):  # noqa: F811
    code, run, _ = chain(SCORES)
    stage, host = run / "stages/01-sft", pid_space()
    dead = stage / f".model.tmp-{host}-{2**22 + 5}-{'a' * 12}"  # a killed save of the stage's model
    (dead / "sub").mkdir(parents=True)
    (dead / "sub/model.safetensors").write_bytes(b"x")
    stray = run / f".leaderboard.json.tmp-{host}-{2**22 + 6}-{'b' * 12}"
    stray.write_text("{")
    live = stage / f".stage.json.tmp-{host}-{os.getppid()}-{'c' * 12}"  # its writer is alive: kept
    live.write_text("{")
    (stage / "work/checkpoint-30").mkdir(parents=True)  # killed after the record said trained
    cache = run.parent.parent / "cache"
    build = cache / f".build.tmp-{host}-{2**22 + 7}-{'d' * 12}"  # a killed build in the cache other runs share
    (build / "checkpoint-5").mkdir(parents=True)
    building = cache / f".build.tmp-{host}-{os.getppid()}-{'e' * 12}"  # another run's build, going on
    building.mkdir()
    code, _, again = chain(SCORES)
    assert code == 0 and again.trained == []
    assert not dead.exists() and not stray.exists() and not (stage / "work").exists() and live.exists()
    assert not build.exists() and building.exists()
    assert f"removed {dead}" in (run / "pipeline.log").read_text() and f"removed {build}" in (
        run / "pipeline.log").read_text()


@pytest.mark.slow
def test_a_run_refused_by_the_lock_writes_nothing_into_the_run_folder(chain, capsys):  # noqa: F811
    code, run, _ = chain(SCORES)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    holder = RunLock(run)
    holder.acquire()  # a live run on the folder
    try:
        code, _, again = chain(SCORES)
    finally:
        holder.release()
    assert code == 2 and again.trained == [] and again.scored == []
    assert f"in use by pid {os.getpid()}" in capsys.readouterr().err
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before  # outcome.json, pipeline.log and everything else untouched, nothing added


@pytest.mark.fault("save", "lost lease", "6",
                   "the last marked checkpoint: the new one is not marked, no older one removed")
def test_a_process_that_lost_its_lock_marks_no_checkpoint_and_rotates_none_out(tmp_path):
    run = tmp_path / "runs/tiny"
    work = run / "stages/01-sft/work"
    lock = RunLock(run, lease_s=60, renew_s=60)
    lock.acquire()
    try:
        args = SimpleNamespace(output_dir=str(work), save_total_limit=1)
        marker = CheckpointMarker(args)
        _checkpoint(work, 10, marked=False)
        marker.on_save(args, SimpleNamespace(global_step=10), SimpleNamespace())
        (run / ".lock").write_text(json.dumps({"owner": "another", "pid": 4242, "host": "node-b"}))  # taken over
        _checkpoint(work, 20, marked=False)
        with pytest.raises(LockLost, match="to pid 4242 on node-b"):
            marker.on_save(args, SimpleNamespace(global_step=20), SimpleNamespace())
        assert (work / "checkpoint-10" / COMPLETE).is_file() and not (work / "checkpoint-20" / COMPLETE).exists()
    finally:
        lock.release()
