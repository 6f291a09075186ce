"""Config schemas for a run and its stages; recipe loading, dotted overrides and validation.

A recipe (`pipeline/recipes/NAME.yaml`, or any recipe file; it may start from another: pipeline/recipe_files.py) is a
small delta over the defaults below. Overrides are dotted `key=value` arguments applied after the recipe. OmegaConf
struct mode refuses unknown keys; every error here is a `ConfigError` with a one-line message naming the key, raised
before any model loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import itertools
import logging
import types
import typing
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from pipeline import extension as extensions
from pipeline import recipe_files, redact
from pipeline.data import sources
from pipeline.errors import ConfigError
from pipeline.recipe_files import RECIPES_DIR, available_recipes, yaml_problem  # noqa: F401 - found here too
from pipeline.settings import RUN_OWNED, EvalConfig, StageKind, StageSettings, arg, declared
from pipeline.stages import kinds

log = logging.getLogger("pipeline")
MIXTURES_DIR = RECIPES_DIR.with_name("data_mixtures")
DEFAULT_RECIPE = "tiny"  # the embedded demo: runs anywhere in minutes


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


def _eval_defaults() -> EvalConfig:
    return EvalConfig(tasks=[], num_fewshot=-1, limit=0, max_gen_toks=256, batch_size=16, apply_chat_template=True,
                      include_path="", gsm8k_dir="", backend="hf")


@dataclass
class ModelConfig:
    name_or_path: str = arg("Hub id, local checkpoint, or the section name of the recipe extension that builds it",
                            "HuggingFaceTB/SmolLM3-3B-Base")
    revision: str = arg("a Hub model's branch, tag or commit; 40 hex digits pin it (a branch moves, and stages keyed "
                        "on it do not see the move)", "main", added=True)
    tokenizer: str = arg("defaults to name_or_path", "")
    chat_template: str = arg("path to a Jinja template; empty keeps the tokenizer's", "")
    precision: str = arg("auto (bf16 on GPUs that have it, else fp32) | bf16 (also CPU autocast) | fp16 (CUDA, dynamic "
                         "loss scaling) | fp32; autocast over fp32 master weights (see load_dtype)", "auto")
    attn_implementation: str = arg("attention kernel (sdpa, eager, flash_attention_2, ...)", "sdpa")
    trust_remote_code: bool = arg("allow model code from the Hub", False)
    load_dtype: str = arg("dtype the weights load in: auto (fp32 master weights with bf16/fp16 autocast; the training "
                          "dtype under DeepSpeed, which keeps FP32 masters) | fp32 | bf16 (pure bf16 weights and "
                          "optimizer states: half the memory, less precise)", "auto", added=True)


@dataclass
class PlanConfig:
    """`plan=true`: print what the run would do, with token and GPU-hour estimates, then exit (chain/plan.py)."""

    enabled: bool = arg("print the plan instead of running (`plan=true` is short for plan.enabled=true)", False)
    gpu: str = arg("a device of the peak-FLOPs table in pipeline/train/flops.py", "H100")
    num_gpus: int = arg("GPUs the estimate assumes", 8)
    mfu: float = arg("assumed model FLOPs utilisation", 0.35)
    params: float = arg("model parameters; 0: from the model's config (local config.json, known models, a built "
                           "model's settings)", 0)
    output: str = arg("table | json", "table")


@dataclass
class RunConfig:
    recipe: str = arg("the recipe the run starts from: a shipped one's NAME (pipeline/recipes/NAME.yaml) or a recipe "
                      "file's path", DEFAULT_RECIPE)
    extension: str = arg("a Python module that adds a config section, data generators, eval tasks and a built base "
                         "model to the run (pipeline/extension.py), e.g. the embedded demo's", "")
    run_name: str = arg("defaults to the recipe's name (a recipe file's: its stem)", "")
    output_root: str = arg("folder that holds the run folders", "runs")
    cache_dir: str = arg("tokenised data and extensions' data and models; defaults to <output_root>/.cache", "")
    stages: list[str] = arg("the stage chain, in order: sections of stage kinds (each kind has a section of its name; "
                            "any other section names its kind, e.g. `sft_long: {kind: sft, ...}`)",
                            factory=lambda: ["sft", "midtrain"])
    redo: list[str] = arg("retrain these finished stages (and every stage after them)", factory=list)
    seed: int = arg("training seed", 42)
    deterministic: bool = arg("debugging: deterministic kernels and full seeding (slower)", False)
    model: ModelConfig = arg("the base model", factory=ModelConfig)
    eval: EvalConfig = arg("lm-eval defaults for every checkpoint", factory=_eval_defaults)
    base_eval: EvalConfig = arg("lm-eval settings of the base model over `eval` (null: inherit)",
                                factory=lambda: EvalConfig(apply_chat_template=False))
    plan: PlanConfig = arg("the dry run", factory=PlanConfig)
    hub_mirror: str = arg("a folder of local Hub dataset copies, <owner>/<repo>/...: `hub:` sources read from it", "")
    report_to: list[str] = arg("trackers transformers supports: tensorboard, wandb, trackio, ...", factory=list)
    push_to_hub: str = arg("a Hub model repository, ORG/NAME: a run that passes pushes its final model to the main "
                           "branch and each stage's model to a branch named after the stage (01-sft, ...); needs a "
                           "Hub login (docs/publishing.md)", "")
    push_candidates: bool = arg("push_to_hub: also push each sweep candidate's model, to branch <NN-stage>-<id>", False)
    push_again: bool = arg("push_to_hub: push again what this run folder already pushed there unchanged", False)
    strict_gates: bool = arg("a gate that cannot see what it judges, measured once it has judged (max_drop below the "
                             "smallest change it detects, or a drop test at the metric's floor, a gain test at its "
                             "ceiling; pipeline/evaluation/power.py) stops the run with exit 2 instead of a warning",
                             False)
    collective_timeout_s: int = arg("timeout of every collective (process-group waits, all-reduces) in seconds; 5 h as "
                                    "in SmolLM3's configs. Data preparation is not under it: the other ranks wait "
                                    "for the cache folder on disk", 18000)
    prep_timeout_s: int = arg("how long the other ranks wait for the main process to prepare a cache folder (tokenised "
                              "data) on disk, in seconds; past it they stop with exit 2 naming the folder", 86400)


CHOICES = {
    "format": ("chat", "text"),
    "packing_strategy": ("bfd", "bfd_split", "wrapped"),
    "train_sampling_strategy": ("random", "group_by_length", "batch_rebalance"),
    "precision": ("auto", "bf16", "fp16", "fp32"),
    "matmul_precision": ("highest", "high", "medium"),
    "load_dtype": ("auto", "fp32", "bf16"),
    "action": ("stop", "warn"),
    "test": ("no_significant_drop", "non_inferior", "superior"),
    "backend": ("hf", "vllm"),
    "kl_estimator": ("k1", "k3"),
    "value_init": ("policy", "reward_model"),
}


def _kind(hint: Any) -> str:
    """A field's type in words (`help=true`), not as a Python type."""
    text = str(hint)
    for word, kind in (("list", "list"), ("dict", "mapping"), ("bool", "true/false"), ("int", "integer"),
                       ("float", "number"), ("str", "text")):
        if word in text:
            return kind
    return "any value"


