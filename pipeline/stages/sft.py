"""SFT and reasoning mid-training: one code path (TRL's SFTTrainer; same trainer, different data and settings),
registered as two kinds, `sft` and `midtrain` (its defaults: plain documents, wrapped packing). An extension's
base-model pretraining may use it too.

`format: chat` trains on `messages` through the tokenizer's chat template with assistant-only loss
and packing; `format: text` tokenises documents itself (chat rows rendered through the template),
ends each with EOS and packs them with the `wrapped` strategy. Rows are tokenised once into the
cache (`pipeline.tokcache`). LoRA trains an adapter and saves a merged full checkpoint.
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
class SftSettings(StageSettings):
    """A TRL SFTTrainer stage; `sft` and `midtrain` share this schema and code path."""

    format: str = arg("chat: `messages` with assistant-only loss; text: plain documents", "chat",
                      choices=("chat", "text"))
    packing: bool = arg("pack several rows into each sequence", True)
    packing_strategy: str = arg("bfd | bfd_split | wrapped", "bfd", choices=("bfd", "bfd_split", "wrapped"))
    assistant_only_loss: bool = arg("train only on assistant turns (needs format=chat)", True)
    train_sampling_strategy: str = arg(
        "random | group_by_length: batches of similar lengths, less padding (see docs/telemetry.md) | "
        "batch_rebalance: each optimizer step's rows drawn at random, then sorted by length into its "
        "gradient-accumulation micro-batches (transformers' BatchRebalanceSampler): less padding, the same rows per "
        "step", "random", choices=("random", "group_by_length", "batch_rebalance"))
    activation_offloading: bool = arg("TRL's activation offloading: saved activations go to CPU memory during the "
                                      "forward pass and come back for the backward; for long sequences (CUDA)", False,
                                      added=True, resumable=True)
    dataset_num_proc: int = arg("processes tokenising this stage's rows (datasets map num_proc); progress in rows/s",
                                1, added=True, resumable=True)


class Sft(StageKind):
    name, settings, trl_config, order = "sft", SftSettings, "trl:SFTConfig", 10
    help = "supervised fine-tuning (chat)"
    report_keys = ("loss_type",)  # nll, or dft

    def formats(self, stage: Any) -> list[str]:
        chats = ["conversational", "prompt-completion"]
        return chats if stage.format == "chat" else ["language modeling", *chats]

    def check(self, cfg: Any, name: str) -> None:
        if cfg[name].assistant_only_loss and cfg[name].format != "chat":
            raise ConfigError(f"'{name}.assistant_only_loss' needs format=chat")

    def trainer_args(self, stage: Any, work_dir: Any, seed: int, precision: str, run: Any = None) -> Any:
        return sft_args(stage, work_dir, seed, precision, run)

    def train(self, ctx: Any) -> dict:
        return run(ctx)


class Midtrain(Sft):
    name, help, order = "midtrain", "reasoning mid-training (text)", 20
    defaults = {"format": "text", "packing_strategy": "wrapped", "assistant_only_loss": False}  # noqa: RUF012


KINDS = (Sft(), Midtrain())


def check_columns(dataset: Any, stage: Any, tok: Any, name: str) -> None:
    """Refuse data that cannot feed this stage's format, before the model loads."""
    cols = set(dataset.column_names)
    if stage.format == "chat" and "messages" not in cols:
        raise ConfigError(f"stage '{name}' (format chat) needs a `messages` column; its data gives {sorted(cols)}")
    if stage.format == "text" and "text" not in cols:
        raise ConfigError(f"stage '{name}' (format text) needs `text` or `messages`; its data gives {sorted(cols)}")


