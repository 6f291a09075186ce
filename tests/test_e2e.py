"""The tiny recipe through the real CLI: LoRA's merged handoff and the telemetry a stage records. The FAST chain
through `smol-pipeline` (training, handoff, run folder, terminal, resume, refusal) runs from the installed wheel:
tests/test_wheel.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FAST, run_cli
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights."""
    return load_file(str(model_dir / "model.safetensors"))


def changed(a: dict, b: dict) -> bool:
    """Whether any weight differs between two checkpoints' weights."""
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_lora_saves_a_merged_full_checkpoint(tmp_path, cache_dir):
    proc = run_cli("recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", "stages=[sft]",
                   "sft.lora.r=8", "sft.learning_rate=5e-3", *FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model_dir = tmp_path / "tiny/stages/01-sft/model"
    assert not (model_dir / "adapter_config.json").exists()
    (base,) = Path(cache_dir).glob("tiny-*/model")
    w_base, w_sft = weights(base), weights(model_dir)
    assert set(w_base) == set(w_sft) and changed(w_base, w_sft)
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
