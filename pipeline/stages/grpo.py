"""GRPO stage: critic-free RL through TRL's GRPOTrainer with the same rewards as PPO.

Prompts come from the mixture (a string prompt becomes one user turn); the reward function gets the
dataset's `answer` column as a keyword argument. `num_generations` completions per prompt; the
per-device batch (x accumulation x processes) must be a multiple of it.
"""

from __future__ import annotations

import logging

from trl import GRPOConfig, GRPOTrainer

from pipeline.config import ConfigError
from pipeline.data import load_mixture
from pipeline.rewards import as_chat, reward_function
from pipeline.stage import StageContext
from pipeline.stages.ppo import greedy_reward, heldout_rows
from pipeline.training import common_args, fit, load_model, load_tokenizer, lora_config

log = logging.getLogger("pipeline")


def run(ctx: StageContext) -> dict:
    from accelerate import PartialState

    stage, cfg = ctx.stage, ctx.cfg
    tok = load_tokenizer(ctx.input_model, cfg.model, need_template=True)
    data = load_mixture(stage.mixture, cfg)
    if "prompt" not in data.column_names or (stage.reward == "verifiable" and "answer" not in data.column_names):
        raise ConfigError(f"grpo mixture '{stage.mixture}' needs `prompt` and `answer` columns; it has "
                          f"{sorted(data.column_names)}")
    data = data.map(lambda r: {"prompt": as_chat(r["prompt"])})
    score = reward_function(stage, ctx.stage_dir)

    def reward(prompts, completions, answer=None, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return score(prompts, texts, answer if answer is not None else [""] * len(texts))

    reward.__name__ = f"{stage.reward}_reward"
    base = common_args(stage, ctx.stage_dir / "work", cfg.seed, cfg.model.precision)
    base.pop("max_length")  # GRPO bounds prompts by the data and completions by max_completion_length
    args = GRPOConfig(**base, num_generations=stage.num_generations,
                      max_completion_length=stage.max_new_tokens, temperature=stage.temperature, beta=stage.beta,
                      include_num_input_tokens_seen="non_padding")
    model = load_model(ctx.input_model, cfg.model)
    model.generation_config.pad_token_id = tok.pad_token_id
    main = PartialState().is_main_process
    heldout = heldout_rows(ctx)
    before = greedy_reward(model, tok, heldout, stage.max_new_tokens) if main else None
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=data, processing_class=tok,
                          peft_config=lora_config(stage))
    metrics = fit(trainer, tok, ctx.stage_dir, stage.nonfinite_limit)
    rewards = [(h["step"], h["reward"]) for h in trainer.state.log_history if "reward" in h]
    after = None
    if main and heldout:
        after = greedy_reward(load_model(ctx.stage_dir / "model", cfg.model), tok, heldout, stage.max_new_tokens)
    log.info("grpo: held-out greedy reward %s -> %s; training rewards %s", before, after, rewards)
    return {**metrics, "rewards": rewards, "heldout_reward_before": before, "heldout_reward_after": after}
