"""Preference optimisation (DPO, APO-zero, IPO, ... through TRL's DPOTrainer) with a sweep.

Pairs come from the stage's mixture and/or on-policy sampling (`on_policy`: k answers per prompt
from the input checkpoint, a correct one chosen over an incorrect one). The reference model is the
input checkpoint, frozen (with LoRA: the adapter-disabled base). `sweep` expands beta x learning
rate into candidates under `candidates/<id>/`, each trained from the same input checkpoint and
scored by the stage's eval; `soup.top_k` averages the K best, `merge` mixes the soup (or the best
candidate) with an earlier stage's checkpoint; soup and merge compete as candidates too.

Selection: the highest value of the stage's gate metric wins; ties go to the candidate listed
first (grid order: beta ascending, then learning rate ascending; then soup, then merge), so the
simpler model wins a tie. Finished candidates are reused when the stage is resumed.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from accelerate import PartialState
from omegaconf import OmegaConf
from trl import DPOConfig, DPOTrainer

from pipeline import merge
from pipeline.config import ConfigError, grid
from pipeline.data import load_mixture
from pipeline.files import atomic_dir, fingerprint, read_json, write_json, write_text
from pipeline.stage import StageContext, earlier_stage_model
from pipeline.training import common_args, fit, load_model, load_tokenizer, lora_config

log = logging.getLogger("pipeline")


def _pairs(ctx: StageContext) -> Any:
    """The stage's preference pairs: its mixture plus on-policy pairs (sampled once, kept in pairs.jsonl)."""
    import datasets

    stage, state = ctx.stage, PartialState()
    parts = [load_mixture(stage.mixture, ctx.cfg)] if stage.mixture else []
    if stage.on_policy.enabled:
        path = ctx.stage_dir / "on_policy_pairs.jsonl"
        if state.is_main_process and not path.is_file():
            from pipeline.onpolicy import on_policy_pairs

            op = stage.on_policy
            rows = load_mixture(op.mixture, ctx.cfg)
            if op.max_prompts:
                rows = rows.select(range(min(op.max_prompts, len(rows))))
            pairs, stats = on_policy_pairs(ctx.input_model, list(rows["prompt"]), list(rows["answer"]), op.samples,
                                           op.max_new_tokens, op.temperature, op.batch_size, ctx.cfg.seed)
            log.info("on-policy pairs: %s", stats)
            write_json(ctx.stage_dir / "on_policy_stats.json", stats)
            write_text(path, "".join(json.dumps(p) + "\n" for p in pairs))
        state.wait_for_everyone()
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        if rows:
            parts.append(datasets.Dataset.from_list(rows))
        else:
            log.warning("on-policy sampling found no prompt with both a correct and an incorrect answer")
    if not parts:
        raise ConfigError("dpo has no preference pairs: on-policy sampling found no prompt with both a correct and "
                          "an incorrect answer (raise dpo.on_policy.samples or temperature, or add dpo.mixture)")
    return datasets.concatenate_datasets(parts).shuffle(seed=ctx.cfg.seed) if len(parts) > 1 else parts[0]


def _on_disk(pairs: Any, path: Path) -> Any:
    """The pairs as a disk-backed dataset: every candidate then reuses TRL's tokenisation of them
    (datasets caches a map beside the data, keyed by the dataset's fingerprint)."""
    import datasets

    if PartialState().is_main_process and not path.is_dir():
        with atomic_dir(path) as tmp:
            pairs.save_to_disk(str(tmp))
    PartialState().wait_for_everyone()
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


def _trainer(ctx: StageContext, tok: Any, pairs: Any, cand: dict, work: Path) -> DPOTrainer:
    stage = ctx.stage
    args = DPOConfig(
        **{**common_args(stage, work, ctx.cfg.seed, ctx.cfg.model.precision), "learning_rate": cand["learning_rate"]},
        beta=cand["beta"], loss_type=list(stage.loss_type), loss_weights=list(stage.loss_weights) or None,
        padding_free=stage.padding_free, precompute_ref_log_probs=stage.precompute_ref_log_probs)
    return SharedRefDPOTrainer(model=load_model(ctx.input_model, ctx.cfg.model), ref_model=None, args=args,
                               train_dataset=pairs, processing_class=tok, peft_config=lora_config(stage))


def _with_reference(ctx: StageContext, tok: Any, pairs: Any, path: Path) -> Any:
    """The pairs, tokenised, with the reference model's log-probs: computed once per stage (TRL's
    precompute, all ranks) and stored in `path`, so no candidate runs the reference model."""
    import datasets

    state = PartialState()
    if not path.is_dir():
        work = ctx.stage_dir / "reference"  # the trainer's output folder: it trains nothing, nothing is saved
        trainer = _trainer(ctx, tok, pairs, grid(ctx.stage)[0], work)
        log.info("reference log-probs of %d pairs computed once for every candidate: %s", len(trainer.train_dataset),
                 path)
        if state.is_main_process:
            with atomic_dir(path) as tmp:
                trainer.train_dataset.save_to_disk(str(tmp))
            shutil.rmtree(work, ignore_errors=True)
        del trainer
    state.wait_for_everyone()
    return datasets.load_from_disk(str(path))


def _train(ctx: StageContext, tok: Any, pairs: Any, cand: dict, out: Path) -> dict:
    return fit(_trainer(ctx, tok, pairs, cand, out / "work"), tok, out, ctx.stage.nonfinite_limit)


