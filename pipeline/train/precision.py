"""Training precision, non-finite steps and the long-context memory switches.

Mixed precision keeps FP32 master weights: wherever the optimizer holds the weights (one device, DDP)
the model loads in fp32 and the Trainer autocasts to bf16 (or fp16 with dynamic loss scaling), so AdamW's
weights and states stay fp32. Under DeepSpeed, which keeps its own FP32 masters, the weights load in the
training dtype. `model.load_dtype=bf16` asks for bf16 weights anyway (pure bf16: half the memory, bf16
optimizer states). On CPU `bf16` runs torch's CPU autocast (fp32 parameters and Adam states); fp16 needs CUDA.

A step whose gradients are not finite (a NaN/inf loss backpropagates into them) is skipped: `NonFiniteGuard`
drops every gradient before the optimizer step (torch optimizers leave a parameter without a gradient
untouched, its Adam moments included) and counts it; past the stage's `nonfinite_limit` the stage stops
with `NonFiniteLimit` (exit code 4: change the recipe, e.g. the learning rate, and redo the stage).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import platform
from collections.abc import Iterator
from typing import Any

import torch
from transformers import TrainerCallback

from pipeline.errors import ConfigError, TrainingFailed

log = logging.getLogger("pipeline")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class NonFiniteLimit(TrainingFailed):
    """More non-finite steps than the stage allows: the run stops (exit code 4)."""


def mixed_precision(precision: str) -> str:
    """The autocast mode for `model.precision`: 'bf16', 'fp16' or 'no' (fp32).

    auto: bf16 on a bf16-capable GPU, else fp32. bf16 also runs on CPU (CPU autocast). fp16 (dynamic loss
    scaling, for GPUs without bf16) needs CUDA.
    """
    cuda = torch.cuda.is_available()
    bf16_gpu = cuda and torch.cuda.is_bf16_supported()
    if precision == "auto":
        return "bf16" if bf16_gpu else "no"
    if precision == "bf16" and cuda and not bf16_gpu:
        raise ConfigError("model.precision=bf16 but this GPU has no bf16; use fp16 (dynamic loss scaling) or fp32")
    if precision == "fp16" and not cuda:
        raise ConfigError("model.precision=fp16 needs a CUDA GPU (loss scaling); on CPU use bf16 or fp32")
    return "no" if precision == "fp32" else precision


def emulated_bf16(precision: str) -> bool:
    """Whether `precision` trains under bf16 autocast on an x86 CPU without native bf16 products (neither
    avx512_bf16 nor AMX), where torch emulates them: on 2 AVX2 cores SmolLM2-135M's SFT ran at 6 tokens/s under
    bf16 against 89 in fp32."""
    return (mixed_precision(precision) == "bf16" and not torch.cuda.is_available()
            and platform.machine().lower() in ("x86_64", "amd64")
            and not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))


def trainer_flags(precision: str) -> dict:
    """The Trainer's `bf16` / `fp16` flags for `model.precision` (autocast over the weights as loaded)."""
    mode = mixed_precision(precision)
    return {"bf16": mode == "bf16", "fp16": mode == "fp16"}


def load_dtype(model_cfg: Any, deepspeed: bool) -> torch.dtype:
    """The dtype to load weights in: `model.load_dtype`, or for `auto` fp32 master weights unless DeepSpeed
    (which keeps FP32 masters itself) trains them, then the training dtype."""
    mode = mixed_precision(model_cfg.precision)
    if model_cfg.load_dtype != "auto":
        return DTYPES[model_cfg.load_dtype]
    return DTYPES[mode] if deepspeed and mode != "no" else torch.float32


def inference_dtype(precision: str) -> torch.dtype:
    """The dtype a checkpoint is loaded in for generation and evaluation: the autocast dtype on a GPU, else fp32."""
    mode = mixed_precision(precision)
    return DTYPES[mode] if torch.cuda.is_available() and mode != "no" else torch.float32


@contextlib.contextmanager
def matmul_precision(value: str) -> Iterator[None]:
    """While inside, fp32 matrix products run at `value` (`torch.set_float32_matmul_precision`); restored after.

    `medium` computes them from bf16 inputs with fp32 sums (AMX / avx512_bf16 on CPU, tensor cores on GPU); the
    weights, activations and optimizer states stay fp32. On CPU sdpa's fused attention backward becomes several
    times slower under it, so pair it with `attn_implementation=eager` there.
    """
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def memory_args(stage: Any) -> dict:
    """Trainer arguments for the stage's memory switches: Liger kernels (CUDA + liger-kernel) and TRL's
    activation offloading (only for stages whose schema has it: SFT, mid-training, DPO)."""
    if stage.use_liger_kernel and not torch.cuda.is_available():
        raise ConfigError("use_liger_kernel=true needs a CUDA GPU (Liger's kernels are Triton); set it false on CPU")
    if stage.use_liger_kernel and importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("use_liger_kernel=true but liger-kernel is not installed: pip install liger-kernel")
    if stage.get("activation_offloading") and not torch.cuda.is_available():
        raise ConfigError("activation_offloading=true needs a CUDA GPU (TRL moves activations from the accelerator to "
                          "CPU memory); set it false on CPU")
    offload = {"activation_offloading": stage.activation_offloading} if "activation_offloading" in stage else {}
    return {"use_liger_kernel": stage.use_liger_kernel, **offload}


class NonFiniteGuard(TrainerCallback):
    """Skip and count optimizer steps with non-finite gradients; stop past `limit` of them.

    Runs after gradient clipping (which turns a single inf into NaN everywhere) and, under DDP, after the
    all-reduce, so every rank skips the same steps. fp16's GradScaler already skips overflow steps and lowers
    its scale (normal while the scale settles), so under fp16 the guard leaves them to it. Under DeepSpeed
    the gradients live in the engine and are not visible here.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs) -> None:
        """Drop every gradient when one is not finite, so the optimizer leaves the weights as they are."""
        if args.fp16 or model is None:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads or torch.stack([torch.isfinite(g).all() for g in grads]).all():
            return
        self.count += 1
        for p in model.parameters():
            p.grad = None
        log.warning("step %d: non-finite gradient, update skipped (%d so far, limit %d)", state.global_step + 1,
                    self.count, self.limit)
        if self.count > self.limit:
            raise NonFiniteLimit(f"{self.count} optimizer steps had non-finite losses or gradients (nonfinite_limit="
                                 f"{self.limit}); the training diverged: lower the learning rate, raise warmup or use "
                                 "fp32/bf16 and add redo=[<stage>] (the stage trains again from its input), or "
                                 "raise nonfinite_limit and rerun (it resumes from the last checkpoint)")
