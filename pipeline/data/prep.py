"""Data preparation at scale: the collective timeout, and waits that are not collectives.

The run's process group (`training.process_state`: plain, gloo on CPU, or DeepSpeed's `init_distributed`),
which every trainer reuses, times out after `collective_timeout_s` (default 5 h, as SmolLM3's published
configs); groups DeepSpeed clones from it for ZeRO take torch's default (10 min NCCL, 30 min gloo), but
only its training collectives run on them. Preparing a mixture can
take longer still, so it never runs under a collective: the main process of the world prepares (the cache
folder lives under `cache_dir`, which like the run folder must be on a filesystem every node shares, so
once per world is once per node too), and the other ranks poll for the finished folder, which appears
whole (written to a temporary name and renamed). Only then do all ranks meet at a barrier.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger("pipeline")

POLL_S = 1.0
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


def wait_for_dir(path: Path, what: str) -> None:
    """Block until another process has committed the folder `path` (no collective, so no timeout).

    If the preparing process dies, the launcher (torchrun / accelerate) stops this one with it.
    """
    started = last = time.monotonic()
    while not path.is_dir():
        time.sleep(POLL_S)
        if time.monotonic() - last > 60:
            last = time.monotonic()
            log.info("waiting for the main process to prepare %s (%.0f s)", what, last - started)


def log_rate(what: str, rows: int, started: float) -> None:
    """Log how fast a preparation step went, in rows/s."""
    took = max(time.monotonic() - started, 1e-9)
    log.info("%s: %s rows in %.1f s (%s rows/s)", what, f"{rows:,}", took, f"{rows / took:,.0f}")
