"""Preemption: SIGTERM / SIGUSR1 (Slurm's warning signal) make the pipeline save and exit cleanly.

The signal only sets a flag. A training stage checks it after every optimizer step (agreeing
across ranks), saves a checkpoint and stops; the orchestrator also checks it between stages. The
process then exits with `errors.PREEMPTED` (75), and rerunning the same command resumes from that
checkpoint.
"""

from __future__ import annotations

import signal
from typing import Any

from transformers import TrainerCallback

from pipeline.errors import Preempted  # noqa: F401 - raised by the stages that check `requested`
from pipeline.train.distributed import any_rank

_requested = {"signal": None}


def _handler(signum: int, _frame: Any) -> None:
    _requested["signal"] = signal.Signals(signum).name


def install() -> None:
    """Route SIGTERM and SIGUSR1 to the save-and-exit flag."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _handler)


def requested() -> str | None:
    """The name of the signal received, or None."""
    return _requested["signal"]


def check(where: str) -> None:
    """Raise `Preempted` at a safe point if a signal arrived."""
    if requested():
        raise Preempted(f"{requested()} received; stopped cleanly {where}")


class PreemptCallback(TrainerCallback):
    """After each optimizer step: on a preemption signal, save a checkpoint and stop training."""

    def on_step_end(self, args, state, control, **kwargs):  # noqa: D102 - TrainerCallback hook
        if any_rank(requested() is not None):  # all ranks stop at the same step
            _requested["signal"] = _requested["signal"] or "a peer's signal"
            control.should_save = True
            control.should_training_stop = True
        return control
