"""SFT throughput: our SFT stage vs a plain TRL SFTTrainer with its defaults, same model and data.

    python bench/sft_throughput.py [--steps 60] [--batch 16] [--repeats 3] [--accuracy] [override ...] [--seeds N ...]

Each repeat trains, interleaved (so a busy machine slows them alike): a plain SFTTrainer (TRL
defaults: fp32, sdpa, no packing, activation checkpointing on; `--batch` chats per step), our stage
as the recipe sets it, and our stage unpacked: one chat per row, `UNPACKED_BATCH` chats per step (the
recipe before packing, the reference it is measured against). Effective tokens/s counts non-padding tokens
trained. Printed as JSON: per variant the median and range over the repeats of tokens/s, its ratio to
plain TRL in the same repeat, its padding, and our step-time breakdown (forward, backward, optimizer,
data wait, save).

`--accuracy` also trains the recipe's whole SFT stage twice from the same input, the recipe's own
(its mid-training stage, run once through the CLI): as the recipe sets it, and unpacked on the same data
(one chat per row, as many chats per step as a packed step holds, the same steps: only the batching
differs). It prints each held-out score with its standard error, and whether they agree within one.
`--seeds 42 1 2` repeats that for each training seed (each with its own base model and mid-training) and
also compares the means over the seeds: single runs of a stage move with the seed by about as much as
one standard error.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf
from trl import SFTConfig, SFTTrainer

from pipeline.config import load_config
from pipeline.data import packing, tokcache
from pipeline.data.mixtures import load_mixture
from pipeline.evaluation.lmeval import run_eval, settings
from pipeline.stages.sft import train
from pipeline.tiny.model import ensure_base_model
from pipeline.train.models import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
METRIC = "tiny_gsm_val/exact_match,strict-match"  # validation: settings are never chosen on test
BREAKDOWN = ("forward_s", "backward_s", "optimizer_s", "data_wait_s", "save_s")
UNPACKED_BATCH = 32  # chats per step: the tiny recipe before it packed its SFT data
UNPACKED = {"sft": {"packing": False, "per_device_train_batch_size": UNPACKED_BATCH}}


def plain_trl(base: Path, tok, dataset, steps: int, batch: int, work: Path) -> float:
    """A plain SFTTrainer: TRL defaults (no packing, activation checkpointing on), CPU-capable."""
    args = SFTConfig(output_dir=str(work), max_steps=steps, per_device_train_batch_size=batch, report_to="none",
                     use_cpu=True, bf16=False, save_strategy="no", include_num_input_tokens_seen="non_padding",
                     disable_tqdm=True, learning_rate=1e-3)
    trainer = SFTTrainer(model=str(base), args=args, train_dataset=dataset, processing_class=tok)
    result = trainer.train()
    return trainer.state.num_input_tokens_seen / result.metrics["train_runtime"]


def variant(cfg, change: dict, **sft) -> tuple:
    """The recipe's sft block (with `sft` set) and model settings, `change` ({"sft": ..., "model": ...}) applied."""
    return (OmegaConf.merge(cfg.sft, sft, change.get("sft", {})), OmegaConf.merge(cfg.model, change.get("model", {})))


def ours(cfg, change: dict, base: Path, tok, dataset, steps: int, work: Path, cache: str) -> dict:
    """Our SFT stage with `change` ({"sft": ..., "model": ...}) applied to the recipe: its training metrics."""
    stage, model_cfg = variant(cfg, change, max_steps=steps, save_steps=10**6, logging_steps=10**6)
    metrics = train(stage, model_cfg, base, tok, dataset, work, cfg.seed, Path(cache))
    shutil.rmtree(work, ignore_errors=True)
    return metrics


def spread(values: list[float]) -> dict:
    """Median and range of a list of measurements."""
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2), "max": round(max(values), 2)}


def throughput(args, cfg) -> dict:
    """Interleaved repeats of plain TRL and our variants: tokens/s, ratios and our breakdown."""
    base = ensure_base_model(Path(args.cache), cfg.tiny, cfg.model, cfg.seed)
    tok = load_tokenizer(base, cfg.model, need_template=True)
    dataset = load_mixture(cfg.sft.mixture, cfg)
    variants = {"ours_recipe": {}, "ours_unpacked": UNPACKED}
    runs: dict[str, list] = {"plain_trl": [], **{name: [] for name in variants}}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            runs["plain_trl"].append(plain_trl(base, tok, dataset, args.steps, args.batch, Path(tmp) / f"plain{rep}"))
            for name, change in variants.items():
                runs[name].append(ours(cfg, change, base, tok, dataset, args.steps, Path(tmp) / name, args.cache))
    out = {"plain_trl_tokens_per_s": spread(runs["plain_trl"])}
    for name in variants:
        rates = [m["tokens_per_s"] for m in runs[name]]
        out[f"{name}_tokens_per_s"] = spread(rates)
        out[f"ratio_{name}_vs_plain"] = spread([r / p for r, p in zip(rates, runs["plain_trl"], strict=True)])
        out[f"{name}_padding_fraction"] = runs[name][0]["padding_fraction"]
        out[f"{name}_breakdown"] = {k: spread([m[k] for m in runs[name]])["median"] for k in BREAKDOWN}
    return out


