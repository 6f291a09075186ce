"""Config schemas for a run and its stages; recipe loading, dotted overrides and validation.

A recipe (`recipes/NAME.yaml`) is a small delta over the defaults below. Overrides are dotted
`key=value` arguments applied after the recipe. OmegaConf struct mode refuses unknown keys; every
error here is a `ConfigError` with a one-line message naming the key, raised before any model loads.
"""

from __future__ import annotations

import difflib
import itertools
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = ROOT / "recipes"
MIXTURES_DIR = ROOT / "data_mixtures"


class ConfigError(ValueError):
    """Bad configuration or input: the run stops with exit code 2 before any heavy work."""


@dataclass
class LoraConfig:
    r: int = 0  # 0 disables LoRA (full fine-tuning)
    alpha: int = 16
    dropout: float = 0.05
    target_modules: str = "all-linear"


@dataclass
class EvalConfig:
    """lm-eval settings. Top-level `eval` applies to every checkpoint; `base_eval` and each stage's
    `eval` override only the fields they set (null = inherit)."""

    tasks: list[str] | None = None  # tiny_gsm, gsm8k_local, gsm8k (Hub), any lm-eval task name
    num_fewshot: int | None = None  # -1: the task's own default
    limit: int | None = None  # samples per task; 0: all
    max_gen_toks: int | None = None
    batch_size: int | None = None
    apply_chat_template: bool | None = None  # true for instruct checkpoints, false for base models
    include_path: str | None = None  # a folder of extra lm-eval task YAMLs
    gsm8k_dir: str | None = None  # folder with GSM8K train.jsonl / test.jsonl (task gsm8k_local)


def _eval_defaults() -> EvalConfig:
    return EvalConfig(tasks=[], num_fewshot=-1, limit=0, max_gen_toks=256, batch_size=16, apply_chat_template=True,
                      include_path="", gsm8k_dir="../shared/data/gsm8k")


@dataclass
class GateConfig:
    """Decides after a stage's evaluation whether the chain goes on."""

    metric: str = ""  # <task>/<metric>,<filter>, e.g. tiny_gsm/exact_match,strict-match; empty: no gate
    min: float | None = None  # absolute floor
    max_drop: float | None = None  # allowed drop vs the previous evaluated checkpoint
    action: str = "stop"  # stop | warn