def _show(value: Any) -> str:
    """A config value as an override writes it: true, null, 0.002, [a, b], ''."""
    if isinstance(value, DictConfig | ListConfig):
        value = OmegaConf.to_container(value)
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return value if isinstance(value, str) and value else repr(value)


def _is_section(value: Any) -> bool:
    return isinstance(value, DictConfig) and is_dataclass(OmegaConf.get_type(value))


def _source_of(sources: dict[str, str], key: str) -> str:
    """Where the value of dotted `key` (or of keys under it) came from, as `load_with_sources` records it; empty
    for a default."""
    return ", ".join(dict.fromkeys(s for k, s in sources.items() if k == key or k.startswith(f"{key}.")))


def _leaf(key: str, value: Any, field_: Any, sources: dict[str, str]) -> str:
    resumable = " [a resume may change it]" if field_.metadata.get("resumable") else ""
    origin = f" [{source}]" if (source := _source_of(sources, key)) else ""
    return f"  {key}={_show(value)}  ({_kind(field_.type)}) {field_.metadata.get('help', '')}{resumable}{origin}"


def _section(node: DictConfig, key: str, text: str, sources: dict[str, str]) -> list[str]:
    """A config section's lines: its values, then its subsections; one line when every value is null."""
    values = OmegaConf.to_container(node)
    if all(v is None for v in values.values()):
        return [f"  {key}.*=null  {text}; keys: {', '.join(values)}"]
    schema_fields = {f.name: f for f in fields(OmegaConf.get_type(node))}
    lines = [f"\n{key}: {text}"]
    lines += [_leaf(f"{key}.{n}", node[n], f, sources) for n, f in schema_fields.items() if not _is_section(node[n])]
    for name in [n for n in schema_fields if _is_section(node[n])]:
        lines += _section(node[name], f"{key}.{name}", schema_fields[name].metadata.get("help", ""), sources)
    return lines


