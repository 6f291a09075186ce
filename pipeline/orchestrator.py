"""The stage chain: plan (resume by fingerprint), run each stage, hand its checkpoint to the next.

Run folder (see DESIGN.md): `resolved.yaml`, `manifest.json`, `pipeline.log` and
`stages/NN-name/{model/, stage.json}`. A stage is reused when its `stage.json` says done with the
same fingerprint (its config, its data, and everything upstream). A finished stage whose
fingerprint changed is an error unless the user asks to redo it; redoing a stage redoes every
stage after it. Every rank plans the same way; only the main process writes run files.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline import data, evaluate, gates, leaderboard, manifest, outcome, preempt
from pipeline.config import ConfigError, cache_dir, stage_section
from pipeline.files import RunLock, fingerprint, read_json, write_json, write_text

log = logging.getLogger("pipeline")


@dataclass
class PlannedStage:
    index: int
    name: str
    dir: Path
    fingerprint: str  # training: config, data, everything upstream
    eval_fingerprint: str | None  # training fingerprint + eval settings; None: not evaluated
    action: str  # reuse | evaluate | train | resume
    data: list[dict]


def run_dir(cfg: DictConfig) -> Path:
    """`<output_root>/<run_name>`."""
    return Path(cfg.output_root) / cfg.run_name


def setup_logging(path: Path | None, main: bool) -> None:
    """Log to stderr (main process: info, others: warnings) and, on the main process, to `path`."""
    log.handlers.clear()
    log.setLevel(logging.INFO if main else logging.WARNING)
    log.propagate = False
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if path is not None:
        handlers.append(logging.FileHandler(path, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(fmt)
        log.addHandler(handler)


def _base_fingerprint(cfg: DictConfig) -> str:
    model = OmegaConf.to_container(cfg.model)
    tiny = OmegaConf.to_container(cfg.tiny) if cfg.model.name_or_path == "tiny" else None
    return fingerprint({"model": model, "tiny": tiny})


def _eval_fingerprint(upstream: str, ev: dict) -> str | None:
    return fingerprint({"checkpoint": upstream, "eval": ev}) if ev["tasks"] else None


def _changes(old: dict, new: dict, prefix: str) -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changes(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def plan(cfg: DictConfig, root: Path) -> list[PlannedStage]:
    """Decide per stage whether to reuse, re-evaluate, resume or train; refuse changed finished stages."""
    upstream, forced, out = _base_fingerprint(cfg), False, []
    for i, name in enumerate([n for n in cfg.stages if cfg[n].enabled], 1):
        stage_dir = root / "stages" / f"{i:02d}-{name}"
        sources = [fp for mix in data.stage_mixtures(cfg, name) for fp in data.fingerprints(mix, cfg)]
        config = stage_section(cfg, name)
        fp = fingerprint({"kind": name, "config": config, "data": sources, "upstream": upstream, "seed": cfg.seed})
        efp = _eval_fingerprint(fp, evaluate.settings(cfg, name))
        prev = read_json(stage_dir / "stage.json") or {}
        trained = prev.get("status") in ("trained", "done") and (stage_dir / "model").is_dir()
        redo = forced or name in cfg.redo
        if trained and prev.get("fingerprint") == fp and not redo:
            done = prev["status"] == "done" and prev.get("eval_fingerprint") == efp
            action = "reuse" if done else "evaluate"
        elif trained and not redo:
            changed = _changes(prev.get("config", {}), config, f"{name}.")
            if prev.get("data") != sources:
                changed.append("its data")
            if prev.get("upstream") != upstream:
                changed.append("its input model")
            raise ConfigError(
                f"stage {stage_dir.name} already finished with a different config ({'; '.join(changed)}); "
                f"to retrain it and every stage after it add redo=[{name}], or use a new run_name")
        else:
            action = "resume" if prev.get("status") == "running" and prev.get("fingerprint") == fp else "train"
            forced = True
        out.append(PlannedStage(i, name, stage_dir, fp, efp, action, sources))
        upstream = fp
    return out


def check_gates(cfg: DictConfig, tasks_dir: Path) -> None:
    """Refuse, before any work, gates on metrics their stage's evaluation does not produce."""
    evaluate.expected_metrics(evaluate.settings(cfg, None), tasks_dir)  # unknown base-eval tasks fail here
    for name in [n for n in cfg.stages if cfg[n].enabled]:
        ev, gate = evaluate.settings(cfg, name), cfg[name].gate
        produced = evaluate.expected_metrics(ev, tasks_dir)
        if gate.metric and gate.metric not in produced:
            raise ConfigError(f"gate of stage '{name}' uses metric '{gate.metric}', which its eval does not produce "
                              f"(eval tasks {ev['tasks']} produce: {', '.join(sorted(produced)) or 'nothing'})")


