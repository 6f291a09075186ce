"""Entry point: `accelerate launch pipeline/run.py recipe=NAME|FILE [key=value ...]` (or `smol-pipeline`, which
launches this file and keeps its exit code: pipeline/launch.py); `--help` prints the usage (`USAGE`), `help=true
[recipe=NAME key=value ...]` every key with its value in that recipe and where the value came from.

Exit codes (pipeline/errors.py): 0 every stage passed; 2 bad config or bad input; 3 a gate stopped the
chain; 4 a stage could not finish training (diverged, disk full); 5 device memory passed its limit (checkpoint
saved); 6 another process took the run folder's lock over; 75 a preemption signal (SIGTERM / SIGUSR1) made it
save and stop; 1 a crash (its traceback is
appended to `<run>/pipeline.log`). The main process records the outcome in `<run>/outcome.json`
(pipeline/chain/outcome.py), as `accelerate launch` reports every failure as 1.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from pipeline import errors, redact  # noqa: E402
from pipeline.config import DEFAULT_RECIPE, load_config, load_with_sources  # noqa: E402
from pipeline.describe import describe  # noqa: E402
from pipeline.errors import ConfigError, LockLost, MemoryAlert, Preempted, TrainingFailed  # noqa: E402
from pipeline.grid import swept_candidate  # noqa: E402
from pipeline.recipe_files import available_recipes  # noqa: E402
from pipeline.settings import kinds, stage_names  # noqa: E402

BAD_INPUT_GRACE_S = 10  # how long a rank other than the main one waits before it exits on bad input


USAGE = """\
usage: smol-pipeline [launcher options] [--] [recipe=NAME|FILE] [key=value ...]
       python pipeline/run.py [recipe=NAME|FILE] [key=value ...]      (one process, no launcher)

Trains a chain of post-training stages on a base model, evaluates each checkpoint and checks its gate; the run
folder is <output_root>/<run_name> (runs/<recipe> by default), with leaderboard.html and pipeline.log in it.
Rerunning the same command resumes. Stage kinds: {kinds}.

Recipes (recipe=NAME, recipes/NAME.yaml; default {default}):
{recipes}
  recipe=path/to/my.yaml           your own recipe file; `base: NAME` (or a path) in it starts from another recipe

Common overrides (dotted keys over the recipe):
  stages=[sft,dpo]                 the stages to run, in order
  sft.learning_rate=1e-4           a stage's setting: <stage>.<key> (sft.max_steps=50, dpo.beta=0.1, ...), or any
                                   field of the TRL config it builds, under TRL's name (sft.neftune_noise_alpha=5)
  sft.sweep={{learning_rate: [1e-5,3e-5]}}   a sweep: one candidate per value; the gate metric selects
  model.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct   the base model: a Hub id or a local checkpoint
  output_root=/scratch/runs        where run folders go; run_name=try2 names this one
  eval.tasks=[gsm8k] eval.limit=200   what each checkpoint is scored on
  report_to=[tensorboard]          experiment tracking (its package must be installed)
  redo=[dpo]                       retrain a finished stage and the ones after it
  plan=true                        print what the run would do and its cost; trains nothing
  help=true                        every key with its value in this recipe and where the value came from:
                                   help=true recipe=NAME [key=value ...]

Exit codes: 0 finished; 1 crashed (traceback in <run>/pipeline.log); 2 bad config or input (one line
"error: ..."); 3 a gate stopped the chain; 4 training failed (diverged, disk full; earlier checkpoints kept);
5 memory alert (checkpoint saved; lower what a step needs); 6 lock lost (another process took the run folder
over; this one wrote nothing more); 75 preempted (SIGTERM / SIGUSR1; checkpoint saved).
Rerunning the same command resumes; after bad input, a failed training or a memory alert, fix the cause first.

Examples:
  smol-pipeline                                          the default recipe, {default}: on CPU, minutes
  smol-pipeline recipe={default} stages=[sft] sft.max_steps=50
  smol-pipeline help=true recipe=smollm2                 the recipe's settings
  smol-pipeline recipe=smol plan=true                    tokens and GPU hours, before a cluster run
  smol-pipeline --config_file zero3 --num_processes 8 recipe=smol    a shipped accelerate config, by name"""


def usage() -> str:
    """The pipeline's own usage: recipes, common overrides, `help=true`, exit codes, examples."""
    return USAGE.format(default=DEFAULT_RECIPE, recipes="\n".join(_recipe_line(r) for r in available_recipes()),
                        kinds=", ".join(kinds()))


def _recipe_line(name: str) -> str:
    """`  NAME  model M; stages a, b, c` for a shipped recipe, from its resolved config."""
    try:
        cfg = load_config([f"recipe={name}"])
    except ConfigError as err:
        return f"  {name:<9} (does not load: {err})"
    stages = ", ".join(s for s in cfg.stages if cfg[s].enabled)
    model = cfg.model.name_or_path
    model = f"{model}, built locally" if model in cfg and model not in ("model", *stage_names(cfg)) else model
    return f"  {name:<9} model {model}; stages {stages}"


