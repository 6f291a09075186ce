"""Paired comparison of two evaluated checkpoints from their per-problem results (lm-eval's samples).

`run_eval` keeps `<eval dir>/samples_<task>.jsonl`: one row per problem and answer filter, with its
`doc_id` and the metric's per-problem value. Two checkpoints scored on the same problems are compared
problem by problem, with scipy's tests:

- a 0/1 metric (exact match, accuracy): McNemar's mid-p test on the problems gained and lost (the exact
  binomial test of the discordant pairs, scipy's `binomtest`, less half the probability of the observed count),
  and Newcombe's hybrid score interval for paired proportions (his method 10, built on scipy's Wilson intervals
  of the two scores), which keeps its coverage at a handful of discordant problems, where a Wald interval
  collapses to a point;
- any other metric (a log-probability, bits per byte): the paired t-test and its interval (`ttest_rel`).

A sweep picks its model on one half of the validation problems and its gate judges it on the other
(`HALVES`: even doc_ids select, odd doc_ids gate), so that the gate's estimate is not the winner's curse
of the pick: the best of several candidates on the same problems scores above its true value there.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from scipy import stats as scipy_stats

from pipeline.runfolder import recall, samples_file

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


def higher_is_better(result: dict | None, metric: str) -> bool:
    """Whether `metric` (`<task>/<metric>,<filter>`) is better higher, as the eval `result` records lm-eval's
    `higher_is_better` (true when it does not say)."""
    task, _, key = metric.partition("/")
    return ((result or {}).get("higher_is_better") or {}).get(task, {}).get(key.partition(",")[0], True)


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
    """`b - a` on the problems both eval folders scored (only `half` of them when given) as `compare` gives it;
    None when they share no problem for `metric`."""
    a, b = per_problem(a_dir, metric, half), per_problem(b_dir, metric, half)
    shared = sorted(set(a) & set(b))
    return compare([a[i] for i in shared], [b[i] for i in shared]) if shared else None


def compare(a: list[float], b: list[float]) -> dict:
    """The paired change `b - a` of one metric on the same problems: {diff, se (the paired standard error), ci_low,
    ci_high (two-sided 95%), bound_low, bound_high (one-sided 95% bounds), n, p_value (two-sided), test}, plus
    {gained, lost} (problems b gets right and a does not, and the reverse) for a 0/1 metric."""
    n = len(a)
    d = [y - x for x, y in zip(a, b, strict=True)]
    diff = sum(d) / n
    se = math.sqrt(sum((x - diff) ** 2 for x in d) / (n - 1) / n) if n > 1 else 0.0
    out = {"diff": diff, "se": se, "n": n}
    if all(v in (0.0, 1.0) for v in (*a, *b)):
        gained, lost, both = sum(x > 0 for x in d), sum(x < 0 for x in d), sum(x * y for x, y in zip(a, b, strict=True))
        low, high = newcombe_interval(int(both), gained, lost, n, 0.95)
        bound_low, bound_high = newcombe_interval(int(both), gained, lost, n, 0.90)
        return {**out, "ci_low": low, "ci_high": high, "bound_low": bound_low, "bound_high": bound_high,
                "p_value": mcnemar_midp(gained, lost), "test": "McNemar mid-p", "gained": gained, "lost": lost}
    if se == 0:  # every problem moved by the same amount: no noise left to test against
        return {**out, "ci_low": diff, "ci_high": diff, "bound_low": diff, "bound_high": diff,
                "p_value": 1.0 if diff == 0 else 0.0, "test": "paired t"}
    result = scipy_stats.ttest_rel(b, a)
    two, one = result.confidence_interval(0.95), result.confidence_interval(0.90)
    return {**out, "ci_low": float(two.low), "ci_high": float(two.high), "bound_low": float(one.low),
            "bound_high": float(one.high), "p_value": float(result.pvalue), "test": "paired t"}


@functools.lru_cache(maxsize=65536)
def mcnemar_midp(gained: int, lost: int) -> float:
    """Two-sided McNemar mid-p value of `gained` against `lost` discordant problems: twice the binomial (scipy's)
    probability of a split more lopsided than the one observed plus half that of the observed one."""
    m, k = gained + lost, min(gained, lost)
    return float(min(1.0, 2 * (scipy_stats.binom.cdf(k - 1, m, 0.5) + scipy_stats.binom.pmf(k, m, 0.5) / 2)))


@functools.lru_cache(maxsize=65536)
def newcombe_interval(both: int, gained: int, lost: int, n: int, confidence: float) -> tuple[float, float]:
    """Newcombe's hybrid score interval (1998, method 10) of the paired difference of two 0/1 scores over `n`
    problems: the second checkpoint's score (both + gained) / n less the first's (both + lost) / n, built from
    scipy's Wilson intervals of the two scores and their phi correlation."""
    neither = n - both - gained - lost
    p1, p2 = (both + gained) / n, (both + lost) / n
    (l1, u1), (l2, u2) = (scipy_stats.binomtest(k, n).proportion_ci(confidence, "wilson")
                          for k in (both + gained, both + lost))
    margins = (both + gained) * (lost + neither) * (both + lost) * (gained + neither)
    phi = (both * neither - gained * lost) / math.sqrt(margins) if margins else 0.0
    down = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    up = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return p1 - p2 - down, p1 - p2 + up


def describe(paired: dict, digits: int = 3) -> str:
    """The one text of a paired change the product prints: `+0.008 [-0.000, +0.017], p=0.05 (McNemar mid-p,
    +21 / -10, n=1319)`."""
    p = paired["p_value"]
    counts = f", +{paired['gained']} / -{paired['lost']}" if "gained" in paired else ""
    test = paired.get("test", "paired")
    return (f"{paired['diff']:+.{digits}f} [{paired['ci_low']:+.{digits}f}, {paired['ci_high']:+.{digits}f}], "
            f"{f'p={p:.2g}' if p >= 1e-4 else 'p<1e-4'} ({test}{counts}, n={paired['n']})")
