"""The GPU kit's CPU variant (`python -m bench.gpu` without CUDA): every row runs or says why it cannot.

On CPU: dense sdpa SFT trains; flex_attention has no backward on CPU and activation offloading needs CUDA,
so those rows carry the reason; the DPO step is timed. Takes about a minute (3 on a loaded 2-core machine).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU variant")]


def test_cpu_variant_prints_every_row(tmp_path):
    out = tmp_path / "kit.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GPU kit on cpu" in proc.stdout and "tokens_per_s" in proc.stdout
    rows = {(r["run"], r["attention"], r["offload"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows["sft", "sdpa", False]["tokens_per_s"] > 0 and "error" not in rows["sft", "sdpa", False]
    assert "needs a CUDA GPU" in rows["sft", "flex_attention", True]["error"]
    assert rows["sft", "flex_attention", False].get("tokens_per_s") or rows["sft", "flex_attention", False]["error"]
    assert rows["dpo", "sdpa", False]["step_s"] > 0
