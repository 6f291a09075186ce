"""What every trainer shares: training arguments, the training precision, LoRA, driving a TRL trainer to a
saved checkpoint (`fit`), and the atomic checkpoint save (models and tokenizers load through `models`).

A checkpoint is written to a temporary folder and renamed into place, so `model/` is always whole;
with LoRA the adapter is merged and a full plain checkpoint is saved. A Trainer checkpoint (`work/checkpoint-N`)
counts only once its files are fsynced and its marker (`COMPLETE`, listing them with their sizes) is written last
(`CheckpointMarker`); resuming skips and removes any other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import shutil
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import TrainerCallback
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config
from transformers.trainer_utils import TrainOutput

from pipeline import preempt
from pipeline.data import prep
from pipeline.distributed import is_main, main_value, main_writes, trainer_state_args
from pipeline.errors import LockLost, MemoryAlert, TrainingFailed
from pipeline.files import commit_dir, fsync_tree, lock_lost, read_json, temp_name, write_json
from pipeline.runfolder import checkpoint_dir, checkpoints, model_dir
from pipeline.settings import declared, passed_through
from pipeline.train import precision as prec
from pipeline.train import progress, tracking
from pipeline.train.telemetry import MEMORY_LIMIT, Telemetry

MFU_ALERT = 0.30  # warn below this model FLOPs utilisation (GPU only: CPUs have no MFU)

log = logging.getLogger("pipeline")


def common_args(stage: Any, work_dir: Path, seed: int, precision: str, run: DictConfig | None = None) -> dict:
    """TrainingArguments the pipeline computes for every TRL trainer it drives (bf16 on capable GPUs, CPU-safe
    otherwise), beyond the stage's settings of the same names (`trl_config`); the run `run` (when given) adds its
    tracking settings."""
    return dict(
        output_dir=str(work_dir),
        lr_scheduler_kwargs={"min_lr_rate": stage.min_lr_rate} if "min_lr" in stage.lr_scheduler_type else None,
        # transformers 5 has no warmup_ratio: a warmup_steps below 1 is read as a fraction of the training steps
        warmup_steps=stage.warmup_ratio,
        logging_first_step=True,
        save_total_limit=2,
        seed=seed,
        **prec.trainer_flags(precision),
        **prec.memory_args(stage),
        use_cpu=not torch.cuda.is_available(),
        **tracking.trainer_args(run, work_dir),  # report_to, run_name: the run's settings
        disable_tqdm=not (is_main() and sys.stderr.isatty()),  # quiet in CI logs and ranks > 0
        **trainer_state_args(),
    )


def trl_config(cls: type, stage: Any, computed: dict) -> Any:
    """The TRL config `cls`: every setting the stage declares that `cls` has a field of the same name for, as it
    is; over them the arguments the pipeline computes (`computed`); over those the stage's keys that its settings do
    not declare (TRL's own fields, checked when the config loads: `settings.passed_through`). Secret values
    (`hub_token`) reach it as `redact.Secret`: a pickle of the config (`training_args.bin`) holds them redacted."""
    from pipeline import redact

    named = {f.name for f in dataclasses.fields(cls)} & declared(stage)
    same = {k: v for k, v in OmegaConf.to_container(stage, resolve=True).items() if k in named}
    return cls(**{**same, **computed, **redact.protect(passed_through(stage))})


def lora_config(stage: Any):
    """A peft LoraConfig when the stage asks for LoRA (`lora.r > 0`), else None."""
    if stage.lora.r <= 0:
        return None
    from peft import LoraConfig

    return LoraConfig(r=stage.lora.r, lora_alpha=stage.lora.alpha, lora_dropout=stage.lora.dropout,
                      target_modules=stage.lora.target_modules, task_type="CAUSAL_LM")


def _train(trainer: Any, tok: Any, out_dir: Path, telemetry: Telemetry) -> tuple[Any, str | None]:
    """Train (resuming from the last complete checkpoint in the trainer's output folder) and save `out_dir/model`.
    The checkpoints (`work/`) stay: the caller removes them once its record says the stage is trained."""
    work_dir = Path(trainer.args.output_dir)
    resume = main_value(last_complete_checkpoint(work_dir) if is_main() else None)  # one answer for every rank
    if resume:
        log.info("resuming %s from %s", out_dir.name, resume)
    trainer.add_callback(preempt.PreemptCallback(save_seconds(Path(resume)) if resume else None))
    trainer.add_callback(NoStepPastTheEnd())
    with disk_errors_explained(model_dir(out_dir)):
        try:
            result = trainer.train(resume_from_checkpoint=resume)
        except _Finished:  # resumed from the last step's checkpoint: its weights are the trained model
            result = TrainOutput(trainer.state.global_step, None, {"train_runtime": 0.0})
        preempt.check(f"in {out_dir.name} at step {trainer.state.global_step} (checkpoint in {work_dir})")
        if telemetry.memory_stop:
            raise MemoryAlert(f"device memory over {MEMORY_LIMIT:.0%} in {out_dir.name} at step "
                              f"{trainer.state.global_step}; checkpoint saved in {work_dir}. Lower what a step needs "
                              "with settings a resume may change: halve per_device_train_batch_size and double "
                              "gradient_accumulation_steps (the same training), or gradient_checkpointing=true; "
                              "then rerun with them to resume")
        save_trained(trainer, tok, model_dir(out_dir))
    unset_hf_deepspeed_config()  # ZeRO-3 must not partition what one process loads later (eval, sampling)
    return result, resume


# what a preference or RL trainer logs that explains it (first and last values: `pipeline.rl.diagnostics`): DPO's
# rewards/ and logps/, GRPO's reward, KL and completion length
TRACKED = ("rewards/", "logps/", "reward", "kl", "completions/mean_length")


def fit(trainer: Any, tok: Any, out_dir: Path, nonfinite_limit: int, matmul_precision: str = "highest") -> dict:
    """Train (resuming from the last complete checkpoint in the trainer's output folder), save a full checkpoint
    to `out_dir/model` atomically, and return the training metrics. The intermediate checkpoints (`work/`) stay
    until the caller's record says the stage is trained (`runfolder.drop_work`).
    The training steps' fp32 matrix products run at `matmul_precision` (`precision.matmul_precision`).

    Runs collectively on every rank; only the main process writes files.
    """
    started = time.time()
    trainer.add_callback(CheckpointMarker(trainer.args))  # first: its fsync counts as saving time in the telemetry
    telemetry = Telemetry().attach(trainer)
    progress.attach(trainer, out_dir.name)
    trainer.add_callback(guard := prec.NonFiniteGuard(nonfinite_limit))  # skips and counts non-finite steps
    with prec.matmul_precision(matmul_precision):
        result, resume = _train(trainer, tok, out_dir, telemetry)
    runtime = result.metrics.get("train_runtime", 0.0)
    history = trainer.state.log_history
    losses = [(h["step"], h["loss"]) for h in history if "loss" in h]
    tokens = int(trainer.state.num_input_tokens_seen)
    precision = "bf16" if trainer.args.bf16 or trainer.args.fp16 else "fp32"  # fp16 peaks equal bf16's
    tele = telemetry.summary(trainer.model, tokens, runtime, precision, trainer.accelerator.num_processes)
    if tele["mfu"] is not None and tele["mfu"] < MFU_ALERT:
        log.warning("%s: MFU %.1f%% is under %.0f%% (compute %.1f s, data wait %.1f s, saving %.1f s)", out_dir.name,
                    100 * tele["mfu"], 100 * MFU_ALERT, tele["compute_s"], tele["data_wait_s"], tele["save_s"])
    logged = [(k, v) for h in history for k, v in h.items() if k.startswith(TRACKED) and isinstance(v, int | float)]
    first = dict(reversed(logged))
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
        "nonfinite_steps": guard.count,
        "matmul_precision": matmul_precision,
        "wall_time_s": round(time.time() - started, 2),
        **parallelism(trainer.accelerator),
        **tele,
        **({"first_logged": first, "last_logged": dict(logged)} if logged else {}),
    }


def parallelism(accelerator: Any) -> dict:
    """How the trainer really ran: its world size, distributed type and ZeRO stage (None without DeepSpeed)."""
    plugin = accelerator.state.deepspeed_plugin
    return {"world_size": accelerator.num_processes, "distributed_type": accelerator.distributed_type.value,
            "zero_stage": plugin.zero_stage if plugin else None, "collective_timeout_s": prep.group_timeout_s()}


COMPLETE = ".complete"  # the marker written last into a complete Trainer checkpoint


class _Finished(Exception):
    """The training had already taken its last step when it resumed."""


class NoStepPastTheEnd(TrainerCallback):
    """Before a step: stop when the training has taken all its steps. transformers checks the end only after a
    step, so resuming from the checkpoint of the last step would train one step more than `max_steps`."""

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: D102 - TrainerCallback hook
        if 0 < state.max_steps <= state.global_step:
            raise _Finished


class CheckpointMarker(TrainerCallback):
    """Makes a Trainer checkpoint count only once it is whole on disk. The Trainer calls `on_save` after it has
    written `checkpoint-N` completely (model, optimizer, scheduler, RNG states, trainer_state.json); then every
    rank fsyncs the checkpoint's files and the main process writes the marker, atomically and last, listing each
    file with its size. It also takes over the Trainer's rotation (`save_total_limit`), which runs before
    `on_save`, so that no rotation removes the last marked checkpoint before the new one is marked."""

    def __init__(self, args: Any) -> None:
        self.limit = args.save_total_limit
        args.save_total_limit = None  # rotated here, after the marker

    def on_save(self, args, state, control, **kwargs):  # noqa: D102 - TrainerCallback hook
        folder = checkpoint_dir(Path(args.output_dir), state.global_step)
        lost = main_value(lock_lost(folder) if is_main() else None)  # every rank stops together
        if lost:
            raise LockLost(lost)  # its checkpoint is not marked, and no older one is rotated out
        with main_writes():
            if folder.is_dir():
                fsync_tree(folder)  # each rank the files it wrote (ZeRO shards, RNG states), shared storage or not
        with main_writes() as main:
            if main and folder.is_dir():
                mark_checkpoint(folder, state.global_step)
                self._rotate(Path(args.output_dir))
        return control

    def _rotate(self, work_dir: Path) -> None:
        if not self.limit or self.limit <= 0:
            return
        marked = [p for _, p in checkpoints(work_dir) if (p / COMPLETE).is_file()]
        for old in marked[: -self.limit]:
            shutil.rmtree(old, ignore_errors=True)


def save_seconds(checkpoint: Path) -> float:
    """About how long writing the complete `checkpoint` took: from its first file to its marker, written last, by
    their modification times (the storage's clock). A requeued job's first save is guarded with it (`preempt`)."""
    times = [f.stat().st_mtime for f in Path(checkpoint).rglob("*") if f.is_file()]
    return max(times) - min(times)


def mark_checkpoint(folder: Path, step: int) -> None:
    """Write `folder/COMPLETE` (atomically, fsynced): the step and every file of the checkpoint with its size."""
    files = {f.relative_to(folder).as_posix(): f.stat().st_size for f in sorted(folder.rglob("*"))
             if f.is_file() and not f.name.startswith(f".{COMPLETE}") and f.name != COMPLETE}
    write_json(folder / COMPLETE, {"step": step, "files": files})
    fsync_tree(folder.parent, files=False)  # the checkpoint's own entry in work/


def checkpoint_problem(path: Path) -> str | None:
    """Why the Trainer checkpoint `path` cannot be resumed from (None: it is complete): a file its marker lists
    missing or of another size, or a trainer_state.json that does not parse. Without a readable marker (cut short
    before it, saved by a version that wrote none, or the marker itself damaged) the files are read instead
    (`_unproven`)."""
    marker = read_json(path / COMPLETE)
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        return _unproven(path)
    for name, size in marker["files"].items():
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as err:
            return f"{name} cannot be read ({err.strerror})"
        if actual != size:
            return f"{name} has {actual} bytes, {size} when saved"
    if read_json(path / "trainer_state.json") is None:
        return "its trainer_state.json does not parse"
    return None


def _unproven(path: Path) -> str | None:
    """Why the checkpoint `path`, which has no readable marker, is not whole when its files are read: the Trainer
    writes trainer_state.json last, so it must parse and name this step; every safetensors file's header must
    parse and its tensors fit the file, every torch file be a whole zip archive; an optimizer needs its scheduler
    beside it (the Trainer loads both or neither). None: it is whole."""
    from safetensors import safe_open

    state = read_json(path / "trainer_state.json")
    step = path.name.rpartition("-")[2]
    if not isinstance(state, dict) or str(state.get("global_step")) != step:
        return f"no completion marker, and no trainer_state.json of step {step}: cut short"
    for file in sorted(f for f in path.rglob("*") if f.is_file()):
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), "pt"):
                    pass
            elif file.suffix in (".pt", ".pth", ".bin"):
                with zipfile.ZipFile(file):
                    pass
        except Exception as err:  # noqa: BLE001 - each reader has its own errors: the file is not whole
            return f"no completion marker, and {file.relative_to(path)} cannot be read ({err})"
    if (path / "optimizer.pt").is_file() and not (path / "scheduler.pt").is_file():
        return "no completion marker, and scheduler.pt is missing beside optimizer.pt"
    return None


def last_complete_checkpoint(work_dir: Path) -> str | None:
    """The newest `checkpoint-N` that is complete (`checkpoint_problem`); each newer one is set aside, renamed
    `incomplete-checkpoint-N` (kept, never deleted: delete it once you have looked), with a warning, so training
    resumes from the one before it and no rotation keeps a broken one."""
    if not work_dir.is_dir():
        return None
    for _, path in reversed(checkpoints(work_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        aside, copies = path.with_name(f"incomplete-{path.name}"), 1
        while aside.exists():
            copies += 1
            aside = path.with_name(f"incomplete-{path.name}-{copies}")
        path.rename(aside)
        log.warning("setting aside checkpoint %s (%s) as %s; resuming from the one before", path, problem,
                    aside.name)
    return None


def save_checkpoint(out: Path, write: Callable[[Path], None], every_rank: bool = False) -> None:
    """Write the checkpoint folder `out` atomically: `write(tmp)` fills a temporary folder beside it (on the
    main process, or on every rank when the save is collective, e.g. gathering ZeRO-3 shards), then the main
    process renames it into place. Every rank calls this; every rank returns once `out` is whole."""
    tmp = Path(main_value(str(temp_name(out))))  # the main process's: a leftover names its host and pid
    main = is_main()
    try:
        with main_writes():
            if main or every_rank:
                write(tmp)
        with main_writes():
            if main:
                (tmp / "training_args.bin").unlink(missing_ok=True)
                commit_dir(tmp, out)
    except BaseException:
        if main:  # other ranks must not touch the folder the main process writes
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_trained(trainer: Any, tok: Any, out: Path) -> None:
    """Save a trainer's model as a full, plain HF checkpoint to `out` atomically (a LoRA adapter merged in)."""
    if not hasattr(trainer.model, "merge_and_unload"):
        save_checkpoint(out, lambda tmp: trainer.save_model(str(tmp)), every_rank=True)
        return

    def merged(tmp: Path) -> None:
        with _gathered(trainer.model):
            if is_main():
                trainer.model.merge_and_unload().save_pretrained(tmp)
                tok.save_pretrained(tmp)
    save_checkpoint(out, merged, every_rank=True)


def _gathered(model: Any) -> contextlib.AbstractContextManager:
    """Under ZeRO-3 (each rank holds a shard of every weight): the full weights while inside, on every rank."""
    if not is_deepspeed_zero3_enabled():
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


@contextlib.contextmanager
def disk_errors_explained(out: Path) -> Iterator[None]:
    """Turn a full or size-capped disk while writing checkpoints into one clear error (exit code 4)."""
    try:
        yield
    except Exception as err:
        full = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        if not (full or any(s in str(err) for s in ("No space left", "File too large", "Disk quota"))):
            raise
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[-1]
        raise TrainingFailed(f"could not write the checkpoint {out} or its training checkpoints: {reason}; the "
                          "previous checkpoint (if any) is intact - free space and rerun the same command") from None
