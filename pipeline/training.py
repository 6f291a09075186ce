"""The one causal-LM training path: TRL's SFTTrainer for SFT, mid-training and tiny pretraining.

`format: chat` trains on `messages` through the tokenizer's chat template with assistant-only loss
and packing; `format: text` tokenises documents itself (chat rows rendered through the template),
ends each with EOS and packs them with the `wrapped` strategy. LoRA trains an adapter and saves a
merged full checkpoint. The final checkpoint is written atomically, then handed to the next stage.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import torch
from accelerate import PartialState
from accelerate.state import AcceleratorState
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config
from trl import SFTConfig, SFTTrainer
from trl.chat_template_utils import is_chat_template_stop_token_trained

from pipeline import packing, preempt, tokcache
from pipeline.config import ConfigError
from pipeline.files import commit_dir, read_json
from pipeline.telemetry import MEMORY_LIMIT, Telemetry

MFU_ALERT = 0.30  # warn below this model FLOPs utilisation (GPU only: CPUs have no MFU)

log = logging.getLogger("pipeline")


def use_bf16(precision: str) -> bool:
    """Whether to train in bf16: `auto` picks it on GPUs that support it, fp32 elsewhere."""
    if precision == "fp32":
        return False
    has_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if precision == "bf16" and not has_bf16:
        raise ConfigError("model.precision=bf16 but this machine has no bf16-capable GPU; use auto or fp32")
    return has_bf16


def load_tokenizer(path: str | Path, model_cfg: Any, need_template: bool):
    """Load a tokenizer; check it has a chat template (with generation markers) when one is needed."""
    tok = AutoTokenizer.from_pretrained(model_cfg.tokenizer or path, trust_remote_code=model_cfg.trust_remote_code)
    if model_cfg.chat_template:
        tok.chat_template = Path(model_cfg.chat_template).read_text(encoding="utf-8")
    if need_template and not tok.chat_template:
        raise ConfigError(f"tokenizer of {path} has no chat template; set model.chat_template to a Jinja file")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def check_columns(dataset: Any, stage: Any, tok: Any, name: str) -> None:
    """Refuse data that cannot feed this stage's format, before the model loads."""
    cols = set(dataset.column_names)
    if stage.format == "chat" and "messages" not in cols:
        raise ConfigError(f"stage '{name}' (format chat) needs a `messages` column; its mixture gives {sorted(cols)}")
    if stage.format == "text" and "text" not in cols:
        raise ConfigError(f"stage '{name}' (format text) needs `text` or `messages`; its mixture gives {sorted(cols)}")
    if stage.assistant_only_loss and "generation" not in (tok.chat_template or ""):
        raise ConfigError(f"stage '{name}': assistant_only_loss needs a chat template with "
                          "{% generation %} markers around assistant turns")
    if stage.assistant_only_loss and not is_chat_template_stop_token_trained(tok):
        log.warning("stage %s: the chat template leaves the assistant's end-of-turn token out of the loss mask; the "
                    "model may not learn to stop", name)


