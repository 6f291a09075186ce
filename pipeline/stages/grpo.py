"""GRPO stage: critic-free RL through TRL's GRPOTrainer with the PPO stage's rewards (`pipeline.rl.rewards`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.rl import diagnostics
from pipeline.settings import arg
from pipeline.stages.ppo import Rl, RlSettings

log = logging.getLogger("pipeline")


@dataclass
class GrpoSettings(RlSettings):
    """Critic-free RL through TRL's GRPOTrainer with the same reward functions as PPO."""

    num_generations: int = arg("completions sampled per prompt (the group)", 4)
    beta: float = arg("KL coefficient", 0.04)


class Grpo(Rl):
    name, settings, trl_config, help = "grpo", GrpoSettings, "trl:GRPOConfig", "GRPO through TRL"
    order = 80
    report_keys = ("beta",)
    defaults = {"learning_rate": 1e-6, "lr_scheduler_type": "constant"}  # noqa: RUF012

    def vllm_keys(self, cfg: Any, name: str) -> list[str]:
        return [f"{name}.backend"] if cfg[name].backend == "vllm" else []

    def trainer_args(self, stage: Any, work_dir: Any, seed: int, precision: str, run: Any = None) -> Any:
        return grpo_args(stage, work_dir, seed, precision, run)

    def train(self, ctx: Any) -> dict:
        return run(ctx)


KIND = Grpo()


def grpo_args(stage: Any, work_dir: Path, seed: int, precision: str, run: Any = None) -> Any:
    """GRPOTrainer arguments for the stage's settings, its TRL-named keys over them."""
    from trl import GRPOConfig

    from pipeline.train.trainer import common_args, trl_config

    return trl_config(GRPOConfig, stage, dict(
        **common_args(stage, work_dir, seed, precision, run), max_completion_length=stage.max_new_tokens,
        include_num_input_tokens_seen="non_padding",
        **({"use_vllm": True, "vllm_mode": "colocate"} if stage.get("backend") == "vllm" else {}),
        **({"trust_remote_code": run.model.trust_remote_code} if run is not None else {})))  # TRL's vLLM engine too


def run(ctx: Any) -> dict:
    """Train the input checkpoint with GRPO into `ctx.out_dir/model`; return the metrics and held-out rewards."""
    from trl import GRPOTrainer

    from pipeline.distributed import is_main
    from pipeline.logs import figure
    from pipeline.rl.heldout import greedy_reward, heldout_rows
    from pipeline.rl.rewards import load_prompts, reward_function
    from pipeline.train.models import load_model, load_tokenizer
    from pipeline.train.trainer import fit, lora_config

    stage, cfg = ctx.stage, ctx.cfg
    tok = load_tokenizer(ctx.input_model, cfg.model, need_template=True)
    data = load_prompts(stage, cfg, "grpo")
    score = reward_function(stage, ctx.stage_dir, cfg.model)

    groups = diagnostics.GroupRecorder(score, None if stage.reward == "model" else stage.format_reward)

    def reward(prompts, completions, answer=None, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return groups(prompts, texts, answer if answer is not None else [""] * len(texts))

    reward.__name__ = f"{stage.reward.rpartition(':')[2]}_reward"  # TRL logs rewards/<name>
    args = grpo_args(stage, ctx.work_dir, cfg.seed, cfg.model.precision, cfg)
    model = load_model(ctx.input_model, cfg.model)
    model.generation_config.pad_token_id = tok.pad_token_id
    main, heldout = is_main(), heldout_rows(cfg)
    before = greedy_reward(model, tok, heldout, stage.max_new_tokens) if main else None
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=data, processing_class=tok,
                          peft_config=lora_config(stage))
    metrics = fit(trainer, tok, ctx.out_dir, stage.nonfinite_limit, stage.matmul_precision)
    rewards = [(h["step"], h["reward"]) for h in trainer.state.log_history if "reward" in h]
    after = None
    if main and heldout:
        trained = load_model(ctx.model_dir, cfg.model, saved=True)
        after = greedy_reward(trained, tok, heldout, stage.max_new_tokens)
    log.info("grpo: held-out greedy reward %s -> %s; training reward %s at the last logged step", figure(before),
             figure(after), figure(rewards[-1][1]) if rewards else "-")
    return {**metrics, "rewards": rewards, "heldout_reward_before": before, "heldout_reward_after": after,
            "diagnostics": diagnostics.grpo(groups.start(), metrics)}
