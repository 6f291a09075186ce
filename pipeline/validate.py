"""What the schema's types cannot check of a loaded config: stage names and kinds, the TRL fields a section passes
through, declared choices, numeric ranges, sweeps, eval limits, trackers, the Hub repository, and each enabled stage's
own checks (`StageKind.check`). Every error is a one-line `ConfigError`, raised before any model loads."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from pipeline.data import sources
from pipeline.errors import ConfigError
from pipeline.grid import grid
from pipeline.settings import RUN_OWNED, StageKind, declared, enabled_stages, is_section, kind_of, kinds, stage_names
from pipeline.suggest import apply, did_you_mean, show

log = logging.getLogger("pipeline")


def validate(cfg: DictConfig) -> None:
    """Check what the schema types cannot: stage names and kinds, TRL's fields, choices, numeric ranges, sweeps, and
    each enabled stage's own checks (`StageKind.check`)."""
    stages = stage_names(cfg)
    if not cfg.stages:
        raise ConfigError("'stages' is empty: list at least one of " + ", ".join(stages))
    if cfg.run_name in (".", "..") or Path(cfg.run_name).name != cfg.run_name or "\\" in cfg.run_name:
        raise ConfigError(f"'run_name' is '{cfg.run_name}': name one folder inside output_root (no '/', not '.' or "
                          "'..'); output_root says where")
    for key in ("collective_timeout_s", "prep_timeout_s"):
        if cfg[key] <= 0:
            raise ConfigError(f"'{key}' must be > 0 seconds, got {cfg[key]}")
    if not 0 <= cfg.seed < 2**32:
        raise ConfigError(f"'seed' must be in [0, 2**32) (what numpy and torch seed with), got {cfg.seed}")
    for name in list(cfg.stages) + list(cfg.redo):
        if name not in stages:
            raise ConfigError(f"unknown stage '{name}'{did_you_mean(name, stages)} (available: {', '.join(stages)}; "
                              f"or a section of your own naming its kind: {name}: {{kind: sft, ...}})")
    if len(set(cfg.stages)) != len(cfg.stages):
        raise ConfigError(f"'stages' lists a stage twice: {list(cfg.stages)}")
    for name in stages:
        kind = kinds().get(cfg[name].kind)
        if kind is None or kind.settings is not OmegaConf.get_type(cfg[name]) or name in kinds() and kind.name != name:
            raise ConfigError(f"'{name}.kind' is '{cfg[name].kind}': a section's kind is fixed ({name}: "
                              f"{OmegaConf.get_type(cfg[name]).__name__}); name a new section for another kind")
        _check_passed(cfg, name, kind)
    for name in [n for n in cfg if is_section(cfg[n])]:
        _check_choices(cfg[name], name)
    for name in stages:
        gate = cfg[name].gate
        if gate.metric and gate.test == "non_inferior" and gate.max_drop is None:
            raise ConfigError(f"'{name}.gate.test' is {gate.test}: set '{name}.gate.max_drop' (the allowed drop)")
        if cfg[name].candidate is not None and (name not in cfg.stages or not cfg[name].enabled):
            raise ConfigError(f"'{name}.candidate' trains one candidate of the {name} stage: list {name} in 'stages'")
    for name in enabled_stages(cfg):
        stage, kind = cfg[name], kind_of(cfg, name)
        sources.check(stage, name)
        if not kind.mixtures(stage):
            raise ConfigError(f"'{name}' has no data: set '{name}.data' (a Hub dataset or a local file, "
                              f"docs/training.md) or '{name}.mixture' (data_mixtures/*.yaml)")
        for key in ("learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "max_length",
                    "save_steps"):
            if stage[key] <= 0:
                raise ConfigError(f"'{name}.{key}' must be > 0, got {stage[key]}")
        if stage.max_steps <= 0 and stage.num_train_epochs <= 0:
            raise ConfigError(f"'{name}': set max_steps > 0 or num_train_epochs > 0")
        if not 0 <= stage.warmup_ratio < 1:
            raise ConfigError(f"'{name}.warmup_ratio' is a fraction of the training steps: 0 <= it < 1, got "
                              f"{stage.warmup_ratio}")
        if stage.lora.r < 0:
            raise ConfigError(f"'{name}.lora.r' must be >= 0")
        kind.check(cfg, name)
        _validate_sweep(cfg, name)
    evals = ("eval", "base_eval", *(f"{k}.eval" for k in stages))
    tasks = {t for section in evals for t in OmegaConf.select(cfg, section).tasks or []}
    for section in evals:
        _validate_limit(section, OmegaConf.select(cfg, section).limit, tasks)
    _validate_trackers(list(cfg.report_to))
    _validate_repo(cfg.push_to_hub)


