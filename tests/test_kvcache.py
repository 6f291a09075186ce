"""`BufferedLayer` (pipeline/generation/kvcache.py) gives the logits transformers' own dynamic cache gives."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, DynamicLayer, MistralConfig

from pipeline.evaluation import lmeval_fast
from pipeline.generation.kvcache import BufferedLayer, buffered_cache


def _decode(model, cache, steps: int) -> list[torch.Tensor]:
    """Greedy logits of a left-padded batch over `steps` steps, half the rows leaving half-way."""
    torch.manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (6, 9))
    mask = torch.ones_like(ids)
    mask[:3, :4] = 0
    with torch.no_grad():
        position = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        logits = [model(input_ids=ids, attention_mask=mask, position_ids=position, past_key_values=cache).logits]
        for step in range(steps):
            tokens = logits[-1][:, -1].argmax(-1)
            if step == steps // 2:
                keep = torch.tensor([0, 2, 5])
                cache.batch_select_indices(keep)
                tokens, mask = tokens[keep], mask[keep]
            mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=-1)
            logits.append(model(input_ids=tokens[:, None], attention_mask=mask, past_key_values=cache,
                                position_ids=mask.sum(-1, keepdim=True) - 1).logits)
    return logits


@pytest.mark.slow
def test_logits_equal_the_dynamic_caches(tiny_base):
    model = AutoModelForCausalLM.from_pretrained(tiny_base).eval()
    cache = buffered_cache(model.config, 9 + 12)
    assert all(isinstance(layer, BufferedLayer) for layer in cache.layers)
    ours = _decode(model, cache, 12)
    theirs = _decode(model, DynamicCache(config=model.config), 12)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert cache.get_seq_length() == 9 + 12 and cache.layers[0].keys.shape[0] == 3


def test_sliding_window_layers_stay_as_they_are():
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    cache = buffered_cache(config, 32)
    assert [type(layer) for layer in cache.layers] == [type(layer) for layer in DynamicCache(config=config).layers]
    assert not any(type(layer) is DynamicLayer or isinstance(layer, BufferedLayer) for layer in cache.layers)


def test_a_changed_dynamic_layer_turns_fast_generation_off(monkeypatch):
    """`BufferedLayer` builds on `DynamicLayer`'s methods: one renamed or with other parameters is drift."""
    assert lmeval_fast.drift() is None
    monkeypatch.setattr(DynamicLayer, "lazy_initialization", None)
    assert lmeval_fast.drift() == "transformers.DynamicLayer.lazy_initialization"
    monkeypatch.undo()
    monkeypatch.setattr(DynamicLayer, "update", lambda self, key_states, value_states: (key_states, value_states))
    assert lmeval_fast.drift() == "transformers.DynamicLayer.update"
