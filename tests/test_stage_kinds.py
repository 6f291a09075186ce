"""Stage kinds end to end, as users type them: a learning-rate sweep of the tiny recipe's SFT stage, then KTO and ORPO
(each kind one module of pipeline/stages/) on local files in TRL's formats (`data=`: unpaired rows, preference
pairs), all in one `accelerate launch pipeline/run.py recipe=tiny` on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT
from safetensors.torch import load_file

from pipeline.config import load_config
from pipeline.tiny.data import split_file

pytestmark = pytest.mark.slow
RATES = (1e-3, 3e-3)


@pytest.fixture(scope="module")
def chain(tmp_path_factory, cache_dir) -> Path:
    """The run folder of `stages=[sft,kto,orpo]`, the SFT stage a sweep over two learning rates; ORPO reads the tiny
    recipe's preference pairs as a JSONL file, KTO the same pairs as unpaired rows (each pair's chosen answer
    desirable, its rejected one not)."""
    out = tmp_path_factory.mktemp("kinds")
    args = ["recipe=tiny", *FAST, f"output_root={out}", f"cache_dir={cache_dir}", "stages=[sft,kto,orpo]",
            "sft.max_steps=12", f"sft.sweep={{learning_rate: [{RATES[1]}, {RATES[0]}]}}", "eval.limit=20"]
    pairs = split_file(load_config([*args, "stages=[sft]"]), "prefs")  # the tiny recipe's pairs (mixture tiny_prefs)
    unpaired = out / "unpaired.jsonl"
    unpaired.write_text("".join(json.dumps({"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"})
                                + "\n" for p in map(json.loads, pairs.read_text().splitlines())
                                for side in ("chosen", "rejected")))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu",
           str(ROOT / "pipeline" / "run.py"), *args, f"kto.data={unpaired}", f"orpo.data={pairs}",
           *(f"{k}.{key}" for k in ("kto", "orpo") for key in (
               "max_steps=4", "per_device_train_batch_size=4", "max_length=256", "gradient_checkpointing=false",
               "logging_steps=1", "learning_rate=1e-4"))]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / "tiny"


def _record(stage: Path) -> dict:
    return json.loads((stage / "stage.json").read_text())


def _weights(model: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model / "model.safetensors"))


def test_an_sft_learning_rate_sweep_trains_each_rate_and_selects_on_the_gate_metric(chain):
    stage = chain / "stages" / "01-sft"
    record = _record(stage)
    ids = [f"lr{r:g}" for r in RATES]  # ascending, whatever order the recipe lists them in
    assert [c["candidate"] for c in record["metrics"]["candidates"]] == ids
    for cand, rate in zip(ids, RATES, strict=True):
        trained = _record(stage / "candidates" / cand)
        assert trained["status"] == "done" and trained["config"]["learning_rate"] == pytest.approx(rate)
    selected = record["metrics"]["selected"]
    assert selected in ids and record["metrics"]["selected_by"] == "tiny_gsm/exact_match,strict-match"
    assert record["metrics"]["trained_with"]["learning_rate"] == pytest.approx(RATES[ids.index(selected)])
    assert _weights(stage / "model").keys() == _weights(stage / "candidates" / selected / "model").keys()
    first, second = (_weights(stage / "candidates" / c / "model") for c in ids)
    assert any(not torch.equal(first[k], second[k]) for k in first)  # two rates, two models
    table = (chain / "leaderboard.md").read_text()
    assert "| candidate | learning rate | selection half |" in table


@pytest.mark.parametrize("stage, rows", [("02-kto", "rows"), ("03-orpo", "pairs")])
def test_kto_and_orpo_train_their_input_on_preference_rows(chain, stage, rows):
    record = _record(chain / "stages" / stage)
    assert record["status"] == "done" and record["metrics"]["steps"] == 4 and record["metrics"][rows] > 0
    before, after = _weights(chain / record["input_model"]), _weights(chain / "stages" / stage / "model")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert "tiny_gsm" in json.dumps(record["eval"])  # scored like any stage


def test_kto_reads_every_unpaired_row_two_per_pair(chain):
    kto, orpo = (_record(chain / "stages" / s)["metrics"] for s in ("02-kto", "03-orpo"))
    assert kto["rows"] == 2 * orpo["pairs"]  # each pair: its chosen answer desirable, its rejected one not
