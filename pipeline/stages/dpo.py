"""Preference optimisation (DPO, APO-zero, IPO, ... through TRL's DPOTrainer): one model per call.

Pairs come from the stage's mixture and/or on-policy sampling (`on_policy`: k answers per prompt
from the input checkpoint, a right one chosen over a wrong one, as `on_policy.reward` judges them). The reference
model is the input checkpoint, frozen (with LoRA: the adapter-disabled base). The pairs, and with
`precompute_ref_log_probs` the reference's log-probs on them, are prepared once in the stage's folder
and shared by every sweep candidate (`pipeline.sweep` trains each one through `run`).
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError
from pipeline.rl import diagnostics
from pipeline.settings import Data, MergeConfig, SoupConfig, StageKind, StageSettings, arg, data_source

log = logging.getLogger("pipeline")


@dataclass
class OnPolicyConfig:
    """Preference pairs sampled from the stage's input model on prompts with known answers, judged by a verifier."""

    enabled: bool = arg("sample on-policy pairs from the stage's input model", False)
    mixture: str = arg("rows with `prompt` (chat) and `answer`", "", path="mixture")
    samples: int = arg("answers sampled per prompt", 4)
    max_new_tokens: int = arg("most tokens sampled per answer", 128)
    temperature: float = arg("sampling temperature", 1.0)
    max_prompts: int = arg("most prompts sampled: the first N of the mixture (shuffled with its seed); "
                           "0: all prompts", 0)
    batch_size: int = arg("prompts per generation batch (hf)", 32, resumable=True)
    backend: str = arg("hf: transformers' generate | vllm: a vLLM engine (continuous batching)", "hf", added=True,
                       choices=("hf", "vllm"))
    reference_chosen: bool = arg("a prompt with no correct sample pairs its reference answer (the mixture's `answer`, "
                                 "chosen) with a wrong sample, as SPIN does: pairs from a model that rarely gets one "
                                 "right", False, added=True)
    reward: str = arg("the verifier that tells a right sample (scored 1 or more) from a wrong one against `answer`: "
                      "gsm8k (the `#### N` check) or module:function, fn(completions, answers) -> list[float] "
                      "(docs/training.md)", "gsm8k", added=True)


@dataclass
class DpoSettings(StageSettings):
    """A TRL DPOTrainer stage (DPO, APO-zero, IPO, ...), with an optional sweep, soup and merge."""

    loss_type: list[str] = arg("e.g. [apo_zero] or [sigmoid, sft]", factory=lambda: ["sigmoid"])
    loss_weights: list[float] = arg("one per loss type; empty: all 1", factory=list)
    beta: float = arg("DPO temperature: how far the policy may move from the reference", 0.1)
    precompute_ref_log_probs: bool = arg("reference log-probs computed once and shared by every candidate", True)
    on_policy: OnPolicyConfig = arg("preference pairs sampled from the input model", factory=OnPolicyConfig)
    soup: SoupConfig = arg("a uniform average of the best candidates, as one more candidate", factory=SoupConfig)
    merge: MergeConfig = arg("a linear merge with an earlier stage's model, as one more candidate", factory=MergeConfig)
    activation_offloading: bool = arg("TRL's activation offloading of saved activations to CPU memory (CUDA)", False,
                                      added=True, resumable=True)


