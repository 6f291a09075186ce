"""Data preparation at scale: the collective timeout, and waits that are not collectives.

The run's process group (`training.process_state`: plain, gloo on CPU, or DeepSpeed's `init_distributed`),
which every trainer reuses, times out after `collective_timeout_s` (default 5 h, as SmolLM3's published
configs); groups DeepSpeed clones from it for ZeRO take torch's default (10 min NCCL, 30 min gloo), but
only its training collectives run on them. Preparing a mixture can
take longer still, so it never runs under a collective: the main process of the world prepares (the cache
folder lives under `cache_dir`, which like the run folder must be on a filesystem every node shares, so
once per world is once per node too), and the other ranks poll for the finished folder, which appears
whole (written to a temporary name and renamed). Only then do all ranks meet at a barrier. The poll is bounded
too, by `prep_timeout_s` (default 24 h; `set_wait_limit`): past it the waiting rank stops with exit 2, naming
the folder it waited for.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from pipeline import preempt
from pipeline.errors import ConfigError

log = logging.getLogger("pipeline")

POLL_S = 1.0
_wait = {"limit_s": 86400.0}  # prep_timeout_s of this run (`set_wait_limit`)
SLOW_PREP_ENV = "PIPELINE_TEST_SLOW_PREP_S"  # test hook: seconds the main process sleeps while preparing


def group_timeout_s() -> float | None:
    """The default process group's timeout in seconds as the group itself reports it; None without a group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    group = torch.distributed.distributed_c10d._get_default_group()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return group._get_backend(device).options._timeout.total_seconds()


def slow_down_for_tests() -> None:
    """Sleep `PIPELINE_TEST_SLOW_PREP_S` seconds (unset: no sleep), to test preparation longer than a timeout."""
    seconds = float(os.environ.get(SLOW_PREP_ENV) or 0)
    if seconds:
        log.info("test hook: preparation slowed by %.0f s", seconds)
        time.sleep(seconds)


def set_wait_limit(seconds: float) -> None:
    """How long `wait_for_dir` waits at most (the run's `prep_timeout_s`)."""
    _wait["limit_s"] = float(seconds)


def wait_for_dir(path: Path, what: str, limit_s: float | None = None) -> None:
    """Block until another process has committed the folder `path`: no collective, so no collective timeout, but
    at most `limit_s` seconds (default: `set_wait_limit`'s), then a `ConfigError` naming the folder.

    If the preparing process dies, the launcher (torchrun / accelerate) stops this one with it.
    """
    limit_s = _wait["limit_s"] if limit_s is None else limit_s
    started = last = time.monotonic()
    while not path.is_dir():
        if time.monotonic() - started > limit_s:
            raise ConfigError(f"waited {limit_s:.0f} s (prep_timeout_s) for the main process to prepare {what} in "
                              f"{path}, and it never appeared: the cache folder (cache_dir) must be on a filesystem "
                              f"every node shares; if the main process is still preparing, raise prep_timeout_s")
        preempt.check(f"waiting for {what}")  # the main process, which prepares it, got the signal too
        time.sleep(min(POLL_S, max(limit_s, 0.01)))
        if time.monotonic() - last > 60:
            last = time.monotonic()
            log.info("waiting for the main process to prepare %s (%.0f s)", what, last - started)


def log_rate(what: str, rows: int, started: float) -> None:
    """Log how fast a preparation step went, in rows/s."""
    took = max(time.monotonic() - started, 1e-9)
    log.info("%s: %s rows in %.1f s (%s rows/s)", what, f"{rows:,}", took, f"{rows / took:,.0f}")
