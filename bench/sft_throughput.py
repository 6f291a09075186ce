"""SFT throughput: our SFT stage vs plain TRL SFTTrainers (its defaults, and set fairly), same model and data.

    python bench/sft_throughput.py [--steps 60] [--batch 16] [--repeats 3] [--accuracy] [override ...] [--seeds N ...]

Each repeat trains, interleaved (so a busy machine slows them alike), on CPU in fp32 with sdpa:
- `trl_defaults`: a plain SFTTrainer as TRL's defaults set it (no packing, activation checkpointing on;
  `--batch` chats per step);
- `trl_no_checkpointing`, `trl_packed` and `trl_padding_free`: plain TRL as a user who read its docs would
  set it for this model (`trl_settings`): no activation checkpointing, the recipe's tokens per step, padded,
  with TRL's own packing (best-fit-decreasing, padding-free) or its padding-free batches of whole chats;
  the fastest of the three in the median is `trl_best_fair`;
- our stage as the recipe sets it, and unpacked: one chat per row, `UNPACKED_BATCH` chats per step.
Effective tokens/s counts non-padding tokens trained. Printed as JSON: per variant the median and range over
the repeats of tokens/s, our ratios to `trl_defaults` and to `trl_best_fair` in the same repeat, our padding
and step-time breakdown (forward, backward, optimizer, data wait, save).

`--accuracy` also trains the recipe's whole SFT stage twice from the same input, the recipe's own
(its mid-training stage, run once through the CLI): as the recipe sets it, and unpacked on the same data
(one chat per row, as many chats per step as a packed step holds, the same steps: only the batching
differs). It prints each validation score and their paired difference on the same problems (95% interval,
p). `--seeds 42 1 2` repeats that for each training seed (each with its own base model and mid-training)
and pools the paired differences over the seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf
from scipy.stats import norm
from trl import SFTConfig, SFTTrainer

from pipeline.config import load_config
from pipeline.data import packing, tokcache
from pipeline.data.mixtures import load_mixture
from pipeline.evaluation import stats
from pipeline.evaluation.lmeval import run_eval, settings
from pipeline.stages.sft import train
from pipeline.tiny.model import ensure_base_model
from pipeline.train.models import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
METRIC = "tiny_gsm_val/exact_match,strict-match"  # validation: settings are never chosen on test
BREAKDOWN = ("forward_s", "backward_s", "optimizer_s", "data_wait_s", "save_s")
UNPACKED_BATCH = 32  # chats per step: the tiny recipe before it packed its SFT data
UNPACKED = {"sft": {"packing": False, "per_device_train_batch_size": UNPACKED_BATCH}}


def plain_trl(base: Path, tok, dataset, steps: int, work: Path, **settings) -> float:
    """A plain SFTTrainer (CPU, fp32, sdpa) with TRL's defaults but for `settings`: effective tokens/s."""
    args = SFTConfig(output_dir=str(work), max_steps=steps, report_to="none", use_cpu=True, bf16=False,
                     save_strategy="no", include_num_input_tokens_seen="non_padding", disable_tqdm=True,
                     learning_rate=1e-3, **settings)
    trainer = SFTTrainer(model=str(base), args=args, train_dataset=dataset, processing_class=tok)
    result = trainer.train()
    shutil.rmtree(work, ignore_errors=True)
    return trainer.state.num_input_tokens_seen / result.metrics["train_runtime"]