def deepspeed_on() -> bool:
    """Whether `accelerate launch` runs this process under DeepSpeed (a config with `distributed_type: DEEPSPEED`)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"


def process_state() -> PartialState:
    """The process group, created once per process before any trainer.

    DeepSpeed without CUDA (PLATFORM.md): accelerate would pick no backend and fill DeepSpeed's "auto"
    batch sizes for a world size of 1, so the state is created over gloo first and every trainer
    reuses it (`common_args`). Otherwise a plain state (CPU processes over gloo when there is no GPU).
    """
    if deepspeed_on() and not torch.cuda.is_available():
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated")  # per DeepSpeed call
        return PartialState(backend="gloo")
    return PartialState(cpu=not torch.cuda.is_available())


def common_args(stage: Any, work_dir: Path, seed: int, precision: str) -> dict:
    """TrainingArguments shared by every TRL trainer we drive (bf16 on capable GPUs, CPU-safe otherwise)."""
    return dict(
        output_dir=str(work_dir),
        learning_rate=stage.learning_rate,
        lr_scheduler_type=stage.lr_scheduler_type,
        lr_scheduler_kwargs={"min_lr_rate": stage.min_lr_rate} if "min_lr" in stage.lr_scheduler_type else None,
        warmup_steps=stage.warmup_ratio,
        max_grad_norm=stage.max_grad_norm,
        weight_decay=stage.weight_decay,
        num_train_epochs=stage.num_train_epochs,
        max_steps=stage.max_steps,
        per_device_train_batch_size=stage.per_device_train_batch_size,
        gradient_accumulation_steps=stage.gradient_accumulation_steps,
        max_length=stage.max_length,
        activation_checkpointing=stage.activation_checkpointing,
        logging_steps=stage.logging_steps,
        logging_first_step=True,
        save_steps=stage.save_steps,
        save_total_limit=2,
        seed=seed,
        bf16=use_bf16(precision),
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        disable_tqdm=not (PartialState().is_main_process and sys.stderr.isatty()),  # quiet in CI logs and ranks > 0
        **_configured_state(),
    )


def _configured_state() -> dict:
    """DeepSpeed without CUDA: the trainer keeps `process_state`'s gloo group, with a fresh accelerator state
    (accelerate takes one DeepSpeed plugin per state, and the previous stage's trainer left its own)."""
    if not (deepspeed_on() and not torch.cuda.is_available()):
        return {}
    AcceleratorState._reset_state()
    return {"accelerator_config": {"use_configured_state": True}}


def check_lengths(dataset: Any, stage: Any, name: str) -> int:
    """Apply the truncation policy to tokenised rows; return how many rows will be cut.

    Rows longer than `max_length` keep their start and lose their end (TRL's truncation), unless
    packing splits them (`wrapped`, `bfd_split`). The count is logged; if every row would be cut,
    the stage is refused (the data or max_length is wrong).
    """
    if stage.packing and stage.packing_strategy in ("wrapped", "bfd_split"):
        return 0
    lengths = pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_numpy()
    long = int((lengths > stage.max_length).sum())
    if long == len(lengths):
        raise ConfigError(f"stage '{name}': all {long} rows are longer than max_length={stage.max_length} tokens "
                          f"(shortest: {min(lengths)}); raise max_length or fix the data")
    if long:
        log.warning("stage %s: %d of %d rows exceed max_length=%d and are truncated at the end", name, long,
                    len(lengths), stage.max_length)
    return long


def sft_args(stage: Any, work_dir: Path, seed: int, precision: str) -> SFTConfig:
    """SFTTrainer arguments for an SFT / mid-training stage."""
    wrapped = stage.packing and stage.packing_strategy == "wrapped"
    return SFTConfig(
        **common_args(stage, work_dir, seed, precision),
        packing=stage.packing and not packing.applies(stage),  # ours: rows kept apart (packing.py)
        packing_strategy=stage.packing_strategy,
        padding_free=stage.padding_free and not wrapped,
        train_sampling_strategy=stage.sampling,
        assistant_only_loss=False,  # rows come tokenised; their `assistant_masks` column masks the loss
        include_num_input_tokens_seen="non_padding",
    )


def load_model(path: str | Path, model_cfg: Any):
    """A causal LM from a checkpoint, in the training precision."""
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16 if use_bf16(model_cfg.precision) else torch.float32, use_safetensors=True,
        attn_implementation=model_cfg.attn_implementation, trust_remote_code=model_cfg.trust_remote_code)


def lora_config(stage: Any):
    """A peft LoraConfig when the stage asks for LoRA (`lora.r > 0`), else None."""
    if stage.lora.r <= 0:
        return None
    from peft import LoraConfig

    return LoraConfig(r=stage.lora.r, lora_alpha=stage.lora.alpha, lora_dropout=stage.lora.dropout,
                      target_modules=stage.lora.target_modules, task_type="CAUSAL_LM")


def fit(trainer: Any, tok: Any, out_dir: Path) -> dict:
    """Train (resuming from the last checkpoint in the trainer's output folder), save a full checkpoint
    to `out_dir/model` atomically, drop the intermediate checkpoints, and return the training metrics.

    Runs collectively on every rank; only the main process writes files.
    """
    state = PartialState()
    started = time.time()
    work_dir = Path(trainer.args.output_dir)
    resume = last_complete_checkpoint(work_dir)
    if resume:
        log.info("resuming %s from %s", out_dir.name, resume)
    trainer.add_callback(preempt.PreemptCallback())
    telemetry = Telemetry().attach(trainer)
    with disk_errors_explained(out_dir / "model"):
        result = trainer.train(resume_from_checkpoint=resume)
        preempt.check(f"in {out_dir.name} at step {trainer.state.global_step} (checkpoint in {work_dir})")
        if telemetry.memory_stop:
            raise preempt.Preempted(f"device memory over {MEMORY_LIMIT:.0%} in {out_dir.name}; checkpoint saved")
        _save(trainer, tok, out_dir / "model", merge_lora=_is_peft(trainer.model))
    unset_hf_deepspeed_config()  # ZeRO-3 must not partition what one process loads later (eval, sampling)
    runtime = result.metrics.get("train_runtime", 0.0)
    history = trainer.state.log_history
    losses = [(h["step"], h["loss"]) for h in history if "loss" in h]
    if state.is_main_process:
        shutil.rmtree(work_dir, ignore_errors=True)
    state.wait_for_everyone()
    tokens = int(trainer.state.num_input_tokens_seen)
    precision = "bf16" if trainer.args.bf16 else "fp32"
    tele = telemetry.summary(trainer.model, tokens, runtime, precision, state.num_processes)
    if tele["mfu"] is not None and tele["mfu"] < MFU_ALERT:
        log.warning("%s: MFU %.1f%% is under %.0f%% (compute %.1f s, data wait %.1f s, saving %.1f s)", out_dir.name,
                    100 * tele["mfu"], 100 * MFU_ALERT, tele["compute_s"], tele["data_wait_s"], tele["save_s"])
    logged = {k: v for h in history for k, v in h.items() if k.startswith(("rewards/", "logps/"))}
    return {
        "steps": trainer.state.global_step,
        "loss_first": losses[0][1] if losses else None,
        "loss_last": losses[-1][1] if losses else None,
        "train_loss": result.training_loss,
        "losses": losses,
        "tokens": tokens or None,
        "train_runtime_s": round(runtime, 2),
        "tokens_per_s": round(tokens / max(runtime, 1e-9), 1) if tokens else None,
        "resumed_from": resume,
        "wall_time_s": round(time.time() - started, 2),
        **parallelism(trainer.accelerator),
        **tele,
        **({"last_logged": logged} if logged else {}),
    }


