"""How a run ends: the exit codes (the one table of them) and the errors that carry one.

    0   passed           every stage passed its gate
    1   crashed          an unexpected exception (its traceback in <run>/pipeline.log); rerun to resume
    2   bad_input        bad config or input (`ConfigError`), found before any model loads where it can be
    3   gate_stop        a gate stopped the chain (the leaderboard is still written)
    4   training_failed  a stage could not finish training (`TrainingFailed`): its losses diverged, or the disk
                         is full; earlier checkpoints are intact; fix the cause, then rerun to resume
    5   memory_alert     device memory passed its limit during a step: a checkpoint was saved (`MemoryAlert`); lower
                         the memory a step needs (settings a resume may change), then rerun to resume. Not
                         requeued by the Slurm scripts: the same settings would hit the same peak
    6   lock_lost        another process took the run folder's lock over (this one stopped renewing it in time): this
                         one stopped before its next write (`LockLost`), leaving the folder to the new holder
    75  preempted        SIGTERM / SIGUSR1 / SIGINT: what is resumable was saved (`Preempted`); rerun to resume
"""

from __future__ import annotations

PASSED, CRASHED, BAD_INPUT, GATE_STOP, TRAINING_FAILED, MEMORY_ALERT, LOCK_LOST, PREEMPTED = 0, 1, 2, 3, 4, 5, 6, 75
NAMES = {PASSED: "passed", CRASHED: "crashed", BAD_INPUT: "bad_input", GATE_STOP: "gate_stop",
         TRAINING_FAILED: "training_failed", MEMORY_ALERT: "memory_alert", LOCK_LOST: "lock_lost",
         PREEMPTED: "preempted"}


class PipelineError(Exception):
    """An ending the pipeline foresees; `code` is its exit code."""

    code = CRASHED


class ConfigError(PipelineError, ValueError):
    """Bad configuration or input: the run stops with exit code 2, before any heavy work where it can be known.
    `every_rank`: every rank raises it alike, having agreed on it (pipeline/run.py prints it once per machine)."""

    code = BAD_INPUT
    every_rank = False


class TrainingFailed(PipelineError):
    """A stage could not finish training for a reason the message names (diverged, disk full): exit code 4."""

    code = TRAINING_FAILED


class Preempted(PipelineError):
    """A stage saved its checkpoint and stopped after a preemption signal: exit code 75."""

    code = PREEMPTED


class MemoryAlert(PipelineError):
    """Device memory passed its limit during a training step; a checkpoint was saved: exit code 5."""

    code = MEMORY_ALERT


class LockLost(PipelineError):
    """Another process holds the run folder's lock now: this one writes nothing more there: exit code 6."""

    code = LOCK_LOST
