"""The one way the pipeline loads a model or a tokenizer: every `from_pretrained` of either, and every vLLM engine,
goes through here, with the recipe's `model.*` settings (trust_remote_code, attn_implementation, the dtype policy
of `precision`).

Two sources: a checkpoint the recipe starts from or trains on (`saved=False`: the tokenizer is `model.tokenizer`
when set, `model.chat_template` is applied to it and the model is fitted to its tokens, `fit_model`), and a
checkpoint as saved, with its own tokenizer (`saved=True`: a trained stage's model or a reward model, evaluated or
scored as it is; the template fitting it went through is in its files).

Kinds: `causal` (a causal LM) and `classifier` (a one-output sequence classifier: reward and value models).
A vLLM engine (`load_engine`, `engine_args`) reads the checkpoint's own files and tokenizer, in the inference dtype
of `model.precision`, as a model loaded for generation here is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from pipeline.data import chat
from pipeline.distributed import deepspeed_on
from pipeline.errors import ConfigError
from pipeline.train.precision import inference_dtype, load_dtype

KINDS = {"causal": (AutoModelForCausalLM, {}), "classifier": (AutoModelForSequenceClassification, {"num_labels": 1})}


def with_pad_token(tok: Any) -> Any:
    """The tokenizer, padding with its EOS token when it has no pad token of its own."""
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_tokenizer(path: str | Path, model_cfg: Any, need_template: bool = False, saved: bool = False) -> Any:
    """The tokenizer of the checkpoint at `path`, with a pad token. Unless `saved`: `model.tokenizer` when set,
    with `model.chat_template` applied. `need_template`: refuse one without a chat template (ConfigError)."""
    tok = AutoTokenizer.from_pretrained(path if saved else model_cfg.tokenizer or path,
                                        trust_remote_code=model_cfg.trust_remote_code)
    if not saved:
        chat.apply_template(tok, model_cfg.chat_template)
    if need_template and not tok.chat_template:
        raise ConfigError(f"tokenizer of {path} has no chat template; set model.chat_template=chatml or a Jinja file")
    return with_pad_token(tok)


def empty_model(path: str | Path, model_cfg: Any, kind: str = "causal") -> Any:
    """The `kind` model of the checkpoint config at `path`, built from its config alone (no weights are read;
    inside accelerate's `init_empty_weights` it takes no memory either): for checks of its module names."""
    cls, defaults = KINDS[kind]
    config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    return cls.from_config(config, trust_remote_code=model_cfg.trust_remote_code, attn_implementation="eager",
                           **defaults)


def load_model(path: str | Path, model_cfg: Any, kind: str = "causal", saved: bool = False,
               dtype: torch.dtype | None = None, **extra: Any) -> Any:
    """The `kind` model at `path` with `model.attn_implementation` and `model.trust_remote_code`, in `dtype`
    (default: the training dtype, `precision.load_dtype`: fp32 master weights unless DeepSpeed or asked). Unless
    `saved`, fitted to `model.chat_template`'s tokens (`fit_model`). `extra` goes to `from_pretrained`."""
    cls, defaults = KINDS[kind]
    model = cls.from_pretrained(
        path, dtype=dtype or load_dtype(model_cfg, deepspeed_on()), use_safetensors=True,
        attn_implementation=model_cfg.attn_implementation, trust_remote_code=model_cfg.trust_remote_code,
        **{**defaults, **extra})
    return model if saved else fit_model(model, model_cfg, path)


def fit_model(model: Any, model_cfg: Any, path: str | Path) -> Any:
    """`model` made to match its tokenizer with `model.chat_template` applied: embeddings resized to hold
    the added markers, the end-of-turn marker as eos of its config and generation config (in place)."""
    if not model_cfg.chat_template:
        return model
    tok = load_tokenizer(path, model_cfg)
    if len(tok) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tok), pad_to_multiple_of=64)
    if tok.eos_token_id is not None:
        model.config.get_text_config().eos_token_id = tok.eos_token_id
        if getattr(model, "generation_config", None) is not None:  # classifiers have none
            model.generation_config.eos_token_id = tok.eos_token_id
    return model


def engine_args(model_cfg: Any) -> dict:
    """`vllm.LLM` arguments for the `model.*` settings on this machine: `trust_remote_code`, the inference dtype of
    `model.precision` (`precision.inference_dtype`, as `load_model` is asked for generation and evaluation); on CPU
    eager execution, a 2 GiB KV cache and every core (`VLLM_CPU_KVCACHE_SPACE`, `VLLM_CPU_NUM_OF_RESERVED_CPU`
    unless set: vLLM keeps one core back by default, half of a 2-core machine); on GPUs half the memory, leaving the
    rest to a training process on the same device."""
    settings = {"dtype": str(inference_dtype(model_cfg.precision)).removeprefix("torch."),
                "trust_remote_code": model_cfg.trust_remote_code}
    if torch.cuda.is_available():
        return {**settings, "gpu_memory_utilization": 0.5}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return {**settings, "enforce_eager": True}


def load_engine(path: str | Path, model_cfg: Any, seed: int) -> Any:
    """A vLLM engine on the checkpoint at `path` (its own tokenizer) with `engine_args`, sampling with `seed`."""
    from vllm import LLM

    return LLM(model=str(path), seed=seed, **engine_args(model_cfg))