def _main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def main(argv: list[str] | None = None) -> int:
    """Parse the recipe and overrides, then run the chain; return the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not sys.stderr.isatty() or not _main_process():
        os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars only on a terminal, on the main process
    if {"--help", "-h"} & set(argv):
        print(usage())
        return 0
    asks_help = [arg for arg in argv if arg.partition("=")[0] == "help"]
    argv = [arg for arg in argv if arg not in asks_help]
    try:
        cfg, sources = load_with_sources(argv)
        if any(arg.partition("=")[2].lower() not in ("false", "0", "no") for arg in asks_help):
            print(describe(cfg, sources))
            return 0
        if cfg.plan.enabled:  # dry run: print the plan, load nothing
            from pipeline.chain.plan import report

            text = report(cfg, sources)
    except ConfigError as err:
        return _bad_input(err, own=False)  # the same argv on every rank
    if cfg.plan.enabled:
        _say(text, sys.stdout)
        return 0
    return run(cfg, argv)


class _LastError(logging.Filter):
    """Remembers the last error the pipeline logged (a gate stop's verdict) for the outcome's reason."""

    message = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            self.message = record.getMessage()
        return True


def run(cfg, argv: list[str]) -> int:
    """Run the chain on a parsed config; record the outcome (main process); return the exit code."""
    from pipeline import preempt

    preempt.install()  # from here on a stop signal ends the run at its next safe point with exit 75, start-up too
    from pipeline.chain.orchestrator import run_pipeline
    from pipeline.chain.outcome import Outcome
    from pipeline.runfolder import RunPaths, run_dir

    root, main = run_dir(cfg), _main_process()
    redact.remember(cfg)  # secret values of the config are scrubbed from log lines, the outcome and tracebacks
    outcome, last_error = Outcome(root, swept_candidate(cfg), argv), _LastError()
    logger = logging.getLogger("pipeline")
    logger.addFilter(last_error)
    held = []  # the run lock, once the main process holds it: only then are the outcome and log this run's

    def locked(lock) -> None:
        outcome.start()
        held.append(lock)

    try:
        try:
            code = run_pipeline(cfg, argv, on_lock=locked if main else None)
            reason = last_error.message if code else "finished"
        except ConfigError as err:
            code, reason = _bad_input(err), str(err)
        except Preempted as err:
            code, reason = err.code, str(err)
            _tell(f"preempted: {err}; rerun the same command to resume", own=False)  # the ranks stop together
        except MemoryAlert as err:
            code, reason = err.code, str(err)
            _tell(f"memory alert: {err}", own=False)  # the ranks agreed on it and stop together
        except TrainingFailed as err:
            code, reason = err.code, str(err)
            _tell(f"training failed: {err}", own=True)
        except LockLost as err:
            code, reason = err.code, str(err)
            _tell(f"error: {err}", own=True)
        except Exception as err:  # noqa: BLE001 - a crash: logged with its traceback, then exit 1
            code, reason = errors.CRASHED, f"{type(err).__name__}: {err}".splitlines()[0]
            _crashed(RunPaths(root).log if held else None, reason)
        finally:
            logger.removeFilter(last_error)
        if held and not held[0].lost():  # a run refused by another's lock, or that lost it, writes nothing
            outcome.finish(code, reason)
    finally:
        for lock in held:  # let go only once the outcome is written
            lock.release()
    return code


def config_error(argv: list[str]) -> int:
    """0 when `argv` loads as a config; else say the error and return its exit code (2)."""
    try:
        load_config(argv)
    except ConfigError as err:
        return _bad_input(err, own=False)
    return 0


def _bad_input(err: ConfigError, own: bool | None = None) -> int:
    """Say the error (`_tell`; `own`: whether this rank met it alone, by default unless the ranks agreed on it,
    `ConfigError.every_rank`) and return its exit code. Another rank then waits a little, so that a launcher which
    stops all ranks when one exits (torchrun's agent) does not stop the main process before its message and
    outcome are written."""
    _tell(f"error: {redact.scrub(str(err))}", own=not err.every_rank if own is None else own)
    if not _main_process():
        time.sleep(BAD_INPUT_GRACE_S)
    return err.code


def _say(message: str, stream=None) -> None:
    if _main_process():
        print(message, file=stream or sys.stderr)


def _who() -> str:
    return f"rank {os.environ.get('RANK')} on {socket.gethostname()}"


def _tell(message: str, own: bool) -> None:
    """Print an error on stderr. The main process prints every error, as it is. Another rank prints, prefixed
    `rank R on HOST: `, the errors it met on its own (`own`: as far as it knows, only it met this one: bad input
    its own checks found, a failed training; a crash's traceback, `_crashed`, always) and, of the errors every
    rank met alike (a config that does not load, a check the ranks made together, `ConfigError.every_rank`, a
    preemption), only if it is the first process of its machine (`LOCAL_RANK` 0): every machine's log says once
    why it stopped, and no machine repeats it once per process."""
    if _main_process():
        print(message, file=sys.stderr)
    elif own or os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"{_who()}: {message}", file=sys.stderr)


def _crashed(log_path: Path | None, reason: str) -> None:
    """Print the traceback, append it to the run's log `log_path` (main process; None: the run folder is not
    this process's), and end stderr with where it is."""
    text = redact.scrub(traceback.format_exc())
    sys.stderr.write(text)
    where = "traceback above"
    if _main_process() and log_path is not None and log_path.parent.is_dir():
        with open(log_path, "a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} ERROR crashed: {reason}\n{text}")
        where = f"traceback in {log_path}"
    rank = "" if _main_process() else f"{_who()}: "
    print(f"{rank}crashed: {reason}; {where}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