@dataclass
class OptimConfig:
    """What every training stage shares: data, optimiser, schedule, batch, LoRA, eval and gate."""

    enabled: bool = True  # a stage listed in `stages` but disabled is skipped (e.g. optional PPO)
    mixture: str = ""  # data_mixtures/NAME.yaml or a path to a mixture YAML
    learning_rate: float = 2e-5
    lr_scheduler_type: str = "cosine_with_min_lr"
    min_lr_rate: float = 0.1
    warmup_ratio: float = 0.03
    max_grad_norm: float = 0.2
    weight_decay: float = 0.0
    num_train_epochs: float = 1.0
    max_steps: int = -1  # > 0 overrides num_train_epochs
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    max_length: int = 2048
    padding_free: bool = False
    activation_checkpointing: bool = True  # saves memory on large models; turn off for tiny ones
    logging_steps: int = 10
    save_steps: int = 500
    lora: LoraConfig = field(default_factory=LoraConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    gate: GateConfig = field(default_factory=GateConfig)


@dataclass
class TrainConfig(OptimConfig):
    """A TRL SFTTrainer stage; `sft` and `midtrain` share this schema and code path."""

    format: str = "chat"  # chat: `messages` with assistant-only loss; text: plain documents
    packing: bool = True
    packing_strategy: str = "bfd"  # bfd | bfd_split | wrapped
    assistant_only_loss: bool = True
    sampling: str = "random"  # random | group_by_length: batches of similar lengths, less padding (see README)


@dataclass
class OnPolicyConfig:
    """Preference pairs sampled from the stage's input model on prompts with known `#### N` answers."""

    enabled: bool = False
    mixture: str = ""  # rows with `prompt` (chat) and `answer`
    samples: int = 4  # answers sampled per prompt
    max_new_tokens: int = 128
    temperature: float = 1.0
    max_prompts: int = 0  # 0: all prompts
    batch_size: int = 32


@dataclass
class SweepConfig:
    """A grid over beta x learning rate; empty lists keep the stage's own value."""

    beta: list[float] | None = None  # null: not swept (the stage's own beta)
    learning_rate: list[float] | None = None
    # Train only this grid index into candidates/<id>/ and stop, the stage unfinished (one Slurm array task of
    # slurm/sweep.sh); a later run without it reuses the candidates and selects. Not part of the fingerprint.
    candidate: int | None = None


@dataclass
class SoupConfig:
    top_k: int = 0  # average the weights of the K best candidates; 0: no soup


@dataclass
class MergeConfig:
    stage: str = ""  # an earlier stage whose checkpoint is linearly merged in; empty: no merge
    weight: float = 0.1  # weight of that earlier checkpoint (SmolLM3: 0.1 mid-training, 0.9 soup)


@dataclass
class DpoConfig(OptimConfig):
    """A TRL DPOTrainer stage (DPO, APO-zero, IPO, ...), with an optional sweep, soup and merge."""

    loss_type: list[str] = field(default_factory=lambda: ["sigmoid"])  # e.g. [apo_zero] or [sigmoid, sft]
    loss_weights: list[float] = field(default_factory=list)  # one per loss type; empty: all 1
    beta: float = 0.1
    precompute_ref_log_probs: bool = True  # reference log-probs computed once and shared by every candidate
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    soup: SoupConfig = field(default_factory=SoupConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)


def _midtrain_defaults() -> TrainConfig:
    return TrainConfig(format="text", packing_strategy="wrapped", assistant_only_loss=False)


@dataclass
class RewardConfig(OptimConfig):
    """A reward model trained by TRL's RewardTrainer on preference pairs (sequence classifier, 1 output)."""

    center_rewards_coefficient: float = 0.0


@dataclass
class PpoConfig(OptimConfig):
    """Our actor-critic PPO on accelerate. `max_steps` counts PPO updates; `mixture` gives prompts (+ answers)."""

    reward: str = "verifiable"  # verifiable: the `#### N` answer checked against `answer`; model: a reward model
    reward_model: str = ""  # a checkpoint path, or the name of an earlier `reward` stage
    format_reward: float = 0.0  # added when the response has a `#### N` line at all
    value_init: str = "policy"  # policy | reward_model: where the value model starts
    rollout_batch_size: int = 16  # prompts per update and process
    max_new_tokens: int = 128
    temperature: float = 1.0
    unfinished_penalty: float = -1.0  # reward for a response that never ends (no EOS within max_new_tokens)
    kl_coef: float = 0.05
    kl_estimator: str = "k1"  # k1 | k3
    kl_target: float = 0.0  # > 0: adaptive KL coefficient (Ziegler et al.) aiming at this KL
    gamma: float = 1.0
    lam: float = 0.95
    ppo_epochs: int = 4
    num_minibatches: int = 4
    clip_range: float = 0.2
    clip_range_value: float = 0.2
    vf_coef: float = 0.5
    whiten_advantages: bool = True


@dataclass
class GrpoConfig(OptimConfig):
    """Critic-free RL through TRL's GRPOTrainer with the same reward functions as PPO."""

    reward: str = "verifiable"
    reward_model: str = ""
    format_reward: float = 0.0
    num_generations: int = 4
    max_new_tokens: int = 128
    temperature: float = 1.0
    beta: float = 0.04  # KL coefficient


@dataclass
class ModelConfig:
    name_or_path: str = "HuggingFaceTB/SmolLM3-3B-Base"  # Hub id, local checkpoint, or `tiny`
    tokenizer: str = ""  # defaults to name_or_path
    chat_template: str = ""  # path to a Jinja template; empty keeps the tokenizer's
    precision: str = "auto"  # auto (bf16 on GPUs that have it, else fp32) | bf16 | fp32
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False


@dataclass
class TinyConfig:
    """The embedded tiny setup: synthetic GSM8K-style data, a local tokenizer and a tiny model."""

    seed: int = 0
    sft_examples: int = 4000
    midtrain_examples: int = 4000
    general_examples: int = 4000
    pretrain_examples: int = 6000
    test_examples: int = 200
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    pretrain_steps: int = 300
    pretrain_batch_size: int = 16
    pretrain_max_length: int = 256
    pretrain_learning_rate: float = 2e-3


@dataclass
class PlanConfig:
    """`plan=true`: print what the run would do, with token and GPU-hour estimates, then exit (pipeline/plan.py)."""

    enabled: bool = False
    gpu: str = "H100"  # a device of the peak-FLOPs table in pipeline/flops.py
    num_gpus: int = 8
    mfu: float = 0.35  # assumed model FLOPs utilisation
    params: float = 0  # model parameters; 0: from the model's config (local config.json, known models, tiny)
    output: str = "table"  # table | json


@dataclass
class RunConfig:
    recipe: str = "tiny"
    run_name: str = ""  # defaults to the recipe name
    output_root: str = "runs"
    cache_dir: str = ""  # tokenised data and tiny base models; defaults to <output_root>/.cache
    stages: list[str] = field(default_factory=lambda: ["sft", "midtrain"])
    redo: list[str] = field(default_factory=list)
    seed: int = 42
    deterministic: bool = False  # debugging: deterministic kernels and full seeding (slower)
    model: ModelConfig = field(default_factory=ModelConfig)
    eval: EvalConfig = field(default_factory=_eval_defaults)
    base_eval: EvalConfig = field(default_factory=lambda: EvalConfig(apply_chat_template=False))
    tiny: TinyConfig = field(default_factory=TinyConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    sft: TrainConfig = field(default_factory=TrainConfig)
    midtrain: TrainConfig = field(default_factory=_midtrain_defaults)
    dpo: DpoConfig = field(default_factory=lambda: DpoConfig(learning_rate=5e-7, lr_scheduler_type="cosine"))
    reward: RewardConfig = field(default_factory=lambda: RewardConfig(learning_rate=1e-5))
    ppo: PpoConfig = field(default_factory=lambda: PpoConfig(learning_rate=1e-6, lr_scheduler_type="constant",
                                                             max_steps=100))
    grpo: GrpoConfig = field(default_factory=lambda: GrpoConfig(learning_rate=1e-6, lr_scheduler_type="constant"))


STAGE_KINDS = tuple(f.name for f in fields(RunConfig) if f.type.endswith("Config") and f.name not in (
    "model", "tiny", "eval", "base_eval", "plan"))
CHOICES = {
    "format": ("chat", "text"),
    "packing_strategy": ("bfd", "bfd_split", "wrapped"),
    "sampling": ("random", "group_by_length"),
    "precision": ("auto", "bf16", "fp32"),
    "action": ("stop", "warn"),
    "reward": ("verifiable", "model"),
    "kl_estimator": ("k1", "k3"),
    "value_init": ("policy", "reward_model"),
}


def available_recipes() -> list[str]:
    """Names of the shipped recipes (`recipes/*.yaml`)."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def _suggest(cfg: DictConfig, full_key: str) -> str:
    parent_key, _, leaf = full_key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    keys = [str(k) for k in parent.keys()] if isinstance(parent, DictConfig) else []
    close = difflib.get_close_matches(leaf, keys, n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(keys)}"


def explain_error(cfg: DictConfig, err: OmegaConfBaseException, where: str) -> ConfigError:
    key = err.full_key or "?"
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
        return ConfigError(f"unknown config key '{key}' in {where}{_suggest(cfg, key)}")
    msg = str(err).splitlines()[0]
    return ConfigError(f"bad value for '{key}' in {where}: {msg}")


def _apply(cfg: DictConfig, key: str, value: Any, where: str) -> None:
    try:
        OmegaConf.update(cfg, key, value, merge=True)
    except OmegaConfBaseException as err:
        if not err.full_key:
            err.full_key = key
        raise explain_error(cfg, err, where) from None


def _flatten(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict) and node:
        return [kv for k, v in node.items() for kv in _flatten(v, f"{prefix}{k}.")]
    return [(prefix[:-1], node)]


def load_config(argv: list[str]) -> DictConfig:
    """Resolve `recipe=NAME key=value ...` into a validated, read-only run config."""
    overrides = []
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"argument '{arg}' is not key=value (e.g. recipe=tiny sft.learning_rate=1e-4)")
        overrides.append(arg.split("=", 1))
    recipe = next((v for k, v in reversed(overrides) if k == "recipe"), "tiny")  # the last one wins
    path = RECIPES_DIR / f"{recipe}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown recipe '{recipe}'; available: {', '.join(available_recipes())}")
    cfg = OmegaConf.structured(RunConfig)
    OmegaConf.set_struct(cfg, True)
    try:
        delta = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as err:  # noqa: BLE001 - YAML parser errors come in many types
        raise ConfigError(f"cannot parse recipe {path}: {err}") from None
    for key, value in _flatten(delta or {}):
        _apply(cfg, key, value, f"recipe {path.name}")
    cfg.recipe = recipe
    for key, raw in overrides:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"x={raw}"]))["x"] if raw else ""
        key = "plan.enabled" if key == "plan" and isinstance(value, bool) else key  # `plan=true` shorthand
        _apply(cfg, key, value, "command line")
    if not cfg.run_name:
        cfg.run_name = recipe
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def validate(cfg: DictConfig) -> None:
    """Check what the schema types cannot: stage names, choices, numeric ranges."""
    if not cfg.stages:
        raise ConfigError("'stages' is empty: list at least one of " + ", ".join(STAGE_KINDS))
    for name in list(cfg.stages) + list(cfg.redo):
        if name not in STAGE_KINDS:
            close = difflib.get_close_matches(name, STAGE_KINDS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown stage '{name}'{hint} (available: {', '.join(STAGE_KINDS)})")
    if len(set(cfg.stages)) != len(cfg.stages):
        raise ConfigError(f"'stages' lists a stage twice: {list(cfg.stages)}")
    for key, allowed in CHOICES.items():
        for section in ("model", *STAGE_KINDS, *(f"{k}.gate" for k in STAGE_KINDS)):
            value = OmegaConf.select(cfg, section).get(key)  # absent keys (not in this schema) give None
            if value is not None and value not in allowed:
                raise ConfigError(f"'{section}.{key}' is '{value}'; choose one of {', '.join(allowed)}")
    for name in cfg.stages:
        stage = cfg[name]
        if not stage.enabled:
            continue
        if not stage.mixture and not ("on_policy" in stage and stage.on_policy.enabled):
            raise ConfigError(f"'{name}.mixture' is empty: name a data mixture (data_mixtures/*.yaml)")
        for key in ("learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "max_length"):
            if stage[key] <= 0:
                raise ConfigError(f"'{name}.{key}' must be > 0, got {stage[key]}")
        if stage.max_steps <= 0 and stage.num_train_epochs <= 0:
            raise ConfigError(f"'{name}': set max_steps > 0 or num_train_epochs > 0")
        if stage.get("assistant_only_loss") and stage.format != "chat":
            raise ConfigError(f"'{name}.assistant_only_loss' needs format=chat")
        if stage.lora.r < 0:
            raise ConfigError(f"'{name}.lora.r' must be >= 0")
    _validate_dpo(cfg)


def _validate_dpo(cfg: DictConfig) -> None:
    dpo = cfg.dpo
    if "dpo" not in cfg.stages or not dpo.enabled:
        if dpo.sweep.candidate is not None:
            raise ConfigError("'dpo.sweep.candidate' trains one candidate of the dpo stage: list dpo in 'stages'")
        return
    if dpo.padding_free:  # TRL 1.16's DPOTrainer warns and pads anyway: refuse rather than do nothing
        raise ConfigError("'dpo.padding_free' is not supported: TRL 1.16's DPOTrainer turns it off and pads every "
                          "batch; remove the key (or set it to false)")
    if dpo.loss_weights and len(dpo.loss_weights) != len(dpo.loss_type):
        raise ConfigError(f"'dpo.loss_weights' has {len(dpo.loss_weights)} weights for {len(dpo.loss_type)} loss types")
    for key in ("beta", "learning_rate"):
        values = dpo.sweep[key]
        if values is not None and not values:
            raise ConfigError(f"'dpo.sweep.{key}' is an empty grid: list values, or null to keep dpo.{key}")
        if values is not None and any(v <= 0 for v in values):
            raise ConfigError(f"'dpo.sweep.{key}' values must be > 0, got {list(values)}")
    size = len(grid(dpo))
    if (size > 1 or dpo.soup.top_k or dpo.merge.stage) and not dpo.gate.metric:
        extra = " plus soup / merge" if dpo.soup.top_k or dpo.merge.stage else ""
        raise ConfigError(f"the dpo stage picks its model among {size} sweep candidate(s){extra} by 'dpo.gate.metric'"
                          "; set it (a metric of the stage's eval)")
    if dpo.sweep.candidate is not None and not 0 <= dpo.sweep.candidate < size:
        raise ConfigError(f"'dpo.sweep.candidate' is {dpo.sweep.candidate}; the sweep has {size} candidate(s), "
                          f"numbered 0 to {size - 1}")
    if dpo.on_policy.enabled and (not dpo.on_policy.mixture or dpo.on_policy.samples < 2):
        raise ConfigError("'dpo.on_policy' needs a mixture of prompts with answers and samples >= 2")
    if dpo.soup.top_k < 0 or dpo.soup.top_k == 1:
        raise ConfigError(f"'dpo.soup.top_k' must be 0 (no soup) or >= 2, got {dpo.soup.top_k}")
    if dpo.merge.stage:
        order = list(cfg.stages)
        if dpo.merge.stage not in order[: order.index("dpo")]:
            raise ConfigError(f"'dpo.merge.stage' is '{dpo.merge.stage}': it must name a stage before dpo in "
                              f"{order}")
        if not 0 < dpo.merge.weight < 1:
            raise ConfigError(f"'dpo.merge.weight' must be between 0 and 1, got {dpo.merge.weight}")


def grid(dpo: Any) -> list[dict]:
    """The DPO sweep's candidates (beta x learning rate, sorted ascending); the stage's own values if unswept."""
    betas = sorted(dpo.sweep.beta) if dpo.sweep.beta is not None else [dpo.beta]
    rates = sorted(dpo.sweep.learning_rate) if dpo.sweep.learning_rate is not None else [dpo.learning_rate]
    return [{"id": f"beta{b:g}-lr{lr:g}", "beta": b, "learning_rate": lr} for b, lr in itertools.product(betas, rates)]


def cache_dir(cfg: DictConfig) -> Path:
    """Where tokenised data and tiny base models are cached for this config."""
    return Path(cfg.cache_dir or Path(cfg.output_root) / ".cache")


def stage_section(cfg: DictConfig, name: str) -> dict:
    """A stage's training config as a plain dict (for fingerprints and stage.json): no eval, no gate."""
    section = OmegaConf.to_container(cfg[name], resolve=True)
    if "sweep" in section:
        del section["sweep"]["candidate"]  # which candidate one job trains does not change the stage
    return {k: v for k, v in section.items() if k not in ("eval", "gate")}
