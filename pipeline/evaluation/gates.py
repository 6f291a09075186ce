"""Evaluation gates: after a stage is scored, decide whether the chain goes on.

`gate: {metric, min, max_drop, test, action}` judges a stage's eval against the previous evaluated
checkpoint that has the metric (the base model for the first stage). A failure with `action: stop`
halts the chain (exit code 3); with `warn` it is logged and marked in the leaderboard.

- `min`: fails when the metric is below it (the value as measured).
- `test`: how the change against the previous checkpoint is judged. The change is measured problem by
  problem (`stats.paired_difference` on lm-eval's per-problem samples): change = this - previous, with its
  one-sided 95% bounds (Newcombe's paired score interval for a 0/1 metric, the paired t for any other).
  - `no_significant_drop` (needs `max_drop`): fails only when the change is significantly below
    -max_drop (its upper bound is under -max_drop): a drop that noise can explain passes.
  - `non_inferior` (needs `max_drop`): passes only when the change is significantly above -max_drop (its
    lower bound is over -max_drop): "no regression" has to be shown, not merely not disproved.
  - `superior`: passes only on a significant gain (the lower bound of the change is over 0).
  Without shared per-problem samples (other problems, or none kept) the point change is compared with the
  same threshold and the verdict says that no error was known.

Each verdict's reason is one sentence: the change as `stats.describe` writes it (95% interval, p, the
problems gained and lost, n), then what the test concluded; the signs are those of the change (negative: this
checkpoint scores lower).
"""

from __future__ import annotations

from typing import Any

from pipeline.evaluation.stats import describe

NEEDS_MAX_DROP = ("no_significant_drop", "non_inferior")  # the tests that compare only with a max_drop set


def _change(value: float, previous: tuple[str, float], paired: dict | None) -> str:
    """`0.700 (01-sft) -> 0.640: -0.060 [-0.101, -0.019], p=0.0042 (McNemar mid-p, +2 / -8, n=100)`."""
    name, before = previous
    text = f"{before:.3f} ({name}) -> {value:.3f}"
    return f"{text}: " + (describe(paired) if paired else f"{value - before:+.3f} (no paired samples, no error known)")


def _test(test: str, value: float, previous: tuple[str, float], max_drop: float | None,
          paired: dict | None, higher: bool = True) -> tuple[bool, str]:
    """(failed, one-sentence reason) of the gate's `test` on the change from `previous` to `value`; for a metric
    that is better `higher=False` (bits per byte), the change is judged turned round: a rise is the drop."""
    low, high = (paired["bound_low"], paired["bound_high"]) if paired else (value - previous[1],) * 2
    if not higher:
        low, high = -high, -low
    bound = "point change" if paired is None else "one-sided 95% {} bound"
    if test == "no_significant_drop":
        failed = high < -max_drop
        why = (f"{bound.format('upper')} {high:+.3f} < -{max_drop:.3f}" if failed else
               f"{bound.format('upper')} {high:+.3f} >= -{max_drop:.3f}")
        verdict = (f"a significant drop beyond max_drop {max_drop:.3f}" if failed else
                   f"no significant drop beyond max_drop {max_drop:.3f}")
    elif test == "non_inferior":
        failed = low <= -max_drop
        why = f"{bound.format('lower')} {low:+.3f} {'<=' if failed else '>'} -{max_drop:.3f}"
        verdict = (f"not shown within max_drop {max_drop:.3f}" if failed else
                   f"shown not worse than max_drop {max_drop:.3f}")
    else:  # superior
        failed = low <= 0
        why = f"{bound.format('lower')} {low:+.3f} {'<=' if failed else '>'} 0"
        verdict = "no significant gain" if failed else "a significant gain"
    turned = "" if higher else ", lower is better: the change turned round"
    return failed, f"{_change(value, previous, paired)}: {verdict} ({why}{turned})"


def judge(gate: Any, metrics: dict, previous: tuple[str, float] | None, paired: dict | None = None,
          higher: bool = True, sight: dict | None = None) -> dict | None:
    """The verdict of `gate` on a stage's eval `metrics`; None when the stage has no gate.

    `previous` is (checkpoint, value) of the checkpoint to compare with; `paired` its
    `stats.paired_difference(previous, this stage)` on the gate metric, or None when not known; `higher`: whether
    the metric is better higher (lm-eval's `higher_is_better`); `sight`: what the gate can see (`power.sight`),
    recorded with the verdict.
    """
    if not gate.metric:
        return None
    value = metrics[gate.metric]
    test = gate.test
    reasons, notes = [], []
    if gate.min is not None and (value < gate.min if higher else value > gate.min):
        reasons.append(f"{value:.4f} < min {gate.min:.4f}" if higher else
                       f"{value:.4f} > min {gate.min:.4f} (lower is better: the bound is a ceiling)")
    compares = gate.max_drop is not None or test not in NEEDS_MAX_DROP
    if compares and previous is not None:
        failed, text = _test(test, value, previous, gate.max_drop, paired, higher)
        (reasons if failed else notes).append(text)
    passed = not reasons
    return {
        "metric": gate.metric, "value": value, "min": gate.min, "max_drop": gate.max_drop, "test": test,
        "previous": {"checkpoint": previous[0], "value": previous[1]} if previous else None,
        "paired": paired, "higher_is_better": higher, "sight": sight, "action": gate.action, "passed": passed,
        "verdict": "pass" if passed else ("fail" if gate.action == "stop" else "warn"),
        "reason": "; ".join(reasons) or "; ".join(["passed", *notes]),
    }
