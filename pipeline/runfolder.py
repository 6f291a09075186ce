"""What the orchestrator hands a stage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig


@dataclass
class StageContext:
    cfg: DictConfig  # the whole run config
    name: str  # stage kind, also its config section
    input_model: Path  # checkpoint handed over by the previous stage (or the base model)
    stage_dir: Path  # stages/NN-name/: the stage writes model/ (and work/ for checkpoints)
    fingerprint: str = ""  # the stage's training fingerprint (keys what it may reuse inside its folder)
    evaluate: Callable[[Path, Path], dict] | None = None  # (model dir, output dir) -> eval result; main process

    @property
    def stage(self) -> DictConfig:
        """This stage's config section."""
        return self.cfg[self.name]


def earlier_stage_model(stage_dir: Path, name: str) -> Path | None:
    """The finished `model/` of the stage `name` in the same run (the latest if listed twice), or None."""
    found = sorted(p for p in stage_dir.parent.glob(f"*-{name}") if p != stage_dir and (p / "model").is_dir())
    return found[-1] / "model" if found else None