def trl_settings(args, cfg, chats: int) -> dict[str, dict]:
    """Plain TRL as set by its defaults (`--batch` chats per step, activation checkpointing on) and as a user who
    read TRL's docs would set it for this model: no activation checkpointing (a 1M model has no memory to
    save) and the recipe's tokens per step, padded (`chats` chats per step: as many as a packed step holds),
    with TRL's packing (best-fit-decreasing, padding-free: the recipe's rows x `max_length` tokens in one
    flattened row) or with its padding-free batches of `chats` whole chats (flattened into one row)."""
    fair = {"gradient_checkpointing": False, "max_length": cfg.sft.max_length}  # TRL's name
    return {"trl_defaults": {"per_device_train_batch_size": args.batch},
            "trl_no_checkpointing": {**fair, "per_device_train_batch_size": chats},
            "trl_packed": {**fair, "packing": True, "per_device_train_batch_size": cfg.sft.per_device_train_batch_size},
            "trl_padding_free": {**fair, "padding_free": True, "max_length": None,  # TRL truncates only when packing
                                 "per_device_train_batch_size": chats}}


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
    """Interleaved repeats of the plain TRL settings and our variants: tokens/s, our ratio to TRL's defaults and
    to TRL's best fair setting in the same repeat, and our step-time breakdown."""
    base = ensure_base_model(Path(args.cache), cfg.tiny, cfg.model, cfg.seed)
    tok = load_tokenizer(base, cfg.model, need_template=True)
    dataset = load_mixture(cfg.sft.mixture, cfg)
    trl_runs = trl_settings(args, cfg, chats_per_step(cfg, tok, dataset, args.cache))
    variants = {"ours_recipe": {}, "ours_unpacked": UNPACKED}
    runs: dict[str, list] = {name: [] for name in [*trl_runs, *variants]}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name, settings in trl_runs.items():
                runs[name].append(plain_trl(base, tok, dataset, args.steps, Path(tmp) / f"{name}{rep}", **settings))
            for name, change in variants.items():
                runs[name].append(ours(cfg, change, base, tok, dataset, args.steps, Path(tmp) / name, args.cache))
    out: dict = {"trl_settings": trl_runs}
    out.update({f"{name}_tokens_per_s": spread(runs[name]) for name in trl_runs})
    fair = max([n for n in trl_runs if n != "trl_defaults"], key=lambda name: statistics.median(runs[name]))
    out["trl_best_fair"] = fair
    for name in variants:
        rates = [m["tokens_per_s"] for m in runs[name]]
        out[f"{name}_tokens_per_s"] = spread(rates)
        for base_name, label in (("trl_defaults", "trl_defaults"), (fair, "trl_best_fair")):
            out[f"ratio_{name}_vs_{label}"] = spread([r / p for r, p in zip(rates, runs[base_name], strict=True)])
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
    the same data: the validation score and standard error of each, and their paired difference on the same
    problems (`stats.paired_difference`: 95% interval, p)."""
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
    paired = stats.paired_difference(out / "unpacked/eval", out / "recipe/eval", METRIC)
    return {**scores, "recipe_minus_unpacked": paired}


def pooled(diffs: list[dict]) -> dict:
    """The mean of independent paired differences (one per seed) with its 95% interval and two-sided p."""
    diff = statistics.mean(d["diff"] for d in diffs)
    se = math.sqrt(sum(d["se"] ** 2 for d in diffs)) / len(diffs)
    low, high = norm.interval(0.95, loc=diff, scale=se) if se > 0 else (diff, diff)
    p = 2 * norm.sf(abs(diff / se)) if se > 0 else float(diff == 0)
    return {"diff": diff, "se": se, "ci_low": float(low), "ci_high": float(high), "n": sum(d["n"] for d in diffs),
            "p_value": float(p), "test": "normal, pooled over seeds"}


def over_seeds(args, cfg) -> dict:
    """The accuracy comparison for each of `args.seeds` (default: the run's seed), and over all of them: the mean
    scores and the pooled paired difference."""
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds or [cfg.seed]:
            extra = [*args.overrides, f"seed={seed}"]
            seeded = load_config(["recipe=tiny", f"cache_dir={args.cache}", *extra])
            runs[seed] = accuracy(seeded, args.cache, extra, Path(tmp) / str(seed))
    mean = {name: round(statistics.mean(r[name]["score"] for r in runs.values()), 4) for name in ("recipe", "unpacked")}
    return {"seeds": runs, "mean": {**mean, "recipe_minus_unpacked": pooled([r["recipe_minus_unpacked"]
                                                                              for r in runs.values()])}}


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
