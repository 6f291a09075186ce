"""The one generator: completions of chat prompts from one model, whichever backend runs it.

Backends: `hf`, transformers' `generate` on a model in this process (one `load` reads, or one a stage holds: the
policy it trains), and `vllm`, a vLLM engine. `load` builds either through the one loader (`pipeline.train.models`)
from the recipe's `model.*` settings: trust_remote_code, the attention kernel, and the inference dtype of
`model.precision` (the engine's too). Temperature 0 is greedy; above it, tokens are sampled from the whole
distribution at that temperature (no top-k or top-p) in both backends.

Who calls what: on-policy preference pairs (`pipeline.rl.onpolicy`) and held-out scoring (`pipeline.rl.heldout`) call
`Generator.generate`; PPO's rollouts `continue_ids` (the hf backend on token ids: its updates score the sampled
ids); evaluation hands a loaded generator's model and tokenizer to lm-eval's HF model, whose greedy requests run
through our greedy loop (`greedy_until`, where `evaluation.lmeval_fast` finds it gives lm-eval's answers), and
builds lm-eval's vllm model with the loader's engine settings (`models.engine_args`). GRPO samples inside TRL.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from pipeline.generation import engines
from pipeline.generation.kvcache import buffered_cache
from pipeline.train.models import load_engine, load_model, load_tokenizer
from pipeline.train.precision import inference_dtype

Chat = list[dict]


def sampling(temperature: float) -> dict:
    """transformers `generate` arguments for `temperature`: greedy at 0, else sampling from the whole distribution
    at that temperature (top-k and top-p off, as vLLM samples)."""
    if temperature <= 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


@torch.no_grad()
def continue_ids(model: Any, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, pad_id: int, eos_id: int,
                 k: int = 1, temperature: float = 0.0) -> torch.Tensor:
    """The ids `model.generate` writes after the left-padded prompts `ids` (attention `mask`): `k` rows per prompt,
    each ending at `eos_id` or after `max_new_tokens`, padded with `pad_id`. The model generates in eval mode; its
    training mode is restored afterwards. Sampling draws from torch's global generator."""
    was_training = model.training
    model.eval()
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, num_return_sequences=k, max_new_tokens=max_new_tokens,
                             pad_token_id=pad_id, eos_token_id=eos_id, **sampling(temperature))
    finally:
        model.train(was_training)
    return out[:, ids.shape[1]:]


class Generator:
    """Completions of chat prompts from one model: `model` (a transformers causal LM in this process: backend `hf`)
    or `engine` (a vLLM engine: backend `vllm`), with `tokenizer` and its chat template. `batch_size` prompts go
    through `hf`'s `generate` at a time; `seed` seeds torch before each sampled `hf` call (None: torch's state as it
    is). A vLLM engine samples with the seed it was built with (`load`)."""

    def __init__(self, tokenizer: Any, model: Any = None, engine: Any = None, batch_size: int = 64,
                 seed: int | None = None) -> None:
        if (model is None) == (engine is None):
            raise ValueError("a Generator runs either a model or a vLLM engine")
        self.tokenizer, self.model, self.engine = tokenizer, model, engine
        self.batch_size, self.seed = batch_size, seed

    @property
    def backend(self) -> str:
        """`hf` or `vllm`."""
        return "hf" if self.engine is None else "vllm"

    def generate(self, prompts: list[Chat], max_new_tokens: int, k: int = 1,
                 temperature: float = 0.0) -> list[list[str]]:
        """For each chat prompt, `k` completions (new tokens only, special tokens skipped) of at most
        `max_new_tokens`, greedy at temperature 0, else sampled."""
        if self.engine is not None:
            from vllm import SamplingParams

            # seeded by the engine: vLLM 0.32's CPU sampler fails on per-request seeds ("CPU Generator does not use
            # offset")
            params = SamplingParams(n=k, max_tokens=max_new_tokens, temperature=temperature)
            outputs = self.engine.chat(prompts, params, use_tqdm=False, chat_template=self.tokenizer.chat_template)
            return [[choice.text for choice in out.outputs] for out in outputs]
        tok = self.tokenizer
        if temperature > 0 and self.seed is not None:
            torch.manual_seed(self.seed)
        texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        side, tok.padding_side = tok.padding_side, "left"
        out: list[list[str]] = []
        try:
            for start in range(0, len(texts), self.batch_size):
                enc = tok(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                          add_special_tokens=False).to(self.model.device)
                new = continue_ids(self.model, enc["input_ids"], enc["attention_mask"], max_new_tokens,
                                   tok.pad_token_id, tok.eos_token_id, k, temperature)
                decoded = tok.batch_decode(new, skip_special_tokens=True)
                out.extend(decoded[i:i + k] for i in range(0, len(decoded), k))
        finally:
            tok.padding_side = side
        return out


