"""The final outcome of a run, in `<run>/outcome.json`: what `accelerate launch` hides behind its exit code 1.

Written atomically by the main process when the pipeline ends, whatever the ending, provided it held the run
lock (a command line that does not parse exits 2 before the run folder is known; a run refused because another
holds the folder exits 2 and touches none of its files): the exit code, its name, a one-line reason, the stage in
progress, and when the run started and ended. A run removes the previous run's file once it holds the lock, so a
script that finds no file (or an older `started`) knows the command failed before it reached its run folder.
One sweep candidate (`<stage>.candidate=i`, a Slurm array task sharing the folder) writes
`outcome-<stage>-candidate-<i>.json` instead.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from pipeline import redact
from pipeline.errors import NAMES
from pipeline.files import write_json
from pipeline.runfolder import RunPaths

_current = {"stage": None}


def enter(stage: str) -> None:
    """Note the stage the chain is working on (the orchestrator calls this as each stage begins)."""
    _current["stage"] = stage


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Outcome:
    """The outcome file of one invocation: `start` drops the previous one, `finish` writes this one."""

    def __init__(self, root: Path, candidate: tuple[str, int] | None, argv: list[str]) -> None:
        self.path = RunPaths(root).outcome(candidate)
        self.argv = redact.argv(argv)
        self.started = _now()
        self.held = False  # whether this process holds the run lock: only then does it touch the file

    def start(self) -> None:
        """Once this process holds the run lock: remove the previous invocation's outcome (a missing file now
        means: not finished)."""
        self.held = True
        if self.path.parent.is_dir():  # a run folder that cannot exist (e.g. under a file) is reported later
            self.path.unlink(missing_ok=True)

    def finish(self, code: int, reason: str) -> None:
        """Write the exit code, its name, the reason and the stage in progress, atomically (secrets redacted)."""
        if not (self.held and self.path.parent.is_dir()):
            return  # another run holds the folder, or it was never created (e.g. not writable): nothing to record
        with contextlib.suppress(OSError):  # a folder that cannot be written keeps the exit code as it is
            write_json(self.path, {"exit_code": code, "outcome": NAMES.get(code, "crashed"),
                                   "reason": redact.scrub(reason),
                                   "stage": _current["stage"], "started": self.started, "finished": _now(),
                                   "argv": self.argv})
