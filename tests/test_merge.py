"""Weight averaging: soup and linear merge of tiny random Llama checkpoints (no Hub)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from pipeline.chain.merge import linear_merge, load_weights, soup


def tiny_model(path: Path, seed: int, intermediate_size: int = 32, **save_kwargs) -> Path:
    """Save a tiny random Llama (tied embeddings) with weights drawn from `seed` into `path`."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=intermediate_size, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path, **save_kwargs)
    return path


@pytest.fixture
def models(tmp_path: Path) -> list[Path]:
    return [tiny_model(tmp_path / f"m{seed}", seed) for seed in (1, 2, 3)]


def assert_combination(out: Path, models: list[Path], weights: list[float]) -> None:
    merged, inputs = load_weights(out), [load_weights(m) for m in models]
    assert set(merged) == set(inputs[0])
    for name, tensor in merged.items():
        expected = sum(w * t[name] for w, t in zip(weights, inputs, strict=True))
        assert tensor.dtype == inputs[0][name].dtype
        assert torch.allclose(tensor, expected, atol=1e-6), name


def test_soup_is_elementwise_mean(models: list[Path], tmp_path: Path) -> None:
    soup(models[:2], tmp_path / "soup")
    assert_combination(tmp_path / "soup", models[:2], [0.5, 0.5])
    soup(models, tmp_path / "soup3")
    assert_combination(tmp_path / "soup3", models, [1 / 3] * 3)


def test_linear_merge_weights_and_loadable(models: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "merged"
    linear_merge(models[:2], [0.9, 0.1], out)
    assert_combination(out, models[:2], [0.9, 0.1])
    assert (out / "generation_config.json").read_bytes() == (models[0] / "generation_config.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert not list(tmp_path.glob(".merged.tmp-*"))
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 64) and torch.isfinite(logits).all()


def test_bad_weights_and_shapes_raise(models: list[Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sum to 1"):
        linear_merge(models[:2], [0.9, 0.2], tmp_path / "bad")
    with pytest.raises(ValueError, match="one weight per model"):
        linear_merge(models[:2], [1.0], tmp_path / "bad")
    wide = tiny_model(tmp_path / "wide", 4, intermediate_size=48)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight"):
        linear_merge([models[0], wide], [0.5, 0.5], tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_sharded_input_merges_like_unsharded(models: list[Path], tmp_path: Path) -> None:
    sharded = tiny_model(tmp_path / "sharded", 1, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    linear_merge([sharded, models[1]], [0.9, 0.1], tmp_path / "from_sharded")
    linear_merge([models[0], models[1]], [0.9, 0.1], tmp_path / "from_single")
    assert sorted(p.name for p in (tmp_path / "from_sharded").iterdir() if p.suffix == ".safetensors") == [
        "model.safetensors"]
    a, b = load_weights(tmp_path / "from_sharded"), load_weights(tmp_path / "from_single")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
