"""Preference optimisation (DPO, APO-zero, IPO, ... through TRL's DPOTrainer): one model per call.

Pairs come from the stage's mixture and/or on-policy sampling (`on_policy`: k answers per prompt
from the input checkpoint, a correct one chosen over an incorrect one). The reference model is the
input checkpoint, frozen (with LoRA: the adapter-disabled base). The pairs, and with
`precompute_ref_log_probs` the reference's log-probs on them, are prepared once in the stage's folder
and shared by every sweep candidate (`pipeline.sweep` trains each one through `run`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import datasets
from omegaconf import DictConfig
from trl import DPOConfig, DPOTrainer

from pipeline.config import ConfigError
from pipeline.data.mixtures import load_mixture
from pipeline.files import atomic_dir, write_json, write_text
from pipeline.logs import duration
from pipeline.runfolder import StageContext
from pipeline.train import preempt
from pipeline.train.distributed import main_writes
from pipeline.train.models import load_model, load_tokenizer
from pipeline.train.precision import matmul_precision
from pipeline.train.trainer import common_args, fit, lora_config, trl_config

log = logging.getLogger("pipeline")


def _on_policy(ctx: StageContext) -> Any:
    """On-policy pairs sampled from the input model (once: kept in on_policy_pairs.jsonl), or None if none."""
    path = ctx.stage_dir / "on_policy_pairs.jsonl"
    with preempt.main_only("on-policy sampling") as main:
        if main and not path.is_file():
            from pipeline.generation.onpolicy import on_policy_pairs

            op = ctx.stage.on_policy
            rows = load_mixture(op.mixture, ctx.cfg)
            if op.max_prompts:
                rows = rows.select(range(min(op.max_prompts, len(rows))))
            pairs, stats = on_policy_pairs(ctx.input_model, ctx.cfg.model, list(rows["prompt"]), list(rows["answer"]),
                                           op.samples, op.max_new_tokens, op.temperature, op.batch_size, ctx.cfg.seed,
                                           op.backend, op.reference_chosen)
            log.info("on-policy pairs: %d from %d prompts x %d samples (%.0f%% correct; %d prompts all correct, %d all "
                     "wrong; %d pairs chose the reference answer) in %s", stats["pairs"], stats["prompts"], op.samples,
                     100 * stats["correct_rate"], stats["all_correct"], stats["all_wrong"], stats["reference_pairs"],
                     duration(stats["sampling_s"]))
            write_json(ctx.stage_dir / "on_policy_stats.json", stats)
            write_text(path, "".join(json.dumps(p) + "\n" for p in pairs))
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    if not rows:
        log.warning("on-policy sampling found no prompt with both a correct and an incorrect answer")
    return datasets.Dataset.from_list(rows) if rows else None


def preference_pairs(ctx: StageContext) -> Any:
    """The stage's preference pairs: its mixture plus on-policy pairs (sampled once, kept in the stage folder)."""
    stage = ctx.stage
    parts = [load_mixture(stage.mixture, ctx.cfg)] if stage.mixture else []
    if stage.on_policy.enabled and (sampled := _on_policy(ctx)) is not None:
        parts.append(sampled)
    if not parts:
        raise ConfigError("dpo has no preference pairs: on-policy sampling found no prompt with both a correct and "
                          "an incorrect answer (raise dpo.on_policy.samples or temperature, set "
                          "dpo.on_policy.reference_chosen=true, or add dpo.mixture)")
    return datasets.concatenate_datasets(parts).shuffle(seed=ctx.cfg.seed) if len(parts) > 1 else parts[0]


def on_disk(pairs: Any, path: Path) -> Any:
    """The pairs as a disk-backed dataset: every candidate then reuses TRL's tokenisation of them
    (datasets caches a map beside the data, keyed by the dataset's fingerprint)."""
    with main_writes() as main:
        if main and not path.is_dir():
            with atomic_dir(path, first_wins=True) as tmp:  # sweep array tasks share the stage folder
                pairs.save_to_disk(str(tmp))
    return datasets.load_from_disk(str(path))


