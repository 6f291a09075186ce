"""The run's state in memory (`runfolder.RunState`): while the chain holds it, the records, the manifest and the
per-problem scores it wrote are taken from memory, never parsed again from its own files, while their bytes are the
ones it wrote; a file rewritten since, even with the same inode, size and modification time, is parsed anew."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_orchestrator import Chain, N, chain  # noqa: F401 - the chain fixture, used by name

from pipeline.evaluation import stats
from pipeline.files import write_json, write_text
from pipeline.runfolder import RunState, StageRecord, remember, samples_file

METRIC = "tiny_gsm/exact_match,strict-match"
OWN = ("stage.json", "manifest.json")  # the run's files a report reads, besides samples_<task>.jsonl


def _samples(right: int) -> str:
    return "".join(json.dumps({"doc_id": i, "filter": "strict-match", "exact_match": float(i < right)}) + "\n"
                   for i in range(N))


def _no_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Path, *args, **kwargs) -> str:
        raise AssertionError(f"read {self}")
    monkeypatch.setattr(Path, "read_text", refuse)


def test_a_held_state_gives_back_what_this_process_wrote_and_reads_what_another_rewrote(tmp_path, monkeypatch):
    folder, scored = tmp_path / "stages" / "01-sft", tmp_path / "stages" / "01-sft" / "eval"
    with RunState().held():
        StageRecord(stage="sft", index=1, status="done", output_model=str(folder / "model"),
                    eval={"metrics": {METRIC: 0.25}}).write(folder)
        write_text(samples_file(scored, "tiny_gsm"), _samples(10))
        remember(samples_file(scored, "tiny_gsm"), stats.problem_scores(_samples(10)))
        with monkeypatch.context() as patch:
            _no_reads(patch)
            record = StageRecord.read(folder)
            assert record.output_model == str(folder / "model") and record.scores() == {METRIC: 0.25}
            record.eval["metrics"][METRIC] = 1.0  # a reader's changes stay its own
            assert StageRecord.read(folder).scores() == {METRIC: 0.25}
            assert sum(stats.per_problem(scored, METRIC).values()) == 10
        write_json(folder / "stage.json", {"stage": "sft", "status": "stale"})  # as another process would
        write_text(samples_file(scored, "tiny_gsm"), _samples(30))
        assert StageRecord.read(folder).status == "stale"
        assert sum(stats.per_problem(scored, METRIC).values()) == 30
    assert StageRecord.read(folder).status == "stale"  # not held: from disk


def test_a_file_rewritten_with_the_same_size_and_time_is_read_anew(tmp_path):
    """What a network filesystem's attribute cache shows: another host's rewrite with the same inode, size and
    modification time. The memo compares the bytes, not the stamp."""
    folder = tmp_path / "stages" / "01-sft"
    with RunState().held():
        StageRecord(stage="sft", index=1, status="done").write(folder)
        path = folder / "stage.json"
        before, text = os.stat(path), path.read_text()
        with open(path, "r+", encoding="utf-8") as fh:  # in place: the same inode
            fh.write(text.replace('"done"', '"stal"'))
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = os.stat(path)
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
        assert StageRecord.read(folder).status == "stal"


def test_a_chain_reads_back_none_of_the_files_it_wrote(request, monkeypatch):
    """The gates, the sweep's statistics, the leaderboard, the headline and the model cards after every stage read
    no record, manifest or per-problem result that this run wrote (the stand-in scoring keeps its results as
    lm-eval's does)."""
    events: list[tuple[str, Path]] = []
    replace, read_text = os.replace, Path.read_text

    def replaced(src, dst) -> None:
        replace(src, dst)
        events.append(("write", Path(dst)))

    def read(self: Path, *args, **kwargs) -> str:
        events.append(("read", Path(self)))
        return read_text(self, *args, **kwargs)

    scoring = Chain.run_eval

    def remembering(self: Chain, model, ev: dict, tasks_dir: Path, out_dir: Path, model_cfg) -> dict:
        result = scoring(self, model, ev, tasks_dir, out_dir, model_cfg)
        for task in ev["tasks"]:  # rewritten as lmeval.run_eval writes them: atomically, kept in the run state
            right = round(result["metrics"][f"{task}/exact_match,strict-match"] * N)
            write_text(samples_file(out_dir, task), _samples(right))
            remember(samples_file(out_dir, task), stats.problem_scores(_samples(right)))
        return result

    go = request.getfixturevalue("chain")
    monkeypatch.setattr(Chain, "run_eval", remembering)
    monkeypatch.setattr(os, "replace", replaced)
    monkeypatch.setattr(Path, "read_text", read)
    code, run, _ = go({"sft": 0.5, "midtrain": 0.75})
    assert code == 0 and (run / "stages/02-midtrain/stage.json").is_file()
    written: set[Path] = set()
    again = []
    for kind, path in events:
        own = path.name in OWN or (path.name.startswith("samples_") and path.suffix == ".jsonl")
        if kind == "write":
            written.add(path)
        elif own and path in written:
            again.append(path)
    assert any(kind == "read" for kind, _ in events) and not again, sorted(set(again))