def chats_per_step(cfg, tok, dataset, cache: str) -> int:
    """Chats in one step of the recipe's packed SFT: its rows per step times the chats a packed row holds."""
    rows = tokcache.tokenised(dataset, cfg.sft, tok, Path(cache), "sft")
    packed = packing.pack(rows, cfg.sft.max_length, cfg.sft.packing_strategy)
    return round(cfg.sft.per_device_train_batch_size * len(rows) / len(packed))


def accuracy(cfg, cache: str, overrides: list[str], out: Path) -> dict:
    """The recipe's SFT stage from its own input (mid-training, run once through the CLI), as set and unpacked on
    the same data: held-out score and standard error of each, and whether they agree within one."""
    cmd = [sys.executable, str(ROOT / "pipeline/run.py"), "recipe=tiny", "stages=[midtrain]", f"cache_dir={cache}",
           f"output_root={out}", "midtrain.gate.action=warn", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"mid-training failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    run = out / "tiny"
    source = run / "stages/01-midtrain/model"
    tok = load_tokenizer(source, cfg.model, need_template=True)
    dataset, ev = load_mixture(cfg.sft.mixture, cfg), settings(cfg, "sft")
    batch = chats_per_step(cfg, tok, dataset, cache)
    same_data = {"sft": {"packing": False, "per_device_train_batch_size": batch}}
    scores: dict = {"unpacked_chats_per_step": batch}
    for name, change in {"recipe": {}, "unpacked": same_data}.items():
        stage, model_cfg = variant(cfg, change)
        metrics = train(stage, model_cfg, source, tok, dataset, out / name, cfg.seed, Path(cache))
        result = run_eval(out / name / "model", ev, run / "eval_tasks", out / name / "eval", model_cfg)
        scores[name] = {"score": result["metrics"][METRIC], "stderr": result["stderr"][METRIC],
                        "tokens_per_s": metrics["tokens_per_s"]}
    return {**scores, "within_1_stderr": agree(scores["recipe"], scores["unpacked"])}


def agree(a: dict, b: dict) -> bool:
    """Whether two held-out scores ({score, stderr}) differ by at most the larger standard error."""
    return abs(a["score"] - b["score"]) <= max(a["stderr"], b["stderr"])


def over_seeds(args, cfg) -> dict:
    """The accuracy comparison for each of `args.seeds` (default: the run's seed), and the means over them."""
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds or [cfg.seed]:
            extra = [*args.overrides, f"seed={seed}"]
            seeded = load_config(["recipe=tiny", f"cache_dir={args.cache}", *extra])
            runs[seed] = accuracy(seeded, args.cache, extra, Path(tmp) / str(seed))
    mean = {name: {k: round(statistics.mean(r[name][k] for r in runs.values()), 4) for k in ("score", "stderr")}
            for name in ("recipe", "unpacked")}
    return {"seeds": runs, "mean": {**mean, "within_1_stderr": agree(mean["recipe"], mean["unpacked"])}}


def main() -> None:
    """Run the variants and print tokens/s, ratios (median and range) and, with --accuracy, held-out scores."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="chats per step for plain TRL and ours unpacked")
    parser.add_argument("--repeats", type=int, default=3, help="0: only the accuracy runs")
    parser.add_argument("--cache", default="runs/.cache")
    parser.add_argument("--accuracy", action="store_true",
                        help="also train the whole SFT stage as set and unpacked")
    parser.add_argument("--seeds", type=int, nargs="*", default=[], help="training seeds of the accuracy runs")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for our stage, e.g. sft.sampling=random")
    args = parser.parse_args()
    cfg = load_config(["recipe=tiny", f"cache_dir={args.cache}", *args.overrides])
    out = {"machine": "cpu", "steps": args.steps, "batch": args.batch, "repeats": args.repeats,
           "recipe_batch": cfg.sft.per_device_train_batch_size, "recipe_packing": cfg.sft.packing,
           **(throughput(args, cfg) if args.repeats else {})}
    if args.accuracy:
        out["accuracy"] = over_seeds(args, cfg)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
