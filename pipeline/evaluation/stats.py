"""Paired comparison of two evaluated checkpoints from their per-problem results (lm-eval's samples).

`run_eval` keeps `<eval dir>/samples_<task>.jsonl`: one row per problem and answer filter, with its
`doc_id` and the metric's per-problem value. Two checkpoints scored on the same problems are compared
problem by problem: d_i = b_i - a_i over the shared doc_ids, diff = mean(d), se = sd(d) / sqrt(n)
(the paired standard error; it is much smaller than the two unpaired stderrs combined when the
checkpoints get mostly the same problems right), a 95% normal interval diff +- 1.96 se and the
two-sided p-value of z = diff / se. For 0/1 metrics this z-test is the large-sample McNemar test.

A sweep picks its model on one half of the validation problems and its gate judges it on the other
(`HALVES`: even doc_ids select, odd doc_ids gate), so that the gate's estimate is not the winner's curse
of the pick: the best of several candidates on the same problems scores above its true value there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pipeline.runfolder import recall, samples_file

Z95 = 1.959964  # two-sided 95% normal quantile
HALVES = {"selection": 0, "gate": 1}  # doc_id % 2 of each half of a swept stage's validation problems


def problem_scores(text: str) -> dict[str, dict[int, float]]:
    """`{"<metric>,<filter>": {doc_id: value}}` of the per-problem rows in the text of a `samples_<task>.jsonl`:
    the number each metric the row lists (`metrics`: exact_match, acc, acc_norm, ...) has for it, under the row's
    answer filter (a metric whose value is not one number, e.g. ifeval's per-instruction lists, has none); a row
    without that list: every number it holds but its doc_id and target (a multiple-choice answer's index)."""
    out: dict[str, dict[int, float]] = {}
    for row in (json.loads(line) for line in text.splitlines() if line.strip()):
        for name in row.get("metrics") or [k for k in row if k not in ("doc_id", "target")]:
            if isinstance(row.get(name), (int, float)):
                out.setdefault(f"{name},{row.get('filter', 'none')}", {})[int(row["doc_id"])] = float(row[name])
    return out


def per_problem(eval_dir: Path, metric: str, half: str | None = None) -> dict[int, float]:
    """`{doc_id: value}` of `metric` (`<task>/<metric>,<filter>`) in `eval_dir/samples_<task>.jsonl` (read once
    while a `runfolder.RunState` is held), only the problems of `half` (`HALVES`) when given; empty when the file
    does not exist."""
    task, _, key = metric.partition("/")
    values = (recall(samples_file(eval_dir, task), problem_scores) or {}).get(key, {})
    return {i: v for i, v in values.items() if half is None or i % 2 == HALVES[half]}  # a copy: the state's stays


def half_mean(eval_dir: Path, metric: str, half: str) -> tuple[float, int] | None:
    """(mean of `metric`, problems) on `half` of the problems of `eval_dir`; None without per-problem samples."""
    values = per_problem(eval_dir, metric, half)
    return (sum(values.values()) / len(values), len(values)) if values else None


def paired_difference(a_dir: Path, b_dir: Path, metric: str, half: str | None = None) -> dict | None:
    """`b - a` on the problems both eval folders scored (only `half` of them when given): {diff, se, ci_low,
    ci_high, n, p_value} (95% normal interval, two-sided p); None when they share no problem for `metric`."""
    a, b = per_problem(a_dir, metric, half), per_problem(b_dir, metric, half)
    shared = sorted(set(a) & set(b))
    n = len(shared)
    if n == 0:
        return None
    d = [b[i] - a[i] for i in shared]
    diff = sum(d) / n
    se = math.sqrt(sum((x - diff) ** 2 for x in d) / (n - 1) / n) if n > 1 else 0.0
    if se > 0:
        p = math.erfc(abs(diff / se) / math.sqrt(2))
    else:  # every problem moved by the same amount: no noise left to test against
        p = 1.0 if diff == 0 else 0.0
    return {"diff": diff, "se": se, "ci_low": diff - Z95 * se, "ci_high": diff + Z95 * se, "n": n, "p_value": p}

