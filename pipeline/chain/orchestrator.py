"""The stage chain: set up the run folder, then for each stage decide (`pipeline.resume`), train, score,
judge the gate, and hand its checkpoint to the next.

Run folder: see `pipeline.runfolder`. Every rank runs the same steps; only the main process writes run
files and runs lm-eval (the others wait and read the results back from `stage.json`).
"""

from __future__ import annotations

import gc
import logging
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline import errors, faults, keys, logs, preempt, redact
from pipeline.chain import manifest, outcome, preflight, ranks, revisions, sweep
from pipeline.chain.basemodel import base_model, pending_build
from pipeline.chain.resume import StageDecision, base_fingerprint, eval_fingerprint
from pipeline.data import prep
from pipeline.distributed import (
    agreed_error,
    close_process_group,
    main_value,
    main_writes,
    process_state,
    share_cpu_threads,
)
from pipeline.errors import ConfigError
from pipeline.evaluation import gates, power, scorecache, stats
from pipeline.evaluation import lmeval as evaluate
from pipeline.files import RunLock, fence, remove_leftovers, temp_name, write_text
from pipeline.fingerprints import stage_section
from pipeline.grid import sweeps, swept_candidate
from pipeline.report import headline, hub, leaderboard, modelcard
from pipeline.runfolder import (
    BASE,
    FINISHED,
    KEPT,
    RunPaths,
    RunState,
    StageContext,
    StageRecord,
    Trained,
    base_dir,
    cache_dir,
    candidate_dir,
    candidate_folders,
    copy_kept,
    drop_work,
    eval_dir,
    keep,
    leaderboard_file,
    model_changed,
    model_dir,
    restore,
    run_dir,
    samples_dir,
    samples_file,
    stage_folders,
    stale_children,
    work_dir,
    write_kept,
)
from pipeline.settings import kind_of

log = logging.getLogger("pipeline")
FIGURES = (("tokens_per_s", "{} tokens/s"), ("mfu", "MFU {}"), ("compute_s", "compute {} s"),
           ("data_wait_s", "data wait {} s"), ("peak_rss_mb", "peak RSS {} MB"))


def training_summary(metrics: dict) -> str:
    """A stage's training figures for the log, rounded for people, leaving out those it did not measure."""
    parts = [f"{metrics['steps']} steps"] if metrics.get("steps") is not None else []
    if metrics.get("loss_first") is not None and metrics.get("loss_last") is not None:
        parts.append(f"loss {metrics['loss_first']:.3f} -> {metrics['loss_last']:.3f}")
    if metrics.get("padding_fraction") is not None:
        parts.append(f"padding {metrics['padding_fraction']:.0%}")
    figures = [fmt.format(logs.figure(metrics[key])) for key, fmt in FIGURES if metrics.get(key) is not None]
    return ", ".join(parts + figures)


