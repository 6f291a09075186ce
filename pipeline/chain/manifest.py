"""The run manifest: code version, package versions, hardware, data fingerprints and seeds."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from pipeline import redact

PACKAGE = Path(__file__).resolve().parents[1]  # the `pipeline` folder: a checkout's, or an installed package's
PACKAGES = ("torch", "transformers", "trl", "peft", "datasets", "accelerate", "deepspeed", "lm_eval", "omegaconf")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(PACKAGE.parent), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _version() -> str | None:
    try:
        return importlib.metadata.version("smol-pipeline")
    except importlib.metadata.PackageNotFoundError:
        return None


def code_version() -> dict:
    """The code that runs: the package's version and folder, and where that folder is a git checkout's (the top of
    its work tree, not an installed package, even one inside another repository) the commit and whether the work
    tree had uncommitted changes; both None elsewhere."""
    checkout = _git("rev-parse", "--show-toplevel") == str(PACKAGE.parent)
    return {"version": _version(), "path": str(PACKAGE),
            "git_commit": _git("rev-parse", "HEAD") or None if checkout else None,
            "git_dirty": bool(_git("status", "--porcelain")) if checkout else None}


def package_versions() -> dict:
    """Installed versions of the libraries the pipeline runs on."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu_model() -> str | None:
    """The CPU's model name (`/proc/cpuinfo` on x86 Linux), else what `platform` reports (e.g. `aarch64`)."""
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine() or None


def hardware() -> dict:
    """Host, CPU (model and the instruction set torch's kernels use: fp32 results differ between them, and
    small models' training amplifies that), CPU count and accelerators visible to this process."""
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"host": platform.node(), "platform": platform.platform(), "python": sys.version.split()[0],
            "cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "gpus": gpus,
            "world_size": int(os.environ.get("WORLD_SIZE", 1))}


def build(cfg, argv: list[str], data: dict, run_dir: Path) -> dict:
    """The manifest of one invocation of the pipeline on `run_dir` (secret arguments redacted)."""
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": redact.argv(argv),
        "recipe": cfg.recipe,
        "run_dir": str(run_dir),
        "code": code_version(),
        "packages": package_versions(),
        "hardware": hardware(),
        "seeds": {"run": cfg.seed},
        "deterministic": cfg.deterministic,
        "data": data,
    }
