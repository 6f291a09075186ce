"""ORPO: TRL's ORPOTrainer on preference pairs (Hong et al.): the SFT loss on the chosen answer plus an odds-ratio
term favouring it over the rejected one, with no reference model. TRL keeps ORPO in `trl.experimental`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pipeline.settings import StageKind, StageSettings, arg, data_source


@dataclass
class OrpoSettings(StageSettings):
    """A TRL ORPOTrainer stage."""

    beta: float = arg("weight of the odds-ratio term against the SFT loss (the paper's lambda)", 0.1)


class Orpo(StageKind):
    name, settings, pairs = "orpo", OrpoSettings, True
    order = 45
    report_keys = ("beta",)
    trl_config = "trl.experimental.orpo:ORPOConfig"
    help = "ORPO on preference pairs, no reference model (TRL's ORPOTrainer)"
    defaults = {"learning_rate": 8e-6, "lr_scheduler_type": "linear"}  # noqa: RUF012

    def formats(self, stage: Any) -> list[str]:
        return ["preference"]

    def config_class(self) -> type | None:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # chosen knowingly: the module says so
        return super().config_class()

    def trainer_args(self, stage: Any, work_dir: Any, seed: int, precision: str, run: Any = None) -> Any:
        from pipeline.train.trainer import common_args, trl_config

        return trl_config(self.config_class(), stage, common_args(stage, work_dir, seed, precision, run))

    def train(self, ctx: Any) -> dict:
        self.config_class()
        from trl.experimental.orpo import ORPOTrainer

        from pipeline.data.mixtures import load_mixture
        from pipeline.train.models import load_model, load_tokenizer
        from pipeline.train.trainer import fit, lora_config

        stage, cfg = ctx.stage, ctx.cfg
        tok = load_tokenizer(ctx.input_model, cfg.model, need_template=True)
        pairs = load_mixture(data_source(stage), cfg).shuffle(seed=cfg.seed)
        args = self.trainer_args(stage, ctx.work_dir, cfg.seed, cfg.model.precision, cfg)
        trainer = ORPOTrainer(model=load_model(ctx.input_model, cfg.model), args=args, train_dataset=pairs,
                              processing_class=tok, peft_config=lora_config(stage))
        return {**fit(trainer, tok, ctx.out_dir, stage.nonfinite_limit, stage.matmul_precision), "pairs": len(pairs)}


KIND = Orpo()
