"""The ranks of a run agree before it starts, or every rank stops with one message.

`check_start` runs once the process group exists and the main process has opened and locked the run folder.
Every rank proves that it works on what the main process works on:

- the same run folder and cache folder: the main process writes a random token into each
  (`.rank-check-<token>`, atomically), and every rank reads it back through its own path. A node-local
  `output_root` or `cache_dir` (`/scratch/runs`), or a relative one under a different working directory, fails
  here, within seconds, instead of hanging until the collective timeout;
- the same config (the fingerprint of the resolved config; a mismatch names the keys that differ) and the same
  code (the git commit, else the package's version).

Every rank sends what it found to every other (an all-gather), so every rank reaches the same verdict and raises
the same `ConfigError` (exit 2, flagged `every_rank`: pipeline/run.py prints it once per machine), and none is
left waiting at a collective. The message names each rank that differs, its host and what differs:

    rank 1 on node-b does not see the run folder /scratch/runs/exp1 that rank 0 on node-a writes: output_root
    and cache_dir must be on a filesystem every node shares

Decisions that follow are made the same way: `collectively` runs a check on every rank and raises any rank's
problem on all of them, and `same_decisions` gives every rank the main process's per-stage decisions after
checking that each rank computed the same stage fingerprints.
"""

from __future__ import annotations

import importlib.metadata
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from omegaconf import DictConfig, OmegaConf

from pipeline.chain import manifest
from pipeline.distributed import (
    agreed_error,
    every_value,
    host,
    is_main,
    main_value,
    ranks_do,
    ranks_on,
    world_size,
)
from pipeline.errors import ConfigError
from pipeline.files import fingerprint, write_text
from pipeline.runfolder import cache_dir

T = TypeVar("T")
TOKEN = ".rank-check-{}"
SHARED = "output_root and cache_dir must be on a filesystem every node shares"
MOST = 4  # groups of differing ranks a message names; the rest are counted


def code_version() -> str:
    """The code this rank runs: the git commit of the pipeline, else the installed package's version."""
    commit = manifest.code_version()["git_commit"]
    if commit:
        return f"commit {commit[:12]}"
    try:
        return f"smol-pipeline {importlib.metadata.version('smol-pipeline')}"
    except importlib.metadata.PackageNotFoundError:
        return "an unknown version"


def _flat(obj: object, prefix: str = "") -> dict[str, object]:
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: obj}


def _sees(folder: Path, token: str | None) -> bool:
    try:
        return token is not None and (folder / TOKEN.format(token)).read_text(encoding="utf-8") == token
    except OSError:
        return False


def _write_tokens(folders: dict[str, Path]) -> tuple[str | None, str | None]:
    """The main process writes a fresh token into each folder: (the token, or None and the problem)."""
    token = uuid.uuid4().hex
    for kind, folder in folders.items():
        try:
            write_text(folder / TOKEN.format(token), token)
        except OSError as err:
            return None, f"cannot write the {kind} {folder}: {err.strerror or err}"
    return token, None


def _remove_tokens(folders: dict[str, Path], token: str | None) -> None:
    for folder in folders.values():
        if token:
            (folder / TOKEN.format(token)).unlink(missing_ok=True)


def report(cfg: DictConfig, folders: dict[str, Path], token: str | None) -> dict:
    """What one rank finds: its host, whether it sees each folder's token (and where it looks), its config's
    fingerprint and its code version."""
    return {"host": host(), "sees": {kind: _sees(folder, token) for kind, folder in folders.items()},
            "paths": {kind: str(folder.absolute()) for kind, folder in folders.items()},
            "config": fingerprint(OmegaConf.to_container(cfg, resolve=True)), "code": code_version()}


def _named(groups: dict[tuple[str, str], list[int]], main_host: str) -> str:
    """One clause per group of ranks: `<ranks on host> <what they do>`, the longest lists cut at `MOST`."""
    parts = [ranks_do(ranks, on, what.replace("{main}", f"rank 0 on {main_host}"))
             for (on, what), ranks in groups.items()]
    more = f"; and {len(parts) - MOST} more such group(s) of ranks" if len(parts) > MOST else ""
    return "; ".join(parts[:MOST]) + more


