"""Reward-model stage: TRL's RewardTrainer on preference pairs (prompt / chosen / rejected).

The model is the input checkpoint as a one-output sequence classifier. A held-out tenth of the pairs
(at least one, at most 200) is kept out of training; the stage reports the pairwise accuracy (chosen
scored above rejected) on it before and after training. `ctx.stage_dir/model` is the classifier
with its tokenizer, which PPO / GRPO load (`pipeline.rl.rewards`) through `reward_model: <stage name>`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from trl import RewardConfig as TrlRewardConfig
from trl import RewardTrainer

from pipeline.config import ConfigError
from pipeline.data.mixtures import load_mixture
from pipeline.rl.rewards import RewardModel, as_chat
from pipeline.runfolder import StageContext
from pipeline.train.distributed import is_main
from pipeline.train.models import load_model, load_tokenizer
from pipeline.train.trainer import common_args, fit, lora_config, trl_config

log = logging.getLogger("pipeline")


def _text(message_or_chat) -> str:
    return message_or_chat if isinstance(message_or_chat, str) else message_or_chat[-1]["content"]


@torch.no_grad()
def pair_accuracy(model, tok, pairs, batch_size: int = 32) -> float:
    """Fraction of pairs whose chosen response scores above the rejected one."""
    scorer = RewardModel(model, tok, batch_size)
    was_training = model.training
    model.eval()
    try:
        prompts = [as_chat(p["prompt"]) for p in pairs]
        good = scorer(prompts, [_text(p["chosen"]) for p in pairs])
        bad = scorer(prompts, [_text(p["rejected"]) for p in pairs])
    finally:
        model.train(was_training)
    return sum(g > b for g, b in zip(good, bad, strict=True)) / max(1, len(pairs))


def reward_args(stage: Any, work_dir: Path, seed: int, precision: str,
                run: DictConfig | None = None) -> TrlRewardConfig:
    """RewardTrainer arguments for the stage's settings, its `trainer` mapping over them."""
    return trl_config(TrlRewardConfig, stage, dict(**common_args(stage, work_dir, seed, precision, run),
                                                   center_rewards_coefficient=stage.center_rewards_coefficient or None))


def run(ctx: StageContext) -> dict:
    """Train the input checkpoint as a reward model into `ctx.out_dir/model`; return its held-out pair accuracy."""
    stage, cfg = ctx.stage, ctx.cfg
    tok = load_tokenizer(ctx.input_model, cfg.model, need_template=True)
    data = load_mixture(stage.mixture, cfg)
    if not {"chosen", "rejected"} <= set(data.column_names):
        raise ConfigError(f"reward mixture '{stage.mixture}' needs `chosen` and `rejected`; it has "
                          f"{sorted(data.column_names)}")
    held = min(200, max(1, len(data) // 10))
    split = data.train_test_split(test_size=held, seed=cfg.seed, shuffle=True)
    train, test = split["train"], [dict(r) for r in split["test"]]
    model = load_model(ctx.input_model, cfg.model, "classifier")
    model.config.pad_token_id = tok.pad_token_id
    main = is_main()
    before = pair_accuracy(model, tok, test) if main else None
    args = reward_args(stage, ctx.out_dir / "work", cfg.seed, cfg.model.precision, cfg)
    trainer = RewardTrainer(model=model, args=args, train_dataset=train, processing_class=tok,
                            peft_config=lora_config(stage))
    metrics = fit(trainer, tok, ctx.out_dir, stage.nonfinite_limit, stage.matmul_precision)
    if main:
        trained = load_model(ctx.out_dir / "model", cfg.model, "classifier", saved=True)
        after = pair_accuracy(trained, tok, test)
        log.info("reward model: held-out pair accuracy %.3f -> %.3f (%d pairs)", before, after, len(test))
    else:
        after = None
    return {**metrics, "heldout_pairs": len(test), "heldout_accuracy_before": before, "heldout_accuracy_after": after}
