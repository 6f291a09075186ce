"""The headline and the flat leaderboard on a constructed run folder whose per-problem results are known."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from pipeline.evaluation import stats
from pipeline.report import charts, headline, leaderboard
from pipeline.runfolder import StageRecord

VAL, TEST = "gsm_val/exact_match,strict-match", "gsm/exact_match,strict-match"
SPLITS = {"gsm_val": "validation", "gsm": "test"}


def _eval(folder: Path, right: dict[str, list[int]]) -> dict:
    """Write `samples_<task>.jsonl` (one 0/1 result per problem) into `folder/eval`; return the eval record."""
    (folder / "eval").mkdir(parents=True)
    metrics, stderr = {}, {}
    for task, values in right.items():
        rows = [{"doc_id": i, "filter": "strict-match", "exact_match": float(v)} for i, v in enumerate(values)]
        (folder / "eval" / f"samples_{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        mean = sum(values) / len(values)
        metrics[f"{task}/exact_match,strict-match"] = mean
        metrics[f"{task}/exact_match,flexible-extract"] = min(1.0, mean + 0.05)  # answers found outside the format
        metrics[f"{task}/stopped,strict-match"] = 0.9  # a tenth of the answers cut by the token budget
        stderr[f"{task}/exact_match,strict-match"] = (mean * (1 - mean) / (len(values) - 1)) ** 0.5
    return {"metrics": metrics, "stderr": stderr, "splits": SPLITS, "wall_time_s": 3.0}


def _stage(folder: Path, right: dict[str, list[int]], **fields) -> Path:
    StageRecord(eval=_eval(folder, right), **fields).write(folder)
    return folder


@pytest.fixture
def run(tmp_path) -> Path:
    """base (0 right) -> 01-sft (most right: a gain) -> 02-dpo (a sweep of two candidates; one test problem
    lost: no significant change)."""
    run = tmp_path / "demo"
    (run).mkdir()
    (run / "manifest.json").write_text(json.dumps({"recipe": "demo", "created": "2026-12-04T10:00:00+0000",
                                                   "code": {"git_commit": "abcdef0123", "git_dirty": False}}))
    n = 40
    sft = [1] * 30 + [0] * 10
    _stage(run / "stages/00-base", {"gsm_val": [0] * n, "gsm": [0] * n}, stage="base", index=0, output_model="base")
    gate = {"metric": VAL, "value": 0.75, "verdict": "pass", "test": "no_significant_drop", "passed": True,
            "paired": stats.paired_difference(run / "stages/00-base/eval", run / "stages/00-base/eval", VAL)}
    _stage(run / "stages/01-sft", {"gsm_val": sft, "gsm": sft}, stage="sft", index=1, input_model="base",
           output_model="runs/demo/stages/01-sft/model", wall_time_s=90.0, gate=gate,
           config={"learning_rate": 0.002, "max_steps": -1, "loss_type": ["nll"]})
    dpo = run / "stages/02-dpo"
    table = []
    for cand, beta in (("beta0.5-lr1e-05", 0.5), ("beta2-lr1e-05", 2.0)):
        folder = _stage(dpo / "candidates" / cand, {"gsm_val": sft}, stage="dpo", candidate=cand,
                        config={"beta": beta, "learning_rate": 1e-5, "loss_type": ["apo_zero"]})
        paired = stats.paired_difference(run / "stages/01-sft/eval", folder / "eval", VAL, "selection")
        table.append({"candidate": cand, "selection_half": 0.75, "vs_input": paired})
    _stage(dpo, {"gsm_val": sft, "gsm": [1] * 29 + [0] * 11}, stage="dpo", index=2,
           input_model="runs/demo/stages/01-sft/model", output_model="runs/demo/stages/02-dpo/model",
           wall_time_s=200.0, config={"sweep": {"beta": [0.5, 2.0], "learning_rate": [1e-5]}},
           metrics={"candidates": table, "selected": "beta2-lr1e-05", "selected_by": VAL, "selection_problems": n // 2,
                    "diagnostics": {"prompts": 400, "k": 4, "pass1": 0.4, "passk": 0.65, "usable": 0.45,
                                    "usable_what": "a right and a wrong answer", "margin": [0.0, 0.11]}})
    return run


def test_headline_reports_each_stage_against_its_input_on_test(run):
    records = [StageRecord.read(d) for d in sorted((run / "stages").iterdir())]
    assert headline.metrics(records, SPLITS) == (VAL, TEST)
    h = headline.build(run)
    assert (h.validation, h.test, h.splits) == (VAL, TEST, SPLITS)
    rows = h.rows
    assert [r["checkpoint"] for r in rows] == ["00-base", "01-sft", "02-dpo"]
    sft, dpo = rows[1]["vs_input"], rows[2]["vs_input"]
    assert "vs_input" not in rows[0] and sft["n"] == dpo["n"] == 40
    assert sft["diff"] == pytest.approx(0.75) and sft["ci_low"] > 0
    assert dpo["diff"] == pytest.approx(-1 / 40) and dpo["ci_low"] < 0 < dpo["ci_high"]
    assert headline.sentence(rows[1]).startswith("sft on test: +0.750 [") and "a significant gain" in \
        headline.sentence(rows[1])
    assert headline.sentence(rows[2]).startswith("dpo on test: -0.025 [-") and headline.sentence(rows[2]).endswith(
        f"(Tango score, +{dpo['gained']} / -{dpo['lost']}, n=40): no significant change")
    assert headline.title(h) == ("demo: recipe demo, 2026-12-04, code abcdef0, final model "
                                         "runs/demo/stages/02-dpo/model")
    cells = headline.cells(rows[2])
    assert len(cells) == len(headline.COLUMNS) <= 8 and cells[0] == "02-dpo (beta2-lr1e-05)" and cells[-1] == "3.3 min"
    test = rows[2]["test"]
    assert cells[3] == f"{test:.3f} / {min(1.0, test + 0.05):.3f} / 90%"  # format against reasoning, side by side


def test_after_a_gate_on_a_continuous_metric_the_test_column_is_the_accuracy():
    bpb = {"gsm_val_bpb/bits_per_byte,none": 0.7, "gsm_bpb/bits_per_byte,none": 0.71}
    splits = {**SPLITS, "gsm_val_bpb": "validation", "gsm_bpb": "test"}
    records = [StageRecord(eval={"metrics": {**bpb, VAL: 0.1, TEST: 0.1}}),
               StageRecord(eval={"metrics": {**bpb, VAL: 0.2, TEST: 0.2}},
                           gate={"metric": "gsm_val_bpb/bits_per_byte,none"})]
    assert headline.metrics(records, splits) == ("gsm_val_bpb/bits_per_byte,none", TEST)
    records[1].eval["metrics"] = {"gsm_val_bpb/bits_per_byte,none": 0.7, "gsm_bpb/bits_per_byte,none": 0.7}
    records[0].eval["metrics"] = dict(records[1].eval["metrics"])
    assert headline.metrics(records, splits) == ("gsm_val_bpb/bits_per_byte,none", "gsm_bpb/bits_per_byte,none")


def test_a_stage_not_scored_on_test_hands_the_comparison_to_the_checkpoint_before_it(run):
    sft = run / "stages/01-sft"
    (sft / "eval/samples_gsm.jsonl").unlink()
    record = StageRecord.read(sft)
    record.eval["metrics"].pop(TEST)
    record.write(sft)  # the sft stage scored on validation only (a recipe saving the test set's generation)
    rows = headline.build(run).rows
    assert rows[1]["test"] is None and "vs_input" not in rows[1]
    assert rows[2]["vs"] == "00-base" and rows[2]["vs_input"]["diff"] == pytest.approx(29 / 40)
    assert headline.cells(rows[2])[4].endswith(", n=40) vs 00-base")
    assert headline.sentence(rows[2]).startswith("dpo on test vs 00-base: +0.725 [")
    dpo = next(r for r in leaderboard.rows([headline.build(run)]) if r["checkpoint"] == "02-dpo")
    assert dpo["test_vs"] == "00-base" and dpo["test_vs_input_diff"] == pytest.approx(29 / 40)


def test_markdown_has_the_title_a_short_table_sentences_and_the_sweep_apart(run):
    md = headline.markdown(headline.build(run))
    tables = [line for line in md.splitlines() if line.startswith("| ")]
    assert md.startswith("## demo: recipe demo, 2026-12-04")
    assert all(line.count(" | ") <= 7 for line in tables)  # at most 8 columns
    assert "- sft on test: +0.750 [" in md and "### 02-dpo: sweep" in md
    assert "| beta2-lr1e-05 (selected) | 2 | 1e-05 | 0.750 |" in md
    assert ("- why dpo: input pass@1 0.40, pass@4 0.65 on 400 training prompts; 45% gave a right and a wrong answer; "
            "margin 0.00 -> 0.11\n") in md


def test_csv_and_json_are_flat_and_typed(run, tmp_path):
    table = leaderboard.export([run], tmp_path)
    data = json.loads((tmp_path / "leaderboard.json").read_text())
    assert data["splits"] == SPLITS and [r["checkpoint"] for r in data["headline"]["demo"]] == ["00-base", "01-sft",
                                                                                                "02-dpo"]
    for row in data["rows"]:
        assert all(isinstance(v, (int, float)) or (isinstance(v, str) and v and "[" not in v and ": " not in v)
                   for v in row.values()), row
        assert -1 not in row.values()
    sft = next(r for r in table if r["checkpoint"] == "01-sft")
    assert "max_steps" not in sft and sft["loss_type"] == "nll" and sft["gate"] == "pass"
    assert sft["test_vs_input_diff"] == pytest.approx(0.75) and sft["test_vs_input_n"] == 40
    cand = next(r for r in table if r.get("candidate") == "beta0.5-lr1e-05")
    assert cand["kind"] == "candidate" and cand["selection_half"] == 0.75 and cand["selection_vs_input_n"] == 20
    with open(tmp_path / "leaderboard.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert all(any(r[c] for r in rows) for c in rows[0])  # no column is empty in every row
    assert leaderboard.headers(table, data["splits"])[TEST] == f"{TEST} [test]"


def test_the_heatmap_scale_spans_one_scores_noise():
    norm = charts.anchored_norm([0.937, 0.940], 300)  # one problem apart out of 300
    noise = 1.96 * (0.9385 * 0.0615 / 300) ** 0.5
    assert norm.vmax - norm.vmin >= 2 * noise - 1e-9
    assert norm(0.940) - norm(0.937) < 0.15  # nearly one shade, not full contrast
    wide = charts.anchored_norm([0.1, 0.9], 300)
    assert (wide.vmin, wide.vmax) == (0.1, 0.9)  # real differences keep the full range


def test_the_sweep_table_says_which_candidates_the_selection_half_cannot_tell_apart():
    alike = stats.compare([1.0] * 10 + [0.0] * 30, [1.0] * 9 + [0.0] * 31)  # one problem lost: p about 1
    apart = stats.compare([1.0] * 20 + [0.0] * 20, [0.0] * 40)  # twenty lost
    rows = [{"candidate": c, "settings": {"beta": b}, "selection_half": v, "vs_input": None, "vs_selected": p,
             "selected": p is None} for c, b, v, p in (("a", 0.1, 0.25, None), ("b", 0.2, 0.225, alike),
                                                       ("c", 0.3, 0.0, apart))]
    head, body = headline.sweep_table(rows)
    assert head[-1] == "told apart from the selected on it?"
    assert [r[-1] for r in body] == ["", f"no (p={alike['p_value']:.2g})", f"yes (p={apart['p_value']:.2g})"]
    assert alike["p_value"] >= 0.05 > apart["p_value"]


def test_the_readme_shows_headlines_with_the_columns_the_headline_prints():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    heads = [line for line in readme.splitlines() if line.startswith("| checkpoint |")]
    assert heads, "README shows no headline table"
    for head in heads:
        assert tuple(c.strip() for c in head.strip("|").split("|")) == headline.COLUMNS, head
