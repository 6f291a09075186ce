"""Left-padded batched generation from chat prompts: the one implementation behind on-policy sampling
and held-out scoring."""

from __future__ import annotations

from typing import Any

import torch

Chat = list[dict]


@torch.no_grad()
def generate(model: Any, tok: Any, prompts: list[Chat], batch_size: int, max_new_tokens: int, k: int = 1,
             **sampling: Any) -> list[list[str]]:
    """For each chat prompt, `k` completions (new tokens only, special tokens skipped), in left-padded batches.

    `sampling` goes to `model.generate` (`do_sample`, `temperature`, ...). The tokenizer's padding side and
    the model's training mode are restored afterwards.
    """
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    side, tok.padding_side = tok.padding_side, "left"
    was_training = model.training
    model.eval()
    out: list[list[str]] = []
    try:
        for start in range(0, len(texts), batch_size):
            enc = tok(texts[start:start + batch_size], return_tensors="pt", padding=True,
                      add_special_tokens=False).to(model.device)
            gen = model.generate(**enc, num_return_sequences=k, max_new_tokens=max_new_tokens,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **sampling)
            decoded = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            out.extend(decoded[i:i + k] for i in range(0, len(decoded), k))
    finally:
        tok.padding_side = side
        model.train(was_training)
    return out