def open_run_dir(root: Path, lock: RunLock) -> str | None:
    """Create the run folder and lock it, then check it is writable; return an error message or None. A run
    refused by the lock writes nothing into the folder."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except RuntimeError as err:
        return str(err)
    except OSError as err:
        return f"cannot write the run folder {root}: {err.strerror or err}"
    try:
        probe = temp_name(RunPaths(root).write_probe)  # one per process: sweep array tasks share the folder
        write_text(probe, "ok")
        probe.unlink()
    except OSError as err:
        lock.release()
        return f"cannot write the run folder {root}: {err.strerror or err}"
    return None


def tidy(root: Path, cache: Path) -> None:
    """With the run lock held (main process): remove what killed writers left in the run folder and the `cache`
    (temporary files and folders, `files.remove_leftovers`; in the cache, which other runs share and no lock
    covers, only those of this host's dead processes) and the checkpoints (`work/`) of stages whose record says
    they are finished (killed after the record was written, before `work/` went)."""
    shared = remove_leftovers(cache, lease_s=math.inf) if cache.is_dir() else []  # another host's: never judged
    for path in [*remove_leftovers(root), *shared]:
        log.info("removed %s, left by a writer that was stopped", path)
    for folder in stage_folders(root):
        if StageRecord.read(folder).status in FINISHED and model_dir(folder).is_dir() and work_dir(folder).is_dir():
            log.info("removing %s: the stage finished", work_dir(folder))
            shutil.rmtree(work_dir(folder), ignore_errors=True)


class Run:
    """One invocation of the pipeline on a run folder: what the steps of the chain share."""

    def __init__(self, cfg: DictConfig, root: Path, world_size: int, main: bool) -> None:
        self.cfg, self.root, self.world_size, self.main = cfg, root, world_size, main
        self.paths = RunPaths(root)
        self.state = RunState()  # what it writes into the folder, held in memory while the chain runs
        self.tasks_dir = self.paths.eval_tasks
        self.history: list[tuple[str, dict]] = []  # (checkpoint, eval metrics) in chain order
        self.decisions: list[StageDecision] = []
        self._base: str | Path | None = None
        self.base_build_s: float | None = None  # set when this run built the base model

    def base(self) -> str | Path:
        """The base model, resolved (and when built, built) only when something needs it."""
        if self._base is None:
            pending, t0 = pending_build(self.cfg), time.time()
            if pending:
                log.info("building the base model with extension %s (once; kept in %s)", self.cfg.extension,
                         pending.parent)
            with preempt.collective("building the base model"):
                self._base = base_model(self.cfg)
            if pending:
                self.base_build_s = round(time.time() - t0, 1)
                log.info("base model built in %s: %s", logs.duration(self.base_build_s), self._base)
        return self._base

    def evaluate(self, model: str | Path, ev: dict, out_dir: Path) -> dict:
        """Score `model` on the main process only; the other ranks wait (results travel via stage.json)."""
        if not ev["tasks"]:
            return {"metrics": {}}
        with preempt.main_only(f"scoring {out_dir.parent.name}") as main:
            result = scorecache.run_eval(model, ev, self.tasks_dir, out_dir, self.cfg) if main else {}
            faults.point(f"scored {out_dir.parent.name}")
        if self.main:
            how = (f"scores reused: the same weights were scored the same way before ({result['reused']}, saving "
                   f"{logs.duration(result['wall_time_s'])})" if result.get("reused") else
                   f"scored in {logs.duration(result['wall_time_s'])}")
            log.info("%s %s: %s", out_dir.parent.name, how, logs.scores(result["metrics"]))
        return result

    def base_eval(self) -> None:
        """Evaluate the base model once (reused while its fingerprint holds) so every gate has a baseline."""
        ev = evaluate.settings(self.cfg, None)
        efp = eval_fingerprint(base_fingerprint(self.cfg), ev, self.tasks_dir)
        if efp is None:
            return
        folder = base_dir(self.root)
        record = StageRecord.read(folder)
        if record.eval_fingerprint != efp:
            model = self.base()
            log.info("stage 0: evaluating the base model")
            built = {"build_s": self.base_build_s} if self.base_build_s is not None else None
            StageRecord(stage="base", index=0, status="done", eval_fingerprint=efp, output_model=str(model),
                        metrics=built, eval=self.evaluate(model, ev, samples_dir(folder))).write(folder)
            record = StageRecord.read(folder)
        self.history.append((BASE, record.scores()))

    def gate(self, d: StageDecision) -> dict | None:
        """Judge the stage's gate on its recorded eval; record the verdict; refresh the leaderboard."""
        record, verdict = StageRecord.read(d.dir), None
        if record.eval:
            metric = self.cfg[d.name].gate.metric
            previous = next(((c, m[metric]) for c, m in reversed(self.history) if metric in m), None)
            before_dir = d.dir.parent / previous[0] if previous else None
            scores = record.scores()
            half = _gate_half(record) or (_gate_half(StageRecord.read(before_dir)) if before_dir else None)
            if previous and half:  # a sweep picked this model or its input on the other half: judge this one only
                before, now = (stats.half_mean(eval_dir(p), metric, half) for p in (before_dir, d.dir))
                if before and now:
                    previous, scores = (previous[0], before[0]), {**scores, metric: now[0]}
            paired = stats.paired_difference(eval_dir(before_dir), eval_dir(d.dir), metric, half) if previous else None
            higher = stats.higher_is_better(record.eval, metric)
            sight = power.sight(self.cfg[d.name].gate, paired, stats.per_problem(eval_dir(before_dir), metric, half),
                                half) if previous else None
            if sight and sight["blind"]:
                self.blind(d.name, metric, sight)
            verdict = gates.judge(self.cfg[d.name].gate, scores, previous, paired, higher, sight)
            if verdict and half:
                verdict["problems"] = "gate half (odd doc_ids; a sweep picked on the even ones)"
                verdict["reason"] += f"; judged on the {verdict['problems']}"
            self.history.append((d.dir.name, record.scores()))
        # the main process decides alone whether to write (a reused stage keeps its file untouched); every rank waits
        changed, record.gate = record.gate != verdict, verdict
        record.write(d.dir, changed)
        with main_writes() as main:
            if main:
                modelcard.write(self.cfg, self.root, d.dir)
        self.export()
        return verdict

    def blind(self, name: str, metric: str, sight: dict) -> None:
        """A gate that cannot see what it judges: a warning, or under `strict_gates` exit 2 (`power.blind`)."""
        text = f"the gate of stage {name} cannot see what it judges on {metric}: {sight['blind']}; it {sight['text']}"
        if self.cfg.strict_gates:
            raise ConfigError(f"{text} (strict_gates=true): judge more problems, a continuous metric or a larger "
                              "max_drop")
        log.warning("%s: its verdict is noise; judge more problems, a continuous metric or a larger max_drop", text)

    def export(self) -> None:
        """Rewrite the run's leaderboard files (main process, while it holds the run's lock)."""
        with main_writes() as main:
            if main:
                fence(self.root)
                leaderboard.export([self.root], self.root)

    def print_headline(self) -> None:
        """Log the run's headline (`pipeline.report.headline`) and where its leaderboard is (main process)."""
        if self.main:
            log.info("%sleaderboard: %s", headline.markdown(headline.build(self.root)),
                     leaderboard_file(self.root, "html"))


def _gate_half(record: StageRecord) -> str | None:
    """`"gate"` when a sweep chose the stage's model among several candidates on the selection half of the
    gate metric's problems (`stats.HALVES`), else None: the gates of that stage and of the next one judge the
    other half only (on the selection half the picked model scores above its true value)."""
    m = record.metrics or {}
    return "gate" if len(m.get("candidates") or []) > 1 and m.get("selection_problems") else None


def run_pipeline(cfg: DictConfig, argv: list[str], on_lock: Callable[[RunLock], None] | None = None) -> int:
    """Run the configured chain; return the exit code (0: every stage passed, 3: a gate stopped it). `on_lock`:
    called with the run lock once the main process holds it (the run folder's outcome is this run's from then
    on); the caller then releases it, after writing the outcome. Without it, the lock is released here."""
    from accelerate.utils import broadcast_object_list

    ranks.collectively(preflight.kinds_run_here, cfg)  # before DeepSpeed's group (so alone); others: `preflight.check`
    share_cpu_threads()
    state = process_state(cfg.collective_timeout_s)
    prep.set_wait_limit(cfg.prep_timeout_s)
    root, candidate = run_dir(cfg), swept_candidate(cfg)
    # a single sweep candidate (a Slurm array task): array tasks share the run folder, one lock each
    lock = RunPaths(root).lock(candidate)
    problem = [open_run_dir(root, lock) if state.is_main_process else None]
    broadcast_object_list(problem)
    if problem[0]:
        raise agreed_error(problem[0])
    if on_lock is not None and state.is_main_process:
        on_lock(lock)
        faults.point("locked")
    together = False  # whether every rank reached the same ending (a finished chain, a gate stop, a preemption)
    try:
        ranks.check_start(cfg, root)  # every rank sees the run folder and the cache, runs the same config and code
        run = Run(cfg, root, state.num_processes, state.is_main_process)
        with run.state.held():
            code = _run_chain(_start(cfg, argv, run))
        together = True
        return code
    except (errors.Preempted, errors.MemoryAlert):
        together = True
        raise
    finally:
        if state.is_main_process and on_lock is None:
            lock.release()
        close_process_group(together)


def _start(cfg: DictConfig, argv: list[str], run: Run) -> Run:
    """Determinism, logging, the per-stage decisions, task files, resolved config and manifest; a stop signal
    stops it at once in one process (the ranks of several stop together at the first stage)."""
    with preempt.collective("starting the run"):
        return _prepare(cfg, argv, run)


def _prepare(cfg: DictConfig, argv: list[str], run: Run) -> Run:
    if cfg.deterministic:
        from transformers import enable_full_determinism

        enable_full_determinism(cfg.seed)
    logs.setup(run.paths.log if run.main else None, run.main)
    with main_writes() as main:
        if main:
            tidy(run.root, cache_dir(cfg))
            evaluate.write_tasks(cfg, run.tasks_dir)
    keys.use_pins(main_value(revisions.pin(cfg, run.paths.hub_revisions) if run.main else None))
    checked = ranks.collectively(preflight.check, cfg, run.root, run.tasks_dir, run.world_size)
    run.decisions = ranks.same_decisions(checked)
    if one := swept_candidate(cfg):  # a single sweep candidate: nothing after its stage
        run.decisions = run.decisions[: [d.name for d in run.decisions].index(one[0]) + 1]
    _arrange(run, one)
    with main_writes() as main:
        if main:
            write_text(run.paths.resolved_config, OmegaConf.to_yaml(redact.config(OmegaConf.to_container(cfg))))
            data = {d.name: d.data for d in run.decisions}
            write_kept(run.paths.manifest, manifest.build(cfg, argv, data, run.root))
    log.info("run %s: recipe %s, %d stage(s), world size %d", run.root, cfg.recipe, len(run.decisions),
             run.world_size)
    return run


def _arrange(run: Run, candidate: tuple[str, int] | None) -> None:
    """Make `stages/` hold this chain's stages: a stage whose fingerprint was kept comes back (`restore`), and a
    stage folder the chain no longer has at its place is kept aside (`keep`). Not in a single sweep candidate's
    run, which shares the folder with the other candidates' (it refuses a stage to restore instead)."""
    back = [d for d in run.decisions if d.kept]
    if candidate and back:
        raise ConfigError(f"stage {back[0].dir.name} is in {run.paths.kept} with this fingerprint; run the chain "
                          f"once without {candidate[0]}.candidate to put it back, then its candidates")
    if candidate:
        return
    ours = {d.dir for d in run.decisions}
    with main_writes() as main:
        if main:
            for folder in stage_folders(run.root):
                if folder.name != BASE and folder not in ours and (kept := keep(run.root, folder)):
                    log.info("kept %s as %s: this chain has no such stage", folder.name, kept)
            for d in back:
                restore(run.root, d.dir, d.kept)
                log.info("%s: put back from %s (its fingerprint)", d.dir.name, d.kept)


def _run_chain(run: Run) -> int:
    """Every stage in order: train (or reuse), score, judge; return the exit code."""
    started, model = time.time(), None  # model: the previous stage's checkpoint; None: the base model
    _freeze_survivors()
    run.base_eval()
    for d in run.decisions:
        outcome.enter(d.dir.name)
        _freeze_survivors()
        preempt.check_together(f"before stage {d.dir.name}")
        if d.action in ("reuse", "evaluate"):
            ranks.collectively(_check_model, run, d)
        if d.action == "reuse":
            log.info("%s: reusing finished stage %s (fingerprint %s)", _label(run, d), d.dir, d.fingerprint)
            _forget_redo(run, d)
        if d.action in ("train", "resume") and not _train(run, d, model or run.base()):
            return 0  # a single sweep candidate trained: the stage stays unfinished
        if d.action != "reuse":
            _score(run, d)
        if _gate_stops(run, d):
            return errors.GATE_STOP
        model = model_dir(d.dir)
    run.export()
    log.info("run finished in %s; final model: %s", logs.duration(time.time() - started), model)
    run.print_headline()
    if run.cfg.push_to_hub:  # every stage passed: publish what the run made
        with preempt.main_only(f"pushing to {run.cfg.push_to_hub}") as main:
            if main:
                hub.push(run.cfg, run.root, [d.dir for d in run.decisions])
    return 0


def _freeze_survivors() -> None:
    """Collect the last stage's garbage, then keep what survives (libraries, config, caches) out of every later
    collection (`gc.freeze`): a full collection scans every object, and torch, transformers and lm-eval leave
    many."""
    gc.collect()
    gc.freeze()


def _check_model(run: Run, d: StageDecision) -> None:
    """Refuse (exit 2) a finished stage whose model folder is not the model it saved (the main process reads it)."""
    problem = model_changed(StageRecord.read(d.dir), d.dir) if run.main else None
    if problem:
        raise ConfigError(f"stage {d.dir.name} finished, but {problem}: it was changed after training, and neither "
                          f"its scores nor the stages after it can be trusted on it; to retrain it and every stage "
                          f"after it add redo=[{d.name}], or use a new run_name")


def _forget_redo(run: Run, d: StageDecision) -> None:
    """A reused stage that a redo= retrained: once a run no longer asks for that redo, a later one redoes it again."""
    record = StageRecord.read(d.dir)
    if record.redone and d.name not in run.cfg.redo:
        record.redone = None
        record.write(d.dir)
    elif record.redone and run.main:
        log.info("%s: redo=[%s] was carried out by an earlier run of this command: reusing the stage it retrained "
                 "(run once without redo to redo it again)", d.dir.name, d.name)


def _label(run: Run, d: StageDecision) -> str:
    return f"stage {d.index}/{len(run.decisions)} {d.name}"


def _clear_stale(d: StageDecision) -> None:
    """Before a stage trains from scratch: remove its earlier attempt's checkpoints (`work/`) and scores, and the
    data it prepared (pairs, samples) unless that was prepared for the same inputs (`StageDecision.prepared`). Its
    sweep candidates stay: each is reused when its own fingerprint matches. Its model/ stays until replaced."""
    record = StageRecord.read(d.dir)
    with main_writes() as main:
        if main and d.dir.is_dir():
            gone = stale_children(d.dir, keep_prepared=record.prepared == d.prepared)
            if record.status == "running" and work_dir(d.dir).is_dir():
                log.warning("%s: discarding the checkpoints of its interrupted attempt (%s)", d.dir.name,
                            "redo=" if d.redo else "an earlier stage was retrained")
            for child in gone:
                shutil.rmtree(child) if child.is_dir() else child.unlink()


def _set_aside(run: Run, d: StageDecision) -> None:
    """Before a stage trains from scratch: a finished or interrupted stage of another fingerprint in its folder is
    kept (`keep`); what an attempt of the same fingerprint left (a redo, a lost model) is cleared, and the later
    stages trained from it are marked stale."""
    record = StageRecord.read(d.dir)
    if record.fingerprint != d.fingerprint and record.status in KEPT:
        with main_writes() as main:
            if main:
                log.info("%s: kept its earlier model, of another fingerprint, as %s", d.dir.name,
                         keep(run.root, d.dir))
    else:
        _clear_stale(d)
    _invalidate_later(run, d)


def _invalidate_later(run: Run, d: StageDecision) -> None:
    """A stage trains from scratch: a later stage whose record still has its fingerprint in this chain (and its
    sweep candidates) was trained from the model being replaced; mark their records `stale`, so that no rerun
    reuses them. (A later stage of another fingerprint was trained from another model: it is kept when replaced.)"""
    later = [e.dir for e in run.decisions if e.index > d.index and StageRecord.read(e.dir).fingerprint == e.fingerprint]
    for folder in later + [c for e in later for c in candidate_folders(e)]:
        record = StageRecord.read(folder)
        if record.status and record.status != "stale":
            record.status, record.prepared = "stale", None
            record.write(folder)


def _fit(run: Run, d: StageDecision, ctx: StageContext) -> Trained | None:
    """Train the stage's model (through its sweep, if it has one); None when only one sweep candidate was asked."""
    train = kind_of(run.cfg, d.name).train
    if not sweeps(ctx.stage):
        return Trained(train(ctx), None)
    ev = evaluate.settings(run.cfg, d.name)
    select = sweep.selection_settings(ev, ctx.stage.gate.metric, ctx.stage.gate.tie_break)

    def evaluate_on_select(model: Path, out: Path) -> dict:
        return run.evaluate(model, select, out)
    key = main_value(eval_fingerprint(d.inputs, select, run.tasks_dir) if run.main else None)  # one key everywhere
    score = sweep.Scorer(evaluate_on_select, key)
    if ctx.stage.candidate is None:
        return sweep.run(ctx, d.inputs, d.grid, train, score)  # scored on `select`'s tasks; `_score` adds the rest
    sweep.train_candidates(ctx, d.inputs, d.grid, train, score, only=ctx.stage.candidate)
    return None


def _train(run: Run, d: StageDecision, model: str | Path) -> bool:
    """Train (or resume) one stage from `model` and record it; False when the stage stays unfinished."""
    log.info("%s: %s from %s", _label(run, d), "resuming" if d.action == "resume" else "training", model)
    t0 = time.time()
    record = StageRecord(stage=d.name, index=d.index, fingerprint=d.fingerprint, upstream=d.upstream,
                         config=stage_section(run.cfg, d.name), data=d.data, input_model=str(model),
                         world_size=run.world_size, status="running", redone=(d.name in run.cfg.redo) or None,
                         prepared=d.prepared)
    if d.action == "train":
        _set_aside(run, d)
    record.write(d.dir)
    result = _fit(run, d, StageContext(run.cfg, d.name, model, d.dir))
    faults.point("model-saved")
    if result is None:
        log.info("%s: sweep candidate %d done; a run without %s.candidate selects and goes on", _label(run, d),
                 run.cfg[d.name].candidate, d.name)
        return False
    record.status, record.output_model = "trained", str(model_dir(d.dir))
    record.model_digest = keys.tree_digest(model_dir(d.dir)) if run.main else None  # the main process writes it
    record.metrics, record.wall_time_s = result.metrics, round(time.time() - t0, 2)
    if result.config:  # a sweep: the selected candidate's settings (the record's config stays the stage's)
        record.metrics = {**record.metrics, "trained_with": result.config}
    if result.eval:  # a sweep already scored the selected model, on every task or on its gate's task only
        complete = set(_tasks(result.eval)) == set(evaluate.settings(run.cfg, d.name)["tasks"])
        record.eval, record.eval_fingerprint = result.eval, d.eval_fingerprint if complete else None
    record.write(d.dir)
    drop_work(d.dir)  # its checkpoints go only once the record says trained
    log.info("%s: trained in %s: %s", _label(run, d), logs.duration(time.time() - t0),
             training_summary(result.metrics))
    return True


def _score(run: Run, d: StageDecision) -> None:
    """Evaluate the stage's model unless its record already holds this evaluation; mark it done."""
    record = StageRecord.read(d.dir)
    if not (record.eval and record.eval_fingerprint == d.eval_fingerprint):
        ev = evaluate.settings(run.cfg, d.name)
        earlier = record.eval if record.eval_fingerprint is None else None  # a sweep's, on some of the tasks
        record.eval = _scored(run, d, ev, earlier, record.metrics) if d.eval_fingerprint else None
        record.eval_fingerprint = d.eval_fingerprint
    record.status = "done"
    record.write(d.dir)


def _tasks(result: dict | None) -> list[str]:
    """The tasks an evaluation scored."""
    return ((result or {}).get("settings") or {}).get("tasks") or []


def _scored(run: Run, d: StageDecision, ev: dict, earlier: dict | None, metrics: dict) -> dict:
    """The stage model scored on `ev`'s tasks. Those its sweep already scored it on, with the same settings
    (`earlier`: the selected candidate's evaluation), are taken from there, samples included, not scored again."""
    same = earlier and {**earlier["settings"], "tasks": ev["tasks"]} == ev
    done = _tasks(earlier) if same else []  # the tie-break's task too, when the stage's eval does not list it
    rest = run.evaluate(model_dir(d.dir), {**ev, "tasks": [t for t in ev["tasks"] if t not in done]},
                        samples_dir(d.dir))
    if not (done and run.main):
        return rest
    selected = metrics["selected"]
    for task in done:
        copy_kept(samples_file(samples_dir(candidate_dir(d.dir, selected)), task),
                  samples_file(samples_dir(d.dir), task))
    log.info("%s: %s taken from candidate %s's scoring", d.dir.name, ", ".join(done), selected)
    return evaluate.merge(earlier, rest, ev)


def _gate_stops(run: Run, d: StageDecision) -> bool:
    """Judge the stage's gate; whether a failed gate stops the chain (a warning otherwise)."""
    verdict = run.gate(d)
    if not verdict or verdict["passed"]:
        return False
    where = f"gate after stage {d.dir.name}: {verdict['metric']} = {verdict['value']:.4f} ({verdict['reason']})"
    if verdict["action"] == "stop":
        run.print_headline()
        log.error("%s; chain stopped (leaderboard: %s)", where, leaderboard_file(run.root, "html"))
        return True
    log.warning("%s; going on (action: warn)", where)
    return False
