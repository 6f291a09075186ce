"""A stage's sweep (`pipeline.chain.sweep`), here the DPO stage's, on hand-built candidates: grid, selection,
ties, soup and merge, reuse.

Candidates are one-tensor safetensors checkpoints: "training" writes a weight derived from the candidate's
beta and learning rate, "evaluation" scores a checkpoint by reading its weight back, so soups and merges are
real weight averages scored like any candidate.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.chain import sweep
from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.grid import grid, sweeps
from pipeline.runfolder import StageContext, StageRecord, candidate_dir

METRIC = "gsm8k_local_val/exact_match,flexible-extract"  # the smol recipe's dpo gate metric
GRID = ["dpo.sweep.beta=[0.2,0.1]", "dpo.sweep.learning_rate=[2e-6,1e-6]", "dpo.soup.top_k=0", "dpo.merge.stage="]
SMOL_TIE = "gsm8k_local_val_bpb/bits_per_byte,none"
TIE = "gsm8k_local_val/bpb,none"  # a second metric of the same task, for tie-breaking
IDS = ["beta0.1-lr1e-06", "beta0.1-lr2e-06", "beta0.2-lr1e-06", "beta0.2-lr2e-06"]


def _weight(model: Path) -> float:
    return load_file(str(model / "model.safetensors"))["w"].item()


def _save(model: Path, value: float) -> Path:
    model.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.tensor([value], dtype=torch.float64)}, str(model / "model.safetensors"))
    return model


class Fakes:
    """A stage's train and evaluate functions over one-tensor checkpoints, counting their calls.

    `weights`: candidate id -> the weight its training writes; the score is `-(weight - target)^2`, or missing
    for a weight in `unscored`."""

    def __init__(self, weights: dict[str, float], target: float = 10.0, unscored: tuple[float, ...] = (),
                 lower_is_better: bool | None = None) -> None:
        self.weights, self.target, self.unscored = weights, target, unscored
        self.lower_is_better = lower_is_better  # also score TIE (the weight itself), better lower or higher
        self.trained: list[str] = []
        self.scored: list[str] = []

    def train(self, ctx: StageContext) -> dict:
        cand = ctx.out_dir.name
        _save(ctx.out_dir / "model", self.weights[cand])
        self.trained.append(cand)
        return {"steps": 5, "loss_last": self.weights[cand], "beta": ctx.stage.beta,
                "learning_rate": ctx.stage.learning_rate,
                "diagnostics": {"pass1": 0.5, "margin": [0.0, self.weights[cand]]}}  # the samples', its own

    def evaluate(self, model: Path, out: Path) -> dict:
        self.scored.append(model.parent.name)
        w = _weight(model)
        if self.lower_is_better is not None:
            return {"metrics": {METRIC: -((w - self.target) ** 2), TIE: w},
                    "higher_is_better": {"gsm8k_local_val": {"bpb": not self.lower_is_better}}}
        return {"metrics": {} if w in self.unscored else {METRIC: -((w - self.target) ** 2)}}


def _ctx(root: Path, *overrides: str) -> StageContext:
    cfg = load_config(["recipe=smol", f"output_root={root}", *GRID, *overrides])
    return StageContext(cfg, "dpo", root / "stages" / "02-midtrain" / "model", root / "stages" / "03-dpo")


def _run(ctx: StageContext, fakes: Fakes, stage_fp: str = "fp", scoring: str = "eval"):
    return sweep.run(ctx, stage_fp, grid(ctx.stage), fakes.train, sweep.Scorer(fakes.evaluate, scoring))


def _weights(*values: float) -> dict[str, float]:
    return dict(zip([*IDS, "soup", "merge"], values, strict=False))


def test_the_grid_is_beta_by_learning_rate_ascending_with_readable_ids(tmp_path):
    cands = grid(_ctx(tmp_path).stage)
    assert [c["id"] for c in cands] == IDS
    assert [(c["beta"], c["learning_rate"]) for c in cands] == [(0.1, 1e-6), (0.1, 2e-6), (0.2, 1e-6), (0.2, 2e-6)]
    smol = grid(load_config(["recipe=smol"]).dpo)
    assert len(smol) == 9 and smol[0]["id"] == "beta0.025-lr5e-07" and smol[-1]["id"] == "beta0.1-lr2e-06"
    one = grid(_ctx(tmp_path, "dpo.sweep.learning_rate=null").stage)  # unswept: the stage's own learning rate
    assert one == [{"id": "beta0.1", "beta": 0.1}, {"id": "beta0.2", "beta": 0.2}]  # ids name what is swept
    none = grid(_ctx(tmp_path, "dpo.sweep.beta=null", "dpo.sweep.learning_rate=null", "dpo.beta=0.3").stage)
    assert none == [{"id": "single"}]  # unswept: one candidate of the stage's own settings


def test_is_sweep_and_the_selection_scores_the_gate_task_only(tmp_path):
    cfg = _ctx(tmp_path).cfg
    assert sweeps(cfg.dpo) and not sweeps(cfg.sft)
    ev = {"tasks": ["gsm8k_local_val", "gsm8k_local"], "limit": None}
    assert sweep.selection_settings(ev, METRIC) == {"tasks": ["gsm8k_local_val"], "limit": None}
    assert sweep.selection_settings(ev, "other_task/acc") == ev  # not one of the tasks: scored on all of them
    assert sweep.selection_settings(ev, "") == ev


def test_every_candidate_is_trained_with_its_settings_scored_and_the_best_selected(tmp_path):
    ctx, fakes = _ctx(tmp_path), Fakes(_weights(1, 9, 12, 4))
    trained = _run(ctx, fakes)
    assert fakes.trained == IDS and fakes.scored == IDS
    for cand in grid(ctx.stage):
        record = StageRecord.read(candidate_dir(ctx.stage_dir, cand["id"]))
        assert record.status == "done" and record.candidate == cand["id"]
        assert (record.config["beta"], record.config["learning_rate"]) == (cand["beta"], cand["learning_rate"])
        assert not set(sweep.NOT_TRAINING) & set(record.config)
        assert record.metrics["beta"] == cand["beta"] and record.metrics["learning_rate"] == cand["learning_rate"]
    m = trained.metrics
    assert m["selected"] == "beta0.1-lr2e-06" and m["selected_by"] == METRIC
    assert m["tie_rule"] == sweep.tie_rule(METRIC, SMOL_TIE) == f"best {METRIC}; among those not told apart from " \
        f"the best (paired p >= 0.05), the best {SMOL_TIE}, then {sweep.EARLIER}"
    assert sweep.tie_rule(METRIC, "") == f"best {METRIC}; ties go to {sweep.EARLIER}"
    assert [(row["candidate"], row[METRIC]) for row in m["candidates"]] == [(IDS[0], -81), (IDS[1], -1),
                                                                          (IDS[2], -4), (IDS[3], -36)]
    assert m["loss_last"] == 9 and trained.eval == {"metrics": {METRIC: -1}}  # the selected candidate's
    assert m["diagnostics"] == {"pass1": 0.5, "margin": [0.0, 9]}
    assert _weight(ctx.stage_dir / "model") == 9


def test_a_tie_goes_to_the_candidate_earlier_in_the_grid(tmp_path):
    trained = _run(_ctx(tmp_path), Fakes(_weights(1, 8, 12, 8)))  # beta0.1-lr2e-06 and beta0.2-lr2e-06: -4
    assert trained.metrics["selected"] == "beta0.1-lr2e-06"


def test_a_tie_is_broken_by_the_second_metric_in_its_direction(tmp_path):
    # three candidates at -4; the weight is the tie-break metric: 8 (two of them) or 12
    ctx = _ctx(tmp_path, f"dpo.gate.tie_break={TIE}")
    lower = _run(ctx, Fakes(_weights(1, 8, 12, 8), lower_is_better=True)).metrics
    assert lower["selected"] == "beta0.1-lr2e-06" and lower["tie_rule"] == sweep.tie_rule(METRIC, TIE)
    assert [row[TIE] for row in lower["candidates"]] == [1, 8, 12, 8]  # as measured, not signed
    shutil.rmtree(tmp_path / "stages")
    higher = _run(ctx, Fakes(_weights(1, 8, 12, 8), lower_is_better=False)).metrics
    assert higher["selected"] == "beta0.2-lr1e-06"
    assert sweep.selection_settings({"tasks": ["a", "b", "c"]}, "a/acc,none", "b/bpb,none") == {"tasks": ["a", "b"]}
    assert sweep.selection_settings({"tasks": ["a"]}, "a/acc,none", "d/bpb,none") == {"tasks": ["a", "d"]}


def test_a_candidate_without_the_metric_ranks_last(tmp_path):
    trained = _run(_ctx(tmp_path), Fakes(_weights(10, 1, 2, 3), unscored=(10,)))
    assert trained.metrics["selected"] == "beta0.2-lr2e-06"
    assert trained.metrics["candidates"][0][METRIC] == float("-inf")


@pytest.mark.slow
def test_a_sweep_of_one_candidate_needs_no_gate_metric(tmp_path):
    with pytest.raises(ConfigError, match="picks its model among 4 sweep candidate"):
        _ctx(tmp_path, "dpo.gate.metric=")
    unswept = _ctx(tmp_path, "dpo.gate.metric=", "dpo.sweep.beta=null", "dpo.sweep.learning_rate=null")
    assert not sweeps(unswept.stage)  # trained directly, as any stage without a sweep
    ctx = _ctx(tmp_path, "dpo.gate.metric=", "dpo.sweep.beta=[0.05]", "dpo.sweep.learning_rate=null")
    trained = _run(ctx, Fakes({"beta0.05": 3}))
    assert trained.metrics["selected"] == "beta0.05" and trained.metrics["selected_by"] is None


def test_a_failed_candidate_stops_the_sweep_and_the_rerun_trains_only_what_is_left(tmp_path):
    ctx = _ctx(tmp_path)
    failing = Fakes(_weights(1, 9))  # the third candidate's training raises (no weight for it)
    with pytest.raises(KeyError, match=IDS[2]):
        _run(ctx, failing)
    assert failing.trained == IDS[:2]
    rerun = Fakes(_weights(1, 9, 12, 4))
    assert _run(ctx, rerun).metrics["selected"] == IDS[1]
    assert rerun.trained == IDS[2:] and rerun.scored == IDS[2:]


def test_a_finished_sweep_is_reused_without_training_or_scoring(tmp_path):
    ctx = _ctx(tmp_path, "dpo.soup.top_k=2", "dpo.merge.stage=midtrain")
    _save(ctx.input_model, 0.0)
    first = _run(ctx, Fakes(_weights(1, 9, 12, 4)))
    again = Fakes(_weights(1, 9, 12, 4))
    assert _run(ctx, again).metrics == first.metrics and again.trained == again.scored == []


def test_a_trained_but_unscored_candidate_is_scored_without_retraining(tmp_path):
    ctx = _ctx(tmp_path)
    _run(ctx, Fakes(_weights(1, 9, 12, 4)))
    folder = candidate_dir(ctx.stage_dir, IDS[3])
    record = StageRecord.read(folder)
    record.status, record.eval = "trained", None  # interrupted during its evaluation
    record.write(folder)
    again = Fakes(_weights(1, 9, 12, 4))
    _run(ctx, again)
    assert again.trained == [] and again.scored == [IDS[3]]


def test_a_candidate_is_retrained_when_its_model_is_gone_or_the_stage_changed(tmp_path):
    ctx = _ctx(tmp_path)
    _run(ctx, Fakes(_weights(1, 9, 12, 4)))
    (candidate_dir(ctx.stage_dir, IDS[0]) / "model" / "model.safetensors").unlink()
    (candidate_dir(ctx.stage_dir, IDS[0]) / "model").rmdir()
    again = Fakes(_weights(1, 9, 12, 4))
    _run(ctx, again)
    assert again.trained == [IDS[0]]
    changed = Fakes(_weights(1, 9, 12, 4))
    _run(ctx, changed, stage_fp="another stage fingerprint")
    assert changed.trained == IDS


def test_one_candidate_alone_is_trained_for_an_array_task(tmp_path):
    ctx, fakes = _ctx(tmp_path), Fakes(_weights(1, 9, 12, 4))
    records = sweep.train_candidates(ctx, "fp", grid(ctx.stage), fakes.train, sweep.Scorer(fakes.evaluate, "eval"),
                                     only=2)
    assert [r.candidate for r in records] == [IDS[2]] and fakes.trained == [IDS[2]]
    assert not (ctx.stage_dir / "model").exists()
    rest = Fakes(_weights(1, 9, 12, 4))
    assert _run(ctx, rest).metrics["selected"] == IDS[1] and rest.trained == [IDS[0], IDS[1], IDS[3]]


def test_the_soup_averages_the_best_candidates_and_can_win(tmp_path):
    ctx = _ctx(tmp_path, "dpo.soup.top_k=2")
    trained = _run(ctx, Fakes(_weights(1, 8, 12, 3)))  # the two best: 8 and 12 (-4 each); their soup: 10 (0)
    soup = StageRecord.read(candidate_dir(ctx.stage_dir, "soup"))
    assert soup.config == {"sources": [f"stages/03-dpo/candidates/{c}/model" for c in (IDS[1], IDS[2])],
                           "weights": None}  # relative to the run folder, which may move
    assert _weight(Path(soup.output_model)) == 10 and soup.scores() == {METRIC: 0}
    m = trained.metrics
    assert m["selected"] == "soup" and [row["candidate"] for row in m["candidates"]] == [*IDS, "soup"]
    assert _weight(ctx.stage_dir / "model") == 10
    # the soup was not trained: no candidate's training figures are reported as the selected model's; the figures
    # every candidate shares (its diagnostics' pass rates of the samples they all trained on) are
    assert not {"steps", "loss_last", "beta", "learning_rate"} & set(m)
    assert m["diagnostics"] == {"pass1": 0.5}


def test_a_soup_tied_with_the_best_candidate_loses_to_it(tmp_path):
    trained = _run(_ctx(tmp_path, "dpo.soup.top_k=2"), Fakes(_weights(10, 1, 10, 4)))  # soup of two 10s: 10 too
    assert trained.metrics["selected"] == IDS[0]
    assert trained.metrics["candidates"][-1] == {"candidate": "soup", METRIC: 0, "selection_half": 0, "vs_input": None,
                                                 "vs_selected": None, SMOL_TIE: None}  # the smol recipe's tie-break


def test_the_merge_mixes_the_soup_with_the_earlier_stage(tmp_path):
    ctx = _ctx(tmp_path, "dpo.soup.top_k=2", "dpo.merge.stage=midtrain", "dpo.merge.weight=0.25")
    _save(ctx.input_model, 14.0)
    trained = _run(ctx, Fakes(_weights(1, 4, 12, 3), target=10.0))  # soup 8; merge 0.75 x 8 + 0.25 x 14 = 9.5
    merged = StageRecord.read(candidate_dir(ctx.stage_dir, "merge"))
    assert merged.config == {"sources": ["stages/03-dpo/candidates/soup/model", "stages/02-midtrain/model"],
                             "weights": [0.75, 0.25]}
    assert _weight(Path(merged.output_model)) == pytest.approx(9.5)
    assert trained.metrics["selected"] == "merge" and _weight(ctx.stage_dir / "model") == pytest.approx(9.5)


def test_a_merge_without_the_earlier_stage_s_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="dpo.merge.stage 'midtrain' has no finished checkpoint"):
        _run(_ctx(tmp_path, "dpo.merge.stage=midtrain"), Fakes(_weights(1, 9, 12, 4)))


def test_a_finished_soup_whose_model_is_gone_is_made_again(tmp_path):
    ctx = _ctx(tmp_path, "dpo.soup.top_k=2")
    _run(ctx, Fakes(_weights(1, 8, 12, 3)))
    soup = candidate_dir(ctx.stage_dir, "soup") / "model"
    (soup / "model.safetensors").unlink()
    soup.rmdir()
    assert _run(ctx, Fakes(_weights(1, 8, 12, 3))).metrics["selected"] == "soup" and _weight(soup) == 10


def test_a_run_folder_moved_mid_sweep_reuses_its_candidates_soup_included(tmp_path):
    first = Fakes(_weights(1, 8, 12, 3))
    _run(_ctx(tmp_path / "a", "dpo.soup.top_k=2"), first)
    (tmp_path / "a/stages/03-dpo/model/model.safetensors").unlink()  # as if killed before the selection was copied
    shutil.move(tmp_path / "a", tmp_path / "b")  # the records name their models relative to the run folder
    ctx, again = _ctx(tmp_path / "b", "dpo.soup.top_k=2"), Fakes(_weights(1, 8, 12, 3))
    trained = _run(ctx, again)
    assert again.trained == [] and again.scored == []  # every candidate and the soup reused where they are now
    assert trained.metrics["selected"] == "soup" and _weight(ctx.stage_dir / "model") == 10


def _scored(folder: Path, name: str, right: int, bpb: float) -> StageRecord:
    """A candidate whose eval kept per-problem rows of 100 problems: `right` of the 50 even ones (the selection
    half) right, every problem at `bpb` bits per byte (better lower)."""
    rows = [{"doc_id": i, "filter": "flexible-extract", "metrics": ["exact_match"],
             "exact_match": float(i % 2 == 0 and i // 2 < right)} for i in range(100)]
    rows += [{"doc_id": i, "filter": "none", "metrics": ["bpb"], "bpb": bpb + 0.001 * (i % 7)} for i in range(100)]
    (folder / name / "eval").mkdir(parents=True)
    (folder / name / "eval" / "samples_gsm8k_local_val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return StageRecord(stage="dpo", candidate=name, status="done", output_model=str(folder / name / "model"),
                       eval={"metrics": {METRIC: right / 100, TIE: bpb},
                             "higher_is_better": {"gsm8k_local_val": {"bpb": False}}})


def test_candidates_not_told_apart_are_ordered_by_the_tie_break(tmp_path):
    best, close, far = (_scored(tmp_path, "best", 30, 0.9), _scored(tmp_path, "close", 29, 0.7),
                        _scored(tmp_path, "far", 10, 0.5))
    chosen, how = sweep.pick([best, close, far], METRIC, TIE)
    assert chosen is close and how == f"picked by {TIE} among 2 not told apart by {METRIC}"  # far is told apart
    assert sweep.pick([best, close, far], METRIC, "")[0] is best  # without a tie-break the one-problem lead wins
    alone, how = sweep.pick([best, far], METRIC, TIE)
    assert alone is best and how == f"picked by {METRIC}: told apart from every other candidate"
