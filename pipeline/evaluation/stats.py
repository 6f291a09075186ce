"""Paired comparison of two evaluated checkpoints from their per-problem results (lm-eval's samples).

`run_eval` keeps `<eval dir>/samples_<task>.jsonl`: one row per problem and answer filter, with its
`doc_id` and the metric's per-problem value. Two checkpoints scored on the same problems are compared
problem by problem, each metric with one test and the interval that inverts it:

- a 0/1 metric (exact match, accuracy): Tango's score test of the paired difference of two proportions and its
  score interval (Tango 1998, "Equivalence test and confidence interval for the difference in proportions for the
  paired-sample design", Statistics in Medicine 17:891-908; recommended by Fagerland, Lydersen and Laake 2014,
  "Recommended tests and confidence intervals for paired binomial proportions", Statistics in Medicine
  33:2850-2875), with Edwards' continuity correction (`CORRECTION`), which keeps its one-sided error within its
  level (`tests/test_stats.py` weighs every table exactly). It depends only on the problems gained and lost and n;
  at a change of 0 it is McNemar's test with that correction (statsmodels' `mcnemar(correction=True)`);
- any other metric (a log-probability, bits per byte): the paired t-test and its interval (scipy's `ttest_rel`).

Everything printed and decided comes from that one test: the two-sided 95% interval, the two-sided p against no
change (below 0.05 exactly when the interval leaves 0 out), and each gate's one-sided test at `ALPHA` = 2.5%
against its threshold (significant exactly when the interval's bound lies beyond it). A comparison that no
outcome could make significant (a zero standard error, too few problems) says so (`cannot_judge`) rather than
printing a p of 0.

A sweep picks its model on one half of the validation problems and its gate judges it on the other
(`HALVES`: even doc_ids select, odd doc_ids gate), so that the gate's estimate is not the winner's curse
of the pick: the best of several candidates on the same problems scores above its true value there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats as scipy_stats
from scipy.stats import norm

from pipeline.runfolder import recall, samples_file

ALPHA = 0.025  # one-sided error of every gate's test: the bound of the two-sided 95% interval
Z = float(norm.ppf(1 - ALPHA))
# Edwards' continuity correction of McNemar's test (gained - lost moves in steps of 2): uncorrected, Tango's test
# calls a drop beyond a margin up to 4.4% of the time at its nominal 2.5% (skewed tables, few problems changing)
CORRECTION = 1.0
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
    a, b = per_problem(a_dir, metric, half), per_problem(b_dir, metric)  # the problems of `half` that b scored too
    shared = sorted(set(a) & set(b))
    return compare([a[i] for i in shared], [b[i] for i in shared]) if shared else None


def compare(a: list[float], b: list[float]) -> dict:
    """The paired change `b - a` of one metric on the same problems: {diff, se (the paired standard error), ci_low,
    ci_high (two-sided 95%), n, p_value (two-sided, against no change), test}, plus {gained, lost} (problems b gets
    right and a does not, and the reverse) for a 0/1 metric, and `cannot_judge` (why no test can tell anything,
    with p_value None; a continuous metric's interval is then the point) when none can."""
    n = len(a)
    d = [y - x for x, y in zip(a, b, strict=True)]
    diff = sum(d) / n
    se = math.sqrt(sum((x - diff) ** 2 for x in d) / (n - 1) / n) if n > 1 else 0.0
    out = {"diff": diff, "se": se, "n": n}
    if all(v in (0.0, 1.0) for v in (*a, *b)):
        gained, lost = sum(x > 0 for x in d), sum(x < 0 for x in d)
        low, high = score_interval(gained, lost, n)
        out |= {"ci_low": low, "ci_high": high, "p_value": float(2 * norm.sf(abs(tango_z(gained, lost, n, 0.0)))),
                "test": "Tango score", "gained": gained, "lost": lost}
        if not reachable(n, 0.0, above=True):  # at a change of 0 the test is symmetric: a gain or a drop alike
            return {**out, "p_value": None, "cannot_judge": f"{n} shared problem{'s' * (n != 1)}: no outcome could be "
                                                            "significant"}
        return out
    if se == 0:
        why = "one shared problem" if n < 2 else "every problem moved by the same amount: no noise to test against"
        return {**out, "ci_low": diff, "ci_high": diff, "p_value": None, "test": "paired t", "cannot_judge": why}
    result = scipy_stats.ttest_rel(b, a)
    ci = result.confidence_interval(1 - 2 * ALPHA)
    return {**out, "ci_low": float(ci.low), "ci_high": float(ci.high), "p_value": float(result.pvalue),
            "test": "paired t"}


def tango_z(gained: Any, lost: Any, n: Any, delta: Any) -> Any:
    """Tango's score statistic of `(gained - lost) / n = delta` (numbers or numpy arrays): the observed difference less
    `delta` (brought `CORRECTION` problems nearer to it), over its standard error at the maximum-likelihood table that
    has difference `delta`; large when the change is above `delta`."""
    gained, lost, n, delta = (np.asarray(v, dtype=float) for v in (gained, lost, n, delta))
    b = delta * (2 * n - gained + lost) - gained - lost
    q = (np.sqrt(np.maximum(b * b + 8 * n * lost * delta * (1 - delta), 0.0)) - b) / (4 * n)  # the share lost
    u, var = gained - lost - n * delta, n * (2 * q + delta * (1 - delta))
    u = np.sign(u) * np.maximum(np.abs(u) - CORRECTION, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(var > 0, u / np.sqrt(np.where(var > 0, var, 1.0)), np.where(u == 0, 0.0, np.sign(u) * np.inf))
    return z if z.ndim else float(z)


def score_p(gained: Any, lost: Any, n: Any, threshold: Any, above: bool) -> Any:
    """One-sided p of Tango's test that the change (gained - lost) / n lies `above` (or below) `threshold`
    (numbers or numpy arrays)."""
    z = tango_z(gained, lost, n, threshold)
    return norm.sf(z) if above else norm.cdf(z)


def reachable(n: int, threshold: float, above: bool) -> bool:
    """Whether some table of `n` problems (the most lopsided one: all gained, or all lost) makes Tango's one-sided
    test significant at `ALPHA` that the change lies `above` (or below) `threshold`."""
    best = score_p(n, 0, n, threshold, True) if above else score_p(0, n, n, threshold, False)
    return bool(best < ALPHA)


def significant(paired: dict) -> bool:
    """Whether the paired change (a `compare`) is told apart from no change: two-sided p < 0.05, the 95% interval
    leaving 0 out (a comparison that is not testable is not)."""
    return paired["p_value"] is not None and paired["p_value"] < 2 * ALPHA


def score_interval(gained: Any, lost: Any, n: Any) -> tuple[Any, Any]:
    """The two-sided 95% interval of the change (gained - lost) / n that inverts Tango's test (numbers or numpy
    arrays): every threshold the one-sided test at `ALPHA` rejects on neither side, found by bisection (the statistic
    falls as the threshold rises)."""
    g, lo, m = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (gained, lost, n)))
    diff = (g - lo) / m

    def edge(end: float, side: int) -> np.ndarray:
        inside, outside = diff, np.full_like(diff, end)
        for _ in range(60):
            mid = (inside + outside) / 2
            keep = side * tango_z(g, lo, m, mid) <= Z
            inside, outside = np.where(keep, mid, inside), np.where(keep, outside, mid)
        return np.where(side * tango_z(g, lo, m, end) <= Z, end, inside)

    low, high = edge(-1.0, 1), edge(1.0, -1)
    return (float(low), float(high)) if low.ndim == 0 else (low, high)


