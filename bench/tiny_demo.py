"""The tiny demo's figures: per-stage held-out accuracy, paired significance, DPO movement and CPU time.

    python bench/tiny_demo.py [--out /tmp/tiny_demo] [--reuse] [extra overrides ...]
    python bench/tiny_demo.py --read runs/tiny        # the figures of a finished (or partial) run folder

Runs `pipeline/run.py recipe=tiny` in a fresh output folder (bootstrap included: data, tokenizer and
base-model pretraining; `--reuse` keeps the folder, so finished stages are read, not rerun), then reads
each stage's per-problem results (`stages/NN-x/eval/samples_tiny_gsm.jsonl`) and prints JSON with:
accuracy and its standard error per checkpoint; the paired difference to the previous checkpoint on the
same problems (wins, losses, exact two-sided McNemar p); each DPO candidate's first and last loss,
last logged reward margin and validation accuracy; wall time and the run's CPU seconds (user + system). On a
busy machine, wall time says little: compare CPU seconds with those of a run measured on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = "eval/samples_tiny_gsm.jsonl"
VALIDATION = "eval/samples_tiny_gsm_val.jsonl"  # sweep candidates are scored on validation only


def per_problem(path: Path) -> dict[int, float]:
    """Exact match per problem id from an lm-eval samples file."""
    rows = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return {row["doc_id"]: float(row["exact_match"]) for row in rows}


def mcnemar(before: dict[int, float], after: dict[int, float]) -> dict:
    """Problems won and lost between two checkpoints, and the exact two-sided McNemar p-value."""
    ids = before.keys() & after.keys()
    won = sum(1 for i in ids if after[i] > before[i])
    lost = sum(1 for i in ids if after[i] < before[i])
    n = won + lost
    tail = sum(math.comb(n, j) for j in range(min(won, lost) + 1)) / 2 ** n if n else 0.5
    return {"won": won, "lost": lost, "p": round(min(1.0, 2 * tail), 6)}


def summary(scores: dict[int, float]) -> dict:
    """Accuracy, problem count and binomial standard error."""
    n = len(scores)
    acc = sum(scores.values()) / n
    return {"n": n, "accuracy": round(acc, 4), "stderr": round(math.sqrt(acc * (1 - acc) / max(n - 1, 1)), 4)}


def dpo_movement(stage_dir: Path) -> dict:
    """Each sweep candidate's first / last loss, last logged reward margin and validation accuracy."""
    out = {}
    for cand in sorted((stage_dir / "candidates").glob("*")):
        record = json.loads((cand / "stage.json").read_text()) if (cand / "stage.json").is_file() else {}
        metrics = record.get("metrics") or {}
        logged = metrics.get("last_logged") or {}
        scores = cand / VALIDATION
        out[cand.name] = {"loss_first": metrics.get("loss_first"), "loss_last": metrics.get("loss_last"),
                          "steps": metrics.get("steps"), "margin_last": logged.get("rewards/margins"),
                          "validation": summary(per_problem(scores))["accuracy"] if scores.is_file() else None}
    return out


def report(run: Path) -> dict:
    """Per-checkpoint accuracy, paired tests against the previous checkpoint, DPO candidates' movement."""
    chain, previous = {}, None
    for stage_dir in sorted((run / "stages").glob("*")):
        record = json.loads((stage_dir / "stage.json").read_text()) if (stage_dir / "stage.json").is_file() else {}
        selected = (record.get("metrics") or {}).get("selected")  # a sweep: the selected model, scored in stage_dir
        samples = stage_dir / SAMPLES
        if not samples.is_file():
            continue
        scores = per_problem(samples)
        chain[stage_dir.name] = summary(scores) | {"selected": selected} | (
            {"vs_previous": mcnemar(previous, scores)} if previous else {})
        if (stage_dir / "candidates").is_dir():
            chain[stage_dir.name]["candidates"] = dpo_movement(stage_dir)
        previous = scores
    return chain


def main() -> None:
    """Run (or reuse) the tiny chain and print its figures."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/tiny_demo")
    parser.add_argument("--reuse", action="store_true", help="keep the output folder (finished stages are reused)")
    parser.add_argument("--read", metavar="RUN_DIR", help="only print the figures of an existing run folder")
    args, extra = parser.parse_known_args()
    if args.read:
        print(json.dumps(report(Path(args.read)), indent=2))
        return
    if not args.reuse:
        shutil.rmtree(args.out, ignore_errors=True)
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "pipeline/run.py"), "recipe=tiny", f"output_root={args.out}",
                           *extra], cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = {"wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
           "checkpoints": report(Path(args.out) / "tiny")}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
