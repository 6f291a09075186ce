"""KTO: TRL's KTOTrainer on unpaired preference rows, a completion marked desirable or not (Ethayarajh et al.).

The stage's data gives unpaired rows (`prompt`, `completion`, `label`: desirable or not) or preference pairs
(`prompt`, `chosen`, `rejected`), which TRL's own `unpair_preference_dataset` turns into unpaired rows: the chosen
answer desirable, the rejected one not. The reference model is the input checkpoint, frozen (with LoRA: the
adapter-disabled base).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.settings import StageKind, StageSettings, arg, data_source


@dataclass
class KtoSettings(StageSettings):
    """A TRL KTOTrainer stage."""

    beta: float = arg("KTO temperature: how far the policy may move from the reference", 0.1)
    desirable_weight: float = arg("weight of the desirable (chosen) rows' loss", 1.0)
    undesirable_weight: float = arg("weight of the undesirable (rejected) rows' loss", 1.0)


class Kto(StageKind):
    name, settings, trl_config, reference = "kto", KtoSettings, "trl:KTOConfig", True
    order = 40
    report_keys = ("beta",)
    help = "KTO on unpaired preference rows (TRL's KTOTrainer)"
    defaults = {"learning_rate": 5e-7, "lr_scheduler_type": "cosine"}  # noqa: RUF012

    def formats(self, stage: Any) -> list[str]:
        return ["unpaired preference", "preference"]

    def trainer_args(self, stage: Any, work_dir: Any, seed: int, precision: str, run: Any = None) -> Any:
        from trl import KTOConfig

        from pipeline.train.trainer import common_args, trl_config

        return trl_config(KTOConfig, stage, common_args(stage, work_dir, seed, precision, run))

    def train(self, ctx: Any) -> dict:
        from trl import KTOTrainer
        from trl.data_utils import unpair_preference_dataset

        from pipeline.data.mixtures import load_mixture
        from pipeline.train.models import load_model, load_tokenizer
        from pipeline.train.trainer import fit, lora_config

        stage, cfg = ctx.stage, ctx.cfg
        tok = load_tokenizer(ctx.input_model, cfg.model, need_template=True)
        rows = load_mixture(data_source(stage), cfg)
        rows = (rows if "label" in rows.column_names else unpair_preference_dataset(rows)).shuffle(seed=cfg.seed)
        args = self.trainer_args(stage, ctx.work_dir, cfg.seed, cfg.model.precision, cfg)
        trainer = KTOTrainer(model=load_model(ctx.input_model, cfg.model), ref_model=None, args=args,
                             train_dataset=rows, processing_class=tok, peft_config=lora_config(stage))
        return {**fit(trainer, tok, ctx.out_dir, stage.nonfinite_limit, stage.matmul_precision), "rows": len(rows)}


KIND = Kto()
