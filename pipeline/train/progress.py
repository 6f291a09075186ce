"""What a trainer shows while it trains: one line per logging step in the log (`01-sft: step 40/200, loss 1.094,
13,100 tokens/s, ETA 45 s`), a progress bar instead on a terminal, and the trainer's full record of each step in
`pipeline.log` only (`pipeline.logs.detail`). Replaces transformers' printer and progress callbacks, which print
each step's record as a Python dict.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from transformers import PrinterCallback, ProgressCallback, TrainerCallback

from pipeline.logs import detail, duration

log = logging.getLogger("pipeline")
# figures worth a person's glance besides the loss, as the TRL trainers log them: (key, label)
EXTRAS = (("rewards/margins", "reward margin"), ("rewards/accuracies", "pair accuracy"), ("reward", "reward"))


class StepLines(TrainerCallback):
    """Logs one compact line per logging step (to the terminal too when `terminal`), and the full record to the
    log file."""

    def __init__(self, label: str, terminal: bool) -> None:
        self.label, self.terminal = label, terminal
        self.started = self.last_time = 0.0
        self.first_step = self.last_tokens = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.started = self.last_time = time.time()
        self.first_step, self.last_tokens = state.global_step, state.num_input_tokens_seen or 0

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        record = {k: v for k, v in logs.items() if k != "total_flos"}
        detail("%s: step %d: %s", self.label, state.global_step, ", ".join(f"{k}={v}" for k, v in record.items()))
        if "loss" not in record:  # the closing summary: the stage's own line says it
            return
        line = self.line(state, record)
        (log.info if self.terminal else detail)(line)

    def line(self, state: Any, record: dict) -> str:
        """`LABEL: step S/N, loss L[, extras], T tokens/s, ETA E` for the record logged at the current step."""
        now, step, total = time.time(), state.global_step, state.max_steps
        parts = [f"{self.label}: step {step}/{total}", f"loss {record['loss']:.3f}"]
        parts += [f"{label} {record[key]:.3f}" for key, label in EXTRAS if isinstance(record.get(key), (int, float))]
        tokens = record.get("num_input_tokens_seen", state.num_input_tokens_seen) or 0
        if tokens > self.last_tokens and now > self.last_time:
            parts.append(f"{(tokens - self.last_tokens) / (now - self.last_time):,.0f} tokens/s")
        if step > self.first_step and total > step:
            parts.append(f"ETA {duration((now - self.started) / (step - self.first_step) * (total - step))}")
        self.last_time, self.last_tokens = now, tokens
        return ", ".join(parts)


class _Bar(ProgressCallback):
    """transformers' progress bar without its printing of each step's record."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        return None


def attach(trainer: Any, label: str) -> None:
    """Give `trainer` our step lines (and a progress bar where it would show one) in place of its printer."""
    bar = trainer.args.disable_tqdm is False
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if bar:
        trainer.add_callback(_Bar())
    trainer.add_callback(StepLines(label, terminal=not bar))