def stage_names(cfg: DictConfig) -> list[str]:
    """The config's stage sections (one per registered kind, and every named stage), in config order."""
    return [n for n in cfg if isinstance(cfg[n], DictConfig) and issubclass(OmegaConf.get_type(cfg[n]) or dict,
                                                                              StageSettings)]


def kind_of(cfg: DictConfig, name: str) -> StageKind:
    """The stage kind that trains section `name`."""
    return kinds()[cfg[name].kind]


def describe(cfg: DictConfig, sources: dict[str, str] | None = None) -> str:
    """Every key of the loaded config `cfg` (dotted, as overrides name it) with its value, type and help text, and
    where its value came from (`sources`, as `load_with_sources` records them); of the stage sections, only those
    of the stages `cfg` runs, in its order."""
    runs, stages, sources = [n for n in cfg.stages if cfg[n].enabled], stage_names(cfg), sources or {}
    others = [n for n in stages if n not in runs]
    top = RunConfig.__dataclass_fields__
    hidden = f" (the keys of {', '.join(others)} appear when stages=[...] runs them)" if others else ""
    lines = [f"recipe {cfg.recipe}: stages {', '.join(runs)}{hidden}"]
    if sources:
        lines.append(f"a value set over its default is marked with where it came from: "
                     f"{', '.join(f'[{s}]' for s in dict.fromkeys(sources.values()))}")
    lines += [_leaf(n, cfg[n], f, sources) for n, f in top.items() if not _is_section(cfg[n])]
    for name in [n for n in top if _is_section(cfg[n])]:
        lines += _section(cfg[name], name, top[name].metadata["help"], sources)
    for name in runs:
        kind = kind_of(cfg, name)
        text = kind.help if name == kind.name else f"a stage of kind {kind.name} ({kind.help})"
        lines += _section(cfg[name], name, text, sources)
        if kind.trl_config:
            lines.append(f"  {name}.<field>: any other field of TRL's {kind.trl_config.partition(':')[2]} passes to "
                         "it under its own name")
    for name in [n for n in cfg if n not in top and n not in stages]:
        lines += _section(cfg[name], name, f"settings of the recipe extension {cfg.extension}", sources)
    return "\n".join(lines)


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice a mistyped `word` most likely means: one whose initials it is (lr: learning_rate), then one that
    contains it (epochs: num_train_epochs), then the closest spelling; None when none is close."""
    choices = list(choices)
    for match in (lambda c: len(word) > 1 and word == "".join(part[:1] for part in c.split("_")),
                  lambda c: len(word) > 3 and word in c):
        found = [c for c in choices if match(c)]
        if found:
            return min(found, key=len)
    close = difflib.get_close_matches(word, choices, n=1)
    return close[0] if close else None


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """"; did you mean 'X'?" for the choice closest to a mistyped `word` (named `prefix` + choice); empty when none
    is close."""
    match = closest(word, choices)
    return f"; did you mean '{prefix}{match}'?" if match else ""


def _keys(node: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a config node, sections included."""
    if not isinstance(node, DictConfig):
        return []
    return [k for key in node for k in (f"{prefix}{key}", *_keys(node[key], f"{prefix}{key}."))]


