"""Evaluation in the chain: base baseline, per-stage scores, gates (pass, stop, warn), leaderboard."""

from __future__ import annotations

import csv
import json
import math
import shutil
import statistics
from pathlib import Path

import pytest
from conftest import FAST, ROOT, ink, render_in_chromium, run_cli
from huggingface_hub import ModelCard

from pipeline.config import load_config
from pipeline.evaluation.lmeval import run_eval, settings, write_tasks
from pipeline.report import leaderboard

pytestmark = pytest.mark.slow
METRIC = "tiny_gsm/exact_match,strict-match"
FLEX = "tiny_gsm/exact_match,flexible-extract"  # a few steps of training already score on it
GSM8K_DIR = ROOT / "tests" / "fixtures" / "gsm8k"  # the first rows of GSM8K, shipped


def _run(out: Path, cache_dir: Path, *args: str):
    return run_cli("recipe=tiny", f"output_root={out}", f"cache_dir={cache_dir}", *FAST, *args)


@pytest.fixture(scope="module")
def gated_run(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("gated")
    # sft's floor cannot be met (a warning verdict, the chain goes on); midtrain's gates always pass; midtrain is
    # scored by stock lm-eval
    proc = _run(out, cache_dir, f"sft.gate.metric={METRIC}", "sft.gate.min=1.0",
                f"midtrain.gate.metric={FLEX}", "midtrain.gate.min=0.0", "midtrain.gate.max_drop=0.5",
                "midtrain.eval.fast_generation=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out / "tiny" / "terminal.log").write_text(proc.stderr)
    return out / "tiny"


def _outcomes(run: Path, stage: str, metric: str) -> dict[int, float]:
    lines = (run / "stages" / stage / "eval/samples_tiny_gsm.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return {int(r["doc_id"]): r["exact_match"] for r in rows if r["filter"] == metric.partition(",")[2]}


def test_every_checkpoint_is_scored_and_gated(gated_run):
    base = json.loads((gated_run / "stages/00-base/stage.json").read_text())
    assert METRIC in base["eval"]["metrics"] and base["eval"]["fast_generation"] is True
    for stage, fast in (("01-sft", True), ("02-midtrain", False)):
        record = json.loads((gated_run / "stages" / stage / "stage.json").read_text())
        ev = record["eval"]
        assert ev["fast_generation"] is fast and ev["settings"]["fast_generation"] is (False if not fast else None)
        assert 0.0 <= ev["metrics"][METRIC] <= 1.0 and METRIC in ev["stderr"]
        assert ev["samples"] == {"tiny_gsm": 50} and "tiny_gsm" in ev["task_configs"]
        samples = (gated_run / "stages" / stage / "eval" / "samples_tiny_gsm.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in samples]  # one row per problem and answer filter
        assert {r["doc_id"] for r in rows} == set(range(50)) and {r["filter"] for r in rows} == {"strict-match",
                                                                                               "flexible-extract"}
        assert "<|im_start|>assistant" in rows[0]["arguments"][0][0]
        for metric in (METRIC, FLEX):
            assert ev["metrics"][metric] == pytest.approx(sum(_outcomes(gated_run, stage, metric).values()) / 50)
    sft = json.loads((gated_run / "stages/01-sft/stage.json").read_text())["gate"]
    assert sft["verdict"] == "warn" and not sft["passed"] and f"{sft['value']:.4f} < min 1.0000" in sft["reason"]
    mid = json.loads((gated_run / "stages/02-midtrain/stage.json").read_text())["gate"]
    assert mid["verdict"] == "pass" and mid["previous"]["checkpoint"] == "01-sft"
    # the drop is judged problem by problem against 01-sft: recompute the paired difference from the samples
    before, after = _outcomes(gated_run, "01-sft", FLEX), _outcomes(gated_run, "02-midtrain", FLEX)
    d = [after[i] - before[i] for i in range(50)]
    se = statistics.stdev(d) / math.sqrt(50)
    assert mid["paired"]["n"] == 50 and mid["paired"]["diff"] == pytest.approx(statistics.mean(d))
    assert mid["paired"]["se"] == pytest.approx(se)
    assert f"(01-sft) -> {mid['value']:.3f}: {statistics.mean(d):+.3f} [" in mid["reason"]
    assert "n=50): no significant drop beyond max_drop" in mid["reason"]
    assert (gated_run / "eval_tasks" / "tiny_gsm.yaml").is_file()


def test_each_checkpoint_has_a_model_card(gated_run):
    for stage in ("01-sft", "02-midtrain"):
        card = ModelCard.load(gated_run / "stages" / stage / "model/README.md")
        record = json.loads((gated_run / "stages" / stage / "stage.json").read_text())
        results = {f"{r.dataset_type}/{r.metric_name}": r.metric_value for r in card.data.eval_results}
        assert results == record["eval"]["metrics"] and card.data.model_name == f"tiny/{stage}"
        assert f"| {stage} | tiny_sft" in card.text or f"| {stage} | tiny_midtrain" in card.text
        assert f"{record['eval']['metrics'][METRIC]:.4f} +- {record['eval']['stderr'][METRIC]:.4f}" in card.text
    final = ModelCard.load(gated_run / "stages/02-midtrain/model/README.md").text
    sft_lr = json.loads((gated_run / "stages/01-sft/stage.json").read_text())["config"]["learning_rate"]
    assert f"| 01-sft | tiny_sft (sft) | learning_rate={sft_lr:.4g}, max_steps=30" in final  # the whole chain
    assert "| 00-base |" in final and "warn: " in final


def test_leaderboard_formats_agree_and_rebuild_is_identical(gated_run, tmp_path):
    data = json.loads((gated_run / "leaderboard.json").read_text())
    with open(gated_run / "leaderboard.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["checkpoint"] for r in data["rows"]] == [r["checkpoint"] for r in rows] == ["00-base", "01-sft",
                                                                                          "02-midtrain"]
    for js, cs in zip(data["rows"], rows, strict=True):
        assert float(cs[METRIC]) == pytest.approx(js[METRIC])
        assert cs["gate"] == js.get("gate", "")
        assert all(isinstance(v, (int, float)) or "[" not in v for v in js.values())  # typed: no reprs, no prose
    assert data["rows"][1]["gate"] == "warn" and data["rows"][1]["gate_metric"] == METRIC
    assert data["splits"] == {"tiny_gsm": "test"}
    md = (gated_run / "leaderboard.md").read_text()
    assert md.startswith("# Leaderboard\n\n## tiny: recipe tiny, ") and "final model " in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 3 and all(line.count(" | ") <= 7 for line in table)  # at most 8 columns
    assert "- sft on test: " in md and "(Tango score, +" in md and "- midtrain on test: " in md
    terminal = (gated_run / "terminal.log").read_text()  # the end of the run prints the same headline
    assert all(line in terminal for line in table) and f"leaderboard: {gated_run / 'leaderboard.html'}" in terminal
    assert leaderboard.main([str(gated_run), "--out", str(tmp_path)]) == 0
    for name in ("leaderboard.csv", "leaderboard.json", "leaderboard.md", "leaderboard.html"):
        assert (tmp_path / name).read_text() == (gated_run / name).read_text(), name


def test_leaderboard_combines_runs(gated_run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(gated_run, other)
    table = leaderboard.export([gated_run, other], tmp_path / "both")
    assert len(table) == 6 and {r["run"] for r in table} == {"tiny", "other"}


def test_html_renders_in_a_real_browser_at_1280px_without_sideways_scroll(gated_run, tmp_path):
    scroll_width, shot, dom = render_in_chromium(gated_run / "leaderboard.html", tmp_path)
    assert scroll_width <= 1280
    assert ink(shot) > 0.01  # not blank: text, table borders and the chart
    headline = dom[dom.index('id="leaderboard"'):dom.index("</table>")]
    assert headline.count("<tr") == 1 + 3 and "01-sft" in headline and "warn" in headline
    assert headline.count("<th>") <= 8 and (" [-" in headline or " [+" in headline)  # the paired test interval
    chart = dom[dom.index('id="charts"'):]
    assert chart.count("<svg") == 2 and METRIC in chart and FLEX in chart and "01-sft" in chart  # each gated metric
    assert "<polyline" not in dom and 'id="details"' in dom  # no line joining checkpoints; hyperparameters folded


def test_gate_stop_halts_the_chain_with_exit_3(tmp_path, cache_dir):
    proc = _run(tmp_path, cache_dir, f"sft.gate.metric={METRIC}", "sft.gate.min=1.0", "sft.gate.action=stop")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "gate after stage 01-sft" in proc.stderr and "< min 1.0000" in proc.stderr
    assert f"chain stopped (leaderboard: {tmp_path / 'tiny/leaderboard.html'})" in proc.stderr
    assert "| 01-sft |" in proc.stderr  # the headline, printed before the stop
    run = tmp_path / "tiny"
    assert not (run / "stages/02-midtrain").exists()
    rows = json.loads((run / "leaderboard.json").read_text())["rows"]
    assert rows[-1]["checkpoint"] == "01-sft" and rows[-1]["gate"].startswith("fail")


def test_gate_warn_goes_on(tmp_path, cache_dir):
    proc = _run(tmp_path, cache_dir, f"sft.gate.metric={METRIC}", "sft.gate.min=1.0", "sft.gate.action=warn")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "tiny/leaderboard.json").read_text())["rows"]
    assert [r["checkpoint"] for r in rows] == ["00-base", "01-sft", "02-midtrain"]
    assert rows[1]["gate"].startswith("warn")


def test_gate_on_a_metric_the_eval_does_not_produce_fails_at_start(tmp_path, cache_dir):
    proc = _run(tmp_path, cache_dir, "sft.gate.metric=tiny_gsm/accuracy,none")
    assert proc.returncode == 2
    assert "does not produce" in proc.stderr and "tiny_gsm/exact_match,strict-match" in proc.stderr
    assert not (tmp_path / "tiny/stages").exists()


def test_gsm8k_from_local_files_scores_a_real_checkpoint(gated_run, tmp_path):
    """Scores the real GSM8K test file, then items whose answers are known: the same questions twice, once with
    the answer the checkpoint gives (right by construction) and once with one it cannot give (wrong)."""
    def score(gsm_dir: Path, limit: int, out: str) -> tuple[dict, list[dict]]:
        cfg = load_config(["recipe=tiny", "eval.tasks=[gsm8k_local]", "eval.num_fewshot=0", f"eval.limit={limit}",
                           "eval.max_gen_toks=32", f"eval.gsm8k_dir={gsm_dir}", f"output_root={tmp_path}"])
        tasks = write_tasks(cfg, tmp_path / out / "tasks")
        result = run_eval(gated_run / "stages/01-sft/model", settings(cfg, "sft"), tasks, tmp_path / out, cfg.model)
        lines = (tmp_path / out / "samples_gsm8k_local.jsonl").read_text().splitlines()
        return result, [r for r in map(json.loads, lines) if r["filter"] == "flexible-extract"]

    real, samples = score(GSM8K_DIR, 4, "real")
    assert real["samples"] == {"gsm8k_local": 4}
    assert samples[0]["doc"]["question"].startswith("Janet") and samples[0]["target"].endswith("#### 18")
    said = [r["filtered_resps"][0] for r in sorted(samples, key=lambda r: r["doc_id"])]  # last number of each answer
    assert samples[0]["exact_match"] == float(said[0].strip("$.").replace(",", "") == "18")  # Janet makes $18
    right = [a for a in said if a != "[invalid]"]
    assert right, f"the checkpoint wrote no number at all: {said}"
    known = tmp_path / "known"
    known.mkdir()
    items = [{"question": r["doc"]["question"], "answer": f"... #### {a}"} for r, a in zip(samples, said, strict=True)]
    items += [{"question": r["doc"]["question"], "answer": "... #### -987654321"} for r in samples]
    (known / "test.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    shutil.copy(GSM8K_DIR / "train.jsonl", known / "train.jsonl")
    result, rescored = score(known, 0, "known")
    assert result["samples"] == {"gsm8k_local": 8}
    assert result["metrics"]["gsm8k_local/exact_match,flexible-extract"] == pytest.approx(len(right) / 8)
    assert [r["exact_match"] for r in sorted(rescored, key=lambda r: r["doc_id"])][4:] == [0.0] * 4
    real_right = sum(r["exact_match"] for r in samples) / 4  # the real score: the checkpoint's answers vs GSM8K's
    assert real["metrics"]["gsm8k_local/exact_match,flexible-extract"] == pytest.approx(real_right)


def test_validation_task_is_disjoint_scored_and_labelled(tmp_path, tiny_base, caplog):
    from pipeline.chain.preflight import warn_test_split_gates
    from pipeline.tiny.data import DATA_KEYS, build_splits

    cfg = load_config(["recipe=tiny", *FAST, "eval.tasks=[tiny_gsm_val,tiny_gsm]",
                       "eval.limit={tiny_gsm_val: 5, tiny_gsm: 3}", "eval.max_gen_toks=32", f"output_root={tmp_path}",
                       f"cache_dir={tmp_path / 'cache'}"])
    splits = build_splits({k: cfg.tiny[k] for k in DATA_KEYS})
    validation = {r["question"] for r in splits["validation"]}
    trained = {m["messages"][0]["content"] for s in ("sft", "reasoning") for m in splits[s]}
    assert len(validation) == 50 and not validation & ({r["question"] for r in splits["test"]} | trained)
    tasks = write_tasks(cfg, tmp_path / "tasks")
    result = run_eval(tiny_base, settings(cfg, "sft"), tasks, tmp_path / "eval", cfg.model)
    assert result["splits"] == {"tiny_gsm_val": "validation", "tiny_gsm": "test"}
    assert result["samples"] == {"tiny_gsm_val": 5, "tiny_gsm": 3}  # eval.limit per task
    test_rows = [json.loads(line) for line in (tmp_path / "eval/samples_tiny_gsm.jsonl").open()]
    asked = {r["doc_id"]: r["doc"]["question"] for r in test_rows}  # a row per filter
    assert asked == {i: r["question"] for i, r in enumerate(splits["test"][:3])}  # the first ones, as `limit` takes
    asked = {json.loads(line)["doc"]["question"] for line in (tmp_path / "eval/samples_tiny_gsm_val.jsonl").open()}
    assert asked <= validation
    row = {"run": "r", "checkpoint": "01-sft", "tiny_gsm_val/exact_match,strict-match": 0.1, METRIC: 0.2}
    headers = leaderboard.headers([row], result["splits"])
    assert headers[METRIC] == f"{METRIC} [test]"
    assert headers["tiny_gsm_val/exact_match,strict-match"] == "tiny_gsm_val/exact_match,strict-match [validation]"
    warn_test_split_gates(cfg, tasks)  # FAST gates judge the test task: allowed, with a warning
    assert "judges tiny_gsm on a test split" in caplog.text
