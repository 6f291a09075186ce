"""`sampling: batch_rebalance`: each optimizer step's rows drawn at random, then sorted by length into its
gradient-accumulation micro-batches (transformers' BatchRebalanceSampler), through our SFT stage's trainer."""

from __future__ import annotations

import pytest
from conftest import FAST
from trl import SFTTrainer

from pipeline.config import load_config
from pipeline.data import tokcache
from pipeline.data.mixtures import load_mixture
from pipeline.stages.sft import sft_args
from pipeline.train.models import load_model, load_tokenizer


@pytest.mark.slow
def test_batch_rebalance_sorts_each_steps_rows_into_its_micro_batches(tiny_base, cache_dir, tmp_path):
    cfg = load_config(["recipe=tiny", f"cache_dir={cache_dir}", *FAST, "sft.train_sampling_strategy=batch_rebalance",
                       "sft.per_device_train_batch_size=8", "sft.gradient_accumulation_steps=2"])
    tok = load_tokenizer(tiny_base, cfg.model, need_template=True)
    rows = tokcache.tokenised(load_mixture(cfg.sft.mixture, cfg).select(range(160)), cfg.sft, tok, tmp_path, "sft")
    trainer = SFTTrainer(model=load_model(tiny_base, cfg.model), args=sft_args(cfg.sft, tmp_path / "work", 0, "fp32"),
                         train_dataset=rows, processing_class=tok)
    batches = list(trainer.get_train_dataloader())
    steps = [batches[i:i + 2] for i in range(0, len(batches), 2)]
    assert len(steps) == 10 and all(sum(len(b["input_ids"]) for b in step) == 16 for step in steps)
    padded = one_batch = real = 0
    for step in steps:
        short, long = sorted((b["attention_mask"].sum(1).tolist() for b in step), key=max)
        assert max(short) <= min(long)  # the step's 16 rows, sorted by length, split in two micro-batches
        padded += sum(b["input_ids"].numel() for b in step)
        one_batch += 16 * max(long)  # the same rows as one batch of 16
        real += sum(short) + sum(long)
    assert real == sum(len(r) for r in rows["input_ids"])  # every row once
    assert padded - real < 0.75 * (one_batch - real)  # measured: 2,698 padding tokens against 5,551