def p_beyond(paired: dict, threshold: float, above: bool) -> float:
    """One-sided p that the change of `paired` (a `compare`) lies `above` (or below) `threshold`, from the test that
    made its interval: significant at `ALPHA` exactly when the interval's bound lies beyond the threshold."""
    if "gained" in paired:
        return float(score_p(paired["gained"], paired["lost"], paired["n"], threshold, above))
    t = (paired["diff"] - threshold) / paired["se"]
    return float(scipy_stats.t.sf(t, paired["n"] - 1) if above else scipy_stats.t.cdf(t, paired["n"] - 1))


def describe(paired: dict, digits: int = 3) -> str:
    """The one text of a paired change the product prints: `+0.008 [-0.000, +0.017], p=0.05 (Tango score,
    +21 / -10, n=1319)`; a comparison no test can judge: `+0.000, not testable: <why> (n=1)`."""
    counts = f", +{paired['gained']} / -{paired['lost']}" if "gained" in paired else ""
    p = paired["p_value"]
    if p is None:
        where = f"{counts[2:]}, n={paired['n']}" if counts else f"n={paired['n']}"
        return f"{paired['diff']:+.{digits}f}, not testable: {paired.get('cannot_judge')} ({where})"
    return (f"{paired['diff']:+.{digits}f} [{paired['ci_low']:+.{digits}f}, {paired['ci_high']:+.{digits}f}], "
            f"{f'p={p:.2g}' if p >= 1e-4 else 'p<1e-4'} ({paired.get('test', 'paired')}{counts}, n={paired['n']})")
