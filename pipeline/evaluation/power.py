"""What a gate can see: the smallest change its paired test detects, known before it judges.

A gate's test (`gates`) compares a stage with its input problem by problem, with one-sided 95% bounds. Over n
problems it detects, with 80% power, a true change of at least:

- a 0/1 metric at score r (the input's): the solution d of Connor's (1987) sample size for McNemar's test,
  n = (z_0.95 sqrt(psi) + z_0.80 sqrt(psi - d^2))^2 / d^2, with psi = 2 r (1 - r), the share of problems whose
  answer changes when the two checkpoints answer independently (the most churn: a bound, not a guess);
- a continuous metric with per-problem SD s (the input's): (z_0.95 + z_0.80) s / sqrt(n), taking the two
  checkpoints' per-problem values as correlated 0.5 (so the paired difference has SD s).

Before the input is scored r is assumed 0.5 (the most noise) and said so. A gate cannot see what it judges when its
`max_drop` (for `no_significant_drop` / `non_inferior`) is below that change, or when a 0/1 metric sits at its floor
or ceiling (fewer than `EDGE` problems right, or wrong, expected): a warning in the log and the headline, exit 2
under `strict_gates=true`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf
from scipy import optimize
from scipy.stats import norm

from pipeline import extension
from pipeline.config import sweeps

ALPHA, POWER = 0.05, 0.80  # one-sided, as the gates' bounds
EDGE = 5  # fewer expected right (or wrong) answers than this: the metric sits at its floor (or ceiling)
ASSUMED_RATE = 0.5  # the input's score before it is scored: the most noise a 0/1 metric can have
BINARY = ("exact_match", "acc", "acc_norm")  # metrics scored 0 or 1 per problem; others are continuous
RANGES = {**{m: (0.0, 1.0) for m in BINARY}, "bits_per_byte": (0.0, math.inf)}  # the values a known metric takes
# problems per shipped task, as published (GSM8K's test set; the validation slice of tasks/gsm8k_validation.py)
SIZES = {"gsm8k_local": 1319, "gsm8k_local_bpb": 1319, "gsm8k_local_val": 500, "gsm8k_local_val_bpb": 500}


def measure(metric: str) -> str:
    """The metric's own name in `<task>/<metric>,<filter>`: `exact_match`, `bits_per_byte`."""
    return metric.partition("/")[2].partition(",")[0]


def binary(metric: str) -> bool:
    """Whether `metric` (`<task>/<metric>,<filter>`) is scored 0 or 1 per problem (else it is continuous)."""
    return measure(metric) in BINARY


def detectable(n: int, rate: float | None = None, sd: float | None = None) -> float:
    """The smallest true change a one-sided 5% paired test over `n` problems detects with 80% power: of a 0/1
    metric at score `rate`, or of a continuous one with per-problem SD `sd`; inf when no change can be."""
    za, zb = norm.ppf(1 - ALPHA), norm.ppf(POWER)
    if n < 2:
        return math.inf
    if sd is not None:
        return (za + zb) * sd / math.sqrt(n)
    r = min(max(rate if rate is not None else ASSUMED_RATE, 0.5 / n), 1 - 0.5 / n)
    psi = 2 * r * (1 - r)

    def needed(d: float) -> float:  # problems needed to detect d, less n
        return (za * math.sqrt(psi) + zb * math.sqrt(max(psi - d * d, 0.0))) ** 2 / (d * d) - n

    top = math.sqrt(psi)
    return optimize.brentq(needed, 1e-9, top) if needed(top) < 0 else math.inf


def blind(test: str, max_drop: float | None, change: float, n: int, rate: float | None) -> str | None:
    """Why a gate cannot see what it judges (its `test` and `max_drop`, the `change` it detects over `n` problems,
    the input's 0/1 `rate`, None for a continuous metric), or None when it can."""
    if rate is not None and min(rate, 1 - rate) * n < EDGE:
        edge = "floor" if rate < 0.5 else "ceiling"
        return (f"the metric sits at its {edge}: {rate:.3f} of {n} problems is about {round(rate * n)} right "
                f"answers, too few for a paired test to move")
    if max_drop is not None and test != "superior" and max_drop < change:
        return f"max_drop {max_drop:.3f} is below the smallest change this gate detects ({change:.3f})"
    return None


def describe(change: float, n: int, rate: float | None, assumed: bool) -> str:
    """`detects +-0.033 (80% power, n=150, input 0.013)`."""
    at = "" if rate is None else f", input {rate:.3f}" + (" assumed: the most noise" if assumed else "")
    return f"detects \u00b1{change:.3f} (80% power, n={n}{at})" if math.isfinite(change) else \
        f"detects no change (n={n}{at})"


def sight(gate: Any, values: dict[int, float]) -> dict | None:
    """What `gate` can see over the input's per-problem `values` of its metric (the problems it judges): {detectable,
    n, rate (a 0/1 metric's score, else None), blind (why it cannot see, else None), text}; None without values."""
    if not values:
        return None
    n, scores = len(values), list(values.values())
    binary = all(v in (0.0, 1.0) for v in scores)
    rate = sum(scores) / n if binary else None
    change = detectable(n, rate, None if binary else (statistics.stdev(scores) if n > 1 else 0.0))
    return {"detectable": change, "n": n, "rate": rate, "blind": blind(gate.test, gate.max_drop, change, n, rate),
            "text": describe(change, n, rate, assumed=False)}


def before_run(cfg: Any, name: str) -> dict | None:
    """What the gate of stage `name` can see before its input is scored (`planned`); None without a gate."""
    gate = cfg[name].gate
    if not gate.metric:
        return None
    limit = cfg[name].eval.limit if cfg[name].eval.limit is not None else cfg.eval.limit
    limit = OmegaConf.to_container(limit) if isinstance(limit, DictConfig) else limit
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
    """What `gate` can see before its input is scored, over the `n` problems of its task (half of them, `halved`,
    when a sweep selects on the other half): {detectable, n, rate, assumed, blind, text}, at the assumed input
    score `ASSUMED_RATE`; for a continuous metric, or an unknown n, only a note."""
    if n is None:
        return {"n": None, "text": "n unknown before its task is loaded: computed once its input is scored"}
    n = n // 2 if halved else n
    if not binary(gate.metric):
        return {"n": n, "text": f"a continuous metric over n={n}: its sight is known once its input is scored"}
    change = detectable(n, ASSUMED_RATE)
    return {"detectable": change, "n": n, "rate": ASSUMED_RATE, "assumed": True,
            "blind": blind(gate.test, gate.max_drop, change, n, None),
            "text": describe(change, n, ASSUMED_RATE, assumed=True)}


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