def _suggest(cfg: DictConfig, full_key: str) -> str:
    """The full dotted key a mistyped `full_key` most likely means: one of the same section first, then any key
    with that last part, then any key; else the section's keys."""
    parent_key, _, leaf = full_key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    keys = [str(k) for k in parent] if isinstance(parent, DictConfig) else []
    if hint := did_you_mean(leaf, keys, f"{parent_key}." if parent_key else ""):
        return hint
    everywhere = _keys(cfg)
    by_leaf = {k: k.rpartition(".")[2] for k in everywhere}
    if match := closest(leaf, set(by_leaf.values())):
        return f"; did you mean '{next(k for k, v in by_leaf.items() if v == match)}'?"
    if hint := did_you_mean(full_key, everywhere):
        return hint
    where = f" of '{parent_key}'" if parent_key else ""
    return f"; valid keys{where}: {', '.join(keys)}" if keys else "; help=true lists every key"


# OmegaConf's messages about a value of the wrong type (they name its classes) -> what the key takes, in words
EXPECTED = (("to Float", "a number"), ("to Integer", "a whole number"), ("valid bool", "true or false"),
            ("ListConfig", "a list, e.g. [a,b]"), ("to Dict", "a mapping, e.g. {a: 1}"))


def explain_error(cfg: DictConfig, err: OmegaConfBaseException, where: str) -> ConfigError:
    """A one-line error for OmegaConf's `err` on key `err.full_key`: an unknown key with a suggestion, or a bad
    value with what the key takes."""
    key = err.full_key or "?"
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
        return ConfigError(f"unknown config key '{key}' in {where}{_suggest(cfg, key)}")
    msg = str(err).splitlines()[0]
    if "is not a subclass of" in msg:
        return ConfigError(f"'{key}' in {where} is a section, not a value: set its keys ({key}.KEY=value)")
    expected = next((words for marker, words in EXPECTED if marker in msg), None)
    if expected is not None:
        msg = f"'{_show(err.value)}' is not {expected}"
    return ConfigError(f"bad value for '{key}' in {where}: {msg}")


def _apply(cfg: DictConfig, key: str, value: Any, where: str) -> None:
    try:
        OmegaConf.update(cfg, key, value, merge=True)
    except OmegaConfBaseException as err:
        if not err.full_key:
            err.full_key = key
        raise explain_error(cfg, err, where) from None


def _flatten(node: Any, cfg: DictConfig, prefix: str = "") -> list[tuple[str, Any]]:
    """A recipe's values as (dotted key, value), down to the keys of `cfg`'s sections and mappings: a mapping given to
    a field that is not one (e.g. `eval.limit: {task: n}`) stays whole."""
    if isinstance(node, dict) and node and (not prefix or isinstance(OmegaConf.select(cfg, prefix[:-1]), DictConfig)):
        return [kv for k, v in node.items() for kv in _flatten(v, cfg, f"{prefix}{k}.")]
    return [(prefix[:-1], node)]


def _stage_section(kind: StageKind, name: str) -> DictConfig:
    """A stage section of `kind` named `name`, at the kind's defaults: its declared keys are checked by type, its
    sub-sections refuse unknown keys, and other keys (TRL's fields) are let in for `_check_passed` to judge."""
    section = OmegaConf.structured(kind.settings(**{**kind.defaults, "kind": kind.name}))
    OmegaConf.set_struct(section, False)
    for key in declared(section):
        if _is_section(section[key]):  # not a mapping (sweep, data_columns): its keys are the user's
            OmegaConf.set_struct(section[key], True)
    return section


