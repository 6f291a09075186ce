"""A sweep inside a stage (any stage's `sweep`, `soup`, `merge`), driven by the orchestrator.

`sweep` expands its settings' values (`grid.grid`) into candidates under `candidates/<id>/`, each trained by the
stage kind's `train` (one model per call) from the same input checkpoint and scored on the task of the gate metric
only (`selection_settings`: validation; the selected model is then scored on every task);
`soup.top_k` averages the K best, `merge` mixes the soup (or the best candidate) with an earlier stage's
checkpoint; soup and merge compete as candidates too. Finished candidates are reused (by fingerprint).

Selection: on the selection half of the gate metric's problems (even doc_ids, `stats.HALVES`), the candidates
that cannot be told apart from the best one (their paired test against it, p >= 0.05: a lead of a problem or two
is noise) are ordered by `gate.tie_break`, a second metric such as a continuous one, and the best of them wins
(the highest, or the lowest for a metric lm-eval says is better lower); without a tie-break the best on the gate
metric wins, and equal values go to the candidate listed first (grid order: settings by name, each ascending;
then soup, then merge), so the simpler model wins a tie. The stage records how it picked ("picked by <metric>
among N not told apart"). Each candidate's row says whether it can be told apart from the selected one on the
selection half. The gate then judges the selected model on the other half only (the orchestrator), where the pick
has not already favoured it.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from pipeline import keys, preempt, redact
from pipeline.chain import merge
from pipeline.chain.resume import refuse_other_world
from pipeline.distributed import is_main, main_value, main_writes, world_size
from pipeline.errors import ConfigError
from pipeline.evaluation import stats
from pipeline.files import atomic_dir
from pipeline.fingerprints import stage_section, training_view
from pipeline.grid import swept
from pipeline.runfolder import (
    StageContext,
    StageRecord,
    Trained,
    candidate_dir,
    checkpointed,
    drop_work,
    earlier_stage_model,
    eval_dir,
    find_kept,
    finished,
    input_stage,
    keep,
    model_changed,
    model_dir,
    restore,
    run_root,
    samples_dir,
    stored_path,
)

log = logging.getLogger("pipeline")
EARLIER = "the earlier candidate (grid order, then soup, then merge)"
NOT_TRAINING = ("eval", "gate", "sweep", "soup", "merge", "candidate")  # left out of a candidate's recorded config
Train = Callable[[StageContext], dict]  # a stage's entry function: trains ctx.out_dir/model, returns metrics


@dataclass
class Scorer:
    """How candidates are scored: `score(model dir, output dir) -> eval result` (on the main process), and the key of
    that scoring (`resume.eval_fingerprint`: eval settings, the tasks' contents, the scoring libraries). A finished
    candidate scored under another key is scored again, never ranked on its old scores."""

    score: Callable[[Path, Path], dict]
    key: str | None


def scored(record: StageRecord, folder: Path, scorer: Scorer) -> bool:
    """Whether a candidate's record holds its scores under `scorer`'s key, of the model its folder holds (one
    changed since it was scored is scored anew, with a warning)."""
    if not (record.status == "done" and record.eval_fingerprint == scorer.key):
        return False
    problem = main_value(model_changed(record, folder) if is_main() else None)  # read once, one answer everywhere
    if problem:
        log.warning("candidate %s: %s; scoring it anew", folder.name, problem)
    return problem is None


def selection_settings(ev: dict, metric: str, tie_break: str = "") -> dict:
    """The eval settings candidates are scored with: only the task of the gate `metric`, when it is one of `ev`'s
    tasks (the held-out test split is for the report: only the selected model is scored on it), else `ev`; plus
    the task of the `tie_break` metric, whether `ev` lists it or not."""
    tasks = [metric.partition("/")[0]] if metric and metric.partition("/")[0] in ev["tasks"] else list(ev["tasks"])
    tie = tie_break.partition("/")[0] if metric and tie_break else ""
    return {**ev, "tasks": tasks + ([tie] if tie and tie not in tasks else [])}


def tie_rule(metric: str, tie_break: str) -> str:
    """How the sweep ranks its candidates, in words."""
    then = (f"among those not told apart from the best (paired p >= 0.05), the best {tie_break}, then {EARLIER}"
            if tie_break else f"ties go to {EARLIER}")
    return f"best {metric or 'metric'}; {then}"


def pick(candidates: list[StageRecord], metric: str, tie_break: str) -> tuple[StageRecord, str]:
    """The selected candidate and how it was picked: the best on `metric` (selection half); with a `tie_break`,
    the best on it among the candidates not told apart from that one (`tie_rule`)."""
    best = max(candidates, key=lambda r: _rank(r, metric, tie_break))  # max keeps the first of equal values
    if not (metric and tie_break):
        return best, f"picked by {metric or 'order (single candidate)'}"
    home = samples_dir(Path(best.output_model).parent)
    alike = [r for r in candidates if r is best or _alike(stats.paired_difference(
        home, samples_dir(Path(r.output_model).parent), metric, "selection"))]
    if len(alike) == 1:
        return best, f"picked by {metric}: told apart from every other candidate"
    chosen = max(alike, key=lambda r: (_value(r, tie_break), _value(r, metric)))
    return chosen, f"picked by {tie_break} among {len(alike)} not told apart by {metric}"


def _alike(paired: dict | None) -> bool:
    """Whether a paired difference (`stats.compare`) does not tell the two apart (not `stats.significant`)."""
    return paired is not None and not stats.significant(paired)


def _value(record: StageRecord, metric: str) -> float:
    """The candidate's `metric` on the selection half of its problems (all of them without per-problem samples),
    signed so that higher is better (lm-eval's `higher_is_better` of the metric, as the candidate's eval records
    it)."""
    value = _half(record, metric)
    if value is None:
        return float("-inf")
    return value if stats.higher_is_better(record.eval, metric) else -value


def _rank(record: StageRecord, metric: str, tie_break: str) -> tuple[float, float]:
    return _value(record, metric), _value(record, tie_break)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _half(record: StageRecord, metric: str) -> float | None:
    """The candidate's `metric` on the selection half as measured (not signed); None when not scored."""
    if not metric:
        return None
    half = stats.half_mean(samples_dir(Path(record.output_model).parent), metric, "selection")
    return half[0] if half else record.scores().get(metric)


def _score(record: StageRecord, out: Path, scorer: Scorer) -> StageRecord:
    """Score a finished candidate (main process), write its stage.json last; every rank reads it back."""
    record.status, record.output_model, record.eval_fingerprint = "done", str(model_dir(out)), scorer.key
    record.eval = scorer.score(model_dir(out), samples_dir(out))  # the main process scores; the others get nothing
    record.model_digest = record.eval.get("model_digest", record.model_digest)  # the files it scored
    record.write(out)  # written last (main process); every rank reads it back
    return StageRecord.read(out)


def candidate_fingerprint(ctx: StageContext, inputs: str, cand: dict) -> str:
    """A grid candidate's fingerprint: the stage's inputs (`StageDecision.inputs`) and what the candidate trains
    (the stage's settings with the candidate's over them, not the grid, soup or merge): other candidates, a grid
    that grows or a changed soup leave it as it was."""
    section = stage_section(ctx.cfg, ctx.name, {k: v for k, v in cand.items() if k != "id"})
    trains = keys.by_contents(training_view(section, OmegaConf.get_type(ctx.cfg[ctx.name])))
    return keys.key({"inputs": inputs, "config": {k: v for k, v in trains.items() if k not in NOT_TRAINING}})


def _candidate(ctx: StageContext, inputs: str, cand: dict, train: Train, scorer: Scorer) -> StageRecord:
    """One grid candidate: reused when finished with the same fingerprint, resumed when interrupted with it, else
    trained from scratch (or re-scored)."""
    cctx, fp = ctx.for_candidate(cand), candidate_fingerprint(ctx, inputs, cand)
    record = StageRecord.read(cctx.out_dir, strict=True)
    record = _reclaim(cctx.out_dir, fp, record)
    if finished(record, cctx.out_dir, fp) and scored(record, cctx.out_dir, scorer):
        log.info("candidate %s: reusing", cand["id"])
        drop_work(cctx.out_dir)  # left when a kill came between its record and the removal
        return record
    if not finished(record, cctx.out_dir, fp):
        if not (record.fingerprint == fp and record.status == "running"):
            _clear(cctx.out_dir)  # an attempt with other settings or inputs: its checkpoints must not resume
        elif checkpointed(cctx.out_dir):
            refuse_other_world(f"candidate {cand['id']} of {ctx.stage_dir.name}", ctx.name, record, world_size(),
                               cctx.stage)
        config = OmegaConf.to_container(cctx.stage, resolve=True)
        record = StageRecord(stage=ctx.name, candidate=cand["id"], fingerprint=fp, status="running",
                             world_size=world_size(),
                             config=redact.config({k: v for k, v in config.items() if k not in NOT_TRAINING}))
        record.write(cctx.out_dir)
        record.metrics, record.status = train(cctx), "trained"
        record.write(cctx.out_dir)  # trained; a crash during its eval re-scores only
    drop_work(cctx.out_dir)  # its checkpoints go only once the record says trained
    return _score(record, cctx.out_dir, scorer)


def _reclaim(folder: Path, fp: str, record: StageRecord) -> StageRecord:
    """The record of the candidate `folder` (now `record`), after putting back a kept candidate of fingerprint
    `fp` (`runfolder.find_kept`) when `folder` holds another."""
    root = run_root(folder)
    if record.fingerprint == fp or not (kept := find_kept(root, folder, fp)):
        return record
    with main_writes() as main:
        if main:
            restore(root, folder, kept)
    log.info("candidate %s: put back from %s", folder.name, kept)
    return StageRecord.read(folder, strict=True)


def _clear(folder: Path) -> None:
    """Empty a candidate's folder: keep a finished or interrupted one (`keep`), remove a stale one (main process;
    every rank waits)."""
    with main_writes() as main:
        if main and folder.is_dir() and keep(run_root(folder), folder) is None:
            shutil.rmtree(folder)


def train_candidates(ctx: StageContext, inputs: str, cands: list[dict], train: Train, scorer: Scorer,
                     only: int | None = None) -> list[StageRecord]:
    """Train (or reuse) and score the grid's candidates `cands` (`grid.grid`, carried by the stage's decision), or
    only the one numbered `only`; `inputs`: what the stage starts from (`StageDecision.inputs`)."""
    records = []
    for cand in cands if only is None else [cands[only]]:
        record = _candidate(ctx, inputs, cand, train, scorer)
        metric = ctx.stage.gate.metric
        if metric:
            log.info("candidate %s: %.3f on the selection half", cand["id"], _value(record, metric))
        records.append(record)
    return records


def _combine(ctx: StageContext, inputs: str, kind: str, models: list[Path], weights: list[float] | None,
             scorer: Scorer) -> StageRecord:
    """A soup (uniform average) or linear merge of `models` as a scored candidate under `candidates/<kind>`."""
    out = candidate_dir(ctx.stage_dir, kind)
    sources = [stored_path(m, run_root(out)) for m in models]  # relative to the run folder: it may move
    made_of = [StageRecord.read(Path(m).parent).fingerprint for m in models]  # its ingredients, wherever they lie
    fp = keys.key({"inputs": inputs, kind: made_of, "weights": weights})
    record = _reclaim(out, fp, StageRecord.read(out))
    if finished(record, out, fp) and scored(record, out, scorer):
        return record
    if record.fingerprint != fp:
        _clear(out)
    with preempt.main_only(f"making the {kind}") as main:
        if main and weights is None:
            merge.soup(models, model_dir(out))
        elif main:
            merge.linear_merge(models, weights, model_dir(out))
    log.info("%s of %s (%s)", kind, ", ".join(Path(m).parent.name for m in models),
             f"weights {', '.join(map(str, weights))}" if weights else "equal weights")
    config = {"sources": sources, "weights": weights}
    return _score(StageRecord(stage=ctx.name, candidate=kind, fingerprint=fp, config=config), out, scorer)


def _soup_and_merge(ctx: StageContext, inputs: str, ranked: list[StageRecord],
                    scorer: Scorer) -> list[StageRecord]:
    """The soup of the best candidates and the merge with an earlier stage, as the stage asks for them."""
    stage, extra = ctx.stage, []
    if stage.soup.top_k:
        models = [Path(r.output_model) for r in ranked[: stage.soup.top_k]]
        extra.append(_combine(ctx, inputs, "soup", models, None, scorer))
    if stage.merge.stage:
        base = earlier_stage_model(ctx.stage_dir, stage.merge.stage)
        if base is None:
            raise ConfigError(f"{ctx.name}.merge.stage '{stage.merge.stage}' has no finished checkpoint in this run")
        top = extra[-1] if extra else ranked[0]
        extra.append(_combine(ctx, inputs, "merge", [Path(top.output_model), base],
                              [1 - stage.merge.weight, stage.merge.weight], scorer))
    return extra


def versus_input(stage: Path, candidate_eval: Path, metric: str, half: str | None = None) -> dict | None:
    """The paired difference of a scored candidate (its eval folder) to the stage's input checkpoint on
    `metric` (on `half` of the problems when given); None without a metric, an evaluated input checkpoint or
    shared problems."""
    source = input_stage(stage) if metric else None
    return stats.paired_difference(eval_dir(source), candidate_eval, metric, half) if source else None


def run(ctx: StageContext, inputs: str, cands: list[dict], train: Train, scorer: Scorer) -> Trained:
    """Train every candidate of `cands`, add soup / merge, select by the gate metric into `ctx.stage_dir/model`."""
    metric, tie_break = ctx.stage.gate.metric, ctx.stage.gate.tie_break
    candidates = train_candidates(ctx, inputs, cands, train, scorer)
    ranked = sorted(candidates, key=lambda r: _rank(r, metric, tie_break), reverse=True)  # stable: ties keep order
    candidates += _soup_and_merge(ctx, inputs, ranked, scorer)
    selected, picked = pick(candidates, metric, tie_break)
    with main_writes() as main:
        if main:
            with atomic_dir(model_dir(ctx.stage_dir)) as tmp:
                shutil.copytree(selected.output_model, tmp, dirs_exist_ok=True)
    chosen = samples_dir(Path(selected.output_model).parent)
    table = [{"candidate": r.candidate, metric or "metric": r.scores().get(metric, float("-inf")),
              "selection_half": _half(r, metric), **({tie_break: _half(r, tie_break)} if tie_break else {}),
              "vs_input": versus_input(ctx.stage_dir, samples_dir(Path(r.output_model).parent), metric, "selection"),
              "vs_selected": None if r is selected else stats.paired_difference(
                  chosen, samples_dir(Path(r.output_model).parent), metric, "selection") if metric else None}
             for r in candidates]
    half = stats.half_mean(samples_dir(Path(selected.output_model).parent), metric, "selection") if metric else None
    log.info("selected candidate %s, %s, on the selection half of its problems: %s", selected.candidate, picked,
             ", ".join(f"{r['candidate']} {_num(r['selection_half'])}" for r in table))
    alike = [r["candidate"] for r in table if _alike(r["vs_selected"])]
    if alike and not tie_break:
        log.info("%s cannot be told apart from %s on the selection half (paired p >= 0.05): the pick among them is "
                 "noise; set %s.gate.tie_break to a second metric (a continuous one) to decide", ", ".join(alike),
                 selected.candidate, ctx.name)
    metrics = {**(selected.metrics or {}), "selected": selected.candidate,  # a soup or merge trained nothing
               "diagnostics": (selected.metrics or {}).get("diagnostics") or shared_diagnostics(candidates),
               "selected_by": metric or None, "tie_rule": tie_rule(metric, tie_break), "picked": picked,
               "candidates": table,
               "selection_problems": half[1] if half else None}
    return Trained(metrics, selected.eval, _trained_with(ctx, selected))


def shared_diagnostics(candidates: list[StageRecord]) -> dict | None:
    """What every trained candidate's `diagnostics` (`pipeline.rl.diagnostics`) agree on: the stage's own figures (a
    soup or merge, which trained nothing, has the pass rates of the samples every candidate trained on, not a margin of
    its own); None without any."""
    found = [d for r in candidates if (d := (r.metrics or {}).get("diagnostics"))]
    return {k: v for k, v in found[0].items() if all(d.get(k) == v for d in found)} if found else None


def _trained_with(ctx: StageContext, selected: StageRecord) -> dict:
    """The settings of the selected model: a grid candidate's own; for a soup or merge the stage's settings
    without the swept ones (its ingredients had several) plus its sources and weights."""
    if selected.candidate not in ("soup", "merge"):
        return selected.config
    names = set(swept(ctx.stage))
    stage = OmegaConf.to_container(ctx.stage, resolve=True)
    return redact.config({**{k: v for k, v in stage.items() if k not in NOT_TRAINING and k not in names},
                          **selected.config})
