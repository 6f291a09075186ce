"""Fault injection for the reliability tests: with `PIPELINE_TEST_KILL_AT=<point>` the process kills itself
(SIGKILL, as a node that dies: no handler, no cleanup) when the run reaches that point, with
`PIPELINE_TEST_TERM_AT=<point>` it sends itself SIGTERM (as Slurm's warning before the end of a job); unset, nothing
happens.

Points: `locked` (the main process holds the run lock, nothing else has started), `model-saved` (a stage's `model/`
is committed, its record still says running), `scored <folder>` (lm-eval has scored the checkpoint of that stage
folder, e.g. `scored 01-sft`, and its record does not say so yet), `leaderboard` (the first leaderboard file is
written, the others not).
"""

from __future__ import annotations

import os
import signal

ENV = "PIPELINE_TEST_KILL_AT"
TERM_ENV = "PIPELINE_TEST_TERM_AT"


def point(name: str) -> None:
    """Die here, or get SIGTERM here, when the test asked for this point."""
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(TERM_ENV) == name:
        os.kill(os.getpid(), signal.SIGTERM)
