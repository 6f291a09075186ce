"""The tiny recipe end to end through the real CLI: training, handoff, run folder, resume, refusal."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT, run_cli
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def _changed(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def tiny_chain(tmp_path_factory, cache_dir):
    """The FAST chain through `smol-pipeline`, as a user types it: (run folder, arguments, the process)."""
    out = tmp_path_factory.mktemp("runs")
    args = ["recipe=tiny", f"output_root={out}", f"cache_dir={cache_dir}", *FAST]
    proc = subprocess.run([str(Path(sys.executable).with_name("smol-pipeline")), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "tiny", args, proc


@pytest.fixture(scope="module")
def tiny_run(tiny_chain):
    return tiny_chain[:2]


def test_terminal_reads_like_a_report(tiny_chain):
    """No library warning, raw dict or Python repr on the terminal: one line per logging step, rounded figures,
    the summary table and the leaderboard's path at the end; the trainers' full records are in pipeline.log."""
    run, _, proc = tiny_chain
    text = proc.stdout + proc.stderr
    for noise in ("Warning", "warn(", "{'", "forward_call", "accelerate launch", "[WARNING]", "it/s]"):
        assert noise not in text, noise
    lines = proc.stderr.splitlines()
    assert all(line.strip() for line in lines[: lines.index(next(x for x in lines if "## tiny" in x))])  # no blanks
    steps = [line for line in lines if re.search(r" INFO 01-sft: step \d+/30, loss \d+\.\d{3}, [\d,]+ tokens/s", line)]
    assert len(steps) == 7 and "ETA" in steps[1]  # steps 1, 5, ..., 30
    assert re.search(r"sft: trained in [\w ]+: 30 steps, loss \d\.\d{3} -> \d\.\d{3}, padding \d+%", proc.stderr)
    assert "| checkpoint | validation | test |" in proc.stderr
    assert lines[-1] == f"leaderboard: {run / 'leaderboard.html'}"
    log = (run / "pipeline.log").read_text()
    assert "01-sft: step 5: loss=" in log and "learning_rate=" in log  # the trainer's own record, in the file only


def test_run_folder_matches_the_contract(tiny_run):
    run, _ = tiny_run
    for name in ("resolved.yaml", "manifest.json", "pipeline.log"):
        assert (run / name).is_file(), name
    manifest = json.loads((run / "manifest.json").read_text())
    assert {"code", "packages", "hardware", "data", "seeds"} <= set(manifest)
    assert manifest["packages"]["trl"] and set(manifest["data"]) == {"sft", "midtrain"}
    # the CPU's kernels shape fp32 results (README, 'Results'): the manifest names them
    assert manifest["hardware"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert manifest["hardware"]["cpu"]
    assert sorted(p.name for p in (run / "stages").iterdir()) == ["00-base", "01-sft", "02-midtrain"]
    for stage in ("01-sft", "02-midtrain"):
        files = {p.name for p in (run / "stages" / stage / "model").iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= files
        assert not [p for p in (run / "stages" / stage).iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_each_stage_trained_and_handed_off(tiny_run, cache_dir):
    run, _ = tiny_run
    sft = json.loads((run / "stages/01-sft/stage.json").read_text())
    mid = json.loads((run / "stages/02-midtrain/stage.json").read_text())
    for record in (sft, mid):
        assert record["status"] == "done" and record["world_size"] == 1
        m = record["metrics"]
        assert m["steps"] > 0 and m["tokens"] > 0
        assert m["loss_last"] < m["loss_first"], m["losses"]
    assert mid["input_model"] == sft["output_model"] == "stages/01-sft/model"  # relative to the run folder
    assert mid["upstream"] == sft["fingerprint"]
    (base,) = Path(cache_dir).glob("tiny-*/model")
    assert sft["input_model"] == str(base)
    w_base, w_sft, w_mid = (_weights(p) for p in (base, run / "stages/01-sft/model", run / "stages/02-midtrain/model"))
    assert _changed(w_base, w_sft) and _changed(w_sft, w_mid)


def test_final_model_loads_and_chats(tiny_run):
    run, _ = tiny_run
    path = run / "stages/02-midtrain/model"
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "Tom has 3 apples."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_rerun_reuses_then_refuses_a_changed_stage_then_redoes(tiny_run):
    run, args = tiny_run
    before = {p: p.stat().st_mtime_ns for p in run.glob("stages/*/stage.json")}
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr.count("reusing finished stage") == 2
    assert before == {p: p.stat().st_mtime_ns for p in run.glob("stages/*/stage.json")}

    changed = run_cli(*args, "sft.learning_rate=3e-4")
    assert changed.returncode == 2
    message = changed.stderr.strip().splitlines()[-1]
    assert "01-sft" in message and "learning_rate" in message and "redo=[sft]" in message
    assert before == {p: p.stat().st_mtime_ns for p in run.glob("stages/*/stage.json")}

    redo = run_cli(*args, "sft.learning_rate=3e-4", "redo=[sft]")
    assert redo.returncode == 0, redo.stderr[-2000:]
    sft = json.loads((run / "stages/01-sft/stage.json").read_text())
    mid = json.loads((run / "stages/02-midtrain/stage.json").read_text())
    assert sft["config"]["learning_rate"] == pytest.approx(3e-4)
    assert mid["upstream"] == sft["fingerprint"]
    assert all(p.stat().st_mtime_ns > t for p, t in before.items() if "00-base" not in str(p))  # base eval reused


def test_lora_saves_a_merged_full_checkpoint(tmp_path, cache_dir):
    proc = run_cli("recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", "stages=[sft]",
                   "sft.lora.r=8", "sft.learning_rate=5e-3", *FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model_dir = tmp_path / "tiny/stages/01-sft/model"
    assert not (model_dir / "adapter_config.json").exists()
    (base,) = Path(cache_dir).glob("tiny-*/model")
    w_base, w_sft = _weights(base), _weights(model_dir)
    assert set(w_base) == set(w_sft) and _changed(w_base, w_sft)
    AutoModelForCausalLM.from_pretrained(model_dir)


@pytest.mark.parametrize("packing", ["true", "false"])
def test_telemetry_fields_are_present_and_sane(tmp_path, cache_dir, packing):
    proc = run_cli("recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *FAST, "stages=[sft]",
                   f"sft.packing={packing}", "sft.per_device_train_batch_size=4", "eval.tasks=[]", "sft.gate.metric=")
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "tiny/stages/01-sft/stage.json").read_text())["metrics"]
    # the trainer's count equals what the batches held, give or take the one batch the loader collates ahead
    assert 0 < m["tokens"] <= m["tokens_in_batches"] <= m["tokens"] + 4 * 256
    assert m["mfu"] is None and m["device"] == "cpu"  # no invented MFU on a CPU
    if packing == "true":  # packed rows of several chats, padded only to the longest row of the batch
        assert m["padding_fraction"] < 0.15  # measured 0.08 at batch 4
    else:
        assert 0 < m["padding_fraction"] < 1
    assert m["compute_s"] > 0 and m["data_wait_s"] >= 0 and m["peak_rss_mb"] > 100
    assert m["compute_s"] + m["data_wait_s"] <= m["wall_time_s"]
    assert m["samples"] > 0 and m["samples_per_s"] > 0 and m["tokens_per_s"] > 0
