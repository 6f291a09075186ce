"""Every check that can be made before a model loads, in one pass: each check runs, and every problem found is
reported at once, in one `ConfigError` (exit code 2), before the base model is built, loaded or scored.

What a config alone cannot tell is checked here against what the run will meet: the base model's path and
config (a Hub id: well formed, cached when offline, on the Hub when online), the trainer fields each stage passes
to TRL, the device for the precision and memory switches, the attention implementation's package, the PPO batch
arithmetic, vLLM where a backend asks for it (installed, serving the model), a Hub login where the run pushes,
the chat template a chat stage needs (rendered on the first rows of each of its sources), LoRA target modules
against the model's module names (the model instantiated on the meta device), every data file and its rows (with
the per-stage decisions: reuse, resume, train), the first rows of every source (Hub splits included) against the
columns its stage uses, every eval task's name (shipped, the extension's, `eval.include_path`'s or lm-eval's
registry) and the metrics the gates read against the eval tasks. What needs a model that is not on this machine
yet (a base the recipe's extension builds, before it is built) is left to the stage, as are rows longer than
`max_length` in the input model's tokens.
"""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from pipeline import extension, redact
from pipeline.chain import dryrun
from pipeline.chain.basemodel import check_model_path, local_config
from pipeline.chain.dryrun import FAILED, Problems
from pipeline.chain.resume import StageDecision, decide
from pipeline.data import chat, formats
from pipeline.data import mixtures as data
from pipeline.distributed import deepspeed_on
from pipeline.errors import ConfigError
from pipeline.evaluation import lmeval as evaluate
from pipeline.evaluation import power
from pipeline.generation import engines
from pipeline.settings import enabled_stages, kind_of, passed_through
from pipeline.train import precision
from pipeline.train.models import load_tokenizer

log = logging.getLogger("pipeline")


def check(cfg: DictConfig, root: Path, tasks_dir: Path, world_size: int) -> list[StageDecision]:
    """Run every check (the eval tasks already written to `tasks_dir`); return the stage decisions (on `world_size`
    ranks), or raise one ConfigError naming every problem."""
    problems = Problems()
    for one in (trl_values, device_settings, attention, vllm, hub_login):
        problems.attempt(one, cfg)
    rows = problems.attempt(stage_rows, cfg)
    if problems.attempt(check_model_path, cfg) is not FAILED:  # the chat template is read from that model's tokenizer
        problems.attempt(chat_template, cfg, {} if rows is FAILED else rows)
        problems.attempt(lora_targets, cfg)
    decisions = problems.attempt(decide, cfg, root, world_size)
    problems.attempt(dryrun.eval_tasks, cfg, tasks_dir)
    problems.attempt(dryrun.gate_metrics, cfg, tasks_dir)
    problems.raise_them()
    warn_test_split_gates(cfg, tasks_dir)
    gate_power(cfg)
    return decisions  # type: ignore[return-value]


def kinds_run_here(cfg: DictConfig) -> None:
    """A stage whose kind cannot train under accelerate's DeepSpeed (`StageKind.no_deepspeed`: PPO's loop) is refused
    there. Checked first of all, before the process group that DeepSpeed would shape (`run_pipeline`)."""
    for name in [n for n in enabled_stages(cfg) if kind_of(cfg, n).no_deepspeed] if deepspeed_on() else []:
        raise ConfigError(f"stage '{name}' does not run under DeepSpeed ({kind_of(cfg, name).no_deepspeed}): run the "
                          f"chain with {name}.enabled=false here, then the same command under "
                          "--config_file ddp (or cpu), which reuses the finished stages")


def trl_values(cfg: DictConfig) -> None:
    """Each enabled stage that passes TRL fields through builds its TRL config with them (no model loads), so a
    value the class refuses stops the run here."""
    for name in [n for n in enabled_stages(cfg) if passed_through(cfg[n])]:
        kind = kind_of(cfg, name)
        work = Path(tempfile.gettempdir()) / "trl-args-check" / "work"  # outside any run folder: no tracking
        try:
            kind.trainer_args(cfg[name], work, cfg.seed, cfg.model.precision)
        except ConfigError:
            raise
        except (TypeError, ValueError) as err:
            reason = re.sub(r"is not a valid \w+, please select one of", "is not one of", str(err).splitlines()[0])
            raise ConfigError(f"bad value in '{name}': TRL's {kind.config_class().__name__} refuses it: "
                              f"{reason}") from None
        finally:
            unset_hf_deepspeed_config()  # building it under ZeRO-3 would shard every later model load


def device_settings(cfg: DictConfig) -> None:
    """The precision and each stage's memory switches (Liger kernels, activation offloading) on this device."""
    precision.mixed_precision(cfg.model.precision)
    if precision.emulated_bf16(cfg.model.precision):
        log.warning("model.precision=bf16 on a CPU without bf16 instructions (avx512_bf16, AMX): torch emulates bf16 "
                    "products, about 15x slower than fp32 here; model.precision=fp32 trains faster on this machine")
    for name in enabled_stages(cfg):
        precision.memory_args(cfg[name])


