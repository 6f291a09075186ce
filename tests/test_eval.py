"""Evaluation in the chain: base baseline, per-stage scores, gates (pass, stop, warn), leaderboard."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import FAST, ROOT, run_cli

from pipeline import leaderboard
from pipeline.config import load_config
from pipeline.evaluate import run_eval, settings, write_tasks

pytestmark = pytest.mark.slow
METRIC = "tiny_gsm/exact_match,strict-match"
GSM8K_DIR = ROOT.parent / "shared" / "data" / "gsm8k"


def _run(out: Path, cache_dir: Path, *args: str):
    return run_cli("recipe=tiny", f"output_root={out}", f"cache_dir={cache_dir}", *FAST, *args)


@pytest.fixture(scope="module")
def gated_run(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("gated")
    proc = _run(out, cache_dir, f"sft.gate.metric={METRIC}", "sft.gate.min=0.0",
                f"midtrain.gate.metric={METRIC}", "midtrain.gate.min=0.0", "midtrain.gate.max_drop=1.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "tiny"


def test_every_checkpoint_is_scored_and_gated(gated_run):
    base = json.loads((gated_run / "stages/00-base/stage.json").read_text())
    assert METRIC in base["eval"]["metrics"]
    for stage in ("01-sft", "02-midtrain"):
        record = json.loads((gated_run / "stages" / stage / "stage.json").read_text())
        ev = record["eval"]
        assert 0.0 <= ev["metrics"][METRIC] <= 1.0 and METRIC in ev["stderr"]
        assert ev["samples"] == {"tiny_gsm": 50} and "tiny_gsm" in ev["task_configs"]
        assert record["gate"]["verdict"] == "pass"
        samples = (gated_run / "stages" / stage / "eval" / "samples_tiny_gsm.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in samples]  # one row per problem and answer filter
        assert {r["doc_id"] for r in rows} == set(range(50)) and {r["filter"] for r in rows} == {"strict-match",
                                                                                               "flexible-extract"}
        assert "<|im_start|>assistant" in rows[0]["arguments"][0][0]
    mid = json.loads((gated_run / "stages/02-midtrain/stage.json").read_text())
    assert mid["gate"]["previous"]["checkpoint"] == "01-sft"
    assert (gated_run / "eval_tasks" / "tiny_gsm.yaml").is_file()


def test_leaderboard_formats_agree_and_rebuild_is_identical(gated_run, tmp_path):
    data = json.loads((gated_run / "leaderboard.json").read_text())
    with open(gated_run / "leaderboard.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["checkpoint"] for r in data["rows"]] == [r["checkpoint"] for r in rows] == ["00-base", "01-sft",
                                                                                          "02-midtrain"]
    for js, cs in zip(data["rows"], rows, strict=True):
        assert float(cs[METRIC]) == pytest.approx(js[METRIC])
        assert cs["gate"] == js["gate"]
    md = (gated_run / "leaderboard.md").read_text()
    assert md.count("\n") == 2 + 3 and METRIC in md
    assert leaderboard.main([str(gated_run), "--out", str(tmp_path)]) == 0
    for name in ("leaderboard.csv", "leaderboard.json", "leaderboard.md", "leaderboard.html"):
        assert (tmp_path / name).read_text() == (gated_run / name).read_text(), name


def test_leaderboard_combines_runs(gated_run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(gated_run, other)
    table = leaderboard.export([gated_run, other], tmp_path / "both")
    assert len(table) == 6 and {r["run"] for r in table} == {"tiny", "other"}


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_html_renders_in_a_real_browser(gated_run, tmp_path):
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs it)")
        pytest.skip("chromium is not installed")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'p'}"]
    url = (gated_run / "leaderboard.html").resolve().as_uri()
    dom = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    assert dom.count("<tr") == 1 + 3  # header + one row per checkpoint
    assert dom.count("<polyline") >= 1 and "01-sft" in dom and METRIC in dom
    shot = tmp_path / "shot.png"
    subprocess.run([browser, *flags, f"--screenshot={shot}", "--window-size=1200,900", url],
                   capture_output=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 5000


def test_gate_stop_halts_the_chain_with_exit_3(tmp_path, cache_dir):
    proc = _run(tmp_path, cache_dir, f"sft.gate.metric={METRIC}", "sft.gate.min=1.01", "sft.gate.action=stop")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "gate after stage 01-sft" in proc.stderr and "< min 1.0100" in proc.stderr
    run = tmp_path / "tiny"
    assert not (run / "stages/02-midtrain").exists()
    rows = json.loads((run / "leaderboard.json").read_text())["rows"]
    assert rows[-1]["checkpoint"] == "01-sft" and rows[-1]["gate"].startswith("fail")


def test_gate_warn_goes_on(tmp_path, cache_dir):
    proc = _run(tmp_path, cache_dir, f"sft.gate.metric={METRIC}", "sft.gate.min=1.01", "sft.gate.action=warn")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "tiny/leaderboard.json").read_text())["rows"]
    assert [r["checkpoint"] for r in rows] == ["00-base", "01-sft", "02-midtrain"]
    assert rows[1]["gate"].startswith("warn")


def test_gate_on_a_metric_the_eval_does_not_produce_fails_at_start(tmp_path, cache_dir):
    proc = _run(tmp_path, cache_dir, "sft.gate.metric=tiny_gsm/accuracy,none")
    assert proc.returncode == 2
    assert "does not produce" in proc.stderr and "tiny_gsm/exact_match,strict-match" in proc.stderr
    assert not (tmp_path / "tiny/stages").exists()


@pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason="../shared/data/gsm8k is not beside this checkout")
def test_gsm8k_from_local_files_scores_a_real_checkpoint(gated_run, tmp_path):
    cfg = load_config(["recipe=tiny", "eval.tasks=[gsm8k_local]", "eval.num_fewshot=0", "eval.limit=4",
                       "eval.max_gen_toks=16", f"eval.gsm8k_dir={GSM8K_DIR}", f"output_root={tmp_path}"])
    tasks = write_tasks(cfg, tmp_path / "tasks")
    result = run_eval(gated_run / "stages/01-sft/model", settings(cfg, "sft"), tasks, tmp_path / "eval", cfg.model)
    assert isinstance(result["metrics"]["gsm8k_local/exact_match,strict-match"], float)
    assert result["samples"] == {"gsm8k_local": 4}
    first = json.loads(io.StringIO((tmp_path / "eval/samples_gsm8k_local.jsonl").read_text()).readline())
    assert first["doc"]["question"].startswith("Janet")  # the real GSM8K test set, first problem
