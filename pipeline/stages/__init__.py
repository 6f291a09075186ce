"""The stage kinds: every module of this package that defines `KIND` (or `KINDS`, several kinds of one code path)
registers it; nothing else lists them. A kind (`pipeline.settings.StageKind`) trains exactly one model per call
into `ctx.out_dir/model` (a sweep calls it once per candidate, `pipeline.chain.sweep`). Kind modules are light to
import: their training libraries are imported by the functions that train.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from pipeline.settings import StageKind


@functools.cache
def kinds() -> dict[str, StageKind]:
    """Every registered stage kind by name, in chain order (`StageKind.order`, then name)."""
    found: list[StageKind] = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found += getattr(module, "KINDS", ()) or ((module.KIND,) if hasattr(module, "KIND") else ())
    return {kind.name: kind for kind in sorted(found, key=lambda k: (k.order, k.name))}
