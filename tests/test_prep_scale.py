"""Data preparation longer than the collective timeout, in a 2-process run.

Rank 0 tokenises the stage's data while a test hook (`PIPELINE_TEST_SLOW_PREP_S`) makes that take 15 s,
three times the collective timeout of 5 s the run sets (`collective_timeout_s=5`). The run completes
because the other rank waits for the cache folder on disk, not at a barrier (pipeline/data/prep.py), and the
process group really runs with the short timeout (read back from the group into the stage metrics).
"""

from __future__ import annotations

import json

import pytest
from conftest import FAST, ROOT, run_cli

pytestmark = pytest.mark.slow


def test_preparation_longer_than_the_collective_timeout_completes(tmp_path, cache_dir, tiny_base):
    launcher = ["accelerate", "launch", "--config_file", str(ROOT / "recipes/accelerate/cpu.yaml"),
                "--num_processes", "2"]
    proc = run_cli("recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *FAST, "stages=[sft]",
                   "sft.max_steps=2", "sft.max_length=300",  # a max_length no other test uses: a tokenising miss
                   "eval.tasks=[]", "sft.gate.metric=", "collective_timeout_s=5", launcher=launcher,
                   env={"PIPELINE_TEST_SLOW_PREP_S": "15"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = json.loads((tmp_path / "tiny/stages/01-sft/stage.json").read_text())["metrics"]
    assert metrics["world_size"] == 2 and metrics["collective_timeout_s"] == 5
    log = (tmp_path / "tiny/pipeline.log").read_text()
    assert "preparation slowed by 15 s" in log and "rows/s)" in log
