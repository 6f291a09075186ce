"""Dress rehearsal of the real recipe: `recipe=smol`, changed by overrides only, runs SFT, mid-training and
APO on the Preference pairs, with every eval and gate, and exits 0.

The overrides: SmolLM2's real tokenizer and chat template on its model cut to 2 layers, the Hub-shaped
smoltalk2 / GSM8K fixtures read through the same `hub:` code path (`hub_mirror`), 2 steps per stage, short
sequences, a 2-candidate sweep, 2 problems per eval task (GSM8K's validation slice and test, from the fixture).
"""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, run_cli
from realmodel import smollm2_shrunk

pytestmark = pytest.mark.slow
FIXTURES = ROOT / "tests" / "fixtures" / "hub"
METRIC = "gsm8k_local_val/exact_match,flexible-extract"  # smol's gate metric
OVERRIDES = [
    f"hub_mirror={FIXTURES}", "eval.limit=2", "eval.max_gen_toks=16", "eval.batch_size=2", "dpo.sweep.beta=[0.05]",
    "dpo.sweep.learning_rate=[1e-6,2e-6]",
    *(f"{s}.{k}" for s in ("sft", "midtrain", "dpo") for k in (
        "max_steps=2", "max_length=1024", "gradient_accumulation_steps=2", "logging_steps=1")),
]


def test_smol_recipe_runs_sft_midtrain_apo_and_gates_on_hub_shaped_data(tmp_path, cache_dir):
    model = smollm2_shrunk(tmp_path / "model")
    proc = run_cli("recipe=smol", f"model.name_or_path={model}", f"output_root={tmp_path}/runs",
                   f"cache_dir={cache_dir}", *OVERRIDES, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = tmp_path / "runs" / "smol" / "stages"
    assert sorted(p.name for p in stages.iterdir()) == ["00-base", "01-sft", "02-midtrain", "03-dpo"]
    records = {p.name: json.loads((p / "stage.json").read_text()) for p in stages.iterdir()}
    for name in ("01-sft", "02-midtrain", "03-dpo"):
        record = records[name]
        assert record["status"] == "done" and METRIC in record["eval"]["metrics"], name
    assert records["01-sft"]["metrics"]["steps"] == records["02-midtrain"]["metrics"]["steps"] == 2
    for cand in ("beta0.05-lr1e-06", "beta0.05-lr2e-06"):  # dpo trains its grid; a soup or merge trains nothing
        assert json.loads((stages / "03-dpo/candidates" / cand / "stage.json").read_text())["metrics"]["steps"] == 2
    dpo = records["03-dpo"]
    assert dpo["config"]["loss_type"] == ["apo_zero"] and dpo["gate"]["passed"] and dpo["gate"]["metric"] == METRIC
    assert [c["candidate"] for c in dpo["metrics"]["candidates"]] == ["beta0.05-lr1e-06", "beta0.05-lr2e-06",
                                                                     "soup", "merge"]
    sft_data = {s["split"] for s in records["01-sft"]["data"]}
    assert len(sft_data) == 25 and all(s.get("mirror") for s in records["01-sft"]["data"])
