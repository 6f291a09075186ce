"""Entry point: `accelerate launch pipeline/run.py recipe=NAME [key=value ...]` (`help=true` or `--help`: every key).

Exit codes: 0 every stage passed; 2 bad config or bad input; 3 a gate stopped the chain; 75 a
preemption signal (SIGTERM / SIGUSR1) made it save and stop; anything else is a crash. In every
case but 2, rerunning the same command resumes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from pipeline.config import ConfigError, describe, load_config  # noqa: E402

EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    """Parse the recipe and overrides, then run the chain; return the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not sys.stderr.isatty() or int(os.environ.get("RANK", "0")) > 0:
        os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars only on a terminal, on the main process
    if {"--help", "-h", "help=true"} & set(argv):
        print(f"{__doc__}\nConfig keys (key=value overrides; recipes/NAME.yaml sets them too):\n{describe()}")
        return 0
    try:
        cfg = load_config(argv)
        if cfg.plan.enabled:  # dry run: print the plan, load nothing
            from pipeline.plan import report

            text = report(cfg)
            if int(os.environ.get("RANK", "0")) == 0:
                print(text)
            return 0
        from pipeline.orchestrator import run_pipeline
        from pipeline.preempt import EXIT_PREEMPTED, Preempted

        try:
            return run_pipeline(cfg, argv)
        except Preempted as err:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"preempted: {err}; rerun the same command to resume", file=sys.stderr)
            return EXIT_PREEMPTED
    except ConfigError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
