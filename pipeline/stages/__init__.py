"""Stage kinds: a plain dict from kind to its entry function `run(ctx) -> metrics`, which trains exactly one
model into `ctx.out_dir/model` (a sweep calls it once per candidate, see `pipeline.sweep`)."""

from __future__ import annotations

from pipeline.stages import dpo, grpo, ppo, reward_model, sft

STAGES = {"sft": sft.run, "midtrain": sft.run, "dpo": dpo.run, "reward": reward_model.run, "ppo": ppo.run,
          "grpo": grpo.run}
