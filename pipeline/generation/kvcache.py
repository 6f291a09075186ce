"""A KV cache for greedy generation that writes in place where transformers' `DynamicLayer` concatenates.

`DynamicLayer.update` appends each step's keys and values with `torch.cat`, which copies the whole cache every
step in every layer. `BufferedLayer` allocates each layer's buffers once, for the whole generation, and hands
attention views of the filled part: bitwise the same logits.
Our greedy loop (`generator.greedy_until`) uses it for lm-eval's greedy requests, with `eval.fast_generation` on and
only while `lmeval_fast.drift()` finds the `DynamicLayer` / `DynamicCache` methods it builds on as expected.
"""

from __future__ import annotations

from typing import Any

from transformers import DynamicCache, DynamicLayer


class BufferedLayer(DynamicLayer):
    """A `DynamicLayer` that writes each step's keys and values into buffers sized for the whole generation,
    where `DynamicLayer` concatenates them (a copy of the whole cache per step and layer). Its keys and values
    are views of the filled part: attention sees the same numbers (bitwise the same logits, measured)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Write the new states after the cached ones; return keys and values so far."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.key_buffer = key_states.new_empty((*key_states.shape[:2], self.capacity, key_states.shape[3]))
            self.value_buffer = value_states.new_empty((*value_states.shape[:2], self.capacity, value_states.shape[3]))
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: Any) -> None:
        """Keep the rows `indices` of the batch."""
        if not self.is_initialized:  # a layer that reads another's cache (KV sharing) holds none
            return
        end = self.get_seq_length()
        self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]


def buffered_cache(config: Any, capacity: int) -> DynamicCache:
    """The dynamic cache `generate` builds for a model with `config`, its full-attention layers `BufferedLayer`s
    of `capacity` positions (sliding-window and other layers as they are)."""
    cache = DynamicCache(config=config.get_text_config(decoder=True))
    cache.layers = [BufferedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
