"""The base model a run starts from: a Hub id, a local checkpoint, or a model the pipeline builds itself
(`model.name_or_path: tiny`, see `pipeline.tiny`). Only this module tells them apart.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.config import ConfigError, TinyConfig, cache_dir, fingerprint_view
from pipeline.tiny import data as tiny_data

BUILT = "tiny"  # the name of the built-in model


def is_built(cfg: DictConfig) -> bool:
    """Whether the run's base model is built by the pipeline rather than loaded."""
    return cfg.model.name_or_path == BUILT


def base_settings(cfg: DictConfig) -> dict | None:
    """The settings a built base model is made from (part of the base fingerprint); None for a loaded one."""
    return fingerprint_view(OmegaConf.to_container(cfg.tiny), TinyConfig) if is_built(cfg) else None


def check_model_path(cfg: DictConfig) -> None:
    """Refuse a local model path that does not exist or is not a Hugging Face checkpoint."""
    if is_built(cfg):
        return
    name = cfg.model.name_or_path
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.name_or_path {name} is not a checkpoint folder (no config.json)")
        from transformers import AutoConfig  # here, not at the top: plan=true imports this module without torch

        try:
            AutoConfig.from_pretrained(path)
        except (ValueError, OSError, KeyError) as err:  # malformed JSON, or no / an unknown model_type
            raise ConfigError(f"model.name_or_path {name}: its config.json cannot be read: {err}") from None
    elif name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise ConfigError(f"model.name_or_path {name} does not exist (and is not a Hub id like org/name)")


def base_model(cfg: DictConfig) -> str | Path:
    """The base checkpoint to load (a built model is built first, collectively on every rank)."""
    if not is_built(cfg):
        return cfg.model.name_or_path
    from pipeline.tiny.model import ensure_base_model

    return ensure_base_model(cache_dir(cfg), cfg.tiny, cfg.model, cfg.seed)


def architecture(cfg: DictConfig) -> tuple[Path, dict | None]:
    """Where the base checkpoint is or will be, and, for a built model, its shape from the settings
    (an upper bound on the vocabulary: the tokenizer may learn fewer tokens). Reads no weights."""
    if not is_built(cfg):
        return Path(cfg.model.name_or_path).expanduser(), None
    t = cfg.tiny
    path = tiny_data.tiny_dir(cache_dir(cfg), OmegaConf.to_container(t), cfg.seed) / "model"
    return path, {"vocab_size": t.vocab_size, "hidden_size": t.hidden_size, "num_hidden_layers": t.num_layers,
                  "intermediate_size": t.intermediate_size, "num_attention_heads": t.num_heads,
                  "tie_word_embeddings": True}


def heldout_problems(cfg: DictConfig) -> list[dict]:
    """Held-out problems {question, answer} that ship with a built model (its test split); empty otherwise."""
    if not is_built(cfg):
        return []
    path = tiny_data.data_dir(cache_dir(cfg), OmegaConf.to_container(cfg.tiny)) / "test.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
