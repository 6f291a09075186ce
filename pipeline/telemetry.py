"""Training telemetry: effective tokens/s, padding, MFU, step-time breakdown, peak memory, alerts.

`Telemetry` is a TrainerCallback plus a collator wrapper. Times are taken with device
synchronisation at step boundaries: `compute_s` is forward + backward + optimizer (step begin to
step end), `data_wait_s` the time between steps spent fetching batches (saving excluded, measured
apart as `save_s`). MFU uses model FLOPs per token (6 x parameters + the attention term
12 x layers x hidden x sequence length, forward + backward) against the device's peak for the
training precision; on a device not in the table (every CPU) it is None, never invented.
"""

from __future__ import annotations

import logging
import resource
import time
from typing import Any

import torch
from transformers import TrainerCallback

from pipeline.flops import flops_per_token, peak_flops

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


class Telemetry(TrainerCallback):
    """Step-time breakdown, memory and alerts for one training run (attach with `attach`)."""

    def __init__(self) -> None:
        self.compute = self.between = self.saving = 0.0
        self.steps = 0
        self._begin = self._end = None
        self.memory_stop = False
        self.collator: CountingCollator | None = None

    def attach(self, trainer: Any) -> Telemetry:
        """Hook into a trainer: callback plus token-counting collator."""
        self.collator = CountingCollator(trainer.data_collator, getattr(trainer.processing_class, "pad_token_id", None))
        trainer.data_collator = self.collator
        trainer.add_callback(self)
        return self

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: D102 - TrainerCallback hook
        self._end = self._now()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: D102
        now = self._now()
        self.between += now - (self._end or now)
        self._begin = now

    def on_step_end(self, args, state, control, **kwargs):  # noqa: D102
        self._end = self._now()
        self.compute += self._end - (self._begin or self._end)
        self.steps += 1
        if torch.cuda.is_available():
            used = torch.cuda.memory_reserved() / torch.cuda.get_device_properties(0).total_memory
            if used > MEMORY_LIMIT:
                log.error("device memory at %.0f%% (> %.0f%%): saving a checkpoint and stopping; lower the batch "
                          "size or max_length, then rerun to resume", 100 * used, 100 * MEMORY_LIMIT)
                self.memory_stop = True
                control.should_save = True
                control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):  # noqa: D102
        now = self._now()
        self.saving += now - (self._end or now)
        self._end = now

    def summary(self, model: Any, tokens: int, runtime: float, precision: str, world_size: int) -> dict:
        """The stage's telemetry fields (stage.json, log, leaderboard)."""
        c = self.collator
        real = c.real if c and c.total else tokens
        seq_len = real / max(c.samples, 1) if c else 0.0
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        peak = peak_flops(device, precision)
        mfu = None
        if peak and runtime > 0 and tokens:
            per_token = flops_per_token(sum(p.numel() for p in model.parameters()), model.config.num_hidden_layers,
                                        model.config.hidden_size, seq_len)
            mfu = round(tokens * per_token / (runtime * peak * world_size), 4)
        return {
            "samples": c.samples if c else None,
            "tokens_in_batches": c.real if c else None,
            "samples_per_s": round(c.samples / runtime, 2) if c and runtime else None,
            "padding_fraction": round(1 - c.real / c.total, 4) if c and c.total else None,
            "mfu": mfu,
            "device": device or "cpu",
            "compute_s": round(self.compute, 2),
            "data_wait_s": round(max(self.between - self.saving, 0.0), 2),
            "save_s": round(self.saving, 2),
            "peak_memory_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if device else None,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        }
