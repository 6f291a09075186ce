"""The fast tier's one end-to-end run: the README's first command, `smol-pipeline recipe=tiny`, as the editable
install puts it on the path, shrunk to one short SFT stage on a fresh cache (a smaller tiny base built, trained,
scored, gated, the leaderboard written), then the same command again, which reuses everything. The full FAST chain
from the installed wheel is tests/test_wheel.py's (slow tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import FAST
from safetensors import safe_open


def smol_pipeline(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`smol-pipeline ARGS` from the test interpreter's environment, as a user types it."""
    return subprocess.run([str(Path(sys.executable).parent / "smol-pipeline"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env={**os.environ})


def test_the_tiny_recipe_runs_end_to_end_then_a_rerun_reuses_it(tmp_path):
    args = ["recipe=tiny", f"output_root={tmp_path}/runs", f"cache_dir={tmp_path}/cache", *FAST, "stages=[sft]",
            "sft.max_steps=5", "tiny.pretrain_steps=8", "tiny.pretrain_examples=300", "tiny.sft_examples=120"]
    first = smol_pipeline(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    outcome = json.loads((run / "outcome.json").read_text())
    assert (outcome["exit_code"], outcome["outcome"], outcome["stage"]) == (0, "passed", "01-sft")
    sft = json.loads((run / "stages/01-sft/stage.json").read_text())
    assert sft["status"] == "done" and sft["metrics"]["steps"] == 5 and len(sft["metrics"]["losses"]) >= 1
    assert Path(sft["input_model"]).is_relative_to(tmp_path / "cache")  # the tiny base, built in this cache
    with safe_open(str(run / "stages/01-sft/model/model.safetensors"), "pt") as weights:
        assert len(list(weights.keys())) > 0
    assert "tiny_gsm/exact_match,strict-match" in sft["eval"]["metrics"] and sft["gate"]["action"] == "warn"
    board = json.loads((run / "leaderboard.json").read_text())
    assert [row["checkpoint"] for row in board["rows"]] == ["00-base", "01-sft"]
    assert "trained in" in first.stderr and "leaderboard:" in first.stderr + first.stdout

    again = smol_pipeline(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "trained in" not in again.stderr  # nothing trained twice
    assert json.loads((run / "stages/01-sft/stage.json").read_text())["model_digest"] == sft["model_digest"]
