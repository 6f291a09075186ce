"""Telemetry: the step-time breakdown, alerts that every rank agrees on, MFU's parameter count under ZeRO-3."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAST, ROOT
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.train.telemetry import full_numel

STOP_RUN = [*FAST, "stages=[sft]", "sft.max_steps=20", "sft.save_steps=1000", "eval.tasks=[]", "sft.gate.metric="]


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_two_ranks(args: list[str], extra_env: dict, logs: Path) -> list[tuple[int, str]]:
    """`pipeline/run.py` as ranks 0 and 1 of one gloo world (what a launcher sets): each rank's exit code and log."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, **extra_env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        with open(logs / f"rank{rank}.log", "w") as log:  # files, not pipes: a full pipe would stall a collective
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "pipeline/run.py"), *args], cwd=ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    return [(p.wait(timeout=900), (logs / f"rank{rank}.log").read_text()) for rank, p in enumerate(procs)]


@pytest.mark.slow
def test_memory_alert_on_one_rank_stops_every_rank_with_its_own_code_and_the_advised_rerun_resumes(
        tmp_path, cache_dir, tiny_base):
    """Rank 1 alone goes over its (lowered) memory limit: both ranks save the same checkpoint and exit 5 (not 75,
    which the Slurm scripts requeue); the rerun with the advised settings resumes from that checkpoint."""
    args = ["recipe=tiny", f"output_root={tmp_path}/out", f"cache_dir={cache_dir}", *STOP_RUN]
    ranks = launch_two_ranks(args, {"PIPELINE_TEST_MEMORY_LIMIT": "1:0.0"}, tmp_path)
    assert [code for code, _ in ranks] == [5, 5], [log[-2000:] for _, log in ranks]
    assert all("saving a checkpoint and stopping on every rank" in log for _, log in ranks)
    assert "memory alert: " in ranks[0][1] and "gradient_accumulation_steps" in ranks[0][1]
    outcome = json.loads((tmp_path / "out/tiny/outcome.json").read_text())
    assert (outcome["exit_code"], outcome["outcome"]) == (5, "memory_alert")
    work = tmp_path / "out/tiny/stages/01-sft/work"
    assert [p.name for p in work.glob("checkpoint-*")] == ["checkpoint-1"]  # stopped at the first step, together
    record = tmp_path / "out/tiny/stages/01-sft/stage.json"
    assert not record.exists() or json.loads(record.read_text())["status"] != "done"
    batch = next(int(a.split("=")[1]) for a in args[::-1] if a.startswith("sft.per_device_train_batch_size="))
    traded = [f"sft.per_device_train_batch_size={batch // 2}", "sft.gradient_accumulation_steps=2"]
    ranks = launch_two_ranks([*args, *traded], {}, tmp_path)
    assert [code for code, _ in ranks] == [0, 0], [log[-2000:] for _, log in ranks]
    assert "resuming 01-sft from" in ranks[0][1] and "checkpoint-1" in ranks[0][1]
    assert json.loads(record.read_text())["status"] == "done"


@pytest.mark.slow
def test_step_breakdown_of_a_packed_stage(tmp_path, cache_dir, tiny_base):
    """A packed SFT stage records forward, backward, optimizer, data, eval and save times that add up."""
    proc = subprocess.run([sys.executable, str(ROOT / "pipeline/run.py"), "recipe=tiny", f"output_root={tmp_path}",
                           f"cache_dir={cache_dir}", *FAST, "stages=[sft]", "sft.max_steps=6", "sft.save_steps=3",
                           "sft.packing=true", "sft.per_device_train_batch_size=4", "eval.tasks=[]",
                           "sft.gate.metric="], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "tiny/stages/01-sft/stage.json").read_text())["metrics"]
    assert m["steps"] == 6 and m["forward_s"] > 0 and m["backward_s"] > 0 and m["optimizer_s"] > 0
    assert m["save_s"] > 0 and m["eval_s"] == 0 and m["data_wait_s"] >= 0  # checkpoints at steps 3 and 6
    assert m["compute_s"] == pytest.approx(m["forward_s"] + m["backward_s"] + m["optimizer_s"], abs=0.02)
    assert m["compute_s"] + m["data_wait_s"] + m["save_s"] <= m["wall_time_s"]
    assert 0 < m["peak_memory_fraction"] < 1
    assert m["padding_fraction"] < 0.15  # rows of several chats, padded to the longest row (measured 0.08)


@pytest.mark.slow
def test_full_numel_counts_zero3_shards(tmp_path, monkeypatch):
    """Under ZeRO-3 a rank holds empty parameters; MFU's count still sees the whole model."""
    import deepspeed  # a dependency of the project: its absence is a failure, not a skip
    port = free_port()
    for key, value in {"DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    expected = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}, "train_batch_size": 1}):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.distributed.destroy_process_group()
    assert sum(p.numel() for p in model.parameters()) == 0  # what the old count saw
    assert full_numel(model) == expected