class Dpo(StageKind):
    name, settings, trl_config, pairs, reference = "dpo", DpoSettings, "trl:DPOConfig", True, True
    order = 30
    report_keys = ("beta", "loss_type")
    help = "preference optimisation with a sweep"
    defaults = {"learning_rate": 5e-7, "lr_scheduler_type": "cosine"}  # noqa: RUF012

    def formats(self, stage: Any) -> list[str]:
        return ["preference"]

    def mixtures(self, stage: Any) -> list[tuple[str | Data, list[str], str]]:
        out = super().mixtures(stage)
        if stage.on_policy.enabled:
            out.append((stage.on_policy.mixture, ["prompt with answer"], "on-policy prompts"))
        return out

    def extra_tokens(self, stage: Any, name: str) -> tuple[float | None, str] | None:
        if not stage.on_policy.enabled:
            return None
        if not stage.on_policy.max_prompts:
            return None, f"unknown: on-policy pairs without {name}.on_policy.max_prompts"
        return (stage.on_policy.max_prompts * 2 * stage.max_length,
                f"at most {stage.on_policy.max_prompts} on-policy pairs x 2 x max_length {stage.max_length}")

    def check(self, cfg: Any, name: str) -> None:
        stage = cfg[name]
        if stage.padding_free:  # TRL 1.16's DPOTrainer warns and pads anyway: refuse rather than do nothing
            raise ConfigError(f"'{name}.padding_free' is not supported: TRL 1.16's DPOTrainer turns it off and pads "
                              "every batch; remove the key (or set it to false)")
        if stage.loss_weights and len(stage.loss_weights) != len(stage.loss_type):
            raise ConfigError(f"'{name}.loss_weights' has {len(stage.loss_weights)} weights for "
                              f"{len(stage.loss_type)} loss types")
        if stage.on_policy.enabled and (not stage.on_policy.mixture or stage.on_policy.samples < 2):
            raise ConfigError(f"'{name}.on_policy' needs a mixture of prompts with answers and samples >= 2")
        if stage.on_policy.enabled:
            from pipeline.evaluation import verifiers

            verifiers.load(stage.on_policy.reward, f"{name}.on_policy.reward")  # imported and its signature read

    def vllm_keys(self, cfg: Any, name: str) -> list[str]:
        op = cfg[name].on_policy
        return [f"{name}.on_policy.backend"] if op.enabled and op.backend == "vllm" else []

    def trainer_args(self, stage: Any, work_dir: Any, seed: int, precision: str, run: Any = None) -> Any:
        return dpo_args(stage, work_dir, seed, precision, run)

    def train(self, ctx: Any) -> dict:
        return run(ctx)


KIND = Dpo()


def _on_policy(ctx: Any) -> Any:
    """On-policy pairs sampled from the input model (once: kept in on_policy_pairs.jsonl), or None if none."""
    import datasets

    from pipeline import preempt
    from pipeline.data.mixtures import load_mixture
    from pipeline.files import write_json, write_text
    from pipeline.logs import duration

    path = ctx.on_policy_pairs
    with preempt.main_only("on-policy sampling") as main:
        if main and not path.is_file():
            from pipeline.rl.onpolicy import on_policy_pairs

            op = ctx.stage.on_policy
            rows = load_mixture(op.mixture, ctx.cfg)
            if op.max_prompts:
                rows = rows.select(range(min(op.max_prompts, len(rows))))
            pairs, stats = on_policy_pairs(ctx.input_model, ctx.cfg.model, list(rows["prompt"]), list(rows["answer"]),
                                           op.samples, op.max_new_tokens, op.temperature, op.batch_size, ctx.cfg.seed,
                                           op.backend, op.reference_chosen, op.reward)
            log.info("on-policy pairs: %d from %d prompts x %d samples (%.0f%% correct; %d prompts all correct, %d all "
                     "wrong; %d pairs chose the reference answer) in %s", stats["pairs"], stats["prompts"], op.samples,
                     100 * stats["correct_rate"], stats["all_correct"], stats["all_wrong"], stats["reference_pairs"],
                     duration(stats["sampling_s"]))
            write_json(ctx.on_policy_stats, stats)
            write_text(path, "".join(json.dumps(p) + "\n" for p in pairs))
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    if not rows:
        log.warning("on-policy sampling found no prompt with both a correct and an incorrect answer")
    return datasets.Dataset.from_list(rows) if rows else None


def preference_pairs(ctx: Any) -> Any:
    """The stage's preference pairs: its data or mixture plus on-policy pairs (sampled once, kept in the stage
    folder)."""
    import datasets

    from pipeline.data.mixtures import load_mixture

    stage = ctx.stage
    parts = [load_mixture(data_source(stage), ctx.cfg)] if data_source(stage) else []
    if stage.on_policy.enabled and (sampled := _on_policy(ctx)) is not None:
        parts.append(sampled)
    if not parts:
        raise ConfigError("dpo has no preference pairs: on-policy sampling found no prompt with both a correct and "
                          "an incorrect answer (raise dpo.on_policy.samples or temperature, set "
                          "dpo.on_policy.reference_chosen=true, or add dpo.data or dpo.mixture)")
    return datasets.concatenate_datasets(parts).shuffle(seed=ctx.cfg.seed) if len(parts) > 1 else parts[0]


