"""Training telemetry: effective tokens/s, padding, MFU, step-time breakdown, memory, alerts that ranks agree on.

`Telemetry` is a TrainerCallback plus a collator wrapper and forward hooks. Times are taken with device
synchronisation (GPU) at step boundaries: `forward_s` (the model's forward passes, timed by hooks),
`backward_s` (the rest of step begin to the optimizer step: backward and gradient clipping),
`optimizer_s` (optimizer step, scheduler, zeroing), `data_wait_s` (between steps, fetching batches),
`eval_s` and `save_s` (the Trainer's evaluation and checkpointing); `compute_s` is forward + backward +
optimizer. MFU uses model FLOPs per token (6 x parameters, counted in full under ZeRO-3, + the attention
term 12 x layers x hidden x sequence length) against the device's peak for the training precision; on a
device not in the table (every CPU) it is None, never invented.

The memory alert compares the memory the steps need with the device's total after every step: on a GPU the
peak allocated since the training began, on CPU the process's resident memory now against physical memory
(not its lifetime peak, which an earlier stage or evaluation may have set). The ranks all-reduce
the verdict, so every rank saves the same checkpoint and stops at the same step, with its own exit code
(`errors.MemoryAlert`). `PIPELINE_TEST_MEMORY_LIMIT=RANK:LIMIT` (tests only) lowers the limit on one rank.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from typing import Any

import psutil
import torch
from accelerate import PartialState
from transformers import TrainerCallback

from pipeline.distributed import any_rank
from pipeline.train.flops import flops_per_token, peak_flops

log = logging.getLogger("pipeline")

MEMORY_LIMIT = 0.90  # of the device's memory: save and stop above it


class CountingCollator:
    """Wraps a data collator to count real (non-padding) and total token slots per batch.

    Counts what the data loader collates, which can run one batch ahead of the last step trained.
    """

    def __init__(self, inner: Any, pad_id: int | None) -> None:
        self.inner, self.pad_id, self.real, self.total, self.samples = inner, pad_id, 0, 0, 0

    def __call__(self, examples: list) -> dict:
        batch = self.inner(examples)
        ids = batch.get("input_ids") if hasattr(batch, "get") else None  # GRPO batches are lists of rows
        if ids is not None:
            mask = batch.get("attention_mask")
            if mask is None:  # padding-free batches: like the Trainer's own count, pad ids are padding
                mask = ids != self.pad_id if self.pad_id is not None else torch.ones_like(ids)
            self.total += ids.numel()
            self.real += int(mask.sum())
        self.samples += len(examples)
        return batch


def memory_in_use() -> float:
    """The memory training steps need, as a fraction of the device's: the peak allocated since the training began
    (GPU) or the process's resident memory now (CPU)."""
    if torch.cuda.is_available():
        return memory_used()
    return psutil.Process().memory_info().rss / psutil.virtual_memory().total


def memory_used() -> float:
    """Peak memory of this process as a fraction of the device's: allocated (GPU) or resident (CPU)."""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return torch.cuda.max_memory_allocated() / total
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / physical


def memory_limit() -> float:
    """The stop threshold for this rank: MEMORY_LIMIT, or the test override `PIPELINE_TEST_MEMORY_LIMIT=RANK:LIMIT`."""
    rank, _, limit = os.environ.get("PIPELINE_TEST_MEMORY_LIMIT", "").partition(":")
    return float(limit) if rank and int(rank) == PartialState().process_index else MEMORY_LIMIT


def full_numel(model: Any) -> int:
    """Parameters of the whole model: ZeRO-3 leaves each rank an empty shard (`numel` 0), `ds_numel` is the full."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


class Telemetry(TrainerCallback):
    """Step-time breakdown, memory and alerts for one training run (attach with `attach`)."""

    def __init__(self) -> None:
        self.times = dict.fromkeys(("forward", "backward", "optimizer", "data_wait", "eval", "save"), 0.0)
        self.steps = 0
        self.memory_stop = False
        self.collator: CountingCollator | None = None
        self._mark = self._begin = self._optimizer = None  # last boundary, step begin, optimizer step begin
        self._forward = self._forward_start = 0.0  # forward seconds in the current step; start of the running one

    def attach(self, trainer: Any) -> Telemetry:
        """Hook into a trainer: callback, token-counting collator and forward timers on the model."""
        self.collator = CountingCollator(trainer.data_collator, getattr(trainer.processing_class, "pad_token_id", None))
        trainer.data_collator = self.collator
        trainer.add_callback(self)
        trainer.model.register_forward_pre_hook(self._forward_begins)
        trainer.model.register_forward_hook(self._forward_ends)
        return self

    def _forward_begins(self, module: Any, args: Any) -> None:
        self._forward_start = _now()

    def _forward_ends(self, module: Any, args: Any, output: Any) -> None:
        self._forward += _now() - self._forward_start

    def _lap(self, key: str) -> float:
        """Add the time since the last boundary to `key`; return now, the new boundary."""
        now = _now()
        self.times[key] += now - (self._mark or now)
        self._mark = now
        return now

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: D102 - TrainerCallback hook
        self._mark = _now()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: D102
        self._begin = self._lap("data_wait")
        self._forward, self._optimizer = 0.0, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # noqa: D102
        self._optimizer = _now()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: D102
        now = _now()
        split = self._optimizer or now  # no optimizer callback (some engines): all of it counts as backward
        self.times["forward"] += self._forward
        self.times["backward"] += max(split - self._begin - self._forward, 0.0)
        self.times["optimizer"] += now - split
        self._mark = now
        self.steps += 1
        used, limit = memory_in_use(), memory_limit()
        if any_rank(used > limit):
            log.error("device memory over %.0f%% on a rank (here %.0f%%) at step %d: saving a checkpoint and stopping "
                      "on every rank", 100 * limit, 100 * used, state.global_step)
            self.memory_stop = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_evaluate(self, args, state, control, **kwargs):  # noqa: D102
        self._lap("eval")

    def on_save(self, args, state, control, **kwargs):  # noqa: D102
        self._lap("save")

    def summary(self, model: Any, tokens: int, runtime: float, precision: str, world_size: int) -> dict:
        """The stage's telemetry fields (stage.json, log, leaderboard)."""
        c = self.collator
        real = c.real if c and c.total else tokens
        seq_len = real / max(c.samples, 1) if c else 0.0
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        peak = peak_flops(device, precision)
        mfu = None
        if peak and runtime > 0 and tokens:
            per_token = flops_per_token(full_numel(model), model.config.num_hidden_layers, model.config.hidden_size,
                                        seq_len)
            mfu = round(tokens * per_token / (runtime * peak * world_size), 4)
        t = self.times
        return {
            "samples": c.samples if c else None,
            "tokens_in_batches": c.real if c else None,
            "samples_per_s": round(c.samples / runtime, 2) if c and runtime else None,
            "padding_fraction": round(1 - c.real / c.total, 4) if c and c.total else None,
            "mfu": mfu,
            "device": device or "cpu",
            "compute_s": round(t["forward"] + t["backward"] + t["optimizer"], 2),
            **{f"{k}_s": round(v, 2) for k, v in t.items()},
            "peak_memory_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if device else None,
            "peak_memory_fraction": round(memory_used(), 4),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        }
