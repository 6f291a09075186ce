"""Stage kinds: a plain dict from kind to its entry function `run(ctx) -> metrics`, which trains exactly one
model into `ctx.out_dir/model` (a sweep calls it once per candidate, see `pipeline.sweep`). The kinds and their
modules are `pipeline.config.STAGE_MODULES` (each stage section of the config names its module)."""

from __future__ import annotations

import importlib

from pipeline.config import STAGE_MODULES

STAGES = {kind: importlib.import_module(f"pipeline.stages.{module}").run for kind, module in STAGE_MODULES.items()}
