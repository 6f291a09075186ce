"""PPO stage: our actor-critic loop (`pipeline.rl.actor_critic.PPOLoop`) from the input checkpoint.

Policy = the input checkpoint (LoRA adapter on it when `lora.r > 0`); reference = a frozen copy (with
LoRA: the adapter-disabled base); value model = a one-output sequence classifier initialised from the
policy (`value_init: policy`) or from the reward model (`value_init: reward_model`). Prompts come
from the mixture (a string prompt becomes one user turn); the reward is the verifiable `#### N` check
against `answer` or a reward model. Where the base model ships held-out problems, the mean verifiable
reward of greedy answers on them is measured before and after training (`heldout_reward_*`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
from accelerate import Accelerator

from pipeline.files import write_text
from pipeline.logs import figure
from pipeline.rl.actor_critic import PPOLoop, ValueModel
from pipeline.rl.heldout import greedy_reward, heldout_rows
from pipeline.rl.rewards import load_prompts, resolve_reward_model, reward_function
from pipeline.runfolder import StageContext
from pipeline.train.distributed import main_writes
from pipeline.train.models import load_model, load_tokenizer
from pipeline.train.precision import load_dtype, matmul_precision, mixed_precision
from pipeline.train.trainer import lora_config, save_checkpoint

log = logging.getLogger("pipeline")
SUMMARY = ("reward_mean", "reward_std", "kl", "entropy", "clipfrac", "approx_kl", "value_loss", "explained_variance",
           "response_length")


def _value_model(ctx: StageContext, pad_id: int) -> ValueModel:
    stage = ctx.stage
    policy_init = stage.value_init == "policy"
    source = ctx.input_model if policy_init else resolve_reward_model(stage.reward_model, ctx.stage_dir)
    classifier = load_model(source, ctx.cfg.model, "classifier", saved=not policy_init,
                            dtype=load_dtype(ctx.cfg.model, deepspeed=False))
    classifier.config.pad_token_id = pad_id
    if policy_init:
        torch.nn.init.zeros_(classifier.score.weight)  # start from V = 0 rather than random values
    return ValueModel(classifier)


def _prompts(ctx: StageContext, tok: Any) -> list[dict]:
    """The mixture's prompts as rows {prompt, answer, input_ids (the rendered prompt)}."""
    rows = []
    for row in load_prompts(ctx.stage, ctx.cfg, "ppo"):
        ids = tok.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True, return_dict=False)
        rows.append({"prompt": row["prompt"], "answer": row.get("answer"), "input_ids": list(ids)})
    return rows


def _models(ctx: StageContext, tok: Any, device: Any) -> tuple[Any, Any, ValueModel]:
    """Policy (with a LoRA adapter when asked), reference (None with LoRA: the disabled adapter) and value model."""
    policy = load_model(ctx.input_model, ctx.cfg.model).to(device)
    policy.generation_config.pad_token_id = tok.pad_token_id
    ref = None
    if lora_config(ctx.stage) is not None:
        from peft import get_peft_model

        policy = get_peft_model(policy, lora_config(ctx.stage))
    else:
        ref = load_model(ctx.input_model, ctx.cfg.model).to(device)
    return policy, ref, _value_model(ctx, tok.pad_token_id).to(device)


def _save(ctx: StageContext, loop: PPOLoop, model: Any, tok: Any, history: list[dict]) -> None:
    """The policy as `model/` (atomically), the value model, the update history; the work folder stays until the
    stage's record says trained (the orchestrator removes it then)."""
    def write(tmp):
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    save_checkpoint(ctx.out_dir / "model", write)
    with main_writes() as main:
        if main:
            loop.acc.unwrap_model(loop.value).model.save_pretrained(ctx.out_dir / "value_model")
            write_text(ctx.out_dir / "history.json", json.dumps(history, indent=1))


def run(ctx: StageContext) -> dict:
    """Train the policy with PPO into `ctx.out_dir/model`; return the loop's metrics and the held-out rewards."""
    stage, cfg = ctx.stage, ctx.cfg
    if stage.reward == "model" or stage.value_init == "reward_model":
        resolve_reward_model(stage.reward_model, ctx.stage_dir)  # fail early with a clear message
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed_precision(cfg.model.precision))
    tok = load_tokenizer(ctx.input_model, cfg.model, need_template=True)
    prompts, score = _prompts(ctx, tok), reward_function(stage, ctx.stage_dir, cfg.model, accelerator.device)

    def reward_fn(rows: list[dict], responses: list[list[int]]) -> list[float]:
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        return score([r["prompt"] for r in rows], texts, [r["answer"] for r in rows])

    policy, ref, value = _models(ctx, tok, accelerator.device)
    main, heldout = accelerator.is_main_process, heldout_rows(cfg)
    before = greedy_reward(policy, tok, heldout, stage.max_new_tokens) if main else None
    with main_writes() as is_main:
        if is_main:
            (ctx.out_dir / "work").mkdir(parents=True, exist_ok=True)
    loop = PPOLoop(stage, accelerator, policy, value, ref, prompts, reward_fn, tok.pad_token_id, tok.eos_token_id,
                   ctx.out_dir / "work", seed=cfg.seed,
                   log_path=ctx.out_dir / f"updates-rank{accelerator.process_index}.jsonl")
    with matmul_precision(stage.matmul_precision):  # the loop's rollouts and updates
        metrics = loop.train()
    model = accelerator.unwrap_model(loop.policy)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    after = greedy_reward(model, tok, heldout, stage.max_new_tokens) if main else None
    _save(ctx, loop, model, tok, metrics.pop("history"))
    last = loop.history[-min(5, len(loop.history)):]
    summary = {k: round(sum(h[k] for h in last) / len(last), 4) for k in SUMMARY} if last else {}
    log.info("ppo: held-out greedy reward %s -> %s; last updates: %s", figure(before), figure(after),
             ", ".join(f"{k} {figure(v)}" for k, v in summary.items()))
    return {**metrics, "heldout_reward_before": before, "heldout_reward_after": after,
            "heldout_prompts": len(heldout), "last_updates": summary, "world_size": accelerator.num_processes,
            "value_model": str(ctx.out_dir / "value_model")}