def _check_choices(section: DictConfig, key: str) -> None:
    """Every field of `section` (dotted `key`) and of its sub-sections that declares its `choices` holds one of them
    (or null)."""
    for f in fields(OmegaConf.get_type(section)):
        value = section[f.name]
        if is_section(value):
            _check_choices(value, f"{key}.{f.name}")
        elif f.metadata.get("choices") and value is not None and value not in f.metadata["choices"]:
            raise ConfigError(f"'{key}.{f.name}' is '{value}'; choose one of {', '.join(f.metadata['choices'])}")


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


def _words(hint: Any) -> str:
    """A field type made of bool / int / float / str / None / Literal in words (`_fits`' types), for messages."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_words(arm) for arm in typing.get_args(hint))
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "text", type(None): "null"}
    return names.get(hint, "of the field's type")


def _check_passed(cfg: DictConfig, name: str, kind: StageKind) -> None:
    """The keys of section `name` its settings do not declare must be fields of the TRL config its kind builds
    (imported only when there are such keys), with values of the field's type."""
    passed = {k: v for k, v in cfg[name].items() if k not in declared(cfg[name])}
    if not passed:
        return
    cls = kind.config_class()
    known = {f.name for f in dataclasses.fields(cls) if f.init} if cls else set()
    hints = typing.get_type_hints(cls) if cls else {}
    for key, value in passed.items():
        if key not in known:
            what = f"nor TRL's {cls.__name__}" if cls else f"(kind {kind.name} runs its own loop, not a TRL config)"
            hint = did_you_mean(str(key), declared(cfg[name]), f"{name}.") or did_you_mean(str(key), known, f"{name}.")
            raise ConfigError(f"unknown config key '{name}.{key}': neither the stage's settings {what} have it{hint}")
        plain = OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value
        if not _fits(plain, hints[key]):
            raise ConfigError(f"bad value for '{name}.{key}': {plain!r} is not {_words(hints[key])}")
        if key in RUN_OWNED and name in cfg.stages:
            log.warning("'%s.%s' is ignored: %s", name, key, RUN_OWNED[key])


def _validate_sweep(cfg: DictConfig, name: str) -> None:
    """A stage's sweep names its settings with non-empty value lists; soup and merge need a grid and a metric."""
    stage = cfg[name]
    for key, values in [(k, v) for k, v in stage.sweep.items() if v is not None]:
        if key in ("kind", "sweep", "candidate", "soup", "merge", "eval", "gate", "mixture", "data", "data_columns",
                   "enabled") or (
                key not in stage):
            raise ConfigError(f"'{name}.sweep.{key}': sweep a training setting of {name} that it sets"
                              f"{did_you_mean(str(key), declared(stage), f'{name}.sweep.')}")
        if not isinstance(values, ListConfig) or not values:
            what = "an empty grid" if isinstance(values, ListConfig) else "not a list"
            raise ConfigError(f"'{name}.sweep.{key}' is {show(values)}, {what}: list the values to sweep, e.g. "
                              f"[1e-5, 3e-5], or null to keep {name}.{key}")
        for value in values:
            apply(OmegaConf.merge(stage), key, value, f"{name}.sweep.{key}")  # the setting's own type check
    size = len(grid(stage))
    if (size > 1 or stage.soup.top_k or stage.merge.stage) and not stage.gate.metric:
        extra = " plus soup / merge" if stage.soup.top_k or stage.merge.stage else ""
        raise ConfigError(f"the {name} stage picks its model among {size} sweep candidate(s){extra} by "
                          f"'{name}.gate.metric'; set it (a metric of the stage's eval)")
    if stage.candidate is not None and not 0 <= stage.candidate < size:
        raise ConfigError(f"'{name}.candidate' is {stage.candidate}; the sweep has {size} candidate(s), numbered 0 "
                          f"to {size - 1}")
    if stage.soup.top_k < 0 or stage.soup.top_k == 1:
        raise ConfigError(f"'{name}.soup.top_k' must be 0 (no soup) or >= 2, got {stage.soup.top_k}")
    if stage.merge.stage:
        order = list(cfg.stages)
        if stage.merge.stage not in order[: order.index(name)]:
            raise ConfigError(f"'{name}.merge.stage' is '{stage.merge.stage}': it must name a stage before {name} in "
                              f"{order}")
        if not 0 < stage.merge.weight < 1:
            raise ConfigError(f"'{name}.merge.weight' must be between 0 and 1, got {stage.merge.weight}")