def on_disk(pairs: Any, path: Path) -> Any:
    """The pairs as a disk-backed dataset: every candidate then reuses TRL's tokenisation of them
    (datasets caches a map beside the data, keyed by the dataset's fingerprint)."""
    import datasets

    from pipeline.distributed import main_writes
    from pipeline.files import atomic_dir

    with main_writes() as main:
        if main and not path.is_dir():
            with atomic_dir(path, first_wins=True) as tmp:  # sweep array tasks share the stage folder
                pairs.save_to_disk(str(tmp))
    return datasets.load_from_disk(str(path))


@functools.cache
def shared_ref_trainer() -> type:
    """DPOTrainer that uses reference log-probs already stored with the pairs instead of recomputing them.

    TRL caches its precomputed log-probs under a fingerprint that includes every training argument
    (beta, learning rate, output folder), so sweep candidates would each run the reference again.
    """
    from trl import DPOTrainer

    class SharedRefDPOTrainer(DPOTrainer):
        def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
            if {"ref_chosen_logps", "ref_rejected_logps"} <= set(dataset.column_names):
                return dataset
            return super()._precompute_ref_logps(dataset, name, batch_size)

    return SharedRefDPOTrainer


def dpo_args(stage: Any, work_dir: Path, seed: int, precision: str, run: Any = None) -> Any:
    """DPOTrainer arguments for the stage's settings (a candidate's beta and rate), its TRL-named keys over them."""
    from trl import DPOConfig

    from pipeline.train.trainer import common_args, trl_config

    return trl_config(DPOConfig, stage, dict(
        **common_args(stage, work_dir, seed, precision, run), loss_weights=list(stage.loss_weights) or None))


def trainer(ctx: Any, tok: Any, pairs: Any, work: Path) -> Any:
    """A DPO trainer of the input model on `pairs` with the stage's settings (a candidate's beta and rate)."""
    from pipeline.train.models import load_model
    from pipeline.train.trainer import lora_config

    args = dpo_args(ctx.stage, work, ctx.cfg.seed, ctx.cfg.model.precision, ctx.cfg)
    return shared_ref_trainer()(model=load_model(ctx.input_model, ctx.cfg.model), ref_model=None, args=args,
                               train_dataset=pairs, processing_class=tok, peft_config=lora_config(ctx.stage))


def with_reference(ctx: Any, tok: Any, pairs: Any, path: Path) -> Any:
    """The pairs, tokenised, with the reference model's log-probs: computed once per stage (TRL's
    precompute, all ranks) and stored in `path`, so no candidate runs the reference model."""
    import datasets

    from pipeline import preempt
    from pipeline.distributed import main_writes
    from pipeline.files import atomic_dir
    from pipeline.train.precision import matmul_precision

    if not path.is_dir():
        work = ctx.reference_dir  # the trainer's output folder: it trains nothing, nothing is saved
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


def train_candidate(ctx: Any, tok: Any, pairs: Any) -> dict:
    """Train one model on `pairs` into `ctx.out_dir/model` (checkpoints in `work/`); return the training metrics."""
    from pipeline.train.trainer import fit

    return fit(trainer(ctx, tok, pairs, ctx.work_dir), tok, ctx.out_dir, ctx.stage.nonfinite_limit,
               ctx.stage.matmul_precision)


def run(ctx: Any) -> dict:
    """Train one model (the stage's settings, or a sweep candidate's) into `ctx.out_dir/model`."""
    import datasets

    from pipeline.train.models import load_tokenizer

    tok = load_tokenizer(ctx.input_model, ctx.cfg.model, need_template=True)
    shared = ctx.ref_pairs_dir if ctx.stage.precompute_ref_log_probs else ctx.pairs_dir
    if shared.is_dir():  # prepared for an earlier candidate
        pairs = datasets.load_from_disk(str(shared))
    else:
        pairs = on_disk(preference_pairs(ctx), ctx.pairs_dir)
        if ctx.stage.precompute_ref_log_probs:
            pairs = with_reference(ctx, tok, pairs, shared)
    log.info("candidate %s: training (beta %g, lr %g) on %d pairs", ctx.out_dir.name, ctx.stage.beta,
             ctx.stage.learning_rate, len(pairs))
    metrics = train_candidate(ctx, tok, pairs)
    stats = ctx.on_policy_stats
    on_policy = json.loads(stats.read_text()) if ctx.stage.on_policy.enabled and stats.is_file() else None
    return {**metrics, "diagnostics": diagnostics.dpo(on_policy, metrics, ctx.stage.beta)}
