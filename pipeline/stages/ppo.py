"""PPO stage: our actor-critic loop (`pipeline.ppo.PPOLoop`) from the input checkpoint.

Policy = the input checkpoint (LoRA adapter on it when `lora.r > 0`); reference = a frozen copy (with
LoRA: the adapter-disabled base); value model = a one-output sequence classifier initialised from the
policy (`value_init: policy`) or from the reward model (`value_init: reward_model`). Prompts come
from the mixture (a string prompt becomes one user turn); the reward is the verifiable `#### N` check
against `answer` or a reward model. On the tiny recipe the mean verifiable reward of greedy answers
on the held-out test problems is measured before and after training (`heldout_reward_*`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from omegaconf import OmegaConf
from transformers import AutoModelForSequenceClassification

from pipeline.config import ConfigError, cache_dir
from pipeline.data import load_mixture
from pipeline.files import commit_dir, write_text
from pipeline.ppo import PPOLoop, ValueModel
from pipeline.precision import load_dtype, mixed_precision
from pipeline.rewards import as_chat, resolve_reward_model, reward_function, verifiable
from pipeline.stage import StageContext
from pipeline.training import load_model, load_tokenizer, lora_config

log = logging.getLogger("pipeline")


def heldout_rows(ctx: StageContext) -> list[dict]:
    """The tiny recipe's held-out test problems as {prompt, answer}; empty for other models."""
    if ctx.cfg.model.name_or_path != "tiny":
        return []
    from pipeline.tiny import data_dir

    path = data_dir(cache_dir(ctx.cfg), OmegaConf.to_container(ctx.cfg.tiny)) / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [{"prompt": as_chat(r["question"]), "answer": r["answer"]} for r in rows]


@torch.no_grad()
def greedy_reward(model: Any, tok: Any, rows: list[dict], max_new_tokens: int, batch_size: int = 64) -> float:
    """Mean verifiable reward (exact `#### N` match) of greedy answers to `rows`."""
    if not rows:
        return float("nan")
    side, tok.padding_side = tok.padding_side, "left"
    was_training = model.training
    model.eval()
    hits = 0.0
    try:
        for s in range(0, len(rows), batch_size):
            chunk = rows[s:s + batch_size]
            texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in chunk]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            gen = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
            outs = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            hits += sum(verifiable(o, r["answer"]) for o, r in zip(outs, chunk, strict=True))
    finally:
        tok.padding_side = side
        model.train(was_training)
    return hits / len(rows)


def _value_model(ctx: StageContext, dtype: torch.dtype, pad_id: int) -> ValueModel:
    stage = ctx.stage
    source = ctx.input_model if stage.value_init == "policy" else resolve_reward_model(stage.reward_model,
                                                                                      ctx.stage_dir)
    classifier = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, dtype=dtype)
    classifier.config.pad_token_id = pad_id
    if stage.value_init == "policy":
        torch.nn.init.zeros_(classifier.score.weight)  # start from V = 0 rather than random values
    return ValueModel(classifier)


def run(ctx: StageContext) -> dict:
    stage, cfg = ctx.stage, ctx.cfg
    if stage.reward == "model" or stage.value_init == "reward_model":
        resolve_reward_model(stage.reward_model, ctx.stage_dir)  # fail early with a clear message
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed_precision(cfg.model.precision))
    tok = load_tokenizer(ctx.input_model, cfg.model, need_template=True)
    data = load_mixture(stage.mixture, cfg)
    if "prompt" not in data.column_names or (stage.reward == "verifiable" and "answer" not in data.column_names):
        raise ConfigError(f"ppo mixture '{stage.mixture}' needs `prompt` and `answer` columns; it has "
                          f"{sorted(data.column_names)}")
    prompts = []
    for row in data:
        chat = as_chat(row["prompt"])
        ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)
        prompts.append({"prompt": chat, "answer": row.get("answer"), "input_ids": list(ids)})
    score = reward_function(stage, ctx.stage_dir, accelerator.device)

    def reward_fn(rows: list[dict], responses: list[list[int]]) -> list[float]:
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        return score([r["prompt"] for r in rows], texts, [r["answer"] for r in rows])

    dtype = load_dtype(cfg.model, deepspeed=False)  # ppo refuses DeepSpeed
    policy = load_model(ctx.input_model, cfg.model).to(accelerator.device)
    policy.generation_config.pad_token_id = tok.pad_token_id
    ref = None
    if lora_config(stage) is not None:
        from peft import get_peft_model

        policy = get_peft_model(policy, lora_config(stage))
    else:
        ref = load_model(ctx.input_model, cfg.model).to(accelerator.device)
    value = _value_model(ctx, dtype, tok.pad_token_id).to(accelerator.device)

    heldout = heldout_rows(ctx)
    before = greedy_reward(policy, tok, heldout, stage.max_new_tokens) if accelerator.is_main_process else None
    work = ctx.stage_dir / "work"
    if accelerator.is_main_process:
        work.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    loop = PPOLoop(stage, accelerator, policy, value, ref, prompts, reward_fn, tok.pad_token_id, tok.eos_token_id,
                   work, seed=cfg.seed, log_path=ctx.stage_dir / f"updates-rank{accelerator.process_index}.jsonl")
    metrics = loop.train()
    model = accelerator.unwrap_model(loop.policy)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    after = greedy_reward(model, tok, heldout, stage.max_new_tokens) if accelerator.is_main_process else None
    if accelerator.is_main_process:
        tmp = ctx.stage_dir / ".model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        commit_dir(tmp, ctx.stage_dir / "model")
        accelerator.unwrap_model(loop.value).model.save_pretrained(ctx.stage_dir / "value_model")
        write_text(ctx.stage_dir / "history.json", json.dumps(metrics["history"], indent=1))
        shutil.rmtree(work, ignore_errors=True)
    accelerator.wait_for_everyone()
    PartialState().wait_for_everyone()
    metrics.pop("history")
    last = loop.history[-min(5, len(loop.history)):]
    summary = {k: round(sum(h[k] for h in last) / max(1, len(last)), 4)
               for k in ("reward_mean", "reward_std", "kl", "entropy", "clipfrac", "approx_kl", "value_loss",
                         "explained_variance", "response_length")} if last else {}
    log.info("ppo: held-out greedy reward %s -> %s; last updates %s", before, after, summary)
    return {**metrics, "heldout_reward_before": before, "heldout_reward_after": after,
            "heldout_prompts": len(heldout), "last_updates": summary, "world_size": accelerator.num_processes,
            "value_model": str(Path(ctx.stage_dir) / "value_model")}