def _validate_limit(section: str, limit: Any, tasks: set[str]) -> None:
    """`<section>.limit`: null, a number >= 0, or a mapping of task names (of some eval's `tasks`) to numbers >= 0:
    a mistyped task would otherwise be scored in full."""
    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if limit is None or count(limit):
        return
    if not (isinstance(limit, DictConfig) and all(count(v) for v in limit.values())):
        raise ConfigError(f"'{section}.limit' is {show(limit)}: give a number of problems >= 0 for every task (0: "
                          "all), or a mapping task -> number, e.g. {gsm8k_local_val: 200}")
    for task in limit:
        if task not in tasks:
            raise ConfigError(f"'{section}.limit' names task '{task}', which no eval scores (tasks: "
                              f"{', '.join(sorted(tasks))}){did_you_mean(str(task), tasks)}")


def _validate_repo(repo: str) -> None:
    """`push_to_hub` names a Hub model repository, ORG/NAME, by huggingface_hub's rules (imported only then)."""
    if not repo:
        return
    if repo in ("True", "False"):
        raise ConfigError(f"push_to_hub takes the Hub repository to push to, not {repo.lower()}: push_to_hub=ORG/NAME "
                          "(e.g. push_to_hub=me/my-model); hub_model_id is gone")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as err:
        raise ConfigError(f"push_to_hub is '{repo}', not a Hub repository id: {str(err).splitlines()[0]}") from None
    if "/" not in repo:
        raise ConfigError(f"push_to_hub is '{repo}': name its owner too, ORG/NAME (e.g. push_to_hub=me/{repo})")


# `report_to` trackers transformers supports -> the modules each needs ("a|b": either) and the pip package of each
TRACKERS: dict[str, tuple[tuple[str, str], ...]] = {
    "tensorboard": (("tensorboard|tensorboardX", "tensorboard"),), "wandb": (("wandb", "wandb"),),
    "trackio": (("trackio", "trackio"),), "mlflow": (("mlflow", "mlflow"),), "comet_ml": (("comet_ml", "comet-ml"),),
    "neptune": (("neptune", "neptune"),), "clearml": (("clearml", "clearml"),),
    "codecarbon": (("codecarbon", "codecarbon"),), "dvclive": (("dvclive", "dvclive"),),
    "swanlab": (("swanlab", "swanlab"),), "azure_ml": (("azureml", "azureml-core"),),
    "dagshub": (("dagshub", "dagshub"), ("mlflow", "mlflow")), "flyte": (("flytekit", "flytekit"),), "kubeflow": (),
}


def _installed(modules: str) -> bool:
    """Whether one of the modules `a|b` can be imported (found on the path; nothing is imported)."""
    return any(importlib.util.find_spec(module) is not None for module in modules.split("|"))


def _validate_trackers(names: list[str]) -> None:
    """Refuse a `report_to` tracker transformers does not know, or one whose package is not installed: the run
    would otherwise fail when its first trainer is built."""
    for name in names:
        if name in ("all", "none"):
            continue
        if name not in TRACKERS:
            raise ConfigError(f"unknown tracker '{name}' in report_to{did_you_mean(name, TRACKERS)} (available: "
                              f"{', '.join(TRACKERS)}, all, none)")
        for modules, package in TRACKERS[name]:
            if not _installed(modules):
                raise ConfigError(f"report_to lists {name}, but the {package} package is not installed: "
                                  f"pip install {package}")
