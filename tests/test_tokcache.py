"""The tokenised-data cache: miss then hit, misses on changed inputs, TRL's own tokens, unchanged losses."""

from __future__ import annotations

import dataclasses
import logging
import shutil

import pytest
from conftest import FAST
from omegaconf import OmegaConf
from trl import SFTTrainer

from pipeline.config import load_config
from pipeline.data import tokcache
from pipeline.data.mixtures import load_mixture
from pipeline.stages.sft import sft_args, train
from pipeline.train.models import load_model, load_tokenizer


@pytest.fixture(scope="module")
def setup(cache_dir, tiny_base):
    """The FAST tiny config, its tokenizer and 64 SFT chats (assistant-only loss, no packing)."""
    cfg = load_config(["recipe=tiny", f"cache_dir={cache_dir}", *FAST, "sft.max_steps=3", "sft.logging_steps=1",
                       "sft.per_device_train_batch_size=8", "sft.save_steps=1000", "sft.packing=false"])
    tok = load_tokenizer(tiny_base, cfg.model, need_template=True)
    return cfg, tok, load_mixture(cfg.sft.mixture, cfg).select(range(64))


@pytest.fixture
def tokenise_calls(monkeypatch) -> list:
    """Records every call of the real tokenisation function (which still runs)."""
    calls, real = [], tokcache.tokenise

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(tokcache, "tokenise", counted)
    return calls


@pytest.fixture
def log(caplog):
    """Captures the pipeline logger (it does not propagate once the CLI has configured it in-process)."""
    logger = logging.getLogger("pipeline")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="pipeline")
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.mark.slow
def test_miss_then_hit_without_tokenising_again(setup, tmp_path, tokenise_calls, log):
    cfg, tok, rows = setup
    first = tokcache.tokenised(rows, cfg.sft, tok, tmp_path, "01-sft")
    (entry,) = (tmp_path / "tokenized").iterdir()
    assert len(tokenise_calls) == 1
    assert f"01-sft: tokenised data: cache miss, tokenising 64 rows into {entry}" in log.messages
    written = entry.stat().st_mtime_ns
    second = tokcache.tokenised(rows, cfg.sft, tok, tmp_path, "01-sft")
    assert len(tokenise_calls) == 1 and f"01-sft: tokenised data: cache hit {entry}" in log.messages
    assert entry.stat().st_mtime_ns == written and list((tmp_path / "tokenized").iterdir()) == [entry]
    assert second.column_names == ["input_ids", "assistant_masks"] and second.to_dict() == first.to_dict()


@pytest.mark.slow
def test_changed_max_length_tokenizer_template_or_rows_miss(setup, tmp_path, tokenise_calls):
    cfg, tok, rows = setup
    tokcache.tokenised(rows, cfg.sft, tok, tmp_path, "sft")
    same = load_tokenizer(shutil.copytree(tok.name_or_path, tmp_path / "copy"), cfg.model, need_template=True)
    tokcache.tokenised(rows, cfg.sft, same, tmp_path, "sft")  # the same files elsewhere: a hit
    assert len(tokenise_calls) == 1
    grown = load_tokenizer(tok.name_or_path, cfg.model, need_template=True)
    grown.add_tokens(["<|new|>"])
    retemplated = load_tokenizer(tok.name_or_path, cfg.model, need_template=True)
    retemplated.chat_template = "{# v2 #}" + tok.chat_template
    changes = [(rows, OmegaConf.merge(cfg.sft, {"max_length": 128}), tok), (rows, cfg.sft, grown),
               (rows, cfg.sft, retemplated), (rows.select(range(63)), cfg.sft, tok)]
    for i, (data, stage, tokenizer) in enumerate(changes, 2):
        tokcache.tokenised(data, stage, tokenizer, tmp_path, "sft")
        assert len(tokenise_calls) == i
    assert len(list((tmp_path / "tokenized").iterdir())) == 1 + len(changes)


@pytest.mark.slow
def test_cached_tokens_and_masks_are_what_trl_produces(setup, tmp_path, tiny_base):
    cfg, tok, rows = setup
    ours = tokcache.tokenised(rows, cfg.sft, tok, tmp_path, "sft")
    args = dataclasses.replace(sft_args(cfg.sft, tmp_path / "work", cfg.seed, "fp32"), assistant_only_loss=True,
                               max_length=None)
    trl_own = SFTTrainer(model=load_model(tiny_base, cfg.model), args=args, train_dataset=rows,
                         processing_class=tok).train_dataset
    assert trl_own["input_ids"] == ours["input_ids"]
    assert [[int(label != -100) for label in labels] for labels in trl_own["labels"]] == ours["assistant_masks"]
    assert all(0 < sum(mask) < len(mask) for mask in ours["assistant_masks"])


@pytest.mark.slow
def test_training_loss_with_the_cache_equals_trl_tokenising_itself(setup, tmp_path, tiny_base):
    cfg, tok, rows = setup
    cached = train(cfg.sft, cfg.model, tiny_base, tok, rows, tmp_path / "cached", cfg.seed, tmp_path / "cache")
    args = dataclasses.replace(sft_args(cfg.sft, tmp_path / "plain", cfg.seed, "fp32"), assistant_only_loss=True)
    plain = SFTTrainer(model=load_model(tiny_base, cfg.model), args=args, train_dataset=rows, processing_class=tok)
    plain.train()
    losses = [h["loss"] for h in plain.state.log_history if "loss" in h]
    assert len(losses) == len(cached["losses"]) == 3
    assert [loss for _, loss in cached["losses"]] == pytest.approx(losses, abs=1e-6)
