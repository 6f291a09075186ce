"""What a stage's fingerprint hashes of its config section (pipeline/chain/resume.py): the section without the fields
that change how it runs rather than what it trains, without newer fields left at their defaults, secrets redacted."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import MISSING, fields, is_dataclass

from omegaconf import DictConfig, OmegaConf

from pipeline import redact


def fingerprint_view(values: dict, schema: type) -> dict:
    """A config section as fingerprints hash it: `values` without the `added` fields of `schema` (a config
    dataclass) that still hold their defaults, in nested sections too."""
    types, out = typing.get_type_hints(schema), dict(values)
    for f in fields(schema):
        if f.name not in out:
            continue
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        default = dataclasses.asdict(default) if is_dataclass(default) else default
        if f.metadata.get("added") and out[f.name] == default:
            del out[f.name]
        elif is_dataclass(types[f.name]) and isinstance(out[f.name], dict):
            out[f.name] = fingerprint_view(out[f.name], types[f.name])
    return out


# TRL fields a stage passes through that change how it runs, not what it trains (as `resumable` fields)
RESUMABLE_TRL_KEYS = ("logging_", "save_", "eval_", "report_to", "run_name", "push_to_hub", "hub_", "disable_tqdm",
                      "log_level", "log_on_each_node", "dataloader_", "gradient_checkpointing",
                      "torch_empty_cache_steps", "skip_memory_metrics", "include_tokens_per_second", "do_eval",
                      "overwrite_output_dir")
# settings renamed to TRL's names, hashed under their former names: run folders made before still resume
HASHED_AS = {"train_sampling_strategy": "sampling"}


def training_view(section: dict, schema: type) -> dict:
    """What a stage section trains, as its fingerprint hashes it: without its `resumable` fields (logging, saving,
    memory switches), the resumable TRL fields it passes through, and its eval and gate; the batch size per device
    and the gradient accumulation enter as their product (the samples per device and optimizer step)."""
    types, out = typing.get_type_hints(schema), {k: v for k, v in section.items() if k not in ("eval", "gate")}
    if "per_device_train_batch_size" in out and "gradient_accumulation_steps" in out:
        out["samples_per_device_step"] = out["per_device_train_batch_size"] * out["gradient_accumulation_steps"]
    own = {f.name for f in fields(schema)}
    for f in fields(schema):
        if f.name not in out:
            continue
        if f.metadata.get("resumable"):
            del out[f.name]
        elif is_dataclass(types[f.name]) and isinstance(out[f.name], dict):
            out[f.name] = training_view(out[f.name], types[f.name])
    out = {k: v for k, v in out.items() if k in own or k == "samples_per_device_step"
           or not k.startswith(RESUMABLE_TRL_KEYS)}
    return {HASHED_AS.get(k, k): v for k, v in out.items()}


def stage_section(cfg: DictConfig, name: str, overrides: dict | None = None) -> dict:
    """A stage's training config as a plain dict (for fingerprints and stage.json): no eval, no gate, secrets
    redacted (`pipeline.redact`: a token's value is neither written nor fingerprinted); with a sweep candidate's
    `overrides` over it. Its kind is left out where the section is named after it, and so is `candidate` (which
    candidate one job trains does not change the stage)."""
    node = OmegaConf.merge(cfg[name], overrides) if overrides else cfg[name]
    section = fingerprint_view(OmegaConf.to_container(node, resolve=True), OmegaConf.get_type(cfg[name]))
    drop = {"eval", "gate", "candidate", *(["kind"] if section.get("kind") == name else [])}
    return redact.config({k: v for k, v in section.items() if k not in drop})