def attention(cfg: DictConfig) -> None:
    """`model.attn_implementation` is one transformers knows, and the package it runs on is installed here
    (transformers' own availability checks: flash-attn on a CUDA GPU for flash_attention_2, ...)."""
    from transformers import utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = cfg.model.attn_implementation
    base = name.removeprefix("paged|")
    if "/" in base:  # a kernel from the Hub (kernels-community/...)
        if not utils.is_kernels_available():
            raise ConfigError(f"model.attn_implementation={name} is a Hub kernel and needs the kernels package: pip "
                              "install kernels, or use sdpa")
        return
    if base not in {"eager", *ALL_ATTENTION_FUNCTIONS.keys(), *(k.removeprefix("paged|") for k in
                                                                ALL_ATTENTION_FUNCTIONS.keys())}:
        known = sorted({"eager", *ALL_ATTENTION_FUNCTIONS.keys()})
        raise ConfigError(f"model.attn_implementation={name} is not one transformers knows (choose one of "
                          f"{', '.join(known)}, or a Hub kernel such as kernels-community/flash-attn2)")
    version = re.fullmatch(r"flash_attention_(\d+)", base)
    checks = {"flex_attention": (utils.is_torch_flex_attn_available, "a torch with flex attention (2.5 or later)")}
    if version:
        checks[base] = (getattr(utils, f"is_flash_attn_{version[1]}_available", lambda: False),
                        f"the flash-attn{'' if version[1] == '2' else ' ' + version[1]} package on a supported GPU"
                        f" (pip install flash-attn{'' if version[1] == '2' else '-' + version[1]})")
    available, needs = checks.get(base, (lambda: True, ""))
    if not available() and not (version and utils.is_kernels_available()):  # transformers falls back to kernels
        raise ConfigError(f"model.attn_implementation={name} needs {needs}, which this machine lacks; use sdpa")


def vllm_uses(cfg: DictConfig) -> list[str]:
    """The config keys that ask for vLLM in this run (enabled stages, their evaluations and the base's)."""
    stages = enabled_stages(cfg)
    keys = ["base_eval.backend"] if evaluate.settings(cfg, None)["backend"] == "vllm" else []
    keys += [f"{name}.eval.backend" for name in stages if evaluate.settings(cfg, name)["backend"] == "vllm"]
    return keys + [key for name in stages for key in kind_of(cfg, name).vllm_keys(cfg, name)]


def vllm(cfg: DictConfig) -> None:
    """Where the run uses vLLM (`vllm_uses`): that it is installed, and that it serves the base model's architecture."""
    engines.check(vllm_uses(cfg), cfg.model.name_or_path)


def hub_login(cfg: DictConfig) -> None:
    """`push_to_hub`: a Hub login to push with when the run ends (huggingface_hub's token: HF_TOKEN, or the file `hf
    auth login` writes), with the Hub not switched off (HF_HUB_OFFLINE). The token is only scrubbed from the log."""
    if not cfg.push_to_hub:
        return
    from huggingface_hub import constants, get_token

    token = get_token()
    if not token:
        raise ConfigError(f"push_to_hub={cfg.push_to_hub} needs a Hub login, and there is none: run `hf auth login` or "
                          "set HF_TOKEN (a token that can write to it)")
    redact.remember({"token": token})
    if constants.is_offline_mode():
        raise ConfigError(f"push_to_hub={cfg.push_to_hub} needs the Hub, and HF_HUB_OFFLINE is set: unset it, or run "
                          "without push_to_hub")


def chat_template(cfg: DictConfig, rows: dict[str, list[tuple[str, dict]]] | None = None) -> None:
    """Refuse, before any training, a chain with a chat stage when neither the base tokenizer nor
    `model.chat_template` gives a chat template (SFT / mid-training with format chat, DPO, PPO, GRPO, reward), and a
    template that cannot render the rows `rows` gives a stage (stage -> [(where, row)]: the first rows of each of its
    sources, normalised, `stage_rows`). A base the recipe's extension has not built yet is checked with the
    `model.chat_template` it will carry, on a stand-in tokenizer (`chat.stand_in_tokenizer`), or not at all when
    its builder brings the template."""
    chat_stages = [n for n in cfg.stages if cfg[n].enabled and cfg[n].get("format", "chat") == "chat"]
    renders = [n for n in cfg.stages if cfg[n].enabled and any("messages" in r or "prompt" in r
                                                                for _, r in (rows or {}).get(n, []))]
    if not chat_stages and not renders:
        return
    path = cfg.model.name_or_path
    source = cfg.model.chat_template or cfg.model.tokenizer or cfg.model.name_or_path
    if extension.builds_base(cfg):
        path = extension.of(cfg).architecture(cfg)[0]
    if extension.builds_base(cfg) and not (path / "config.json").is_file():  # not built yet
        if not cfg.model.chat_template:
            return  # its builder's own template
        tok = chat.stand_in_tokenizer(cfg.model.chat_template)  # the template it will carry, on a stand-in
    else:
        tok = _tokenizer(cfg, path, source, chat_stages)
        if tok is None:
            return
    for name in renders:
        for where, row in (rows or {})[name]:
            chat.render_row(tok, cfg[name], row, f"stage '{name}': the chat template of {source} cannot render {where}")