def check_model_path(name: str) -> None:
    """Refuse a local model path that does not exist or is not a Hugging Face checkpoint."""
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.name_or_path {name} is not a checkpoint folder (no config.json)")
    elif name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise ConfigError(f"model.name_or_path {name} does not exist (and is not a Hub id like org/name)")


def open_run_dir(root: Path, lock: RunLock) -> str | None:
    """Create the run folder, check it is writable and lock it; return an error message or None."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}"  # one per process: sweep array tasks share the folder
        write_text(probe, "ok")
        probe.unlink()
    except OSError as err:
        return f"cannot write the run folder {root}: {err.strerror or err}"
    try:
        lock.acquire()
    except RuntimeError as err:
        return str(err)
    return None


def _base_model(cfg: DictConfig) -> str | Path:
    if cfg.model.name_or_path != "tiny":
        return cfg.model.name_or_path
    from pipeline import tiny

    return tiny.ensure_base_model(cache_dir(cfg), cfg.tiny, cfg.model, cfg.seed)


class Chain:
    """One invocation of the pipeline on a run folder (state shared by the steps of `run_pipeline`)."""

    def __init__(self, cfg: DictConfig, root: Path, state) -> None:
        self.cfg, self.root, self.state = cfg, root, state
        self.main = state.is_main_process
        self.tasks_dir = root / "eval_tasks"
        self.history: list[tuple[str, dict]] = []  # (checkpoint, eval metrics) in chain order
        self._base: str | Path | None = None

    def base(self) -> str | Path:
        """The base model, resolved (and for `tiny`, built) only when something needs it."""
        if self._base is None:
            self._base = _base_model(self.cfg)
        return self._base

    def write(self, path: Path, record: dict) -> None:
        """Write a stage record on the main process; every rank waits for it."""
        if self.main:
            write_json(path, record)
        self.state.wait_for_everyone()

    def evaluate(self, model: str | Path, ev: dict, out_dir: Path) -> dict:
        """Score `model` on the main process only; the other ranks wait (results travel via stage.json)."""
        if not ev["tasks"]:
            return {"metrics": {}}
        result = evaluate.run_eval(model, ev, self.tasks_dir, out_dir, self.cfg.model) if self.main else {}
        if self.main:
            log.info("eval of %s: %s (%.1f s)", out_dir.parent.name,
                     ", ".join(f"{k}={v:.4f}" for k, v in result["metrics"].items()), result["wall_time_s"])
        return result

    def base_eval(self) -> None:
        """Evaluate the base model once (reused while its fingerprint holds) so every gate has a baseline."""
        ev = evaluate.settings(self.cfg, None)
        efp = _eval_fingerprint(_base_fingerprint(self.cfg), ev)
        if efp is None:
            return
        path = self.root / "stages" / "00-base" / "stage.json"
        record = read_json(path) or {}
        if record.get("eval_fingerprint") != efp:
            log.info("stage 0: evaluating the base model")
            model = self.base()
            record = {"stage": "base", "index": 0, "status": "done", "eval_fingerprint": efp,
                      "output_model": str(model), "eval": self.evaluate(model, ev, path.parent / "eval")}
            self.write(path, record)
            record = read_json(path)
        self.history.append(("00-base", record["eval"]["metrics"]))

    def gate(self, s: PlannedStage) -> dict | None:
        """Judge the stage's gate on its recorded eval; record the verdict; refresh the leaderboard."""
        path = s.dir / "stage.json"
        record = read_json(path)
        verdict = None
        if record.get("eval"):
            metric = self.cfg[s.name].gate.metric
            previous = next(((c, m[metric]) for c, m in reversed(self.history) if metric in m), None)
            verdict = gates.judge(self.cfg[s.name].gate, record["eval"]["metrics"], previous)
            self.history.append((s.dir.name, record["eval"]["metrics"]))
        # the main process decides alone whether to write (a reused stage keeps its file untouched); every rank
        # waits, whatever the others read (the write is atomic and leaves the eval metrics as they were)
        if self.main and ("gate" not in record or record["gate"] != verdict):
            write_json(path, {**record, "gate": verdict})
        self.state.wait_for_everyone()
        self.export()
        return verdict

    def export(self) -> None:
        """Rewrite the run's leaderboard files (main process)."""
        if self.main:
            leaderboard.export([self.root], self.root)
        self.state.wait_for_everyone()


