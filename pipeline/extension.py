"""Recipe extensions: a Python module that a recipe names (`extension: package.module`) to bring to a run what a
user otherwise brings as files and paths. The product imports an extension only by the name a recipe gives;
the embedded demo's recipe names one.

An extension module may define:

    SECTION: str, Settings: a dataclass      its own config section (`SECTION.key=value` overrides)
    CHOICES: dict[str, tuple]                allowed values of its section's keys
    GENERATORS: {name: (cfg, split) -> Path} data sources of mixtures (`generator: NAME`, `split`): a JSONL file
    write_tasks(cfg, out: Path)              writes lm-eval task YAMLs into the run's task folder
    build_base_model(cfg) -> Path            builds the base checkpoint (every rank calls it) when
                                             `model.name_or_path` is SECTION
    base_settings(cfg) -> dict               what that built model depends on (part of the base fingerprint)
    architecture(cfg) -> (Path, dict)        where it is or will be, and its shape, without building it
    heldout_problems(cfg) -> list[dict]      held-out {question, answer} problems RL stages report on
    task_sizes(cfg) -> dict[str, int]        how many problems each of its tasks scores (gates' power before a run)
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from pipeline.errors import ConfigError


@functools.cache
def load(name: str) -> ModuleType | None:
    """The extension module `name` (None for an empty name); a ConfigError when it cannot be imported."""
    if not name:
        return None
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ConfigError(f"extension '{name}' cannot be imported: {err}") from None


def of(cfg: Any) -> ModuleType | None:
    """The run's extension module, if its recipe names one."""
    return load(cfg.extension)


def section(cfg: Any) -> str | None:
    """The name of the config section the run's extension adds (None without one)."""
    ext = of(cfg)
    return getattr(ext, "SECTION", None) if ext else None


def builds_base(cfg: Any) -> bool:
    """Whether the run's base model is built by its extension (`model.name_or_path` names its section)."""
    ext = of(cfg)
    return bool(ext) and cfg.model.name_or_path == getattr(ext, "SECTION", None) and hasattr(ext, "build_base_model")


def generator(cfg: Any, name: str, where: str):
    """The data generator `name` of the run's extension; a ConfigError naming `where` when there is none."""
    found = getattr(of(cfg), "GENERATORS", {}).get(name)
    if found is None:
        known = ", ".join(getattr(of(cfg), "GENERATORS", {})) or "none (the recipe names no extension with one)"
        raise ConfigError(f"{where}: unknown generator '{name}'; generators: {known}")
    return found


def write_tasks(cfg: Any, out: Path) -> None:
    """Let the run's extension write its lm-eval tasks into `out`."""
    ext = of(cfg)
    if ext is not None and hasattr(ext, "write_tasks"):
        ext.write_tasks(cfg, out)


def heldout_problems(cfg: Any) -> list[dict]:
    """The held-out problems the run's extension ships (empty without one)."""
    ext = of(cfg)
    return ext.heldout_problems(cfg) if ext is not None and hasattr(ext, "heldout_problems") else []


def task_sizes(cfg: Any) -> dict[str, int]:
    """How many problems each of the run's extension's tasks scores (empty without one)."""
    ext = of(cfg)
    return ext.task_sizes(cfg) if ext is not None and hasattr(ext, "task_sizes") else {}
