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
