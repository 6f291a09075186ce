"""A stage's `trainer` mapping: fields passed straight to the TRL config class the stage builds, checked before
the run starts (`check`): each key must be a field of that class and not one the pipeline's config sets, each
simple value must fit the field's type, and the stage's arguments must build with them.

PPO runs the pipeline's own actor-critic loop (`pipeline.rl.actor_critic`) and builds no TRL config: its
`trainer` mapping must stay empty.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from pipeline.config import ConfigError, did_you_mean
from pipeline.stages import dpo, grpo, reward_model, sft

BUILDERS: dict[str, Callable[[Any, Path, int, str], Any]] = {
    "sft": sft.sft_args, "midtrain": sft.sft_args, "dpo": dpo.dpo_args, "reward": reward_model.reward_args,
    "grpo": grpo.grpo_args}
# TRL fields the pipeline sets from a setting of another name ({stage}: the stage's section); a field named like
# one of the stage's own settings (learning_rate, beta, packing, ...) is that setting's
OWNED = {
    "output_dir": "output_root / run_name", "seed": "seed", "full_determinism": "deterministic",
    "bf16": "model.precision", "fp16": "model.precision", "tf32": "{stage}.matmul_precision",
    "warmup_steps": "{stage}.warmup_ratio", "gradient_checkpointing": "{stage}.activation_checkpointing",
    "train_sampling_strategy": "{stage}.sampling", "max_completion_length": "{stage}.max_new_tokens",
    "report_to": "report_to", "run_name": "run_name", "push_to_hub": "push_to_hub", "hub_model_id": "hub_model_id",
    "ddp_timeout": "collective_timeout_s",
}


def trl_class(name: str) -> type:
    """The TRL config class stage kind `name` builds (the return type of its builder)."""
    return typing.get_type_hints(BUILDERS[name])["return"]


def _owner(key: str, name: str, stage: DictConfig) -> str | None:
    """The pipeline setting that sets TRL field `key` of stage `name`, or None when the pipeline leaves it to TRL."""
    if key in stage and key != "trainer":
        return f"{name}.{key}"
    if key == "lr_scheduler_kwargs" and "min_lr" in stage.lr_scheduler_type:
        return f"{name}.min_lr_rate"
    return OWNED[key].format(stage=name) if key in OWNED else None


def _fits(value: Any, hint: Any) -> bool:
    """Whether `value` fits a field type made of bool / int / float / str / None / Literal; other types (lists,
    dicts, enums) are left to the config class."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, arm) for arm in typing.get_args(hint))
    if typing.get_origin(hint) is typing.Literal:
        return value in typing.get_args(hint)
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    return isinstance(value, hint) if hint in (bool, str, type(None)) else True


def _check_keys(name: str, stage: DictConfig, cls: type) -> None:
    """Refuse keys of `name.trainer` that `cls` lacks, that the pipeline sets, or whose simple value misfits."""
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key, value in OmegaConf.to_container(stage.trainer, resolve=True).items():
        full = f"{name}.trainer.{key}"
        if key not in known:
            raise ConfigError(f"unknown config key '{full}': TRL's {cls.__name__} has no field '{key}'"
                              f"{did_you_mean(str(key), known, f'{name}.trainer.')}")
        if owner := _owner(key, name, stage):
            raise ConfigError(f"'{full}' is set by the pipeline from '{owner}'; set that instead")
        if not _fits(value, hints[key]):
            raise ConfigError(f"bad value for '{full}': {value!r} is not {_words(hints[key])}")


def _words(hint: Any) -> str:
    """A field type made of bool / int / float / str / None / Literal in words (`_fits`' types), for messages."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_words(arm) for arm in typing.get_args(hint))
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "text", type(None): "null"}
    return names.get(hint, "of the field's type")


def check(cfg: DictConfig) -> None:
    """Check every enabled stage's `trainer` mapping, then build its TRL config with it (no model loads), so a
    value the class refuses stops the run here (ConfigError, exit 2)."""
    for name in [n for n in cfg.stages if cfg[n].enabled and cfg[n].trainer]:
        if name not in BUILDERS:
            raise ConfigError(f"'{name}.trainer' is not available: stage {name} runs the pipeline's own loop "
                              f"(pipeline/rl/actor_critic.py), not a TRL trainer; set its {name}.* keys (help=true)")
        cls = trl_class(name)
        _check_keys(name, cfg[name], cls)
        work = Path(tempfile.gettempdir()) / "trl-args-check" / "work"  # outside any run folder: no tracking
        try:
            BUILDERS[name](cfg[name], work, cfg.seed, cfg.model.precision)
        except ConfigError:
            raise
        except (TypeError, ValueError) as err:
            reason = re.sub(r"is not a valid \w+, please select one of", "is not one of", str(err).splitlines()[0])
            raise ConfigError(f"bad value in '{name}.trainer': TRL's {cls.__name__} refuses it: {reason}") from None
        finally:
            unset_hf_deepspeed_config()  # building it under ZeRO-3 would shard every later model load
