"""Entry point: `accelerate launch pipeline/run.py recipe=NAME [key=value ...]` (or `smol-pipeline`, which
launches this file and keeps its exit code: pipeline/launch.py); `help=true` or `--help` lists every key.

Exit codes: 0 every stage passed; 2 bad config or bad input; 3 a gate stopped the chain; 75 a
preemption signal (SIGTERM / SIGUSR1) made it save and stop; 1 a crash (its traceback is appended
to `<run>/pipeline.log`). In every case but 2, rerunning the same command resumes. The main process
records the outcome in `<run>/outcome.json` (pipeline/outcome.py), as `accelerate launch` reports
every failure as 1.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from pipeline.config import ConfigError, describe, load_config  # noqa: E402

EXIT_BAD_INPUT = 2
BAD_INPUT_GRACE_S = 10  # how long a rank other than the main one waits before it exits on bad input


def _main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def main(argv: list[str] | None = None) -> int:
    """Parse the recipe and overrides, then run the chain; return the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not sys.stderr.isatty() or not _main_process():
        os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars only on a terminal, on the main process
    if {"--help", "-h", "help=true"} & set(argv):
        print(f"{__doc__}\nConfig keys (key=value overrides; recipes/NAME.yaml sets them too):\n{describe()}")
        return 0
    try:
        cfg = load_config(argv)
        if cfg.plan.enabled:  # dry run: print the plan, load nothing
            from pipeline.chain.plan import report

            text = report(cfg)
    except ConfigError as err:
        return _bad_input(err)
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
    from pipeline.chain.orchestrator import run_pipeline
    from pipeline.chain.outcome import EXIT_CRASH, Outcome
    from pipeline.runfolder import run_dir
    from pipeline.train.preempt import EXIT_PREEMPTED, Preempted

    root, main = run_dir(cfg), _main_process()
    outcome, last_error = Outcome(root, cfg.dpo.sweep.candidate, argv), _LastError()
    logger = logging.getLogger("pipeline")
    logger.addFilter(last_error)
    if main:
        outcome.start()
    try:
        code = run_pipeline(cfg, argv)
        reason = last_error.message if code else "finished"
    except ConfigError as err:
        code, reason = _bad_input(err), str(err)
    except Preempted as err:
        code, reason = EXIT_PREEMPTED, str(err)
        _say(f"preempted: {err}; rerun the same command to resume")
    except Exception as err:  # noqa: BLE001 - a crash: logged with its traceback, then exit 1
        code, reason = EXIT_CRASH, f"{type(err).__name__}: {err}".splitlines()[0]
        _crashed(root / "pipeline.log", reason)
    finally:
        logger.removeFilter(last_error)
    if main:
        outcome.finish(code, reason)
    return code


def _bad_input(err: ConfigError) -> int:
    """Say the error (main process) and return its exit code. Every rank fails on the same input, but only the
    main process prints: another rank waits a little first, so that a launcher which stops all ranks when one
    exits (torchrun's agent) does not stop the main process before its message and outcome are written."""
    _say(f"error: {err}")
    if not _main_process():
        time.sleep(BAD_INPUT_GRACE_S)
    return EXIT_BAD_INPUT


def _say(message: str, stream=None) -> None:
    if _main_process():
        print(message, file=stream or sys.stderr)


def _crashed(log_path: Path, reason: str) -> None:
    """Print the traceback, append it to the run's log (main process), and end stderr with where it is."""
    text = traceback.format_exc()
    sys.stderr.write(text)
    where = "traceback above"
    if _main_process() and log_path.parent.is_dir():
        with open(log_path, "a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} ERROR crashed: {reason}\n{text}")
        where = f"traceback in {log_path}"
    rank = "" if _main_process() else f" (rank {os.environ.get('RANK')})"
    print(f"crashed{rank}: {reason}; {where}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