def _score(ctx: StageContext, record: dict, out: Path) -> dict:
    """Evaluate a finished candidate (main process), write its stage.json last; every rank reads it back."""
    if PartialState().is_main_process:
        record = {**record, "status": "done", "output_model": str(out / "model"),
                  "eval": ctx.evaluate(out / "model", out / "eval")}
        write_json(out / "stage.json", record)
    PartialState().wait_for_everyone()
    return read_json(out / "stage.json")


def _value(record: dict, metric: str) -> float:
    return (record.get("eval") or {}).get("metrics", {}).get(metric, float("-inf"))


def run(ctx: StageContext) -> dict | None:
    """Train every candidate, add soup / merge, select by the gate metric into `ctx.stage_dir/model`.

    With `sweep.candidate` set, train only that candidate and return None: the stage is unfinished.
    """
    stage, state = ctx.stage, PartialState()
    metric = stage.gate.metric
    tok = load_tokenizer(ctx.input_model, ctx.cfg.model, need_template=True)
    pairs = _on_disk(_pairs(ctx), ctx.stage_dir / "pairs")
    if stage.precompute_ref_log_probs:
        pairs = _with_reference(ctx, tok, pairs, ctx.stage_dir / "pairs_ref")
    candidates, cands = [], grid(stage)
    for cand in cands if stage.sweep.candidate is None else [cands[stage.sweep.candidate]]:
        out = ctx.stage_dir / "candidates" / cand["id"]
        fp = fingerprint({"stage": ctx.fingerprint, "candidate": cand})
        record = read_json(out / "stage.json") or {}
        trained = record.get("status") in ("trained", "done") and record.get("fingerprint") == fp
        if trained and record["status"] == "done" and (out / "model").is_dir():
            log.info("candidate %s: reusing", cand["id"])
        else:
            if not (trained and (out / "model").is_dir()):
                log.info("candidate %s: training (beta %g, lr %g) on %d pairs", cand["id"], cand["beta"],
                         cand["learning_rate"], len(pairs))
                config = {**OmegaConf.to_container(stage, resolve=True), "beta": cand["beta"],
                          "learning_rate": cand["learning_rate"]}
                record = {"stage": ctx.name, "candidate": cand["id"], "fingerprint": fp, "status": "trained",
                          "config": {k: v for k, v in config.items() if k not in ("eval", "gate", "sweep", "soup",
                                                                                  "merge")},
                          "metrics": _train(ctx, tok, pairs, cand, out)}
                if state.is_main_process:
                    write_json(out / "stage.json", record)  # trained; a crash during its eval re-scores only
            record = _score(ctx, record, out)
        log.info("candidate %s: %s = %s", cand["id"], metric or "-", _value(record, metric))
        candidates.append(record)
    if stage.sweep.candidate is not None:
        return None
    ranked = sorted(candidates, key=lambda r: -_value(r, metric))  # stable: ties keep grid order
    best = ranked[0]
    if stage.soup.top_k:
        best_extra = _combine(ctx, "soup", [Path(r["output_model"]) for r in ranked[: stage.soup.top_k]], None)
        candidates.append(best_extra)
    if stage.merge.stage:
        base = earlier_stage_model(ctx.stage_dir, stage.merge.stage)
        if base is None:
            raise ConfigError(f"dpo.merge.stage '{stage.merge.stage}' has no finished checkpoint in this run")
        top = candidates[-1] if stage.soup.top_k else best
        candidates.append(_combine(ctx, "merge", [Path(top["output_model"]), base],
                                   [1 - stage.merge.weight, stage.merge.weight]))
    selected = max(candidates, key=lambda r: _value(r, metric))  # max keeps the first of equal values
    if state.is_main_process:
        with atomic_dir(ctx.stage_dir / "model") as tmp:
            shutil.copytree(selected["output_model"], tmp, dirs_exist_ok=True)
    state.wait_for_everyone()
    table = [{"candidate": r["candidate"], metric or "metric": _value(r, metric)} for r in candidates]
    log.info("selected candidate %s by %s: %s", selected["candidate"], metric or "(single candidate)", table)
    trained = selected.get("metrics") or best["metrics"]
    return {**trained, "selected": selected["candidate"], "selected_by": metric or None,
            "tie_rule": "highest metric; ties go to the earlier candidate (grid order, then soup, then merge)",
            "candidates": table, "eval": selected.get("eval")}


def _combine(ctx: StageContext, kind: str, models: list[Path], weights: list[float] | None) -> dict:
    """A soup (uniform average) or linear merge of `models` as a scored candidate under `candidates/<kind>`."""
    out = ctx.stage_dir / "candidates" / kind
    sources = [str(m) for m in models]
    fp = fingerprint({"stage": ctx.fingerprint, kind: sources, "weights": weights})
    record = read_json(out / "stage.json") or {}
    if record.get("status") == "done" and record.get("fingerprint") == fp:
        return record
    if PartialState().is_main_process:
        (merge.soup(models, out / "model") if weights is None else merge.linear_merge(models, weights, out / "model"))
    PartialState().wait_for_everyone()
    log.info("%s of %s (weights %s)", kind, sources, weights or "uniform")
    return _score(ctx, {"stage": ctx.name, "candidate": kind, "fingerprint": fp,
                        "config": {"sources": sources, "weights": weights}}, out)