def schema(extension: str = "", named: dict[str, str] | None = None) -> DictConfig:
    """The run config's schema and defaults (struct mode: unknown keys refused): a section per stage kind, one per
    named stage (`named`: name -> kind), and the config section of the recipe extension named
    (pipeline/extension.py), if any."""
    cfg = OmegaConf.structured(RunConfig)
    module = extensions.load(extension) if extension else None
    with open_dict(cfg):
        for kind in kinds().values():
            cfg[kind.name] = _stage_section(kind, kind.name)
        for name, kind in (named or {}).items():
            if kind not in kinds():
                raise ConfigError(f"'{name}.kind' is '{kind}': not a stage kind{did_you_mean(str(kind), kinds())} "
                                  f"(available: {', '.join(kinds())})")
            cfg[name] = _stage_section(kinds()[kind], name)
        if module is not None and hasattr(module, "SECTION"):
            cfg[module.SECTION] = OmegaConf.structured(module.Settings)
    OmegaConf.set_struct(cfg, True)
    for name in stage_names(cfg):  # struct mode reaches the sections from the root: open them again
        OmegaConf.set_struct(cfg[name], False)
        for key in [k for k in declared(cfg[name]) if isinstance(cfg[name][k], DictConfig)]:
            OmegaConf.set_struct(cfg[name][key], _is_section(cfg[name][key]))
    return cfg


def _named_stages(recipes: list[dict], overrides: list[list[str]]) -> dict[str, str]:
    """The stage sections the recipe files (`recipes`, each a mapping, bases first) and the command line
    (`NAME.kind=KIND`) add, by name -> kind."""
    named = {k: v["kind"] for delta in recipes for k, v in delta.items()
             if isinstance(v, dict) and "kind" in v and k not in kinds()}
    named.update({k.partition(".")[0]: v for k, v in overrides if k.endswith(".kind") and k.count(".") == 1
                  and k.partition(".")[0] not in kinds()})
    return named


def _set(cfg: DictConfig, sources: dict[str, str], key: str, value: Any, source: str) -> None:
    """Apply one value (a ConfigError naming `source` if it does not fit) and record where it came from, last."""
    _apply(cfg, key, value, source)
    replaced = [k for k in sources if k == key or (not isinstance(value, dict) and k.startswith(f"{key}."))]
    for k in replaced:
        del sources[k]
    sources[key] = source


def load_with_sources(argv: list[str]) -> tuple[DictConfig, dict[str, str]]:
    """Resolve `recipe=NAME|FILE key=value ...` into a validated, read-only run config, and where each value set
    over the defaults came from: dotted key -> `base recipe FILE`, `recipe FILE` or `command line`, in the order
    they were set. The sources stay out of the config (fingerprints hash what a value is, not where it came from)."""
    overrides = []
    for item in argv:
        if "=" not in item:
            raise ConfigError(f"argument '{item}' is not key=value (e.g. recipe=NAME sft.learning_rate=1e-4)")
        overrides.append(item.split("=", 1))
    recipe = next((v for k, v in reversed(overrides) if k == "recipe"), DEFAULT_RECIPE)  # the last one wins
    files = recipe_files.chain(recipe)
    named = _named_stages([f.values for f in files], overrides)
    extension = next((v for k, v in reversed(overrides) if k == "extension"),
                     next((f.values["extension"] for f in reversed(files) if "extension" in f.values), ""))
    cfg, sources = schema(str(extension or ""), named), {}
    stages = stage_names(cfg)
    for file in files:
        for key, value in _flatten(file.values, cfg):
            _set(cfg, sources, key, recipe_files.rebase(key, value, file.path.parent, stages), file.source)
    cfg.recipe = recipe
    for key, raw in overrides:
        try:
            value = OmegaConf.to_container(OmegaConf.from_dotlist([f"x={raw}"]))["x"] if raw else ""
        except Exception as err:  # noqa: BLE001 - YAML parser errors come in many types
            raise ConfigError(f"argument '{key}={raw}' in command line: its value does not parse ("
                              f"{yaml_problem(err, where=False)}); close its brackets or quote it") from None
        key = "plan.enabled" if key == "plan" and isinstance(value, bool) else key  # `plan=true` shorthand
        _set(cfg, sources, key, value, "command line")
    if not cfg.run_name:
        cfg.run_name = recipe_files.run_name(recipe)
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg, sources