def check_lengths(dataset: Any, stage: Any, name: str) -> int:
    """Apply the truncation policy to tokenised rows; return how many rows will be cut.

    Rows longer than `max_length` keep their start and lose their end (TRL's truncation), unless
    packing splits them (`wrapped`, `bfd_split`). The count is logged; if every row would be cut,
    the stage is refused (the data or max_length is wrong).
    """
    import pyarrow.compute as pc

    if stage.packing and stage.packing_strategy in ("wrapped", "bfd_split"):
        return 0
    lengths = pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_numpy()
    long = int((lengths > stage.max_length).sum())
    if long == len(lengths):
        raise ConfigError(f"stage '{name}': all {long} rows are longer than max_length={stage.max_length} tokens "
                          f"(shortest: {min(lengths)}); raise max_length or fix the data")
    if long:
        log.warning("stage %s: %d of %d rows exceed max_length=%d and are truncated at the end", name, long,
                    len(lengths), stage.max_length)
    return long


def sft_args(stage: Any, work_dir: Path, seed: int, precision: str, run: Any = None) -> Any:
    """SFTTrainer arguments for an SFT / mid-training stage (its TRL-named keys over them; the run `run`, when
    given, for its tracking settings)."""
    from trl import SFTConfig

    from pipeline.data import packing
    from pipeline.train.trainer import common_args, trl_config

    wrapped = stage.packing and stage.packing_strategy == "wrapped"
    return trl_config(SFTConfig, stage, dict(
        **common_args(stage, work_dir, seed, precision, run),
        packing=stage.packing and not packing.applies(stage),  # ours: rows kept apart (packing.py)
        padding_free=stage.padding_free and not wrapped,
        assistant_only_loss=False,  # rows come tokenised; their `assistant_masks` column masks the loss
        include_num_input_tokens_seen="non_padding",
    ))


def train(stage: Any, model_cfg: Any, model_path: Path, tok: Any, dataset: Any, stage_dir: Path, seed: int,
          cache: Path, run: Any = None) -> dict:
    """SFT / mid-training of `model_path` on `dataset` into `stage_dir/model`; return the metrics.

    The rows are tokenised once into `cache` (see `tokcache`). Intermediate checkpoints go to
    `stage_dir/work`; if one exists the run resumes from it.
    """
    from trl import SFTTrainer

    from pipeline.data import packing, tokcache
    from pipeline.runfolder import work_dir
    from pipeline.train.models import load_model
    from pipeline.train.trainer import fit, lora_config

    check_columns(dataset, stage, tok, stage_dir.name)
    dataset = tokcache.tokenised(dataset, stage, tok, cache, stage_dir.name)
    truncated = check_lengths(dataset, stage, stage_dir.name)
    packed = packing.applies(stage)
    if packed:
        dataset = packing.pack(dataset, stage.max_length, stage.packing_strategy)
    args = sft_args(stage, work_dir(stage_dir), seed, model_cfg.precision, run)  # first: ZeRO-3 then shards the load
    trainer = SFTTrainer(model=load_model(model_path, model_cfg), args=args, train_dataset=dataset,
                         processing_class=tok, peft_config=lora_config(stage),
                         data_collator=packing.collator(tok) if packed else None)
    return {**fit(trainer, tok, stage_dir, stage.nonfinite_limit, stage.matmul_precision), "truncated_rows": truncated}


def run(ctx: Any) -> dict:
    """Train the input checkpoint on the stage's data or mixture; the result lands in `ctx.out_dir/model`."""
    from pipeline.data import chat
    from pipeline.data.mixtures import load_mixture
    from pipeline.runfolder import cache_dir
    from pipeline.train.models import load_tokenizer

    tok = load_tokenizer(ctx.input_model, ctx.cfg.model, need_template=ctx.stage.format == "chat")
    render = None
    if ctx.stage.format == "text" and tok.chat_template:
        def render(row: dict) -> str:
            return chat.render(tok, row["messages"], row.get("chat_template_kwargs"), tools=row.get("tools"))
    dataset = load_mixture(data_source(ctx.stage), ctx.cfg, render)
    return train(ctx.stage, ctx.cfg.model, ctx.input_model, tok, dataset, ctx.out_dir, ctx.cfg.seed,
                 cache_dir(ctx.cfg), ctx.cfg)
