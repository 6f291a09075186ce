"""SFT throughput: our SFT stage vs a plain TRL SFTTrainer with its defaults, same model and data.

    python bench/sft_throughput.py [--steps 60] [--batch 16] [--cache runs/.cache] [override ...]

Both train the tiny recipe's base model on the tiny SFT chats for the same number of steps and
batch size. Effective tokens/s counts non-padding tokens actually trained. Printed as JSON with
the ratio ours / plain TRL, measured in this run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf
from trl import SFTConfig, SFTTrainer

from pipeline.config import load_config
from pipeline.data import load_mixture
from pipeline.stages.sft import train
from pipeline.tiny.model import ensure_base_model
from pipeline.training import load_tokenizer

# our stage as the recipe sets it, then with length-grouped batches, then packed (bfd, padding-free)
VARIANTS = {"ours_recipe": {}, "ours_grouped": {"sampling": "group_by_length"}, "ours_packed_bfd": {"packing": True}}


def plain_trl(base: Path, tok, dataset, steps: int, batch: int, work: Path) -> float:
    """A plain SFTTrainer: TRL defaults (no packing, activation checkpointing on), CPU-capable."""
    args = SFTConfig(output_dir=str(work), max_steps=steps, per_device_train_batch_size=batch, report_to="none",
                     use_cpu=True, bf16=False, save_strategy="no", include_num_input_tokens_seen="non_padding",
                     disable_tqdm=True, learning_rate=1e-3)
    trainer = SFTTrainer(model=str(base), args=args, train_dataset=dataset, processing_class=tok)
    result = trainer.train()
    return trainer.state.num_input_tokens_seen / result.metrics["train_runtime"]


def main() -> None:
    """Run both trainers and print tokens/s and the ratio."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--cache", default="runs/.cache")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for our stage, e.g. sft.sampling=random")
    args = parser.parse_args()
    cfg = load_config(["recipe=tiny", f"cache_dir={args.cache}", *args.overrides])
    base = ensure_base_model(Path(args.cache), cfg.tiny, cfg.model, cfg.seed)
    tok = load_tokenizer(base, cfg.model, need_template=True)
    dataset = load_mixture(cfg.sft.mixture, cfg)
    out = {"machine": "cpu", "steps": args.steps, "batch": args.batch}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        out["plain_trl_tokens_per_s"] = round(plain_trl(base, tok, dataset, args.steps, args.batch,
                                                        Path(tmp) / "plain"), 1)
        for name, change in VARIANTS.items():
            stage = OmegaConf.merge(cfg.sft, {"max_steps": args.steps, "per_device_train_batch_size": args.batch,
                                              "save_steps": 10**6, "logging_steps": 10**6, **change})
            metrics = train(stage, cfg.model, base, tok, dataset, Path(tmp) / name, cfg.seed, Path(args.cache))
            out[f"{name}_tokens_per_s"] = metrics["tokens_per_s"]
            out[f"{name}_padding_fraction"] = metrics["padding_fraction"]
            shutil.rmtree(Path(tmp) / name, ignore_errors=True)
        out["wall_s"] = round(time.time() - t0, 1)
    for name in VARIANTS:
        out[f"ratio_{name}_vs_plain"] = round(out[f"{name}_tokens_per_s"] / out["plain_trl_tokens_per_s"], 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
