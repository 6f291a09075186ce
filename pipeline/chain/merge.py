"""Weight averaging for the DPO stage: a uniform "soup" of checkpoints and a weighted linear merge.

SmolLM3 recipe: soup the APO checkpoints, then `linear_merge([soup, mid], [0.9, 0.1])`.
mergekit 0.1.5 was checked and its pins do not conflict with ours (transformers<6,>=5.0, accelerate<2,
peft>=0.18, torch>=2.0, pydantic<3), but it would add immutables, protobuf and sentencepiece for what
is a weighted sum of tensors, so this small dependency-free implementation is used instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.files import atomic_dir

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _weight_files(model: Path) -> list[Path]:
    if (model / WEIGHTS).is_file():
        return [model / WEIGHTS]
    if (model / INDEX).is_file():
        shards = json.loads((model / INDEX).read_text(encoding="utf-8"))["weight_map"].values()
        return [model / name for name in sorted(set(shards))]
    raise FileNotFoundError(f"{model}: neither {WEIGHTS} nor {INDEX}")


def load_weights(model: Path) -> dict[str, torch.Tensor]:
    """All tensors of the HF checkpoint folder `model` (single `model.safetensors` or sharded with an index)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(model)):
        tensors.update(load_file(file))
    return tensors


def _check_same(ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor], model: Path) -> None:
    for name in sorted(set(ref) | set(other)):
        if name not in ref or name not in other or ref[name].shape != other[name].shape:
            got = tuple(other[name].shape) if name in other else "missing"
            want = tuple(ref[name].shape) if name in ref else "missing"
            raise ValueError(f"tensor {name!r} mismatch in {model}: {got} vs {want} in the first model")


def linear_merge(models: list[Path], weights: list[float], out: Path) -> None:
    """Write to `out` the checkpoint sum_i weights[i] * models[i], tensor by tensor.

    Sums are computed in float32 and cast back to each tensor's dtype in the first model. The weights must sum
    to 1 (within 1e-6) and every model must hold the same tensor names and shapes, else ValueError. `out` gets
    one `model.safetensors` plus every non-weight file (config, tokenizer, chat template, ...) of the first
    model, written atomically.
    """
    models = [Path(m) for m in models]
    if not models or len(models) != len(weights):
        raise ValueError(f"need one weight per model, got {len(models)} models and {len(weights)} weights")
    if abs(sum(weights) - 1.0) > 1e-6:
        raise ValueError(f"merge weights must sum to 1, got {sum(weights)} from {weights}")
    first = load_weights(models[0])
    dtypes = {name: t.dtype for name, t in first.items()}
    acc = {name: t.float() * weights[0] for name, t in first.items()}
    del first
    for model, weight in zip(models[1:], weights[1:], strict=True):
        tensors = load_weights(model)
        _check_same(acc, tensors, model)
        for name, t in tensors.items():
            acc[name] += t.float() * weight
        del tensors
    skip = {WEIGHTS, INDEX, *(f.name for f in _weight_files(models[0]))}
    with atomic_dir(Path(out)) as tmp:
        merged = {name: t.to(dtypes[name]).contiguous() for name, t in acc.items()}
        save_file(merged, str(tmp / WEIGHTS), metadata={"format": "pt"})
        for file in models[0].iterdir():
            if file.is_file() and file.name not in skip:
                shutil.copy2(file, tmp / file.name)


def soup(models: list[Path], out: Path) -> None:
    """Write to `out` the uniform average of `models` (a model soup); see `linear_merge`."""
    linear_merge(models, [1.0 / len(models)] * len(models) if models else [], out)
