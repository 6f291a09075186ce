"""Where a run's messages go. The terminal gets the pipeline's own lines (stage, step, scores, the summary);
`<run>/pipeline.log` gets those and everything else: the libraries' log records and warnings, and the
trainers' full per-step records (`DETAIL`).

Library loggers (transformers, datasets, DeepSpeed, lm-eval, ...) and Python warnings are routed to the log
file only, so a deprecation notice or a library's advice never reaches the terminal; on a process without a log
file (ranks other than the main one) they go nowhere.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from pipeline import redact

log = logging.getLogger("pipeline")
DETAIL = "pipeline.detail"  # file only: the trainers' full log records
# library loggers to route to the file; transformers and datasets add their own stderr handler,
# DeepSpeed adds one to stdout when it is imported (`distributed.process_state` imports it first when it is used)
LIBRARIES = ("transformers", "datasets", "accelerate", "DeepSpeed", "lm_eval", "lm-eval", "torch", "trl", "peft",
             "huggingface_hub", "filelock", "matplotlib", "urllib3", "httpx", "py.warnings")
OWN_HANDLERS = ("transformers.utils.logging", "datasets.utils.logging")


def setup(path: Path | None, main: bool) -> None:
    """Log the pipeline's lines to stderr (main process: info, others: warnings) and, on the main process, every
    line, the libraries' records and Python's warnings to `path`."""
    _reset(log)
    log.setLevel(logging.INFO if main else logging.WARNING)
    log.propagate = False
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    terminal = logging.StreamHandler(sys.stderr)
    file = logging.FileHandler(path, encoding="utf-8") if path is not None else None
    for handler in (terminal, file):
        if handler is not None:
            handler.setFormatter(fmt)
            handler.addFilter(redact.LogFilter())  # secret values of the config never reach a log line
            log.addHandler(handler)
    detail = logging.getLogger(DETAIL)
    _reset(detail)
    detail.propagate = False
    detail.addHandler(file or logging.NullHandler())
    _libraries_to(file)


def _reset(logger: logging.Logger) -> None:
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()


def _libraries_to(file: logging.Handler | None) -> None:
    """Send the libraries' log records and Python's warnings to `file` (nowhere when None)."""
    for module in OWN_HANDLERS:  # importing them adds their handler (transformers' on first use: added here)
        with contextlib.suppress(ImportError):
            getattr(importlib.import_module(module), "disable_default_handler", lambda: None)()
    logging.captureWarnings(True)
    for name in LIBRARIES:
        logger = logging.getLogger(name)
        logger.handlers = [file or logging.NullHandler()]
        logger.propagate = False


@contextlib.contextmanager
def children_to_file() -> Iterator[None]:
    """Processes started inside the block (a vLLM engine core) write their output to the log file, not the
    terminal: stdout and stderr point at the file while they start, then are restored. No log file: unchanged."""
    file = next((h for h in logging.getLogger(DETAIL).handlers if isinstance(h, logging.FileHandler)), None)
    if file is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    with open(file.baseFilename, "a", encoding="utf-8") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


def detail(message: str, *args: object) -> None:
    """Write a line to the log file only."""
    logging.getLogger(DETAIL).info(message, *args)


def duration(seconds: float) -> str:
    """`45 s`, `3 min 05 s`, `1 h 02 min`: a time for people."""
    s = round(seconds)
    if s < 100:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def figure(value: float | int | None) -> str:
    """A number for people: `12,475`, `118.3`, `0.69`, `3e-06`; `-` for None."""
    if value is None:
        return "-"
    if isinstance(value, int) or abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 1 else f"{value:.3g}"


def scores(metrics: dict[str, float]) -> str:
    """`task/metric,filter` scores grouped by task: `gsm8k exact_match: strict-match 0.930, flexible-extract
    0.930; ...`."""
    tasks: dict[str, list[str]] = {}
    for key, value in metrics.items():
        task, _, name = key.partition("/")
        metric, _, filt = name.partition(",")
        tasks.setdefault(f"{task} {metric}", []).append(f"{filt or metric} {value:.3f}")
    return "; ".join(f"{task}: {', '.join(parts)}" for task, parts in tasks.items())