def load_config(argv: list[str]) -> DictConfig:
    """Resolve `recipe=NAME|FILE key=value ...` into a validated, read-only run config."""
    return load_with_sources(argv)[0]


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
    extension = [s for s in cfg if s not in RunConfig.__dataclass_fields__ and s not in stages]
    subsections = [f"{n}.{k}" for n in stages for k in declared(cfg[n]) if _is_section(cfg[n][k])]
    for key, allowed in CHOICES.items():
        for section in ("model", "eval", "base_eval", *extension, *stages, *subsections):
            value = OmegaConf.select(cfg, section).get(key)  # absent keys (not in this schema) give None
            if value is not None and value not in allowed:
                raise ConfigError(f"'{section}.{key}' is '{value}'; choose one of {', '.join(allowed)}")
    for name in stages:
        gate = cfg[name].gate
        if gate.metric and gate.test == "non_inferior" and gate.max_drop is None:
            raise ConfigError(f"'{name}.gate.test' is {gate.test}: set '{name}.gate.max_drop' (the allowed drop)")
        if cfg[name].candidate is not None and (name not in cfg.stages or not cfg[name].enabled):
            raise ConfigError(f"'{name}.candidate' trains one candidate of the {name} stage: list {name} in 'stages'")
    for name in [n for n in cfg.stages if cfg[n].enabled]:
        stage, kind = cfg[name], kind_of(cfg, name)
        sources.check(stage, name)
        if not kind.mixtures(stage):
            raise ConfigError(f"'{name}' has no data: set '{name}.data' (a Hub dataset or a local file, "
                              f"docs/training.md) or '{name}.mixture' (pipeline/data_mixtures/*.yaml)")
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
            raise ConfigError(f"'{name}.sweep.{key}' is {_show(values)}, {what}: list the values to sweep, e.g. "
                              f"[1e-5, 3e-5], or null to keep {name}.{key}")
        for value in values:
            _apply(OmegaConf.merge(stage), key, value, f"{name}.sweep.{key}")  # the setting's own type check
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
        raise ConfigError(f"'{section}.limit' is {_show(limit)}: give a number of problems >= 0 for every task (0: "
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


SHORT = {"learning_rate": "lr"}  # a swept setting's name in candidate ids


def swept_value(value: Any) -> str:
    """A swept setting's value as candidate ids and sweep charts write it: numbers in `g` format (3e-06)."""
    return f"{value:g}" if isinstance(value, float | int) and not isinstance(value, bool) else str(value)


def swept(stage: Any) -> list[str]:
    """The settings a stage sweeps, in name order (a null in its `sweep` mapping: not swept)."""
    return sorted(k for k, v in stage.sweep.items() if v is not None)


def sweeps(stage: Any) -> bool:
    """Whether the stage trains its model through a sweep: a grid, a soup or a merge."""
    return bool(swept(stage)) or bool(stage.soup.top_k) or bool(stage.merge.stage)


def grid(stage: Any) -> list[dict]:
    """A stage's sweep candidates: every combination of its swept settings (settings in name order, values
    ascending), each with its id (e.g. `beta0.5-lr3e-06`); one candidate of the stage's own values unswept."""
    keys = swept(stage)
    values = [sorted(stage.sweep[k]) for k in keys]
    if not keys:
        return [{"id": "single"}]
    return [{"id": "-".join(f"{SHORT.get(k, k)}{swept_value(v)}" for k, v in zip(keys, combo, strict=True)),
             **dict(zip(keys, combo, strict=True))} for combo in itertools.product(*values)]


def swept_candidate(cfg: DictConfig) -> tuple[str, int] | None:
    """The stage and grid index of the one sweep candidate this run trains (`<stage>.candidate`), if any."""
    return next(((n, cfg[n].candidate) for n in cfg.stages if cfg[n].candidate is not None), None)


def cache_dir(cfg: DictConfig) -> Path:
    """Where tokenised data and extensions' data and models are cached for this config."""
    return Path(cfg.cache_dir or Path(cfg.output_root) / ".cache")


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