def _tokenizer(cfg: DictConfig, path: str | Path, source: str, chat_stages: list[str]) -> Any:
    """The base model's tokenizer with `model.*` applied; None when it has no chat template and no stage needs
    one; a ConfigError when it cannot be loaded, or has no template a chat stage needs."""
    try:
        tok = load_tokenizer(path, cfg.model)
    except (OSError, ValueError) as err:  # no tokenizer files, or files no tokenizer class reads
        reason = " ".join(str(err).split())[:300] or type(err).__name__
        raise ConfigError(f"cannot load the tokenizer of {cfg.model.tokenizer or path}: {reason}") from None
    if not tok.chat_template:
        if chat_stages:
            raise ConfigError(f"stage(s) {', '.join(chat_stages)} need a chat template and the tokenizer of {source} "
                              "has no chat template: set model.chat_template=chatml (built in) or to a Jinja file")
        return None
    return tok


def stage_rows(cfg: DictConfig) -> dict[str, list[tuple[str, dict]]]:
    """The first rows of every source of each enabled stage's data or mixtures (`mixtures.head`), checked against
    the formats the stage trains on (`StageKind.mixtures`; a local file's other rows are of its first row's format,
    which its fingerprint checks); returns them per stage (the chat template is rendered on them)."""
    out: dict[str, list[tuple[str, dict]]] = {}
    for name in enabled_stages(cfg):
        for source, accepted, role in kind_of(cfg, name).mixtures(cfg[name]):
            rows = data.head(source, cfg)
            for where, row in rows:
                if not formats.fits(row, accepted):
                    raise ConfigError(f"stage '{name}' ({kind_of(cfg, name).name}) trains on "
                                      f"{formats.describe(accepted)} rows{f' ({role})' if role != 'train' else ''}; "
                                      f"{where} ({data.source_name(source)}) is {formats.of_row(row)}")
            out.setdefault(name, []).extend(rows)
    return out


def lora_targets(cfg: DictConfig) -> None:
    """Each LoRA stage's `lora.target_modules` matches modules of the base model, by peft's own rules (a string is
    a regular expression matched against full module names; all-linear: every linear layer): the model is
    instantiated on the meta device (no weights) and peft injects its adapter into it. Skipped when the model's
    config.json is not on this machine (yet)."""
    stages = [n for n in enabled_stages(cfg) if cfg[n].lora.r > 0 and cfg[n].lora.target_modules != "all-linear"]
    folder = local_config(cfg) if stages else None
    if folder is None:
        return
    import peft
    import torch
    from accelerate import init_empty_weights

    from pipeline.train.models import empty_model

    for name in stages:
        lora = cfg[name].lora
        with init_empty_weights():
            model = empty_model(folder, cfg.model, kind_of(cfg, name).model_class)
            try:
                peft.inject_adapter_in_model(peft.LoraConfig(r=lora.r, target_modules=lora.target_modules), model)
            except ValueError as err:  # peft's NoMatchingPeftModuleError is one
                linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
                leaves, reason = sorted({n.rpartition(".")[2] for n in linear}), " ".join(str(err).split())[:200]
                such_as = f" such as {linear[0]}" if linear else ""
                raise ConfigError(f"'{name}.lora.target_modules' is {lora.target_modules!r}: peft refuses it on "
                                  f"{cfg.model.name_or_path} ({reason}); it is a regular expression matched against "
                                  f"full module names{such_as}, e.g. '.*[.](q_proj|v_proj)', or all-linear; the "
                                  f"model's linear layers: {', '.join(leaves)}") from None


def gate_power(cfg: DictConfig) -> None:
    """Say what each gate would see under the stated assumption, before its input is scored (`power.before_run`):
    the chain measures it once the gate has judged, and warns then about a gate that cannot see."""
    for name in enabled_stages(cfg):
        sight = power.before_run(cfg, name)
        if sight:
            miss = f"; under that assumption it may miss what it judges: {sight['may_miss']}" if sight.get(
                "may_miss") else ""
            log.info("the gate of stage %s, before its input is scored, %s%s", name, sight["text"], miss)


def warn_test_split_gates(cfg: DictConfig, tasks_dir: Path) -> None:
    """Warn about a gate that judges a test split (allowed: test numbers are for the report)."""
    for name in [n for n in enabled_stages(cfg) if cfg[n].gate.metric]:
        task, ev = cfg[name].gate.metric.partition("/")[0], evaluate.settings(cfg, name)
        if evaluate.metric_splits(ev, tasks_dir).get(task) == "test":
            log.warning("the gate of stage %s judges %s on a test split: test numbers are for the report; gate and "
                        "select on a validation task (e.g. gsm8k_local_val)", name, task)
