"""Reward-model stage: TRL's RewardTrainer on preference pairs (prompt / chosen / rejected).

The model is the input checkpoint as a one-output sequence classifier. A held-out tenth of the pairs
(at least one, at most 200) is kept out of training; the stage reports the pairwise accuracy (chosen
scored above rejected) on it before and after training. `ctx.stage_dir/model` is the classifier
with its tokenizer, which PPO / GRPO load (`pipeline.rl.rewards`) through `reward_model: <stage name>`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError
from pipeline.settings import StageKind, StageSettings, arg, data_source

log = logging.getLogger("pipeline")


@dataclass
class RewardSettings(StageSettings):
    """A reward model trained by TRL's RewardTrainer on preference pairs (sequence classifier, 1 output)."""

    center_rewards_coefficient: float = arg("TRL's penalty pulling rewards towards zero mean; 0: off", 0.0)


class Reward(StageKind):
    name, settings, trl_config = "reward", RewardSettings, "trl:RewardConfig"
    order = 60
    help, model_class, pairs = "a reward model for ppo / grpo", "classifier", True
    defaults = {"learning_rate": 1e-5}  # noqa: RUF012

    def formats(self, stage: Any) -> list[str]:
        return ["preference"]

    def trainer_args(self, stage: Any, work_dir: Any, seed: int, precision: str, run: Any = None) -> Any:
        return reward_args(stage, work_dir, seed, precision, run)

    def train(self, ctx: Any) -> dict:
        return run(ctx)


KIND = Reward()


def _text(message_or_chat) -> str:
    return message_or_chat if isinstance(message_or_chat, str) else message_or_chat[-1]["content"]


def pair_accuracy(model, tok, pairs, batch_size: int = 32) -> float:
    """Fraction of pairs whose chosen response scores above the rejected one."""
    import torch

    from pipeline.rl.rewards import RewardModel, as_chat

    scorer = RewardModel(model, tok, batch_size)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            prompts = [as_chat(p["prompt"]) for p in pairs]
            good = scorer(prompts, [_text(p["chosen"]) for p in pairs])
            bad = scorer(prompts, [_text(p["rejected"]) for p in pairs])
    finally:
        model.train(was_training)
    return sum(g > b for g, b in zip(good, bad, strict=True)) / max(1, len(pairs))


def reward_args(stage: Any, work_dir: Path, seed: int, precision: str, run: Any = None) -> Any:
    """RewardTrainer arguments for the stage's settings, its TRL-named keys over them."""
    from trl import RewardConfig as TrlRewardConfig

    from pipeline.train.trainer import common_args, trl_config

    return trl_config(TrlRewardConfig, stage, dict(**common_args(stage, work_dir, seed, precision, run),
                                                   center_rewards_coefficient=stage.center_rewards_coefficient or None))


def run(ctx: Any) -> dict:
    """Train the input checkpoint as a reward model into `ctx.out_dir/model`; return its held-out pair accuracy."""
    from trl import RewardTrainer

    from pipeline.data.mixtures import load_mixture, source_name
    from pipeline.distributed import is_main
    from pipeline.train.models import load_model, load_tokenizer
    from pipeline.train.trainer import fit, lora_config

    stage, cfg = ctx.stage, ctx.cfg
    tok = load_tokenizer(ctx.input_model, cfg.model, need_template=True)
    data = load_mixture(data_source(stage), cfg)
    if not {"chosen", "rejected"} <= set(data.column_names):
        raise ConfigError(f"reward {source_name(data_source(stage))} needs `chosen` and `rejected`; it has "
                          f"{sorted(data.column_names)}")
    held = min(200, max(1, len(data) // 10))
    split = data.train_test_split(test_size=held, seed=cfg.seed, shuffle=True)
    train, test = split["train"], [dict(r) for r in split["test"]]
    model = load_model(ctx.input_model, cfg.model, "classifier")
    model.config.pad_token_id = tok.pad_token_id
    main = is_main()
    before = pair_accuracy(model, tok, test) if main else None
    args = reward_args(stage, ctx.work_dir, cfg.seed, cfg.model.precision, cfg)
    trainer = RewardTrainer(model=model, args=args, train_dataset=train, processing_class=tok,
                            peft_config=lora_config(stage))
    metrics = fit(trainer, tok, ctx.out_dir, stage.nonfinite_limit, stage.matmul_precision)
    if main:
        trained = load_model(ctx.model_dir, cfg.model, "classifier", saved=True)
        after = pair_accuracy(trained, tok, test)
        log.info("reward model: held-out pair accuracy %.3f -> %.3f (%d pairs)", before, after, len(test))
    else:
        after = None
    return {**metrics, "heldout_pairs": len(test), "heldout_accuracy_before": before, "heldout_accuracy_after": after}
