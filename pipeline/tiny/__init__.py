"""The embedded demo (`recipe=tiny`): a recipe extension (pipeline/extension.py) that builds everything locally.

- `data`: GSM8K-style synthetic splits (torch-free), the mixtures' `generator: tiny`;
- `model`: a byte-level BPE tokenizer with a ChatML template and a tiny Llama, pretrained briefly on the
  synthetic corpus (so post-training starts from a model that has seen text): `model.name_or_path: tiny`;
- `tasks/`: lm-eval tasks `tiny_gsm` (test, the report) and `tiny_gsm_val` (validation: gates and selection).

This module imports nothing heavy: the config loader reads its section while parsing a recipe.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from pipeline.files import write_text
from pipeline.runfolder import cache_dir
from pipeline.tiny import data
from pipeline.tiny.settings import TinyConfig

SECTION = "tiny"
Settings = TinyConfig
GENERATORS = {"tiny": data.split_file}
TASKS = Path(__file__).resolve().parent / "tasks"


def _settings(cfg: Any) -> dict:
    return OmegaConf.to_container(cfg.tiny)


def write_tasks(cfg: Any, out: Path) -> None:
    """Write tasks tiny_gsm and tiny_gsm_val into `out`, pointing at this run's synthetic splits."""
    import lm_eval

    values = {"gsm8k_yaml": str(Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml")}
    values.update({f"tiny_{split}": str(data.split_file(cfg, name).resolve())
                   for split, name in (("train", "gsm_train"), ("test", "test"), ("validation", "validation"))})
    for template in sorted(TASKS.glob("*.yaml")):
        write_text(out / template.name, string.Template(template.read_text(encoding="utf-8")).substitute(values))


def task_sizes(cfg: Any) -> dict[str, int]:
    """How many problems tiny_gsm(_bpb) and tiny_gsm_val(_bpb) score."""
    test, validation = cfg.tiny.test_examples, cfg.tiny.validation_examples
    return {"tiny_gsm": test, "tiny_gsm_bpb": test, "tiny_gsm_val": validation, "tiny_gsm_val_bpb": validation}


def base_settings(cfg: Any) -> dict:
    """What the built base model depends on (part of the base fingerprint): what its cache folder is keyed by
    (`data.tiny_key`)."""
    return data.tiny_key(_settings(cfg), cfg.model, cfg.seed)


def build_base_model(cfg: Any) -> Path:
    """Build (once, collectively on every rank) and return the tiny base checkpoint."""
    from pipeline.tiny.model import ensure_base_model

    return ensure_base_model(cache_dir(cfg), cfg.tiny, cfg.model, cfg.seed)


def architecture(cfg: Any) -> tuple[Path, dict]:
    """Where the base checkpoint is or will be, and its shape from the settings (an upper bound on the
    vocabulary: the tokenizer may learn fewer tokens). Builds nothing."""
    t = cfg.tiny
    path = data.tiny_dir(cache_dir(cfg), _settings(cfg), cfg.model, cfg.seed) / "model"
    return path, {"vocab_size": t.vocab_size, "hidden_size": t.hidden_size, "num_hidden_layers": t.num_layers,
                  "intermediate_size": t.intermediate_size, "num_attention_heads": t.num_heads,
                  "tie_word_embeddings": True}


def heldout_problems(cfg: Any) -> list[dict]:
    """The test split's {question, answer} problems: what RL stages report their greedy reward on."""
    path = data.split_file(cfg, "test")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
