"""Real SmolLM2-135M-Instruct weights through the pipeline CLI: SFT with assistant-only loss on its own
(marker-free) chat template, an on-policy APO-zero step, then stock transformers and the stock lm-eval CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_cli
from realmodel import smollm2_checkpoint

pytestmark = pytest.mark.slow
GSM8K = ROOT / "tests" / "fixtures" / "gsm8k"  # the first rows of GSM8K, shipped
# Small enough for 2 CPU cores: short sequences, 2 SFT steps, 1 APO step on 2 on-policy prompts, evals of 1 item.
# (A quiet 2-core machine trains this 135M model at ~20 tokens/s; the timeouts below only catch a hang.)
SMOKE = ["sft.max_steps=2", "sft.max_length=256", "sft.per_device_train_batch_size=1", "sft.gate.action=warn",
         "dpo.on_policy.max_prompts=2", "dpo.on_policy.samples=2", "dpo.on_policy.max_new_tokens=16",
         "dpo.max_steps=1", "dpo.max_length=256", "dpo.per_device_train_batch_size=2", "dpo.sweep.beta=null",
         "dpo.sweep.learning_rate=null", "dpo.gate.action=warn", "eval.limit=1", "eval.num_fewshot=0",
         "eval.max_gen_toks=16", "eval.batch_size=2"]


def _mixture(folder: Path, name: str, rows: list[dict], columns: dict | None = None) -> str:
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mix = folder / f"{name}.yaml"
    mix.write_text(json.dumps({"sources": [{"path": str(folder / f"{name}.jsonl"), "columns": columns or {}}]}))
    return str(mix)


def test_real_weights_sft_on_policy_apo_then_stock_transformers_and_lm_eval(tmp_path, cache_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = smollm2_checkpoint()
    train = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()[:16]]
    sft = _mixture(tmp_path, "sft", train, {"user": "question", "assistant": "answer"})
    easy = [{"prompt": f"Reply with exactly this line: #### {n}", "answer": str(n)} for n in (5, 12)]
    prompts = _mixture(tmp_path, "prompts", easy)  # string prompts, as gsm8k_rl's: the data layer makes them chats
    pairs = [{"prompt": r["prompt"], "chosen": [{"role": "assistant", "content": f"#### {r['answer']}"}],
              "rejected": [{"role": "assistant", "content": "#### 0"}]} for r in easy]
    offline = _mixture(tmp_path, "pairs", pairs)  # DPO still trains when the sampled answers give no pair
    proc = run_cli("recipe=smollm2", f"model.name_or_path={model}", f"output_root={tmp_path}/runs",
                   f"cache_dir={cache_dir}", f"eval.gsm8k_dir={GSM8K}", f"sft.mixture={sft}",
                   f"dpo.on_policy.mixture={prompts}", f"dpo.mixture={offline}", *SMOKE, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "smollm2"
    sft_record = json.loads((run / "stages" / "01-sft" / "stage.json").read_text())
    assert sft_record["metrics"]["steps"] == 2 and sft_record["metrics"]["loss_first"] > 0
    stats = json.loads((run / "stages" / "02-dpo" / "on_policy_stats.json").read_text())
    assert stats["prompts"] == 2 and stats["samples"] == 4
    final = run / "stages" / "02-dpo" / "model"
    tok, lm = AutoTokenizer.from_pretrained(final), AutoModelForCausalLM.from_pretrained(final)
    assert lm.config.num_hidden_layers == 30 and tok.chat_template == AutoTokenizer.from_pretrained(model).chat_template
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={final}",
           "--include_path", str(run / "eval_tasks"), "--tasks", "gsm8k_local,gsm8k_local_val_bpb", "--limit", "3",
           "--num_fewshot", "0",
           "--gen_kwargs", "max_gen_toks=16", "--output_path", str(tmp_path / "lm_eval")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (result,) = (tmp_path / "lm_eval").rglob("results_*.json")
    results = json.loads(result.read_text())["results"]
    scores = results["gsm8k_local"]
    assert 0.0 <= scores["exact_match,flexible-extract"] <= 1.0 and scores["exact_match,strict-match"] is not None
    # the continuous metric under the stock CLI: the reference solutions' bits per byte, a real model's (a uniform
    # guess over SmolLM2's 49,152 tokens would cost about 4 bits per byte)
    assert 0.05 < results["gsm8k_local_val_bpb"]["bits_per_byte,none"] < 2.0
    scored = sft_record["eval"]["metrics"]["gsm8k_local_val_bpb/bits_per_byte,none"]  # the pipeline's own, on SFT
    assert 0.05 < scored < 2.0
    assert sft_record["eval"]["higher_is_better"]["gsm8k_local_val_bpb"] == {"bits_per_byte": False}
