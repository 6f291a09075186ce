"""A stage's sweep grid: the settings it sweeps, its candidates and their ids (`beta0.5-lr3e-06`); the sweep itself
runs in pipeline/chain/sweep.py."""

from __future__ import annotations

import itertools
from typing import Any

from omegaconf import DictConfig

SHORT = {"learning_rate": "lr"}  # a swept setting's name in candidate ids


def swept_value(value: Any) -> str:
    """A swept setting's value as candidate ids and sweep charts write it: numbers in `g` format (3e-06)."""
    return f"{value:g}" if isinstance(value, float | int) and not isinstance(value, bool) else str(value)


def swept(stage: Any) -> list[str]:
    """The settings a stage sweeps, in name order (a null in its `sweep` mapping: not swept)."""
    return sorted(k for k, v in stage.sweep.items() if v is not None)


def sweeps(stage: Any) -> bool:
    """Whether the stage trains its model through a sweep: a grid, a soup or a merge."""
    return bool(swept(stage)) or bool(stage.soup.top_k) or bool(stage.merge.stage)


def grid(stage: Any) -> list[dict]:
    """A stage's sweep candidates: every combination of its swept settings (settings in name order, values
    ascending), each with its id (e.g. `beta0.5-lr3e-06`); one candidate of the stage's own values unswept."""
    keys = swept(stage)
    values = [sorted(stage.sweep[k]) for k in keys]
    if not keys:
        return [{"id": "single"}]
    return [{"id": "-".join(f"{SHORT.get(k, k)}{swept_value(v)}" for k, v in zip(keys, combo, strict=True)),
             **dict(zip(keys, combo, strict=True))} for combo in itertools.product(*values)]


def swept_candidate(cfg: DictConfig) -> tuple[str, int] | None:
    """The stage and grid index of the one sweep candidate this run trains (`<stage>.candidate`), if any."""
    return next(((n, cfg[n].candidate) for n in cfg.stages if cfg[n].candidate is not None), None)