@contextlib.contextmanager
def load(path: str | Path, model_cfg: Any, backend: str = "hf", seed: int = 0, saved: bool = False,
         batch_size: int = 64) -> Iterator[Generator]:
    """A generator on the checkpoint at `path`, loaded with the `model.*` settings `model_cfg` (`saved`: as saved,
    with its own tokenizer; else fitted to `model.tokenizer` / `model.chat_template`, `models.load_tokenizer`).
    `hf`: the model in the inference dtype of `model.precision`, on the GPU when there is one; `vllm`: an engine
    (`models.load_engine`, started shielded from the run's stop signals), shut down on leaving."""
    tokenizer = load_tokenizer(path, model_cfg, saved=saved)
    if backend == "vllm":
        with engines.starting():
            engine = load_engine(path, model_cfg, seed)
        try:
            yield Generator(tokenizer, engine=engine, batch_size=batch_size, seed=seed)
        finally:
            engines.shutdown(engine)
        return
    model = load_model(path, model_cfg, saved=saved, dtype=inference_dtype(model_cfg.precision))
    yield Generator(tokenizer, model.to("cuda" if torch.cuda.is_available() else "cpu"), batch_size=batch_size,
                    seed=seed)


def greedy_until(model: Any, context: torch.Tensor, attention_mask: torch.Tensor, max_length: int, eos: set[int],
                 pad_id: int, stopped: Callable[[list[int]], bool], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Our greedy loop: greedy continuation of the left-padded batch `context` to at most `max_length` positions,
    as `model.generate` would give it, in the in-place KV cache (`kvcache.buffered_cache`); each row leaves the
    batch at an id in `eos` or once `stopped(its generated ids)`. Autocast to `dtype` when given. Returns `context`
    followed by the generated ids, finished rows padded with `pad_id`."""
    accepts = inspect.signature(model.forward).parameters
    last = {"logits_to_keep": 1} if "logits_to_keep" in accepts else {}
    cache = buffered_cache(model.config, max_length)
    cached = {"cache" if "cache" in accepts else "past_key_values": cache}  # transformers 5.2x renamed it
    rows, mask = torch.arange(len(context), device=context.device), attention_mask
    generated: list[list[int]] = [[] for _ in range(len(context))]
    with torch.no_grad(), torch.autocast(device_type=context.device.type, dtype=dtype, enabled=dtype is not None):
        position = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        logits = model(input_ids=context, attention_mask=mask, position_ids=position, use_cache=True,
                       **cached, **last).logits
        for step in range(max_length - context.shape[1]):
            tokens = logits[:, -1].float().argmax(-1)
            live = []
            for j, (i, token) in enumerate(zip(rows.tolist(), tokens.tolist(), strict=True)):
                generated[i].append(token)
                if token not in eos and not stopped(generated[i]):
                    live.append(j)
            if not live or step == max_length - context.shape[1] - 1:
                break
            if len(live) < len(rows):
                index = torch.tensor(live, device=context.device)
                cache.batch_select_indices(index)
                rows, mask, tokens = rows[index], mask[index], tokens[index]
            mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=-1)
            position = mask.long().sum(-1, keepdim=True) - 1
            logits = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=position,
                           use_cache=True, **cached).logits
    out = context.new_full((len(context), context.shape[1] + max(map(len, generated))), pad_id)
    out[:, :context.shape[1]] = context
    for i, ids in enumerate(generated):
        out[i, context.shape[1]:context.shape[1] + len(ids)] = torch.tensor(ids, dtype=out.dtype)
    return out
