"""Does each stage of the tiny chain make the model better, at more than one seed?

    python bench/stage_gains.py --seeds 3 [--first-seed 0] [--out /tmp/stage_gains] [extra overrides ...]

Runs `smol-pipeline recipe=tiny seed=S` (pipeline/launch.py) once per seed (0, 1, ...), each in a fresh folder
(base pretraining included; the synthetic data, and so the held-out test problems, stay those of `tiny.seed`), then
prints for each stage and seed its change on the test problems against its input: accuracy before and after,
problems gained and lost, and the McNemar mid-p (two-sided), and per stage in how many seeds the gain was
significant (mid-p < 0.05, more problems gained than lost). Last, the whole result as JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from scipy.stats import binom

from pipeline.report import headline

ALPHA = 0.05
ROOT = Path(__file__).resolve().parents[1]


def mid_p(gained: int, lost: int) -> float:
    """The two-sided McNemar mid-p of `gained` against `lost` discordant problems (1.0 with none)."""
    n, low = gained + lost, min(gained, lost)
    if n == 0:
        return 1.0
    return float(min(1.0, 2 * (binom.cdf(low, n, 0.5) - 0.5 * binom.pmf(low, n, 0.5))))


def stage_changes(run: Path) -> list[dict]:
    """Each trained stage's test change against its input, from the run folder's headline."""
    h = headline.build(run)
    out = []
    for row in h.rows:
        p = row.get("vs_input")
        if p is None or "gained" not in p:
            continue
        out.append({"stage": row["stage"], "before": row["test"] - p["diff"], "after": row["test"],
                    "gained": p["gained"], "lost": p["lost"], "n": p["n"], "mid_p": mid_p(p["gained"], p["lost"])})
    return out


def run_seed(seed: int, out: Path, overrides: list[str]) -> tuple[list[dict], float]:
    """Run the tiny chain at `seed` in `out/seed-<seed>`; its stage changes and wall seconds."""
    folder = out / f"seed-{seed}"
    started = time.time()
    with open(out / f"seed-{seed}.log", "w") as log:
        done = subprocess.run([sys.executable, str(ROOT / "pipeline/launch.py"), "recipe=tiny", f"seed={seed}",
                               f"output_root={folder}", *overrides], stdout=log, stderr=log, check=False)
    wall = time.time() - started
    if done.returncode != 0:
        print(f"seed {seed}: exit {done.returncode} (log: {out / f'seed-{seed}.log'})", file=sys.stderr)
    return stage_changes(folder / "tiny"), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed, first-seed + 1, ...")
    parser.add_argument("--out", type=Path, default=Path("/tmp/stage_gains"))
    args, overrides = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        changes, wall = run_seed(seed, args.out, overrides)
        results[seed] = {"wall_s": round(wall, 1), "stages": changes}
        for c in changes:
            print(f"seed {seed} {c['stage']:>9}: {c['before']:.3f} -> {c['after']:.3f}  +{c['gained']} / "
                  f"-{c['lost']} of {c['n']}  mid-p {c['mid_p']:.2g}", flush=True)
        print(f"seed {seed}: {wall:.0f} s", flush=True)
    stages = list(dict.fromkeys(c["stage"] for r in results.values() for c in r["stages"]))
    for stage in stages:
        rows = [c for r in results.values() for c in r["stages"] if c["stage"] == stage]
        won = sum(c["mid_p"] < ALPHA and c["gained"] > c["lost"] for c in rows)
        print(f"{stage}: a significant gain in {won} of {len(rows)} seeds", flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
