"""The base model a run starts from: a Hub id, a local checkpoint, or a model the recipe's extension builds
(`model.name_or_path` naming the extension's section, pipeline/extension.py). Only this module tells them apart.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from pipeline import extension
from pipeline.config import ConfigError


def base_settings(cfg: DictConfig) -> dict | None:
    """The settings a built base model is made from (part of the base fingerprint); None for a loaded one."""
    return extension.of(cfg).base_settings(cfg) if extension.builds_base(cfg) else None


def check_model_path(cfg: DictConfig) -> None:
    """Refuse a local model path that does not exist or is not a Hugging Face checkpoint."""
    if extension.builds_base(cfg):
        return
    name = cfg.model.name_or_path
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.name_or_path {name} is not a checkpoint folder (no config.json)")
        from transformers import AutoConfig  # here, not at the top: plan=true imports this module without torch

        try:
            AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
        except (ValueError, OSError, KeyError) as err:  # malformed JSON, or no / an unknown model_type
            raise ConfigError(f"model.name_or_path {name}: its config.json cannot be read: {err}") from None
    elif name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise ConfigError(f"model.name_or_path {name} does not exist (and is not a Hub id like org/name)")


def base_model(cfg: DictConfig) -> str | Path:
    """The base checkpoint to load (a built model is built first, collectively on every rank)."""
    return extension.of(cfg).build_base_model(cfg) if extension.builds_base(cfg) else cfg.model.name_or_path


def architecture(cfg: DictConfig) -> tuple[Path, dict | None]:
    """Where the base checkpoint is or will be, and, for a built model, its shape from the settings. Reads no
    weights."""
    if extension.builds_base(cfg):
        return extension.of(cfg).architecture(cfg)
    return Path(cfg.model.name_or_path).expanduser(), None


def pending_build(cfg: DictConfig) -> Path | None:
    """Where the recipe's extension will build the base model, when it builds one that is not built yet."""
    if not extension.builds_base(cfg):
        return None
    path = architecture(cfg)[0]
    return None if path.is_dir() else path
