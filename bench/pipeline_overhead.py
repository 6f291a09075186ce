"""Pipeline overhead: the tiny recipe end to end, and the share of wall time outside training steps.

    python bench/pipeline_overhead.py [--out /tmp/overhead] [extra overrides ...]

Runs `pipeline/run.py recipe=tiny` in a fresh output folder (the tiny base model is built too, and
counted as training: it is a pretraining run), then splits the wall time from the stage records:
time inside training steps (forward + backward + optimizer, every stage and DPO candidate) against
everything else (imports, data, tokenisation, evaluation, saving, loading, handoff). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    """Time one tiny chain and print the breakdown."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/pipeline_overhead")
    args, extra = parser.parse_known_args()
    shutil.rmtree(args.out, ignore_errors=True)
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "pipeline/run.py"), "recipe=tiny", f"output_root={args.out}",
                           *extra], cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode:
        sys.exit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(p.read_text()) for p in Path(args.out).glob("**/stage.json")]
    # a sweep's stage record repeats the metrics and eval of its selected candidate: count the candidates only
    records = [r for r in records if not (r.get("metrics") or {}).get("selected")]
    records += [{"stage": "tiny-base-pretraining", "metrics": json.loads(p.read_text())}
                for p in Path(args.out).glob(".cache/tiny-*/pretrain.json")]
    train = sum((r.get("metrics") or {}).get("compute_s") or 0 for r in records)
    evals = sum((r.get("eval") or {}).get("wall_time_s") or 0 for r in records)
    out = {"machine": "cpu", "wall_s": round(wall, 1), "training_steps_s": round(train, 1),
           "evaluation_s": round(evals, 1), "outside_training_share": round(1 - train / wall, 3),
           "stages": {r.get("candidate") or r.get("stage"): (r.get("metrics") or {}).get("compute_s")
                      for r in records}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
