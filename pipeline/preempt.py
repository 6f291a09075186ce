"""Preemption: SIGTERM / SIGUSR1 (Slurm's warning signal) and SIGINT (Ctrl-C) make the pipeline save and exit
cleanly with `errors.PREEMPTED` (75); rerunning the same command resumes.

The signal sets a flag. A training stage checks it after every optimizer step (agreeing across ranks), saves a
checkpoint and stops; the orchestrator checks it between stages. Work outside training steps that can run for
minutes (scoring, on-policy sampling, tokenising, building the base model, soups and merges) runs `interruptible`:
there a signal stops it at once, its partial result is dropped (it is redone on the rerun) and what was finished
before it stays. Work of the main process alone runs in `main_only`, where the other ranks wait and then stop
with it, together. A second Ctrl-C stops at once (KeyboardInterrupt). Processes the run starts (a vLLM engine
core) start `shielded` from these signals: the run stops them itself, so a signal sent to every process of a
Slurm step or a terminal's process group never turns into their crash. Under Slurm, a checkpoint is not started
when the job ends (`SLURM_JOB_END_TIME`) sooner than the stage's last save took: the stage stops with exit 75
instead, so the job requeues from the checkpoint before rather than timing out in the middle of a save.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

from transformers import TrainerCallback

from pipeline.distributed import any_rank, is_main, world_size
from pipeline.errors import Preempted

log = logging.getLogger("pipeline")
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# the first signal's name (or the reason `stop` gave); the section a signal stops now; how many SIGINTs came; that
# reason, which is not a signal received
_requested: dict[str, Any] = {"signal": None, "interruptible": None, "sigints": 0, "reason": None}


class _Interrupt(BaseException):
    """Raised by the handler inside an `interruptible` section: a BaseException, so that no library's
    `except Exception` swallows it on its way out (as KeyboardInterrupt)."""


def _handler(signum: int, _frame: Any) -> None:
    _requested["sigints"] += signum == signal.SIGINT
    if _requested["sigints"] > 1:
        raise KeyboardInterrupt  # a second Ctrl-C: stop now
    _requested["signal"] = _requested["signal"] or signal.Signals(signum).name
    if _requested["interruptible"]:
        _requested["interruptible"] = None  # once: a second signal must not cut short the cleanup on the way out
        raise _Interrupt


def install() -> None:
    """Route SIGTERM, SIGUSR1 and SIGINT to the save-and-exit flag."""
    for sig in SIGNALS:
        signal.signal(sig, _handler)


def requested() -> str | None:
    """The name of the signal received, or None."""
    return _requested["signal"]


def _why() -> str:
    """Why the run stops: `SIGNAL received`, or the reason `stop` gave; empty when nothing asked."""
    what = requested() or ""
    return what if what == _requested["reason"] or not what else f"{what} received"


def stop(reason: str) -> None:
    """Stop at the next safe point as on a signal, for `reason` (unless a signal came first)."""
    if not _requested["signal"]:
        _requested["signal"] = _requested["reason"] = reason


def check(where: str) -> None:
    """Raise `Preempted` at a safe point if a signal arrived."""
    if requested():
        raise Preempted(f"{_why()}; stopped cleanly {where}")


def check_together(where: str) -> None:
    """`check` on every rank at once (an all-reduce): when any rank got a signal, every rank raises `Preempted`
    here, so none goes on alone into work the others have left."""
    if any_rank(requested() is not None):
        raise Preempted(f"{_why() or 'a peer rank received a signal'}; stopped cleanly {where}")


@contextlib.contextmanager
def interruptible(where: str) -> Iterator[None]:
    """Run the block so that a stop signal ends it at once with `Preempted` (`where`: what it was doing, for the
    message); one that arrived before the block ends it before it starts. For work whose partial result is
    dropped (written atomically at its end) and that holds no collective the other ranks are inside."""
    check(f"before {where}")
    outer = _requested["interruptible"]
    _requested["interruptible"] = where
    try:
        yield
    except _Interrupt:
        raise Preempted(f"{requested()} received; stopped {where}; it is redone on the rerun") from None
    finally:
        _requested["interruptible"] = outer


def collective(where: str) -> contextlib.AbstractContextManager:
    """For work every rank does together (its collectives inside): `interruptible` when this process works alone;
    with several ranks it runs to its end, and the next check stops the run (a rank that stopped inside a
    collective would leave the others waiting there)."""
    return interruptible(where) if world_size() == 1 else contextlib.nullcontext()


@contextlib.contextmanager
def main_only(where: str) -> Iterator[bool]:
    """`with main_only("scoring 01-sft") as main: if main: ...`: work of the main process alone that the other
    ranks wait for (as `distributed.main_writes`), `interruptible` there; then every rank stops together, with
    `Preempted`, when the main process was stopped or a rank got a signal meanwhile."""
    main, stopped = is_main(), None
    try:
        with interruptible(where) if main else contextlib.nullcontext():
            yield main
    except Preempted as err:
        stopped = err
    if any_rank(stopped is not None or requested() is not None):  # the wait: every rank meets here
        raise stopped or Preempted(f"{_why() or 'a peer rank'} stopped the run {where}")


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Processes started inside the block (a vLLM engine core) ignore the stop signals: they are blocked while
    they start, and a blocked mask is inherited; this process gets any that arrived as the block ends."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def job_time_left() -> float | None:
    """Seconds until the Slurm job's time limit (`SLURM_JOB_END_TIME`, a Unix time); None outside a timed job."""
    try:
        return float(os.environ["SLURM_JOB_END_TIME"]) - time.time()
    except (KeyError, ValueError):
        return None


class PreemptCallback(TrainerCallback):
    """After each optimizer step: on a preemption signal, save a checkpoint and stop training. A save is not started
    when the job ends sooner than the last save took (`save_s`, measured here): training stops without it, the run
    exits 75, and the requeued job resumes from the checkpoint before. `save_s`: how long the checkpoint a resume
    starts from took to write, until this run measures its own."""

    def __init__(self, save_s: float | None = None) -> None:
        self.save_s = save_s  # how long the last checkpoint took
        self._save_started: float | None = None

    def on_step_end(self, args, state, control, **kwargs):  # noqa: D102 - TrainerCallback hook
        if any_rank(requested() is not None):  # all ranks stop at the same step
            _requested["signal"] = _requested["signal"] or "a peer's signal"
            control.should_save = True
            control.should_training_stop = True
        left = job_time_left()
        if control.should_save and any_rank(left is not None and self.save_s is not None and left < self.save_s):
            left = max(left or 0.0, 0.0)  # None on a rank whose environment has no end: another rank's decided
            if is_main():
                log.warning("no checkpoint at step %d: the job ends in %.0f s and the last save took %.0f s; stopping "
                            "without it (exit 75: the requeued job resumes from the checkpoint before)",
                            state.global_step, left, self.save_s)
            stop(f"the job's time limit is nearer than a save ({left:.0f} s left, the last save took {self.save_s:.0f} "
                 "s)")
            control.should_save = False
            control.should_training_stop = True
        self._save_started = time.monotonic() if control.should_save else None
        return control

    def on_save(self, args, state, control, **kwargs):  # noqa: D102 - TrainerCallback hook
        if self._save_started is not None:
            self.save_s = time.monotonic() - self._save_started
        return control
