"""DPO sweep: a 2 x 2 beta x learning-rate sweep with and without the shared reference log-probs and tokenisation.

    python bench/dpo_sweep.py [--pairs 256] [--cache runs/.cache] [override ...]

Every variant trains the same 4 candidates (the tiny base model, `--pairs` of the `tiny_prefs` pairs,
the tiny recipe's DPO settings: one epoch, batch 8) through the stage's own trainer and saves them:

- shared (the pipeline): pairs on disk, tokenised and scored by the reference model once per stage,
  every candidate reads both;
- per_candidate: pairs in memory, each candidate tokenises them and precomputes its own reference
  log-probs (what TRL does for each run of a sweep);
- per_step: pairs in memory, each candidate tokenises them and runs the reference model at every
  step (TRL's default, `precompute_ref_log_probs=False`).

Recipe overrides (e.g. `tiny.pretrain_steps=60`) apply to every variant and to the base model.
The shared variant runs first, so it also pays the warm-up. Prints JSON with each variant's wall time
and CPU time of this process (less sensitive to other jobs on the machine) and their ratios, measured
in this run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from omegaconf import DictConfig

from pipeline.config import load_config
from pipeline.grid import grid
from pipeline.runfolder import StageContext
from pipeline.stages import dpo
from pipeline.tiny.model import ensure_base_model
from pipeline.train.models import load_tokenizer


def candidates(cfg: DictConfig) -> list[dict]:
    """The DPO stage's sweep candidates: the one place this bench reads the sweep."""
    return grid(cfg.dpo)


def sweep(overrides: list[str], cache: str, base: Path, pairs: int, out: Path, shared: bool) -> tuple[float, float]:
    """Wall and CPU seconds of training every candidate of the 2 x 2 grid (and, when shared, the shared data)."""
    cfg = load_config(["recipe=tiny", f"cache_dir={cache}", "stages=[dpo]", "dpo.mixture=tiny_prefs",
                       "dpo.on_policy.enabled=false", "dpo.soup.top_k=0", "dpo.merge.stage=", "dpo.save_steps=100000",
                       *overrides])
    ctx = StageContext(cfg, "dpo", base, out)
    tok = load_tokenizer(base, cfg.model, need_template=True)
    data = dpo.preference_pairs(ctx)
    data = data.select(range(min(pairs, len(data))))
    started, cpu = time.time(), time.process_time()
    if shared:
        data = dpo.with_reference(ctx, tok, dpo.on_disk(data, out / "pairs"), out / "pairs_ref")
    for cand in candidates(cfg):
        dpo.train_candidate(ctx.for_candidate(cand), tok, data)
    return time.time() - started, time.process_time() - cpu


def main() -> None:
    """Run the three variants and print their wall times and ratios."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--cache", default="runs/.cache")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. tiny.pretrain_steps=60")
    args = parser.parse_args()
    cfg = load_config(["recipe=tiny", f"cache_dir={args.cache}", *args.overrides])
    base = ensure_base_model(Path(args.cache), cfg.tiny, cfg.model, cfg.seed)
    out = {"machine": "cpu", "candidates": len(candidates(cfg)), "pairs": args.pairs}
    variants = {"shared": ([], True), "per_candidate": ([], False),
                "per_step": (["dpo.precompute_ref_log_probs=false"], False)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (overrides, shared) in variants.items():
            wall, cpu = sweep([*args.overrides, *overrides], args.cache, base, args.pairs, Path(tmp) / name, shared)
            out[f"{name}_wall_s"], out[f"{name}_cpu_s"] = round(wall, 1), round(cpu, 1)
    for name in ("per_candidate", "per_step"):
        for kind in ("wall", "cpu"):
            out[f"{kind}_ratio_{name}_vs_shared"] = round(out[f"{name}_{kind}_s"] / out[f"shared_{kind}_s"], 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
