"""The chain's decisions (pipeline/chain/orchestrator.py), with stand-ins for training and scoring only: the order of
stages and the handoff of checkpoints, gates that stop or warn, the exit code and outcome, reuse on a rerun.

A stage's "training" writes a one-tensor checkpoint whose weight is the fraction of problems it gets right; its
"scoring" reads the weight back and writes lm-eval-shaped per-problem results, so the paired gate tests, the
leaderboard and the model cards run for real on them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FAST
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, PreTrainedTokenizerFast

from pipeline import keys
from pipeline.evaluation import lmeval
from pipeline.run import main
from pipeline.runfolder import StageRecord
from pipeline.settings import kinds

N = 40  # problems per task
GATE = "tiny_gsm/exact_match,strict-match"


def _checkpoint(folder: Path, right: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"right": torch.tensor([right])}, str(folder / "model.safetensors"))
    return folder


class Chain:
    """Stand-in training (`scores`: stage -> fraction right) and scoring, recording what each was given."""

    def __init__(self, scores: dict[str, float | dict[float, float]]) -> None:
        self.scores, self.trained, self.scored = scores, [], []

    def train(self, ctx) -> dict:
        self.trained.append((ctx.name, Path(ctx.input_model)))
        score = self.scores[ctx.name]  # or by learning rate, for a sweep's candidates
        _checkpoint(ctx.out_dir / "model", score[ctx.stage.learning_rate] if isinstance(score, dict) else score)
        return {"steps": 3, "loss_first": 2.0, "loss_last": 1.0}

    def run_eval(self, model, ev, tasks_dir, out_dir, model_cfg) -> dict:
        self.scored.append(Path(model))
        right = round(load_file(str(Path(model) / "model.safetensors"))["right"].item() * N)
        out_dir.mkdir(parents=True, exist_ok=True)
        metrics = {}
        for task in ev["tasks"]:
            rows = [{"doc_id": i, "filter": "strict-match", "exact_match": float(i < right)} for i in range(N)]
            (out_dir / f"samples_{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            metrics[f"{task}/exact_match,strict-match"] = right / N
        return {"metrics": metrics, "stderr": {}, "samples": {t: N for t in ev["tasks"]},
                "splits": {"tiny_gsm": "test"}, "settings": ev, "wall_time_s": 0.0}


@pytest.fixture
def chain(tmp_path, monkeypatch):
    """`chain(scores, *overrides) -> (exit code, run folder, Chain)`: the tiny recipe's sft -> midtrain on a stand-in
    base checkpoint (0 right), in this process."""
    base = _checkpoint(tmp_path / "base", 0.0)
    LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1,
                vocab_size=16).save_pretrained(base)
    words = Tokenizer(models.WordLevel({"<eos>": 0, "<unk>": 1}, unk_token="<unk>"))  # the preflight renders rows
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", unk_token="<unk>").save_pretrained(base)
    fakes: list[Chain] = []

    def go(scores: dict[str, float], *overrides: str) -> tuple[int, Path, Chain]:
        fake = Chain(scores)
        fakes.append(fake)
        for kind in ("sft", "midtrain"):
            monkeypatch.setattr(kinds()[kind], "train", fake.train)
        monkeypatch.setattr(lmeval, "run_eval", fake.run_eval)
        code = main(["recipe=tiny", *FAST, f"output_root={tmp_path / 'runs'}", f"cache_dir={tmp_path / 'cache'}",
                     f"model.name_or_path={base}", "model.chat_template=chatml", *overrides])
        return code, tmp_path / "runs" / "tiny", fake
    yield go
    import logging

    logging.captureWarnings(False)
    for name in ("pipeline", "pipeline.detail"):
        for handler in logging.getLogger(name).handlers:
            handler.close()
        logging.getLogger(name).handlers = []


def _record(run: Path, stage: str) -> dict:
    return json.loads((run / "stages" / stage / "stage.json").read_text())


@pytest.mark.slow
def test_each_stage_trains_from_the_previous_checkpoint_and_a_rerun_reuses_them(chain):
    code, run, fake = chain({"sft": 0.5, "midtrain": 0.75})
    assert code == 0
    base = Path(_record(run, "00-base")["output_model"])
    assert fake.trained == [("sft", base), ("midtrain", run / "stages/01-sft/model")]
    assert fake.scored == [base, run / "stages/01-sft/model", run / "stages/02-midtrain/model"]
    for stage, value in (("01-sft", 0.5), ("02-midtrain", 0.75)):
        record = _record(run, stage)
        assert record["status"] == "done" and record["eval"]["metrics"][GATE] == value
        assert record["gate"]["passed"] and record["gate"]["paired"]["n"] == N  # judged against the stage before
    assert json.loads((run / "outcome.json").read_text())["outcome"] == "passed"
    code, _, again = chain({"sft": 0.5, "midtrain": 0.75})
    assert code == 0 and again.trained == [] and again.scored == []  # finished stages are reused, not rescored


def test_a_failed_stop_gate_ends_the_chain_with_exit_3_before_the_next_stage(chain):
    code, run, fake = chain({"sft": 0.5, "midtrain": 0.75}, "sft.gate.action=stop", "sft.gate.min=0.9")
    assert code == 3
    assert [name for name, _ in fake.trained] == ["sft"] and not (run / "stages/02-midtrain/model").exists()
    verdict = _record(run, "01-sft")["gate"]
    assert not verdict["passed"] and verdict["action"] == "stop"
    outcome = json.loads((run / "outcome.json").read_text())
    assert (outcome["exit_code"], outcome["outcome"], outcome["stage"]) == (3, "gate_stop", "01-sft")
    assert (run / "leaderboard.html").is_file()  # the leaderboard is still written


def test_a_failed_warn_gate_marks_the_stage_and_goes_on(chain):
    code, run, fake = chain({"sft": 0.5, "midtrain": 0.75}, "sft.gate.action=warn", "sft.gate.min=0.9")
    assert code == 0 and [name for name, _ in fake.trained] == ["sft", "midtrain"]
    assert not _record(run, "01-sft")["gate"]["passed"] and _record(run, "02-midtrain")["gate"]["passed"]


def test_a_significant_drop_against_the_previous_checkpoint_fails_its_gate(chain):
    code, run, _ = chain({"sft": 0.75, "midtrain": 0.25}, "midtrain.gate.action=stop", "midtrain.gate.max_drop=0.05")
    assert code == 3
    verdict = _record(run, "02-midtrain")["gate"]
    assert not verdict["passed"] and verdict["paired"]["diff"] == pytest.approx(-0.5)


@pytest.mark.slow
def test_a_redo_is_carried_out_once_and_makes_later_stages_stale_before_it_is_scored(chain):
    """redo=[sft]: a crash while scoring the redone sft leaves midtrain, trained from the replaced model, stale; the
    same command again (a requeue) scores sft without retraining it and retrains midtrain; a run without the redo
    then reuses both and forgets the redo."""
    code, run, _ = chain({"sft": 0.5, "midtrain": 0.75})
    assert code == 0
    code, _, redone = chain({"sft": float("nan"), "midtrain": 0.75}, "redo=[sft]")  # scoring NaN right: a crash
    assert code == 1 and [name for name, _ in redone.trained] == ["sft"]
    assert _record(run, "01-sft")["redone"] is True and _record(run, "01-sft")["status"] == "trained"
    assert _record(run, "02-midtrain")["status"] == "stale"
    _checkpoint(run / "stages/01-sft/model", 0.5)  # the cause of the crash is gone: the stand-in scorer reads the
    record = StageRecord.read(run / "stages/01-sft")  # score from the weights, so they are rewritten, and the record
    record.model_digest = keys.tree_digest(run / "stages/01-sft/model")  # names them (else: refused as edited)
    record.write(run / "stages/01-sft")
    code, _, again = chain({"sft": 0.5, "midtrain": 0.75}, "redo=[sft]")  # the requeue: the same command line
    assert code == 0 and [name for name, _ in again.trained] == ["midtrain"]
    code, _, after = chain({"sft": 0.5, "midtrain": 0.75})
    assert code == 0 and after.trained == [] and "redone" not in _record(run, "01-sft")


@pytest.mark.slow
def test_a_gate_that_cannot_see_warns_and_under_strict_gates_stops_with_exit_2(chain):
    # the base gets 0 of 40 right and sft 20: at the floor, but a significant gain is seen; midtrain changes no
    # answer, and its max_drop 0.01 is below what 40 problems can show
    code, run, _ = chain({"sft": 0.5, "midtrain": 0.5}, "sft.gate.max_drop=0.05", "midtrain.gate.max_drop=0.01")
    assert code == 0
    sft, mid = _record(run, "01-sft")["gate"]["sight"], _record(run, "02-midtrain")["gate"]["sight"]
    assert sft["blind"] is None and sft["n"] == N and sft["rate"] == 0.0 and sft["churn"] == 0.5
    assert mid["blind"].startswith("max_drop 0.010 is below") and mid["rate"] == 0.5 and mid["churn"] == 0.0
    assert "the gate of stage midtrain cannot see what it judges" in (run / "pipeline.log").read_text()
    assert "the gate of midtrain cannot see what it judges" in (run / "leaderboard.md").read_text()
    code, _, fake = chain({"sft": 0.5, "midtrain": 0.5}, "midtrain.gate.max_drop=0.01", "strict_gates=true",
                          f"output_root={run.parent.parent / 'strict'}")
    assert code == 2 and [name for name, _ in fake.trained] == ["sft", "midtrain"]  # known once midtrain is judged


@pytest.mark.slow
def test_a_second_run_on_the_same_weights_takes_their_scores_from_the_cache(chain):
    code, run, _ = chain({"sft": 0.5, "midtrain": 0.75})
    assert code == 0
    code, _, again = chain({"sft": 0.5, "midtrain": 0.75}, f"output_root={run.parent.parent / 'other'}")
    other = run.parent.parent / "other" / "tiny"  # a second run folder, the same cache
    assert code == 0 and len(again.trained) == 2 and again.scored == []  # trained anew, not scored
    assert _record(other, "02-midtrain")["eval"]["metrics"][GATE] == 0.75
    assert (other / "pipeline.log").read_text().count("scores reused: the same weights were scored the same way") == 3


@pytest.mark.slow
def test_after_a_sweep_the_next_stage_is_judged_on_the_gate_half_only(chain):
    # the sweep picks sft's learning rate on the even doc_ids; its pick (21 of 40 right: doc_ids 0-20, 11 even and
    # 10 odd) scores above its gate-half value there, so midtrain (30 right: 15 odd) is judged on the odd ones
    code, run, fake = chain({"sft": {1e-4: 0.25, 1e-3: 0.525}, "midtrain": 0.75}, "sft.sweep.learning_rate=[1e-4,1e-3]")
    assert code == 0 and [name for name, _ in fake.trained] == ["sft", "sft", "midtrain"]
    assert _record(run, "01-sft")["metrics"]["selected"] == "lr0.001"
    verdict = _record(run, "02-midtrain")["gate"]
    assert verdict["previous"] == {"checkpoint": "01-sft", "value": 0.5} and verdict["value"] == 0.75
    assert verdict["paired"]["n"] == N // 2 and (verdict["paired"]["gained"], verdict["paired"]["lost"]) == (5, 0)
    assert "judged on the gate half" in verdict["reason"]
    code, _, _ = chain({"sft": 0.525, "midtrain": 0.75}, f"output_root={run.parent.parent / 'plain'}")
    plain = _record(run.parent.parent / "plain" / "tiny", "02-midtrain")["gate"]  # no sweep: every problem
    assert code == 0 and plain["paired"]["n"] == N and plain["previous"]["value"] == 0.525


@pytest.mark.slow
@pytest.mark.fault("training", "corrupt file", "2",
                   "nothing: refused, naming the record and the ways out; nothing retrained or deleted")
def test_an_unreadable_record_is_refused_naming_it_and_never_retrained(chain, capsys):
    code, run, _ = chain({"sft": 0.5, "midtrain": 0.75})
    assert code == 0
    record = run / "stages/01-sft/stage.json"
    record.write_text("{")  # a truncated record
    weights = (run / "stages/01-sft/model/model.safetensors").read_bytes()
    code, _, fake = chain({"sft": 0.5, "midtrain": 0.75})
    assert code == 2 and fake.trained == [] and fake.scored == []
    said = capsys.readouterr().err
    assert f"error: {record} cannot be read as a stage record" in said and "nothing was retrained" in said
    assert record.read_text() == "{" and (run / "stages/01-sft/model/model.safetensors").read_bytes() == weights
    assert _record(run, "02-midtrain")["status"] == "done"  # not marked stale
    code, _, redone = chain({"sft": 0.5, "midtrain": 0.75}, "redo=[sft]")  # the way out it names
    assert code == 0 and [name for name, _ in redone.trained] == ["sft", "midtrain"]
    assert _record(run, "01-sft")["status"] == "done"
    (run / "stages/02-midtrain/stage.json").write_text("{")
    code, _, requeued = chain({"sft": 0.5, "midtrain": 0.75}, "redo=[sft]")  # the same command again: its redo
    assert code == 2 and requeued.trained == []  # was carried out, so midtrain's unreadable record is refused


@pytest.mark.slow
def test_a_resume_on_another_world_size_is_refused_naming_both(chain, capsys):
    code, run, _ = chain({"sft": 0.5, "midtrain": 0.75})
    assert code == 0
    record = StageRecord.read(run / "stages/01-sft")
    record.status, record.world_size = "running", 2  # interrupted while training on 2 processes
    record.write(run / "stages/01-sft")
    (run / "stages/01-sft/work/checkpoint-3").mkdir(parents=True)  # what a resume would continue from
    code, _, fake = chain({"sft": 0.5, "midtrain": 0.75})
    assert code == 2 and fake.trained == []
    said = capsys.readouterr().err
    assert ("error: stage 01-sft was interrupted at world size 2 and this run has 1: resuming it would change its "
            "global batch from 12 to 6 rows a step; run it again on 2 process(es), or add redo=[sft]") in said
    code, _, redone = chain({"sft": 0.5, "midtrain": 0.75}, "redo=[sft]")
    assert code == 0 and [name for name, _ in redone.trained] == ["sft", "midtrain"]
    record = StageRecord.read(run / "stages/01-sft")
    record.status, record.world_size = "running", 2
    record.write(run / "stages/01-sft")  # killed at 2 processes before its first checkpoint: nothing to resume
    code, _, again = chain({"sft": 0.5, "midtrain": 0.75})
    assert code == 0 and [name for name, _ in again.trained] == ["sft", "midtrain"]


@pytest.mark.slow
@pytest.mark.fault("scoring", "corrupt file", "0", "the model; it is scored again, with a warning")
def test_an_unreadable_score_cache_entry_is_scored_anew_with_a_warning(chain):
    code, run, _ = chain({"sft": 0.5, "midtrain": 0.75})
    assert code == 0
    entries = sorted((run.parent.parent / "cache" / "scores").glob("*/result.json"))
    assert len(entries) == 3  # the base, sft, midtrain
    for entry in entries:
        entry.write_text('{"samples": ')  # a node crashed while the disk held half of it
    code, _, again = chain({"sft": 0.5, "midtrain": 0.75}, f"output_root={run.parent.parent / 'other'}")
    assert code == 0 and len(again.scored) == 3  # each scored anew, none crashed the run
    log = (run.parent.parent / "other" / "tiny" / "pipeline.log").read_text()
    assert log.count("cannot be read (") == 3 and "scoring anew" in log
    assert all(json.loads(entry.read_text())["samples"] for entry in entries)  # replaced by what was scored


@pytest.mark.fault("training", "lost lease", "6", "what the records say: the stopped run writes nothing more")
def test_a_run_that_lost_its_lock_stops_before_its_next_write_with_exit_6(chain, monkeypatch, capsys):
    taker, train = {"pid": 4242, "host": "node-b", "owner": "another", "heartbeat": 0.0}, Chain.train

    def taken_over_while_training(self, ctx):  # midtrain's node froze; another job took the lock meanwhile
        train(self, ctx)
        if ctx.name == "midtrain":
            (ctx.stage_dir.parent.parent / ".lock").write_text(json.dumps(taker))
        return {"steps": 3}
    monkeypatch.setattr(Chain, "train", taken_over_while_training)
    code, run, fake = chain({"sft": 0.5, "midtrain": 0.75})
    assert code == 6 and [name for name, _ in fake.trained] == ["sft", "midtrain"]
    said = capsys.readouterr().err
    assert f"error: lost the lock {run / '.lock'} to pid 4242 on node-b" in said
    assert _record(run, "01-sft")["status"] == "done" and _record(run, "02-midtrain")["status"] == "running"
    assert not (run / "outcome.json").exists() and json.loads((run / ".lock").read_text()) == taker


@pytest.mark.slow
def test_a_reorder_that_would_retrain_a_finished_stage_is_refused_until_redo_names_it(chain, capsys):
    """Stage folders are named by position: a chain reordered before a stage that keeps its place gives it a new
    input. Its finished model is never retrained, nor its files removed, without redo=; with it, the finished one
    is kept, and comes back with the first order, as do the stages the reorder moved."""
    third = ["sft2.kind=sft", "sft2.mixture=tiny_sft", "sft2.max_steps=3", "sft2.gate.action=warn",
             f"sft2.gate.metric={GATE}"]
    scores = {"sft": 0.5, "midtrain": 0.75, "sft2": 0.75}
    code, run, _ = chain(scores, "stages=[sft,midtrain,sft2]", *third)
    assert code == 0
    before = {p: p.read_bytes() for p in (run / "stages/03-sft2").rglob("*") if p.is_file()}
    code, _, fake = chain(scores, "stages=[midtrain,sft,sft2]", *third)
    assert code == 2 and fake.trained == [] and fake.scored == []
    said = capsys.readouterr().err
    assert ("error: stage 03-sft2 already finished with a different config (its input model); settings a resume may "
            "change are marked in help=true; to retrain it and every stage after it add redo=[sft2]") in said
    assert {p: p.read_bytes() for p in (run / "stages/03-sft2").rglob("*") if p.is_file()} == before
    assert not (run / "stages/01-midtrain").exists()
    code, _, redone = chain(scores, "stages=[midtrain,sft,sft2]", "redo=[sft2]", *third)  # the way out it names
    assert code == 0 and [name for name, _ in redone.trained] == ["midtrain", "sft", "sft2"]
    # `stages/` holds this chain; the first order's stages are kept, by fingerprint
    assert sorted(p.name for p in (run / "stages").iterdir()) == ["00-base", "01-midtrain", "02-sft", "03-sft2"]
    assert sorted(p.name.split("@")[0] for p in (run / "kept").iterdir()) == ["01-sft", "02-midtrain", "03-sft2"]
    code, _, back = chain(scores, "stages=[sft,midtrain,sft2]", *third)  # back to the first order
    assert code == 0 and back.trained == [] and back.scored == []
    assert {p: p.read_bytes() for p in (run / "stages/03-sft2").rglob("*") if p.is_file()} == before
    code, _, again = chain(scores, "stages=[midtrain,sft,sft2]", *third)  # and to the second: nothing retrains
    assert code == 0 and again.trained == [] and again.scored == []
    assert len(list((run / "kept").iterdir())) == 3  # the first order's, each in one place


def test_a_grown_grid_takes_its_candidates_from_the_kept_stage_and_the_first_grid_comes_back_whole(chain):
    """redo= after a grid grew keeps the stage trained on the first grid; the new grid's candidates of the same
    fingerprints come out of it (linked, not moved), and going back to the first grid puts that stage back whole."""
    scores = {"sft": {1e-4: 0.25, 1e-3: 0.525, 1e-2: 0.5}, "midtrain": 0.75}
    code, run, _ = chain(scores, "sft.sweep.learning_rate=[1e-4,1e-3]")
    assert code == 0
    first = {p: p.read_bytes() for p in (run / "stages").rglob("*") if p.is_file() and "01-sft" in p.parts}
    code, _, grown = chain(scores, "sft.sweep.learning_rate=[1e-4,1e-3,1e-2]", "redo=[sft]")
    assert code == 0 and [name for name, _ in grown.trained] == ["sft", "midtrain"]  # only lr 0.01's candidate
    assert sorted(c.name for c in (run / "stages/01-sft/candidates").iterdir()) == ["lr0.0001", "lr0.001", "lr0.01"]
    code, _, back = chain(scores, "sft.sweep.learning_rate=[1e-4,1e-3]")
    assert code == 0 and back.trained == [] and back.scored == []
    assert {p: p.read_bytes() for p in (run / "stages").rglob("*") if p.is_file() and "01-sft" in p.parts} == first
