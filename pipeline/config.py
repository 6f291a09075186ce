"""The run config: its schema and defaults, and loading a recipe with dotted overrides into a validated, read-only
config.

A recipe (`recipes/NAME.yaml`, or any recipe file; it may start from another: pipeline/recipe_files.py) is a
small delta over the defaults below. Overrides are dotted `key=value` arguments applied after the recipe. OmegaConf
struct mode refuses unknown keys; every error here is a `ConfigError` with a one-line message naming the key, raised
before any model loads (pipeline/validate.py checks what the types cannot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline import extension as extensions
from pipeline import recipe_files
from pipeline.errors import ConfigError
from pipeline.recipe_files import yaml_problem
from pipeline.settings import (
    EvalConfig,
    ModelConfig,
    StageKind,
    arg,
    declared,
    is_section,
    kinds,
    path_keys,
    stage_names,
)
from pipeline.suggest import apply, did_you_mean
from pipeline.validate import validate

DEFAULT_RECIPE = "tiny"  # the embedded demo: runs anywhere in minutes


def _eval_defaults() -> EvalConfig:
    return EvalConfig(tasks=[], num_fewshot=-1, limit=0, max_gen_toks=256, batch_size=16, apply_chat_template=True,
                      include_path="", gsm8k_dir="", backend="hf")


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
    recipe: str = arg("the recipe the run starts from: a shipped one's NAME (recipes/NAME.yaml) or a recipe "
                      "file's path", DEFAULT_RECIPE)
    extension: str = arg("a Python module that adds a config section, data generators, eval tasks and a built base "
                         "model to the run (pipeline/extension.py), e.g. the embedded demo's", "")
    run_name: str = arg("defaults to the recipe's name (a recipe file's: its stem)", "")
    output_root: str = arg("folder that holds the run folders", "runs", path="marked")
    cache_dir: str = arg("tokenised data and extensions' data and models; defaults to <output_root>/.cache", "",
                         path="marked")
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
    hub_mirror: str = arg("a folder of local Hub dataset copies, <owner>/<repo>/...: `hub:` sources read from it", "",
                          path="local")
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
        if is_section(section[key]):  # not a mapping (sweep, data_columns): its keys are the user's
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
            OmegaConf.set_struct(cfg[name][key], is_section(cfg[name][key]))
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
    apply(cfg, key, value, source)
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
    paths = path_keys(cfg)
    for file in files:
        for key, value in _flatten(file.values, cfg):
            _set(cfg, sources, key, recipe_files.rebase(value, file.path.parent, paths.get(key, "")), file.source)
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

