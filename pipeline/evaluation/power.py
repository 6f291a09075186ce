"""What a gate can see: the smallest change its paired test detects with 80% power.

A gate's test (`gates`, `stats`) compares a stage with its input problem by problem, one-sided at `stats.ALPHA`.
Over n problems it detects, with 80% power, a true change of at least:

- a 0/1 metric whose answers change on a share psi of the problems (the churn: problems gained plus lost, over n):
  the d that solves Connor's (1987) normal approximation of McNemar's test, with the test's continuity correction
  (`stats.CORRECTION` problems): n d - c = z_a sqrt(n psi) + z_b sqrt(n (psi - d^2)) (statsmodels has no power
  function for it), where a change of d moves at least d of the problems (psi is then at least d);
- a continuous metric whose paired differences have SD s: d s, with d the effect size statsmodels' `TTestPower`
  solves for at n (the paired t-test is the one-sample t of the differences).

Once both checkpoints are scored, psi and s are those observed on the problems the gate judges (the sight is
measured, not assumed). Before the run the input's score is assumed 0.5 and its answers to change independently,
psi = 0.5 (the most churn there can be): a stated assumption, printed as such (`plan=true`, the run's log), never a
warning. A gate cannot see what it judges when a test that looks for a drop (`no_significant_drop`,
`non_inferior`) has a `max_drop` below that change, or sits at the metric's floor (fewer than `EDGE` right answers
to lose), or a `superior` test sits at its ceiling (fewer than `EDGE` wrong answers to gain); never when the change
was significant: then it saw it. A blind gate is a warning in the log and the headline, exit 2 under
`strict_gates=true`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from scipy import optimize
from scipy.stats import norm
from statsmodels.stats.power import TTestPower

from pipeline import extension
from pipeline.evaluation.stats import ALPHA, CORRECTION, significant
from pipeline.grid import sweeps

POWER = 0.80
EDGE = 5  # fewer right (or wrong) answers than this: the metric sits at its floor (or ceiling)
ASSUMED_RATE = 0.5  # the input's score before it is scored, its answers changing independently: the most churn
BINARY = ("exact_match", "acc", "acc_norm")  # metrics scored 0 or 1 per problem; others are continuous
RANGES = {**{m: (0.0, 1.0) for m in BINARY}, "bits_per_byte": (0.0, math.inf)}  # the values a known metric takes
# problems per shipped task, as published (GSM8K's test set; the validation slice of tasks/gsm8k_validation.py)
SIZES = {"gsm8k_local": 1319, "gsm8k_local_bpb": 1319, "gsm8k_local_val": 500, "gsm8k_local_val_bpb": 500}
DROPS = ("no_significant_drop", "non_inferior")  # the tests that look for a drop; `superior` looks for a gain


def measure(metric: str) -> str:
    """The metric's own name in `<task>/<metric>,<filter>`: `exact_match`, `bits_per_byte`."""
    return metric.partition("/")[2].partition(",")[0]


def binary(metric: str) -> bool:
    """Whether `metric` (`<task>/<metric>,<filter>`) is scored 0 or 1 per problem (else it is continuous)."""
    return measure(metric) in BINARY


def detectable(n: int, churn: float | None = None, sd: float | None = None) -> float:
    """The smallest true change the gates' one-sided paired test over `n` problems detects with 80% power: of a 0/1
    metric whose answers change on a share `churn` of the problems, or of a continuous one whose paired differences
    have SD `sd`; inf when no change can be."""
    if n < 2:
        return math.inf
    if sd is not None:
        return float(TTestPower().solve_power(nobs=n, alpha=ALPHA, power=POWER, alternative="larger")) * sd
    za, zb = norm.ppf(1 - ALPHA), norm.ppf(POWER)

    def short(d: float) -> float:  # how far n d falls short of what the corrected test needs to detect d
        moved = max(churn, d)  # a change of d moves at least d of the problems (none observed is not none possible)
        return n * d - CORRECTION - za * math.sqrt(n * moved) - zb * math.sqrt(n * max(moved - d * d, 0.0))

    return optimize.brentq(short, 1e-9, 1.0) if short(1.0) > 0 else math.inf


def blind(test: str, max_drop: float | None, change: float, n: int, rate: float | None) -> str | None:
    """Why a gate cannot see what it judges (its `test` and `max_drop`, the `change` it detects over `n` problems,
    the input's 0/1 `rate`, None for a continuous metric), or None when it can: a drop test at the floor or with a
    max_drop below the change, a gain test at the ceiling."""
    drops = test in DROPS
    if rate is not None and (rate if drops else 1 - rate) * n < EDGE:
        edge, few = ("floor", "right answers to lose") if drops else ("ceiling", "wrong answers to gain")
        return (f"the metric sits at its {edge}: {rate:.3f} of {n} problems leaves about "
                f"{round((rate if drops else 1 - rate) * n)} {few}")
    if not math.isfinite(change):
        return f"{n} problem{'s' * (n != 1)} detect no change"
    if max_drop is not None and drops and max_drop < change:
        return f"max_drop {max_drop:.3f} is below the smallest change this gate detects ({change:.3f})"
    return None


