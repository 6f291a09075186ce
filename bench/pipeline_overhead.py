"""Pipeline overhead: the tiny recipe end to end, and the share of wall time outside training steps.

    python bench/pipeline_overhead.py [--out /tmp/overhead] [--repeats 3] [extra overrides ...]

Runs `pipeline/run.py recipe=tiny` in a fresh output folder per repeat (the tiny base model is built
too, and counted as training: it is a pretraining run), then splits each run's wall time from the
stage records into time inside training steps (forward + backward + optimizer, every stage and DPO
candidate), data generation (on-policy DPO sampling: the pairs it trains on), evaluation, and the
rest (imports, data, tokenisation, saving, loading, handoff). `outside_training_share` counts
everything but training steps and data generation. Prints JSON: median and range over the repeats.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _candidate_eval_s(out: Path, sweep: dict) -> float:
    """The scoring time of a sweep stage's selected candidate."""
    path = next(out.glob(f"**/stages/*-{sweep['stage']}/candidates/{sweep['metrics']['selected']}/stage.json"))
    return json.loads(path.read_text())["eval"]["wall_time_s"]


def one_chain(out: Path, extra: list[str]) -> dict:
    """Time one tiny chain in `out` and split its wall time."""
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "pipeline/run.py"), "recipe=tiny", f"output_root={out}", *extra],
                          cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode:
        sys.exit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(p.read_text()) for p in out.glob("**/stage.json")]
    # a sweep's stage record repeats the training metrics of its selected candidate, and its eval includes the
    # candidate's: count the candidates, and of the stage only the scoring its selected model added
    sweeps = [r for r in records if (r.get("metrics") or {}).get("selected")]
    records = [r for r in records if r not in sweeps]
    records += [{"stage": "tiny-base-pretraining", "metrics": json.loads(p.read_text())}
                for p in out.glob(".cache/tiny-*/pretrain.json")]
    train = sum((r.get("metrics") or {}).get("compute_s") or 0 for r in records)
    evals = sum((r.get("eval") or {}).get("wall_time_s") or 0 for r in records)
    evals += sum(r["eval"]["wall_time_s"] - _candidate_eval_s(out, r) for r in sweeps if r.get("eval"))
    generation = sum(json.loads(p.read_text()).get("sampling_s") or 0 for p in out.glob("**/on_policy_stats.json"))
    return {"wall_s": wall, "training_steps_s": train, "data_generation_s": generation, "evaluation_s": evals,
            "outside_training_share": 1 - (train + generation) / wall,
            "outside_training_share_counting_generation": 1 - train / wall}


def main() -> None:
    """Time the tiny chain `--repeats` times and print the breakdown's median and range."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/pipeline_overhead")
    parser.add_argument("--repeats", type=int, default=3)
    args, extra = parser.parse_known_args()
    runs = [one_chain(Path(args.out) / f"run{i}", extra) for i in range(args.repeats)]
    out = {"machine": "cpu", "repeats": args.repeats}
    for key in runs[0]:
        values = [r[key] for r in runs]
        digits = 3 if "share" in key else 1
        out[key] = {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
                    "max": round(max(values), digits)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
