"""Where a run's gain comes from: each checkpoint against the base on the same problems, strict and flexible.

    PYTHONPATH=. python bench/gain.py RUN_FOLDER [--task gsm8k_local]

For every scored checkpoint of the run (`stages/*/eval`), the paired difference to the base model (00-base) on
`--task`'s problems, for strict-match (the answer on a `#### N` line), flexible-extract (the last number in the
answer) and, where `<task>_bpb` was scored, the reference solutions' bits per byte. The flexible gain is better
reasoning (or luck); what strict gains beyond it is the answer format.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    """Print one line per checkpoint and metric."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder (runs/<name>)")
    parser.add_argument("--task", default="gsm8k_local", help="the task whose problems are compared")
    args = parser.parse_args()

    from pipeline.evaluation.stats import describe, paired_difference, per_problem

    base = args.run / "stages" / "00-base" / "eval"
    for stage in sorted(p.parent for p in (args.run / "stages").glob("*/eval") if p.parent.name != "00-base"):
        for name in (f"{args.task}/exact_match,strict-match", f"{args.task}/exact_match,flexible-extract",
                     f"{args.task}_bpb/bits_per_byte,none"):
            scores = per_problem(stage / "eval", name)
            diff = paired_difference(base, stage / "eval", name)
            if not scores or diff is None:
                continue
            print(f"{stage.name} {name}: {sum(scores.values()) / len(scores):.3f} (n={len(scores)}), vs base "
                  f"{describe(diff)}")


if __name__ == "__main__":
    main()
