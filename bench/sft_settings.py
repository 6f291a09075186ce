"""A recipe's SFT stage under named setting variants, on its own model and data: tokens/s, interleaved.

    PYTHONPATH=. python bench/sft_settings.py recipe=smollm2_cpu model.name_or_path=<checkpoint> hub_mirror=<dir> \
        [--steps 5] [--rounds 2] [--variant NAME:KEY=VALUE,KEY=VALUE ...]

Each round trains every variant in turn (a busy machine slows them alike) for `--steps` steps from the recipe's
base model (built first where its extension builds one): the recipe as given (`recipe`) and each `--variant`, the
recipe with those overrides. Printed as JSON: per variant the median and range over the rounds of effective
(non-padding) tokens/s, the padding fraction, forward and backward seconds, and the ratio to the first variant
named (`--variant`, else `recipe`) within each round.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from pipeline.chain.basemodel import base_model
from pipeline.config import load_config
from pipeline.data.mixtures import load_mixture
from pipeline.runfolder import cache_dir
from pipeline.stages.sft import train
from pipeline.train.models import load_tokenizer

KEPT = ("tokens_per_s", "padding_fraction", "forward_s", "backward_s")


def run_variant(overrides: list[str], steps: int, work: Path) -> dict:
    """Train the recipe's SFT stage with `overrides` for `steps` steps into `work`; the kept metrics."""
    cfg = load_config([*overrides, f"sft.max_steps={steps}", "sft.save_steps=1000000"])
    model = base_model(cfg)
    tok = load_tokenizer(model, cfg.model, need_template=cfg.sft.format == "chat")
    dataset = load_mixture(cfg.sft.mixture, cfg)
    shutil.rmtree(work, ignore_errors=True)
    metrics = train(cfg.sft, cfg.model, model, tok, dataset, work, cfg.seed, cache_dir(cfg))
    return {k: metrics[k] for k in KEPT}


def main() -> None:
    """Parse the arguments, train each variant per round, print the summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="+", help="the recipe and its overrides, as smol-pipeline takes them")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE,KEY=VALUE")
    args = parser.parse_args()
    variants = {name: extra.split(",") for name, extra in (v.split(":", 1) for v in args.variant)}
    variants.setdefault("recipe", [])
    first = next(iter(variants))
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name, extra in variants.items():
                runs[name].append(run_variant([*args.overrides, *extra], args.steps, Path(tmp) / name))
                print(name, runs[name][-1], flush=True)
    summary = {}
    for name, rounds in runs.items():
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rounds, runs[first], strict=True)]
        summary[name] = {
            "overrides": variants[name],
            **{k: {"median": round(statistics.median(r[k] for r in rounds), 4),
                   "range": [min(r[k] for r in rounds), max(r[k] for r in rounds)]} for k in KEPT},
            f"tokens_per_s_vs_{first}": {"median": round(statistics.median(ratios), 2),
                                         "range": [round(min(ratios), 2), round(max(ratios), 2)]},
        }
    print(json.dumps({"steps": args.steps, "rounds": args.rounds, "variants": summary}, indent=1))


if __name__ == "__main__":
    main()