def _folders_differ(reports: list[dict]) -> str | None:
    main = reports[0]
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, seen in enumerate(reports):
        missing = []
        for kind, sees in seen["sees"].items():
            if not sees:
                theirs, mine = main["paths"][kind], seen["paths"][kind]
                missing.append(f"the {kind} {theirs}" + ("" if mine == theirs else f" (looking in {mine})"))
        if missing:
            what = f"does not see {' or '.join(missing)} that {{main}} writes"
            groups.setdefault((seen["host"], what), []).append(rank)
    return f"{_named(groups, main['host'])}: {SHARED}" if groups else None


def disagreements(reports: list[dict], configs: list[dict] | None = None) -> str | None:
    """The message for every rank's `report` (in rank order) that differs from the main process's, or None.
    `configs`: every rank's resolved config, to name the keys that differ (gathered only when one does)."""
    if folders := _folders_differ(reports):
        return folders
    main, groups = reports[0], {}
    for rank, seen in enumerate(reports):
        if seen["code"] != main["code"]:
            what = f"runs {seen['code']} where {{main}} runs {main['code']}"
            groups.setdefault((seen["host"], what), []).append(rank)
    if groups:
        return f"{_named(groups, main['host'])}: every node must run the same checkout of the pipeline"
    for rank, seen in enumerate(reports):
        if seen["config"] != main["config"]:
            keys = ""
            if configs:
                mine, theirs = _flat(configs[rank]), _flat(configs[0])
                differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k, ...) != theirs.get(k, ...))
                keys = f" (differing in {', '.join(differ[:8])}{', ...' if len(differ) > 8 else ''})"
            groups.setdefault((seen["host"], f"runs another config than {{main}}{keys}"), []).append(rank)
    if groups:
        return (f"{_named(groups, main['host'])}: start every node with the same command line, recipe files and "
                f"environment")
    return None


def check_start(cfg: DictConfig, root: Path) -> None:
    """Every rank sees the run folder and the cache folder the main process writes, and runs the same config and
    code; else the same `ConfigError` on every rank (see the module's docstring). Every rank must call it."""
    if world_size() == 1:
        return
    folders, main = {"run folder": Path(root), "cache folder": cache_dir(cfg)}, is_main()
    token, problem = main_value(_write_tokens(folders) if main else (None, None))
    if problem:
        raise agreed_error(problem)
    try:
        reports = every_value(report(cfg, folders, token))
    finally:
        if main:
            _remove_tokens(folders, token)
    configs = None
    if any(r["config"] != reports[0]["config"] for r in reports) and not _folders_differ(reports):
        configs = every_value(OmegaConf.to_container(cfg, resolve=True))  # every rank knows to gather them
    if message := disagreements(reports, configs):
        raise agreed_error(message)


def collectively(check: Callable[..., T], *args: object) -> T:
    """`check(*args)` on every rank; a `ConfigError` on any rank is raised on every rank: the main process's
    message as it is, and another rank's (when it differs) named with its rank and host. Every rank must call it."""
    try:
        value, problem = check(*args), None
    except ConfigError as err:
        value, problem = None, str(err)
    seen = every_value((host(), problem))
    if not any(p for _, p in seen):
        return value  # type: ignore[return-value]
    main = seen[0][1]
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, (on, theirs) in enumerate(seen[1:], 1):
        if theirs and theirs != main:
            groups.setdefault((on, theirs), []).append(rank)
    others = "; ".join(f"{ranks_on(ranks, on)}: {theirs}" for (on, theirs), ranks in groups.items())
    raise agreed_error("; ".join(p for p in (main, others) if p))


def same_decisions(decisions: list[T]) -> list[T]:
    """The main process's per-stage decisions (`StageDecision`) on every rank, made once; first every rank's
    stages and fingerprints (config, data, upstream) are compared with the main process's, and a rank that
    computed others stops every rank with a message naming it. Every rank must call it."""
    mine = [(d.name, d.fingerprint) for d in decisions]  # type: ignore[attr-defined]
    seen = every_value((host(), mine))
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, (on, theirs) in enumerate(seen):
        odd = [name for (name, fp), first in zip(theirs, seen[0][1], strict=False) if (name, fp) != first]
        if len(theirs) != len(seen[0][1]):
            what = f"plans the stages {[n for n, _ in theirs]} where {{main}} plans {[n for n, _ in seen[0][1]]}"
        elif odd:
            what = f"computes other fingerprints than {{main}} for {', '.join(odd)}"
        else:
            continue
        groups.setdefault((on, what), []).append(rank)
    if groups:
        raise agreed_error(f"{_named(groups, seen[0][0])}: the data files these ranks read differ from the main "
                           f"process's; every node must see the same data files")
    return main_value(decisions)