def parallelism(accelerator: Any) -> dict:
    """How the trainer really ran: its world size, distributed type and ZeRO stage (None without DeepSpeed)."""
    plugin = accelerator.state.deepspeed_plugin
    return {"world_size": accelerator.num_processes, "distributed_type": accelerator.distributed_type.value,
            "zero_stage": plugin.zero_stage if plugin else None}


def last_complete_checkpoint(work_dir: Path) -> str | None:
    """The newest `checkpoint-N` whose trainer_state.json (written last by the Trainer) parses.

    A checkpoint cut short by a crash is removed, so training resumes from the one before it.
    """
    if not work_dir.is_dir():
        return None
    steps = sorted((int(p.name.split("-")[1]), p) for p in work_dir.glob("checkpoint-*") if p.name[11:].isdigit())
    for _, path in reversed(steps):
        if read_json(path / "trainer_state.json") is not None:
            return str(path)
        if PartialState().is_main_process:
            log.warning("dropping incomplete checkpoint %s", path)
            shutil.rmtree(path, ignore_errors=True)
    return None


def _is_peft(model: Any) -> bool:
    return hasattr(model, "merge_and_unload")


def train(stage: Any, model_cfg: Any, model_path: Path, tok: Any, dataset: Any, stage_dir: Path, seed: int,
          cache_dir: Path) -> dict:
    """SFT / mid-training of `model_path` on `dataset` into `stage_dir/model`; return the metrics.

    The rows are tokenised once into `cache_dir` (see `tokcache`). Intermediate checkpoints go to
    `stage_dir/work`; if one exists the run resumes from it.
    """
    check_columns(dataset, stage, tok, stage_dir.name)
    dataset = tokcache.tokenised(dataset, stage, tok, cache_dir, stage_dir.name)
    truncated = check_lengths(dataset, stage, stage_dir.name)
    packed = packing.applies(stage)
    if packed:
        dataset = packing.pack(dataset, stage.max_length, stage.packing_strategy)
    args = sft_args(stage, stage_dir / "work", seed, model_cfg.precision)  # first: ZeRO-3 then shards the load
    trainer = SFTTrainer(model=load_model(model_path, model_cfg), args=args, train_dataset=dataset,
                         processing_class=tok, peft_config=lora_config(stage),
                         data_collator=packing.collator(tok) if packed else None)
    return {**fit(trainer, tok, stage_dir), "truncated_rows": truncated}


def _save(trainer: Any, tok: Any, out: Path, merge_lora: bool) -> None:
    """Write a full, plain HF checkpoint to `out` atomically (all ranks call; main writes)."""
    state = PartialState()
    tmp = out.with_name(f".{out.name}.tmp")
    if state.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    state.wait_for_everyone()
    try:
        if merge_lora:
            with _gathered(trainer.model):
                if state.is_main_process:
                    merged = trainer.model.merge_and_unload()
                    merged.save_pretrained(tmp)
                    tok.save_pretrained(tmp)
        else:
            trainer.save_model(str(tmp))
        if state.is_main_process:
            (tmp / "training_args.bin").unlink(missing_ok=True)
            commit_dir(tmp, out)
    except BaseException:
        if state.is_main_process:  # other ranks must not touch the folder the main process writes
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    state.wait_for_everyone()


def _gathered(model: Any) -> contextlib.AbstractContextManager:
    """Under ZeRO-3 (each rank holds a shard of every weight): the full weights while inside, on every rank."""
    if not is_deepspeed_zero3_enabled():
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


@contextlib.contextmanager
def disk_errors_explained(out: Path) -> Iterator[None]:
    """Turn a full or size-capped disk while writing checkpoints into one clear error (exit code 2)."""
    try:
        yield
    except Exception as err:
        full = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        if not (full or any(s in str(err) for s in ("No space left", "File too large", "Disk quota"))):
            raise
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[-1]
        raise ConfigError(f"could not write the checkpoint {out} or its training checkpoints: {reason}; the "
                          "previous checkpoint (if any) is intact - free space and rerun the same command") from None