class SharedRefDPOTrainer(DPOTrainer):
    """DPOTrainer that uses reference log-probs already stored with the pairs instead of recomputing them.

    TRL caches its precomputed log-probs under a fingerprint that includes every training argument
    (beta, learning rate, output folder), so sweep candidates would each run the reference again.
    """

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        if {"ref_chosen_logps", "ref_rejected_logps"} <= set(dataset.column_names):
            return dataset
        return super()._precompute_ref_logps(dataset, name, batch_size)


def dpo_args(stage: Any, work_dir: Path, seed: int, precision: str, run: DictConfig | None = None) -> DPOConfig:
    """DPOTrainer arguments for the stage's settings (a candidate's beta and rate), its `trainer` mapping over them."""
    return trl_config(DPOConfig, stage, dict(
        **common_args(stage, work_dir, seed, precision, run), beta=stage.beta, loss_type=list(stage.loss_type),
        loss_weights=list(stage.loss_weights) or None, padding_free=stage.padding_free,
        precompute_ref_log_probs=stage.precompute_ref_log_probs))


def trainer(ctx: StageContext, tok: Any, pairs: Any, work: Path) -> DPOTrainer:
    """A DPO trainer of the input model on `pairs` with the stage's settings (a candidate's beta and rate)."""
    args = dpo_args(ctx.stage, work, ctx.cfg.seed, ctx.cfg.model.precision, ctx.cfg)
    return SharedRefDPOTrainer(model=load_model(ctx.input_model, ctx.cfg.model), ref_model=None, args=args,
                               train_dataset=pairs, processing_class=tok, peft_config=lora_config(ctx.stage))


def with_reference(ctx: StageContext, tok: Any, pairs: Any, path: Path) -> Any:
    """The pairs, tokenised, with the reference model's log-probs: computed once per stage (TRL's
    precompute, all ranks) and stored in `path`, so no candidate runs the reference model."""
    if not path.is_dir():
        work = ctx.stage_dir / "reference"  # the trainer's output folder: it trains nothing, nothing is saved
        # at the precision of the candidates' training steps, which compare their log-probs with these
        with preempt.collective("computing the reference log-probs"), matmul_precision(ctx.stage.matmul_precision):
            computed = trainer(ctx, tok, pairs, work).train_dataset
        log.info("reference log-probs of %d pairs computed once for every candidate: %s", len(computed), path)
        with main_writes() as main:
            if main:
                with atomic_dir(path, first_wins=True) as tmp:
                    computed.save_to_disk(str(tmp))
                shutil.rmtree(work, ignore_errors=True)
    return datasets.load_from_disk(str(path))


def train_candidate(ctx: StageContext, tok: Any, pairs: Any) -> dict:
    """Train one model on `pairs` into `ctx.out_dir/model` (checkpoints in `work/`); return the training metrics."""
    return fit(trainer(ctx, tok, pairs, ctx.out_dir / "work"), tok, ctx.out_dir, ctx.stage.nonfinite_limit,
               ctx.stage.matmul_precision)


def run(ctx: StageContext) -> dict:
    """Train one model (the stage's settings, or a sweep candidate's) into `ctx.out_dir/model`."""
    tok = load_tokenizer(ctx.input_model, ctx.cfg.model, need_template=True)
    shared = ctx.stage_dir / ("pairs_ref" if ctx.stage.precompute_ref_log_probs else "pairs")
    if shared.is_dir():  # prepared for an earlier candidate
        pairs = datasets.load_from_disk(str(shared))
    else:
        pairs = on_disk(preference_pairs(ctx), ctx.stage_dir / "pairs")
        if ctx.stage.precompute_ref_log_probs:
            pairs = with_reference(ctx, tok, pairs, shared)
    log.info("candidate %s: training (beta %g, lr %g) on %d pairs", ctx.out_dir.name, ctx.stage.beta,
             ctx.stage.learning_rate, len(pairs))
    return train_candidate(ctx, tok, pairs)
