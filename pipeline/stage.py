"""What the orchestrator hands a stage."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig


@dataclass
class StageContext:
    cfg: DictConfig  # the whole run config
    name: str  # stage kind, also its config section
    input_model: Path  # checkpoint handed over by the previous stage (or the base model)
    stage_dir: Path  # stages/NN-name/: the stage writes model/ (and work/ for checkpoints)

    @property
    def stage(self) -> DictConfig:
        """This stage's config section."""
        return self.cfg[self.name]
