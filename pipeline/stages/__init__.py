"""Stage kinds: a plain dict from kind to its entry function `run(ctx) -> metrics`."""

from __future__ import annotations

from pipeline.stages import dpo, grpo, ppo, reward, sft

STAGES = {"sft": sft.run, "midtrain": sft.run, "dpo": dpo.run, "reward": reward.run, "ppo": ppo.run,
          "grpo": grpo.run}
