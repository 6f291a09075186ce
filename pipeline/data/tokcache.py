"""Tokenised SFT / mid-training data, cached on disk so sweeps, reruns and resumed runs tokenise once.

A stage's rows are tokenised into `<cache_dir>/tokenized/<key>/` (datasets `save_to_disk`, written
to a temporary folder and renamed). The key hashes the rows' content (the mixed and shuffled
mixture, per-row chat-template kwargs included), the tokenizer's saved files (vocabulary, special
tokens, chat template), the stage's format, assistant-only loss and max_length, the library
versions and `VERSION`. Chat rows are rendered through the chat template with their tools and tokenised as
SFTTrainer does (no special tokens added), giving `input_ids`; with assistant-only loss, `chat.tokenise_masked` gives
`input_ids` and `assistant_masks` on any template, with or without `{% generation %}` markers;
SFTTrainer then skips tokenising and only builds labels, truncates and packs (steps that datasets
caches beside the tokens). Documents (`format: text`) become `input_ids` ending in EOS.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from pipeline import keys, preempt
from pipeline.data import chat, prep
from pipeline.data.mixtures import source_name
from pipeline.distributed import main_writes, same_on_every_rank
from pipeline.errors import ConfigError
from pipeline.files import atomic_dir
from pipeline.settings import data_source

VERSION = 2  # bump when the tokenisation below changes what it writes

log = logging.getLogger("pipeline")


def content_hash(dataset: Any) -> str:
    """sha256 of a dataset's rows, in order (Arrow IPC bytes of fixed-size batches)."""
    digest = hashlib.sha256()
    for batch in dataset.with_format("arrow").iter(batch_size=10_000):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_table(batch.combine_chunks())
        digest.update(sink.getvalue())
    return digest.hexdigest()


def tokenizer_hash(tok: Any) -> str:
    """sha256 of the files `save_pretrained` writes for `tok` (vocabulary, specials, chat template)."""
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cache_key(dataset: Any, stage: Any, tok: Any) -> str:
    """The cache entry's name: every input that changes the tokens, and the code that makes them."""
    return keys.key({"rows": content_hash(dataset), "tokenizer": tokenizer_hash(tok), "format": stage.format,
                        "assistant_only_loss": stage.assistant_only_loss, "max_length": stage.max_length,
                        "version": VERSION, "libraries": keys.versions(keys.TRAINING)})


def tokenise_chat(row: dict, index: int, tok: Any, assistant_only_loss: bool, source: str) -> dict:
    """One chat row (with its tools): `input_ids` of its rendered text, as SFTTrainer tokenises it, with
    `assistant_masks` for assistant-only loss."""
    kwargs, where = chat.template_kwargs(row.get("chat_template_kwargs")), f"{source} row {index + 1}"
    if assistant_only_loss:
        return chat.tokenise_masked(tok, row["messages"], kwargs, where, row.get("tools"))
    text = chat.render(tok, row["messages"], kwargs, tools=row.get("tools"), where=where)
    return {"input_ids": tok(text, add_special_tokens=False)["input_ids"]}


def tokenise_text(row: dict, tok: Any) -> dict:
    """One document (`text`) as `input_ids` ending in EOS (once: rendered chats already end with it)."""
    ids = tok(row["text"], add_special_tokens=False)["input_ids"]
    ends = row["text"].rstrip().endswith(tok.eos_token)
    return {"input_ids": ids if ends else ids + [tok.eos_token_id]}


def tokenise(dataset: Any, stage: Any, tok: Any, name: str) -> Any:
    """Tokenise every row for the stage's format (`name`: the stage, for messages); refuse chat rows with no
    assistant token to learn."""
    started, procs = time.monotonic(), stage.dataset_num_proc if stage.dataset_num_proc > 1 else None
    if stage.format == "text":
        out = dataset.map(tokenise_text, fn_kwargs={"tok": tok}, remove_columns=dataset.column_names, num_proc=procs)
        prep.log_rate("tokenised", len(out), started)
        return out
    out = dataset.map(tokenise_chat, with_indices=True, remove_columns=dataset.column_names, num_proc=procs,
                      fn_kwargs={"tok": tok, "assistant_only_loss": stage.assistant_only_loss,
                                 "source": f"stage {name} ({source_name(data_source(stage))})"})
    prep.log_rate("tokenised", len(out), started)
    if stage.assistant_only_loss:
        empty = [i for i, mask in enumerate(out["assistant_masks"]) if 1 not in mask]
        if empty:
            raise ConfigError(f"{len(empty)} chat row(s) have no assistant tokens to train on (first: row "
                              f"{empty[0] + 1}); add an assistant turn or set assistant_only_loss=false")
    return out


def tokenised(dataset: Any, stage: Any, tok: Any, cache_dir: Path, name: str) -> Any:
    """`dataset` tokenised for `stage`, from the cache or tokenised now and stored: the main process writes, the
    others wait for the folder on disk (see `prep`: tokenising may outlast any collective), then load it. Every
    rank computes the cache key and they compare it first: a rank with another key would wait for a folder the
    main process never writes."""
    key = cache_key(dataset, stage, tok)
    same_on_every_rank(key, f"the tokenised-cache key of {name}'s rows", "their rows, tokenizer files or library "
                       "versions differ: every node must run the same code on the same data")
    path = Path(cache_dir) / "tokenized" / key
    with main_writes() as main:
        if main and path.is_dir():
            log.info("%s: tokenised data: cache hit %s", name, path)
        elif main:
            log.info("%s: tokenised data: cache miss, tokenising %s rows into %s", name, f"{len(dataset):,}", path)
            with preempt.interruptible(f"tokenising {name}'s rows"):
                tokens = tokenise(dataset, stage, tok, name)
                prep.slow_down_for_tests()
                with atomic_dir(path, first_wins=True) as tmp:  # another run sharing the cache may race
                    tokens.save_to_disk(str(tmp))
        else:
            prep.wait_for_dir(path, f"{name}'s tokenised data")
    return datasets.load_from_disk(str(path))
