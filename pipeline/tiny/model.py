"""The tiny setup's tokenizer and base model, built once under `<cache_dir>/tiny-<hash>/`: `init/` (the
tokenizer and a random Llama) and `model/` (after a short causal-LM pretraining on the `pretrain` split), each
published first-wins (`files.publish_dir`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pipeline.distributed import main_value, main_writes
from pipeline.files import atomic_dir, publish_dir, temp_name, write_json
from pipeline.stages.sft import SftSettings, train
from pipeline.tiny.data import data_dir, tiny_dir
from pipeline.train.models import load_tokenizer

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}{{- '\n' -}}"
    "{%- else -%}{{- message['content'] + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
DOC_SEP = "<|endoftext|>"


def _corpus(data: Path) -> Iterator[str]:
    for split in ("pretrain", "sft", "general"):
        for line in open(data / f"{split}.jsonl", encoding="utf-8"):
            row = json.loads(line)
            yield row.get("text") or "\n".join(m["content"] for m in row["messages"])


def build_tokenizer(data: Path, vocab_size: int, out: Path) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (digits split one by one) with a ChatML template, save it into `out` and
    return it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    specials = [DOC_SEP, "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(data), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token=DOC_SEP)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _init_model(path: Path, tok: PreTrainedTokenizerFast, tiny: dict) -> None:
    """A random Llama shaped by `tiny`, over `tok`'s vocabulary, saved into `path` (built here, not loaded)."""
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=tiny["hidden_size"], num_hidden_layers=tiny["num_layers"],
        num_attention_heads=tiny["num_heads"], num_key_value_heads=tiny["num_heads"],
        intermediate_size=tiny["intermediate_size"], max_position_embeddings=tiny["max_position_embeddings"],
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(tiny["seed"])
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)


def _pretrain_settings(tiny: Any) -> Any:
    return OmegaConf.structured(SftSettings(
        mixture="tiny pretrain", format="text", packing_strategy="wrapped", assistant_only_loss=False,
        gradient_checkpointing=False, matmul_precision=tiny.matmul_precision,
        learning_rate=tiny.pretrain_learning_rate, lr_scheduler_type="cosine",
        warmup_ratio=0.05, max_grad_norm=1.0, max_steps=tiny.pretrain_steps, logging_steps=50,
        per_device_train_batch_size=tiny.pretrain_batch_size, max_length=tiny.pretrain_max_length,
        save_steps=tiny.pretrain_steps))


def ensure_base_model(cache_dir: Path, tiny: Any, model_cfg: Any, seed: int) -> Path:
    """The tiny base checkpoint, built once: tokenizer, random init, short causal-LM pretraining.

    The pretraining is the pipeline's own text-training path and runs collectively on all ranks;
    only the main process of the world writes files, once per world (the cache is on a filesystem every node
    shares). Runs sharing the cache may build the same base at once: each world pretrains in a folder of its own
    and the first complete model is kept. Every rank follows the main process's look at the cache, so the ranks
    of a world never split between building and loading.
    """
    params = OmegaConf.to_container(tiny)
    root = tiny_dir(cache_dir, params, model_cfg, seed)
    if main_value((root / "model").is_dir()):
        return root / "model"
    init = root / "init"
    with main_writes() as main:
        if main:
            data = data_dir(cache_dir, params)
            if not init.is_dir():
                with atomic_dir(init, first_wins=True) as tmp:
                    _init_model(tmp, build_tokenizer(data, tiny.vocab_size, tmp), params)
    rows = [json.loads(line) for line in open(data_dir(cache_dir, params) / "pretrain.jsonl", encoding="utf-8")]
    tok = load_tokenizer(init, model_cfg, need_template=False)
    build = Path(main_value(str(temp_name(root / "build"))))  # this world's: checkpoints and the model
    metrics = train(_pretrain_settings(tiny), model_cfg, init, tok, datasets.Dataset.from_list(rows),
                    build / "pretrain", seed, cache_dir)
    with main_writes() as main:
        if main:
            if publish_dir(build / "pretrain" / "model", root / "model"):
                write_json(root / "pretrain.json", metrics)
            shutil.rmtree(build, ignore_errors=True)
    return root / "model"