def run_pipeline(cfg: DictConfig, argv: list[str]) -> int:
    """Run the configured chain; return the exit code (0: every stage passed, 3: a gate stopped it)."""
    import torch
    from accelerate.utils import broadcast_object_list

    from pipeline.training import deepspeed_on, process_state

    if deepspeed_on() and "ppo" in cfg.stages and cfg.ppo.enabled:
        raise ConfigError("stage 'ppo' does not run under DeepSpeed (its loop trains a policy and a value model in one "
                          "Accelerator; accelerate's DeepSpeed takes one model per engine): run the chain with "
                          "ppo.enabled=false here, then the same command under recipes/accelerate/ddp.yaml (or "
                          "cpu.yaml), which reuses the finished stages")
    if not torch.cuda.is_available():  # accelerate launch pins CPU runs to 1 thread; share the cores instead
        share = (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(int(os.environ.get("PIPELINE_CPU_THREADS", 0)) or max(1, share))
    state = process_state()
    if cfg.model.name_or_path != "tiny":
        check_model_path(cfg.model.name_or_path)
    root = run_dir(cfg)
    main = state.is_main_process
    one = cfg.dpo.sweep.candidate  # one DPO sweep candidate: array tasks share the run folder, one lock each
    lock = RunLock(root) if one is None else RunLock(root, f".lock-dpo-candidate-{one}")
    problem = [open_run_dir(root, lock) if main else None]
    broadcast_object_list(problem)
    if problem[0]:
        raise ConfigError(problem[0])
    try:
        return _run(cfg, argv, state, root)
    finally:
        if main:
            lock.release()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # a live gloo group can abort the interpreter at exit


def _run(cfg: DictConfig, argv: list[str], state, root: Path) -> int:
    from pipeline.stage import StageContext
    from pipeline.stages import STAGES

    main = state.is_main_process
    preempt.install()
    if cfg.deterministic:
        from transformers import enable_full_determinism

        enable_full_determinism(cfg.seed)
    setup_logging(root / "pipeline.log" if main else None, main)
    started = time.time()
    stages = plan(cfg, root)
    if cfg.dpo.sweep.candidate is not None:  # one sweep candidate (a Slurm array task): nothing after dpo
        stages = stages[: [s.name for s in stages].index("dpo") + 1]
    chain = Chain(cfg, root, state)
    if main:
        evaluate.write_tasks(cfg, chain.tasks_dir)
    state.wait_for_everyone()
    check_gates(cfg, chain.tasks_dir)
    if main:
        write_text(root / "resolved.yaml", OmegaConf.to_yaml(cfg))
        write_json(root / "manifest.json", manifest.build(cfg, argv, {s.name: s.data for s in stages}, root))
    log.info("run %s: recipe %s, %d stage(s), world size %d", root, cfg.recipe, len(stages), state.num_processes)
    chain.base_eval()
    model: str | Path | None = None  # the previous stage's checkpoint; None: the base model
    upstream = _base_fingerprint(cfg)
    for s in stages:
        outcome.enter(s.dir.name)
        preempt.check(f"before stage {s.dir.name}")
        label = f"stage {s.index}/{len(stages)} {s.name}"
        path = s.dir / "stage.json"
        ev = evaluate.settings(cfg, s.name)
        if s.action == "reuse":
            log.info("%s: reusing finished stage %s (fingerprint %s)", label, s.dir, s.fingerprint)
        if s.action in ("train", "resume"):
            model = model or chain.base()
            log.info("%s: %s from %s", label, "resuming" if s.action == "resume" else "training", model)
            t0 = time.time()
            record = {"stage": s.name, "index": s.index, "fingerprint": s.fingerprint, "upstream": upstream,
                      "config": stage_section(cfg, s.name), "data": s.data, "input_model": str(model),
                      "world_size": state.num_processes}
            if main and s.action == "train" and s.dir.is_dir():  # stale work goes; model/ stays until replaced
                for child in s.dir.iterdir():
                    if child.name != "model":
                        shutil.rmtree(child) if child.is_dir() else child.unlink()
            chain.write(path, {**record, "status": "running"})
            ctx = StageContext(cfg, s.name, model, s.dir, s.fingerprint,
                               lambda m, out, ev=ev: chain.evaluate(m, ev, out))
            metrics = STAGES[s.name](ctx)
            if metrics is None:  # dpo.sweep.candidate: one candidate trained, the stage stays unfinished
                log.info("%s: sweep candidate %d done; a run without dpo.sweep.candidate selects and goes on",
                         label, cfg.dpo.sweep.candidate)
                return 0
            scored = metrics.pop("eval", None)  # a stage that already scored its final model (sweep selection)
            chain.write(path, {**record, "status": "trained", "output_model": str(s.dir / "model"),
                               "metrics": metrics, "wall_time_s": round(time.time() - t0, 2),
                               **({"eval": scored, "eval_fingerprint": s.eval_fingerprint} if scored else {})})
            log.info("%s: trained in %.1f s, loss %.4f -> %.4f over %d steps; %s tokens/s, MFU %s, padding %s, "
                     "compute %s s, data wait %s s, peak RSS %s MB", label, time.time() - t0,
                     metrics["loss_first"] or float("nan"), metrics["loss_last"] or float("nan"), metrics["steps"],
                     metrics.get("tokens_per_s"), metrics.get("mfu"), metrics.get("padding_fraction"),
                     metrics.get("compute_s"), metrics.get("data_wait_s"), metrics.get("peak_rss_mb"))
        if s.action != "reuse":
            record = read_json(path)
            if not (record.get("eval") and record.get("eval_fingerprint") == s.eval_fingerprint):
                result = chain.evaluate(s.dir / "model", ev, s.dir / "eval") if s.eval_fingerprint else None
                record.update(eval=result, eval_fingerprint=s.eval_fingerprint)
            chain.write(path, {**record, "status": "done"})
        verdict = chain.gate(s)
        if verdict and not verdict["passed"]:
            where = f"gate after stage {s.dir.name}: {verdict['metric']} = {verdict['value']:.4f} ({verdict['reason']})"
            if verdict["action"] == "stop":
                log.error("%s; chain stopped (leaderboard: %s)", where, root / "leaderboard.md")
                return gates.EXIT_GATE_STOP
            log.warning("%s; going on (action: warn)", where)
        model, upstream = s.dir / "model", s.fingerprint
    chain.export()
    log.info("run finished in %.1f s; final model: %s", time.time() - started, model)
    return 0