def describe(change: float, n: int, metric: str, spread: str) -> str:
    """`sees ±0.033 on gsm8k_local_val/exact_match,strict-match (80% power, n=150, churn 0.040)`."""
    seen = f"sees \u00b1{change:.3f}" if math.isfinite(change) else "sees no change"
    return f"{seen} on {metric} (80% power, n={n}, {spread})"


def sight(gate: Any, paired: dict | None, before: dict[int, float], half: str | None = None) -> dict | None:
    """What `gate` sees in the change it judged (`paired`, a `stats.compare` of the input and the stage on the
    problems the gate judges, `half` of them when a sweep picked on the other) over the input's per-problem `before`
    values: {detectable, n, rate (the input's 0/1 score, else None), churn or sd (observed), blind (why it cannot
    see, else None; never beside a significant change), text}; None without a paired change, or when the gate
    judges no change (a drop test without `max_drop`)."""
    if not paired or paired.get("p_value") is None or (gate.test in DROPS and gate.max_drop is None):
        return None
    n, where = paired["n"], gate.metric + (f", {half} half" if half else "")
    if "gained" in paired:
        churn = (paired["gained"] + paired["lost"]) / n
        rate = sum(before.values()) / len(before) if before else 0.0
        change, spread, measured = detectable(n, churn), f"churn {churn:.3f}", {"churn": churn}
    else:
        sd = paired["se"] * math.sqrt(n)
        rate, change, measured = None, detectable(n, sd=sd), {"sd": sd}
        spread = f"SD of the paired differences {sd:.3g}"
    return {"detectable": change, "n": n, "rate": rate, "half": half, **measured,
            "blind": None if significant(paired) else blind(gate.test, gate.max_drop, change, n, rate),
            "text": describe(change, n, where, spread)}


def before_run(cfg: Any, name: str) -> dict | None:
    """What the gate of stage `name` would see under the stated assumption, before its input is scored (`planned`);
    None without a gate."""
    gate = cfg[name].gate
    if not gate.metric:
        return None
    limit = cfg[name].eval.limit if cfg[name].eval.limit is not None else cfg.eval.limit  # a mapping is one
    n = problem_count(cfg, {"limit": limit}, gate.metric.partition("/")[0])
    return planned(gate, n, halved=bool(sweeps(cfg[name])))


def problem_count(cfg: Any, ev: dict, task: str) -> int | None:
    """How many problems `ev` scores of `task`, known before it runs: the shipped and the extension's tasks' sizes,
    cut by `eval.limit` (a count, or a mapping task -> count; 0 or absent: all); None when not known."""
    size = SIZES.get(task) or extension.task_sizes(cfg).get(task)
    limit = ev.get("limit")
    limit = limit.get(task) if isinstance(limit, Mapping) else limit
    if not limit:  # None or 0: every problem
        return size
    return min(int(limit), size) if size else int(limit)


def planned(gate: Any, n: int | None, halved: bool) -> dict:
    """What `gate` would see before its input is scored, over the `n` problems of its task (half of them, `halved`,
    when a sweep selects on the other half), under the stated assumption (input score `ASSUMED_RATE`, answers
    changing independently): {detectable, n, rate, assumed, may_miss (what it may not see then, else None), text};
    for a continuous metric, or an unknown n, only a note."""
    if n is None:
        return {"n": None, "text": "n unknown before its task is loaded: its sight is measured once it has judged"}
    n = n // 2 if halved else n
    if gate.test in DROPS and gate.max_drop is None:
        return {"n": n, "text": f"judges no change (no max_drop), only its floor, over n={n}"}
    if not binary(gate.metric):
        return {"n": n, "text": f"a continuous metric over n={n}: its sight is measured once it has judged"}
    churn = 2 * ASSUMED_RATE * (1 - ASSUMED_RATE)
    change = detectable(n, churn)
    text = describe(change, n, gate.metric, f"assumed: input {ASSUMED_RATE}, answers changing independently, "
                                            f"churn {churn:.2f}, the most there can be")
    return {"detectable": change, "n": n, "rate": ASSUMED_RATE, "assumed": True,
            "may_miss": blind(gate.test, gate.max_drop, change, n, None), "text": text}


def impossible(gate: Any) -> str | None:
    """Why `gate`'s `min` or `max_drop` cannot fit its metric (a 0/1 metric's share lies in [0, 1], bits per byte
    is >= 0): a floor outside the metric's range, or an allowed drop below 0 or beyond its range; None when they fit
    or the metric's range is not known."""
    metric = measure(gate.metric)
    low, high = RANGES.get(metric, (-math.inf, math.inf))
    kind = "a 0/1 metric, scored as a share" if binary(gate.metric) else "a continuous metric"
    if gate.min is not None and not low <= gate.min <= high:
        return f"min {gate.min:g} lies outside [{low:g}, {high:g}], the values {metric} takes ({kind})"
    if gate.max_drop is not None and not 0 <= gate.max_drop <= high - low:
        return f"max_drop {gate.max_drop:g} is not a drop {metric} can make ({kind} in [{low:g}, {high:g}])"
    return None
